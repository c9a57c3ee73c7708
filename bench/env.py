"""Environment throughput on one process: resets/s, steps/s with the per-step image, renders/s,
PNG encodes/s, for maze_easy (9x9) and maze_hard (11x11) at 25 px/cell.

    python bench/env.py [--seconds 1.0]

Last line: ``env_steps_per_s=<x>`` (easy, image every step). Medians over 5 timed repeats.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import maze  # noqa: E402

ACTIONS = ["<action>up</action>", "<action>right</action>", "<action>down</action>",
           "<action>left</action>"]


def rate(fn, seconds: float, repeats: int = 5) -> float:
    """Median calls/s of ``fn`` over ``repeats`` windows of ~``seconds``/repeats each."""
    rates = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / repeats:
            for _ in range(64):
                fn()
            n += 64
        rates.append(n / elapsed)
    return statistics.median(rates)


def bench(size: int, seconds: float) -> dict[str, float]:
    env = maze.MazeEnv(size=size, turn_limit=10**9, **maze.REFERENCE_VIEW)
    mazes = [maze.generate_maze(size, s) for s in range(32)]
    state = {"i": 0}

    def reset():
        state["i"] += 1
        env.reset(options={"maze": mazes[state["i"] % 32]})

    def step():
        state["i"] += 1
        env.step(ACTIONS[state["i"] % 4])

    env.reset(options={"maze": mazes[0]})
    renderer = maze.MazeRenderer(mazes[0], 25)
    frame = renderer.frame(mazes[0].start)

    def png():
        maze.to_pil(frame).save(io.BytesIO(), format="PNG")

    return {
        "resets_per_s": rate(reset, seconds),
        "steps_per_s": rate(step, seconds),
        "renders_per_s": rate(lambda: renderer.frame(mazes[0].start), seconds),
        "png_encodes_per_s": rate(png, seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measured quantity")
    args = parser.parse_args()
    results = {name: bench(size, args.seconds) for name, size in [("easy_9x9", 9), ("hard_11x11", 11)]}
    keys = list(next(iter(results.values())))
    print(f"{'maze':12s} " + " ".join(f"{k:>18s}" for k in keys))
    for name, row in results.items():
        print(f"{name:12s} " + " ".join(f"{row[k]:18,.0f}" for k in keys))
    print(f"env_steps_per_s={results['easy_9x9']['steps_per_s']:.0f}")


if __name__ == "__main__":
    main()
