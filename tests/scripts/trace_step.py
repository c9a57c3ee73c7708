"""Which project files does one GRPO step run, and how often does it cross into each? A report for a reader (not a
cap: tests/test_architecture.py checks only that it sees a whole step). Traces step 2 of a short run in-process.

    python tests/scripts/trace_step.py                                   # the default job's step
    python tests/scripts/trace_step.py trainer.eval_every=2 trainer.save_every=2   # with its eval and checkpoint
    python tests/scripts/trace_step.py env.history=2 algo.kl_coef=0.01   # per-turn rows, a KL reference

Step 2 (not 1: the first step also imports modules and builds caches) is the window between the sampler's
second and third ``take``: rollouts, rewards, advantages, the update, the weight sync, the log (and with the keys
above, eval and checkpoint). Prints one line per file: the calls that entered it from another file (trips), and
the functions that ran there; then ``files: N``. FSDP2 and ``engine=vllm`` need torchrun or vllm and are not
traced in-process.
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
    from maze import sampler as sampler_mod

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=SMALL + list(overrides))
    seen: dict[str, set[str]] = defaultdict(set)
    trips: dict[str, int] = defaultdict(int)
    root = str(ROOT) + os.sep

    def profiler(frame, event, _arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and "/.venv/" not in name:
                rel = os.path.relpath(name, ROOT)
                seen[rel].add(frame.f_code.co_name)
                caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
                trips[rel] += caller != name

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
    return {name: (trips[name], functions) for name, functions in seen.items()}


if __name__ == "__main__":
    files = trace(sys.argv[1:])
    for name in sorted(files):
        n, functions = files[name]
        print(f"{name}: {n} trips | {', '.join(sorted(functions))}")
    print(f"files: {len(files)}")
