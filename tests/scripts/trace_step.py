"""Which project files does one GRPO step run? Traces step 2 of a short default run in-process.

    python tests/scripts/trace_step.py [hydra overrides...]

Step 2 (not 1: the first step also imports modules and builds caches) is the window between the sampler's
second and third ``take``: rollouts, rewards, advantages, the update, the weight sync and the log. Eval and
checkpoints are off (they are periodic, not part of every step). Prints one line per file (functions that ran
there) and a last line ``files: N``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SMALL = ["algo.mazes_per_step=2", "algo.group_size=2", "env.max_turns=4", "trainer.steps=3", "trainer.eval_every=0",
         "trainer.save_every=0", "trainer.eval_at_start=false", "trainer.resume=never"]


def trace(overrides: list[str]) -> dict[str, set[str]]:
    from hydra import compose, initialize_config_dir

    import train
    from maze import core as sampler_mod

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=SMALL + list(overrides))
    seen: dict[str, set[str]] = defaultdict(set)
    root = str(ROOT) + os.sep

    def profiler(frame, event, _arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and "/.venv/" not in name:
                seen[os.path.relpath(name, ROOT)].add(frame.f_code.co_name)

    take = sampler_mod.TrainSampler.take
    calls = {"n": 0}

    def traced_take(self, n):
        calls["n"] += 1
        if calls["n"] == 2:
            sys.setprofile(profiler)
        elif calls["n"] == 3:
            sys.setprofile(None)
        return take(self, n)

    sampler_mod.TrainSampler.take = traced_take
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            train.train(cfg, run_dir)
    finally:
        sys.setprofile(None)
        sampler_mod.TrainSampler.take = take
    seen.pop(os.path.relpath(__file__, ROOT), None)
    return dict(seen)


if __name__ == "__main__":
    files = trace(sys.argv[1:])
    for name in sorted(files):
        print(f"{name}: {', '.join(sorted(files[name]))}")
    print(f"files: {len(files)}")
