"""One run's learning curve as a PNG: greedy eval success (95 % Wilson interval) vs step, and the
rollout success of every step (sampled, the training mazes) from TensorBoard.

    python sweeps/plot_run.py outputs/default_job --out docs/default_job_curve.png [--suite fixed64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path, suite: str) -> list[tuple[int, float, list[float]]]:
    points = []
    for report in (run / "eval").glob("step_*/report.json"):
        data = json.loads(report.read_text())
        if suite in data["suites"]:
            s = data["suites"][suite]
            points.append((int(data["step"]), s["success_rate"], s["ci95"]))
    if not points:
        raise SystemExit(f"plot_run: no eval/step_*/report.json with suite {suite} under {run}")
    return sorted(points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--suite", default="fixed64")
    ap.add_argument("--title", default=None, help="default: the run dir's name")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = curve(args.run, args.suite)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = [p[0] for p in points]
    rates = [p[1] for p in points]
    err = [[r - p[2][0] for r, p in zip(rates, points)], [p[2][1] - r for r, p in zip(rates, points)]]
    ax.errorbar(steps, rates, yerr=err, marker="o", capsize=4, label=f"eval {args.suite} (greedy, 95 % CI)")
    acc = EventAccumulator(str(args.run / "tb"))
    acc.Reload()
    if "rollout/success_rate" in acc.Tags()["scalars"]:
        ev = acc.Scalars("rollout/success_rate")
        ax.plot([e.step for e in ev], [e.value for e in ev], color="gray", alpha=0.6, lw=1,
                label="rollout success (sampled, training mazes)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("solve rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{args.title or args.run.name}: {args.suite} {rates[0]:.3f} -> {rates[-1]:.3f}")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
