"""Constant-cost turns: whole-episode sequences vs per-turn samples with a bounded history (``env.history=K``), on
the same mazes in one run, the shipped SFT start, greedy, every episode run to its turn budget.

- rollout: seconds of each turn (one engine call for every live episode) against the turn index; whole episodes
  keep each episode's KV cache across turns (the prompt grows by one frame a turn), windows re-prefill the last K
  turns (bounded);
- update: one forward/backward over the step's training rows (whole episodes, or every turn as its own row),
  seconds per trained turn;
- the longest training row and the longest prompt, in tokens.

    python bench/turn_cost.py [--mazes 4] [--group 4] [--turns 40] [--history 2]

The last line is ``history_last_vs_first_turn=<x> whole_last_vs_first_turn=<y> history_vs_whole_update=<z>``, medians
of the last 10 turns against the 10 from the first whose window is full (turn K + 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import GRPOStep  # noqa: E402
from bench.rollout import TimedEngine, never_ending  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from maze.sampler import TrainSampler  # noqa: E402
from models.build import SHIPPED_SFT, load_policy_dir  # noqa: E402
from models.engines.base import SamplingParams  # noqa: E402
from models.engines.hf import HFEngine  # noqa: E402
from rl.rollout import rollout  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mazes", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--history", type=int, default=2)
    args = p.parse_args()
    model, processor = load_policy_dir(SHIPPED_SFT)
    env = EnvSettings(max_turns=args.turns, max_context_tokens=16384)
    mazes = TrainSampler(seed=2).take(args.mazes)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    runs = {}
    with never_ending():
        for name, history in [("whole", None), ("history", args.history)]:
            run_env = replace(env, history=history)
            engine = TimedEngine(HFEngine(model, processor))
            rollout(engine, processor, mazes[:1], 1, replace(run_env, max_turns=2), greedy)  # warm up
            engine.times = []
            trajs = rollout(engine, processor, mazes, args.group, run_env, greedy)
            assert all(t.num_turns == args.turns for t in trajs), "every episode runs to the turn budget"
            step = GRPOStep(model, processor, run_env, args.group, 24, lr=0.0)
            updates = [step.update(trajs, packing=True)["update"] for _ in range(3)]
            rows = [s.token_ids for t in trajs for s in t.samples] or [t.token_ids for t in trajs]
            runs[name] = dict(times=engine.times, update=statistics.median(updates),
                              turns=sum(t.num_turns for t in trajs), longest=max(len(r) for r in rows))
    w, h = runs["whole"], runs["history"]
    print(f"{args.mazes} mazes x {args.group} samples x {args.turns} turns, greedy, shipped SFT start; "
          f"history = last {args.history} turns")
    print("  turn   whole s   history s")
    for k in range(args.turns):
        if k < 3 or k % 5 == 4 or k == args.turns - 1:
            print(f"  {k + 1:4d}  {w['times'][k]:8.3f}  {h['times'][k]:10.3f}")
    k, m = args.history, 10  # turn k+1 is the first whose window is full: its 10 turns against the last 10
    ratio = {n: statistics.median(r["times"][-m:]) / statistics.median(r["times"][k:k + m]) for n, r in runs.items()}
    for n, r in runs.items():
        print(f"  {n}: rollout {sum(r['times']):.1f} s, last {m} turns / turns {k + 1}-{k + m} {ratio[n]:.2f} "
              f"(medians); update "
              f"{r['update']:.2f} s = {1000 * r['update'] / r['turns']:.1f} ms per trained turn; longest row "
              f"{r['longest']} tokens")
    print(f"history_last_vs_first_turn={ratio['history']:.2f} whole_last_vs_first_turn={ratio['whole']:.2f} "
          f"history_vs_whole_update={h['update'] / w['update']:.2f}")


if __name__ == "__main__":
    main()
