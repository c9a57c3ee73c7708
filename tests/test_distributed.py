"""torchrun, 2 gloo processes: DDP and FSDP2 train, stay in sync, and checkpoint full HF weights."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("parallel,port", [("ddp", 29521), ("fsdp2", 29522)])
def test_two_rank_training_ends_with_equal_weights(tmp_path, parallel, port):
    args = ["cluster=cpu2", f"cluster.parallel={parallel}", f"cluster.rdzv_endpoint=localhost:{port}",
            "reward=shaped", "algo.entropy_coef=0.05", "algo.lr=0.01", "algo.mazes_per_step=2", "algo.group_size=2",
            "env.max_turns=3", "algo.max_new_tokens=8", "trainer.eval_every=2", "trainer.eval_suites=[size7]",
            "trainer.eval_at_start=false", "trainer.steps=2", "trainer.save_every=1", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = [float(x) for x in re.findall(r"ranks in sync at step \d+: parameter checksum ([-\d.]+)", proc.stdout)]
    assert len(sums) == 2 and sums[0] != sums[1], proc.stdout[-2000:]  # in sync, and training moved the weights
    assert "eval step 2: size7" in proc.stdout

    from transformers import AutoModelForImageTextToText

    import models.tiny  # noqa: F401

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "checkpoints/step_2/policy")
    from rl.dist import params_checksum

    assert abs(params_checksum(model) - sums[1]) < 1e-6 * abs(sums[1])
