"""How a GRPO step's cost grows with the work: group size, mazes per step, turns, images in context.

One axis at a time from a small base point (2 mazes x 4 samples x 4 turns, all images kept),
each point the median of ``--steps`` steps after one warm-up, through ``bench.common.GRPOStep``
(the library calls train.py makes). The policy is the shipped SFT checkpoint when it exists (its
episodes end at different turns, as in training), else the random tiny model. The update is
timed with padding-free packing and, on the same trajectories, with right padding.

    python bench/scaling.py [--steps 2] [--out bench/scaling.png]

Prints a table (step time, trained tokens/s, cost per trained token relative to the axis's
first point, packed vs padded update time) and writes the PNG; the last line is
``max_cost_ratio=<x>`` (worst cost per trained token over the axis's cheapest point).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import GRPOStep  # noqa: E402
from maze import TrainSampler  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from models.build import SHIPPED_SFT, load_policy_dir  # noqa: E402
from models.tiny import build_tiny  # noqa: E402

BASE = {"group": 4, "mazes": 2, "turns": 4, "images": 0}
AXES = {"group": [4, 8, 16, 32], "mazes": [1, 2, 4, 8], "turns": [2, 4, 8, 16], "images": [1, 2, 4, 0]}


def policy():
    if SHIPPED_SFT.exists():
        model, processor = load_policy_dir(SHIPPED_SFT)
        return model, processor, "shipped SFT checkpoint"
    model, processor = build_tiny(0)
    return model, processor, "random tiny model"


def measure(point: dict, steps: int, model, processor) -> dict:
    """Median over ``steps`` GRPO steps (packed update) after one warm-up; the padded update is timed on
    the same trajectories right after each step (lr 0: the weights do not move)."""
    env = EnvSettings(pixels_per_cell=16, pad_to=32, max_turns=point["turns"],
                      max_images_in_context=point["images"])
    torch.manual_seed(0)
    stepper = GRPOStep(model, processor, env, point["group"], 16, lr=0.0, packing=True)
    mazes = TrainSampler(sizes=(9,), seed=5).take(point["mazes"] * (steps + 1))
    rows = []
    for s in range(steps + 1):
        res = stepper(mazes[s * point["mazes"]:(s + 1) * point["mazes"]], seed=s)
        res["update_padded"] = stepper.update(stepper.last_trajs, packing=False)["update"]
        if s:
            rows.append(res)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench/scaling.png")
    ap.add_argument("--axes", default=",".join(AXES))
    args = ap.parse_args()
    model, processor, what = policy()
    print(f"policy: {what}; base point {BASE}; median of {args.steps} steps after 1 warm-up")
    print(f"{'axis':7s} {'value':>5s} {'step_s':>7s} {'gen_s':>6s} {'upd_pack_s':>10s} {'upd_pad_s':>9s} "
          f"{'trained_tok':>11s} {'tok/s':>7s} {'cost_ratio':>10s} {'pad_waste':>9s}")
    table: dict[str, list[dict]] = {}
    worst = 1.0
    for axis in args.axes.split(","):
        table[axis] = []
        for value in AXES[axis]:
            point = {**BASE, axis: value}
            row = {"value": value, **measure(point, args.steps, model, processor)}
            row["cost"] = row["step"] / max(row["tokens"], 1.0)
            table[axis].append(row)
        base_cost = min(r["cost"] for r in table[axis])
        for r in table[axis]:
            r["cost_ratio"] = r["cost"] / base_cost
            worst = max(worst, r["cost_ratio"])
            label = "all" if axis == "images" and r["value"] == 0 else str(r["value"])
            print(f"{axis:7s} {label:>5s} {r['step']:7.2f} {r['generate']:6.2f} {r['update']:10.3f} "
                  f"{r['update_padded']:9.3f} {r['tokens']:11.0f} {r['tokens'] / r['step']:7.1f} "
                  f"{r['cost_ratio']:10.2f} {1 - r['context_tokens'] / r['padded_tokens']:9.2f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, len(table), figsize=(4 * len(table), 3.2))
    for ax, (axis, rows) in zip(list(axs) if len(table) > 1 else [axs], table.items()):
        xs = list(range(len(rows)))
        ax.plot(xs, [r["cost_ratio"] for r in rows], "o-", label="cost / trained token")
        ax.plot(xs, [r["update_padded"] / r["update"] for r in rows], "s--", label="padded / packed update")
        ax.axhline(1.3, color="gray", lw=0.8, ls=":")
        ax.set_xticks(xs, ["all" if axis == "images" and r["value"] == 0 else str(r["value"]) for r in rows])
        ax.set_xlabel(axis)
        ax.set_ylim(bottom=0)
    axs_list = list(axs) if len(table) > 1 else [axs]
    axs_list[0].legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    packed_wins = statistics.median(r["update_padded"] / r["update"] for rows in table.values() for r in rows)
    print(f"padded_over_packed_update_median={packed_wins:.2f}")
    print(f"max_cost_ratio={worst:.2f}")


if __name__ == "__main__":
    main()
