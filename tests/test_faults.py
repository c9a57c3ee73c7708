"""Faults: exact resume, a corrupt newest checkpoint, SIGTERM, a killed rank under torchrun."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# reward=shaped + an entropy bonus make every step change the weights, even for a random policy
BASE = ["reward=shaped", "algo.entropy_coef=0.05", "algo.lr=0.01", "algo.mazes_per_step=2", "algo.group_size=2",
        "env.max_turns=3", "algo.max_new_tokens=8", "trainer.eval_every=0", "trainer.save_every=1",
        "trainer.keep_last=0"]


def _train(args, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *BASE, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _weights(run: Path, step: int) -> dict:
    return load_file(run / f"checkpoints/step_{step}/policy/model.safetensors")


def _scalars(run: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_resume_equals_uninterrupted_and_corrupt_checkpoint_falls_back(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _train(["trainer.steps=3", f"hydra.run.dir={straight}"]).returncode == 0
    assert _train(["trainer.steps=2", f"hydra.run.dir={resumed}"]).returncode == 0
    # corrupt the newest checkpoint: resume must report it in one line and use step_1
    weights = resumed / "checkpoints/step_2/policy/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    proc = _train(["trainer.steps=3", f"hydra.run.dir={resumed}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr  # Hydra's logging goes to stdout
    assert re.search(r"skipping corrupt checkpoint .*step_2: policy/model.safetensors has \d+ bytes", out)
    assert "resumed from" in proc.stdout and "step_1 at step 1" in proc.stdout
    a, b = _weights(straight, 3), _weights(resumed, 3)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "resumed weights differ"
    assert not all((a[k] == _weights(straight, 2)[k]).all() for k in a), "training must change the weights"
    for tag in ["loss/pg", "rollout/reward_mean", "loss/entropy"]:
        assert _scalars(straight, tag)[3] == _scalars(resumed, tag)[3], tag


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *BASE, "trainer.steps=200",
                             "trainer.save_every=0", f"hydra.run.dir={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 1/200" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=300) == 0, out[-3000:]
    saved = sorted((tmp_path / "checkpoints").iterdir())
    assert len(saved) == 1 and "received signal 15" in out
    step = int(saved[0].name.split("_")[1])
    assert 1 <= step < 200


@pytest.mark.slow
def test_killed_rank_restarts_under_torchrun_and_finishes(tmp_path):
    import psutil

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = ["cluster=cpu2", "cluster.max_restarts=2", "cluster.rdzv_endpoint=localhost:29531", "trainer.steps=4",
            f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *BASE, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, killed = [], False
    deadline = time.time() + 900
    for line in proc.stdout:
        lines.append(line)
        if not killed and "saved" in line and "step_2" in line:
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "train.py" in " ".join(p.cmdline()) and p.environ().get("LOCAL_RANK") == "1"]
            assert workers, "no rank-1 worker found"
            workers[0].kill()
            killed = True
        if time.time() > deadline:
            proc.kill()
            break
    out = "".join(lines)
    assert proc.wait(timeout=60) == 0 and killed, out[-4000:]
    assert "resumed from" in out and "step 4/4" in out
    assert (tmp_path / "checkpoints/step_4/policy/model.safetensors").is_file()
