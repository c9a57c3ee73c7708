"""The learning regression test: the default job itself (``python train.py``, no keys: 80 GRPO steps from
the shipped SFT checkpoint) must raise the greedy solve rate on fixed64 (the reference's 64 mazes, 20 turns)
by more than random variation reaches, and the same run with the advantages' sign flipped
(``VLMAZE_FAULTS=flip_advantage@all``) must not.

    python -m pytest -q -m slow tests/test_learning.py     # 2 x the default job, ~18 min on 2 cores

The margin is two standard errors of the difference of two independent proportions at the start's
rate on 64 mazes (0.177 at the shipped start's 0.484): a change of the policy that does not help
would have to be lucky on the fixed set at the 2-sigma level to pass. Exporting
``VLMAZE_FAULTS=flip_advantage@all`` makes the first test fail (the closing note shows it).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.build import SHIPPED_SFT

ROOT = Path(__file__).resolve().parents[1]


def _train(run: Path, extra_env: dict | None = None) -> list[float]:
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = sorted((run / "eval").glob("step_*/report.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    return [json.loads(p.read_text())["suites"]["fixed64"]["success_rate"] for p in reports]


def margin(p: float, n: int = 64) -> float:
    return 2 * math.sqrt(2 * p * (1 - p) / n)


@pytest.mark.slow
@pytest.mark.skipif(not SHIPPED_SFT.exists(), reason="the shipped SFT checkpoint is missing")
def test_grpo_from_the_shipped_sft_raises_the_solve_rate(tmp_path):
    curve = _train(tmp_path / "grpo")
    start, end = curve[0], curve[-1]
    assert end - start > margin(start), f"fixed64 {start:.3f} -> {end:.3f}: no more than random variation"


@pytest.mark.slow
@pytest.mark.skipif(not SHIPPED_SFT.exists(), reason="the shipped SFT checkpoint is missing")
def test_flipped_advantages_do_not_learn(tmp_path):
    curve = _train(tmp_path / "flipped", {"VLMAZE_FAULTS": "flip_advantage@all"})
    start, end = curve[0], curve[-1]
    assert end - start <= margin(start), f"fixed64 {start:.3f} -> {end:.3f} with the advantage sign flipped"
