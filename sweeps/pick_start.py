"""Pick a GRPO start among the checkpoints of an SFT run, by measurement on the recipe-selection suite.

For each ``RUN/checkpoints/step_N/policy`` it measures the two things a GRPO start needs:

- ``greedy``: the greedy solve rate on ``--suite`` (default ``select64``, never ``fixed64``, which stays
  a test set), at the environment's default turn budget, on the observation the checkpoint's run recorded;
- ``mixed``: the fraction of GRPO groups (``--group-size`` samples of one training maze at T = 1) whose
  episodes have both outcomes, i.e. groups that carry a learning signal under the sparse success. The training
  mazes are drawn from the distribution the checkpoint's run recorded (its ``env.train_mix`` or one kind), the
  one a GRPO run from it on the same ``env`` trains on.

It prints one row per checkpoint and, with ``--out DIR``, copies the policy of the checkpoint whose greedy
rate is nearest ``--target`` among those with ``mixed >= --min-mixed`` (ties: the earlier step). The bar, 0.2
(1.6 of a default GRPO step's 8 groups), sits a little under the lowest share measured from which the default job
learned: the start made from the longer-reading stage has mixed 0.25 (8 of 32 groups) and GRPO lifts it from 0.469
to 0.81-0.86 on ``select64`` over 3 seeds (results/reference_task_probes.md; 0.4, the earlier bar, refused it); a
bar at exactly 0.25 would let one group's noise decide the pick.

    python sweeps/pick_start.py outputs/tiny_sft --steps 640,768,896,1024 --out checkpoints/my_start

Each checkpoint takes ~3 minutes on 2 cores (64 greedy episodes and 128 sampled ones of up to 20 turns).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(policy_dir: Path, suite: str, train_mazes: int, group_size: int, seed: int) -> dict:
    import torch

    from maze.env import EnvSettings
    from maze.sampler import TrainSampler
    from maze.suites import load_suite
    from models.build import load_policy_dir
    from models.engines.base import SamplingParams
    from models.engines.hf import HFEngine
    from rl.rollout import rollout

    torch.manual_seed(seed)
    env_cfg = recorded_env(policy_dir)
    env = EnvSettings.from_config(env_cfg)
    model, processor = load_policy_dir(policy_dir)
    engine = HFEngine(model, processor)
    greedy = rollout(engine, processor, list(load_suite(suite).mazes), 1, env,
                     SamplingParams(temperature=0.0, max_new_tokens=24))
    mazes = TrainSampler.from_config(env_cfg, seed=10_000 + seed).take(train_mazes)
    sampled = rollout(engine, processor, mazes, group_size, env,
                      SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed))
    wins = np.array([t.success for t in sampled], dtype=float).reshape(train_mazes, group_size)
    return {"greedy": float(np.mean([t.success for t in greedy])), "sampled": float(wins.mean()),
            "mixed": float(np.mean((wins.min(1) == 0) & (wins.max(1) == 1)))}


def choose(rows: list[tuple[Path, dict]], target: float, min_mixed: float) -> Path | None:
    """The checkpoint whose greedy rate is nearest ``target`` among those with ``mixed >= min_mixed`` (ties: the
    earlier step); None when none qualifies."""
    ok = [(abs(m["greedy"] - target), int(c.name.split("_")[1]), c) for c, m in rows if m["mixed"] >= min_mixed]
    return min(ok)[2] if ok else None


def recorded_env(policy_dir: Path):
    """The ``env.*`` config the checkpoint's run recorded (its observation and training distribution), over the
    defaults."""
    from omegaconf import OmegaConf

    from conf.recorded import recorded

    default = _default_env()
    return OmegaConf.merge(default, {k: v for k, v in recorded(policy_dir, "env").items() if k in default})


def _default_env():
    from hydra import compose, initialize_config_dir

    from conf.schema import register

    register()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose("config").env


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="an SFT run dir (holds checkpoints/step_N/policy)")
    ap.add_argument("--suite", default="select64")
    ap.add_argument("--train-mazes", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.45)
    ap.add_argument("--min-mixed", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default="", help="comma-separated checkpoint steps to measure (default: all)")
    ap.add_argument("--out", type=Path, help="copy the chosen checkpoint's policy here")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.suite == "fixed64":
        sys.exit("--suite fixed64: choose on the recipe-selection suite (select64); fixed64 is the test set")
    steps = sorted((p for p in (args.run / "checkpoints").glob("step_*") if (p / "policy").is_dir()),
                   key=lambda p: int(p.name.split("_")[1]))
    if args.steps:
        wanted = {int(x) for x in args.steps.split(",")}
        steps = [p for p in steps if int(p.name.split("_")[1]) in wanted]
    if not steps:
        sys.exit(f"no checkpoints/step_N/policy under {args.run} (--steps {args.steps or 'all'})")
    rows = []
    print(f"| step | greedy {args.suite} | sampled success | mixed groups (G={args.group_size}) |")
    print("| --- | --- | --- | --- |")
    for ckpt in steps:
        m = measure(ckpt / "policy", args.suite, args.train_mazes, args.group_size, args.seed)
        rows.append((ckpt, m))
        print(f"| {ckpt.name} | {m['greedy']:.3f} | {m['sampled']:.3f} | {m['mixed']:.3f} |", flush=True)
    chosen = choose(rows, args.target, args.min_mixed)
    if chosen is None:
        sys.exit(f"no checkpoint has mixed >= {args.min_mixed}")
    print(f"chosen: {chosen}")
    if args.out:
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(chosen / "policy", args.out)
        print(f"copied {chosen / 'policy'} -> {args.out}")


if __name__ == "__main__":
    main()
