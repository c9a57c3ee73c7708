"""Summarise a Hydra multirun of train.py: one table, one CSV, one PNG of learning curves.

    python sweeps/summarize.py multirun/2026-12-02/17-50-00 [more dirs, pooled] [--suite fixed64] [--out DIR]

For each job it reads the overrides (``.hydra/overrides.yaml``) and the periodic eval reports
(``eval/step_N/report.json``); jobs that differ only in ``trainer.seed`` form one setting, shown as
mean ± std over seeds. Writes summary.md, summary.csv and curves.png into ``--out`` (default: the
multirun dir).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import yaml


def load_job(job: Path, suite: str) -> dict | None:
    overrides_file = job / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        return None
    overrides = [o for o in yaml.safe_load(overrides_file.read_text()) or []
                 if not o.startswith(("hydra.", "+sweep="))]
    curve = {}
    for report in sorted((job / "eval").glob("step_*/report.json")):
        data = json.loads(report.read_text())
        if suite in data["suites"]:
            curve[int(data["step"])] = data["suites"][suite]["success_rate"]
    seed = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.seed=")), "0")
    setting = ",".join(o for o in overrides if not o.startswith("trainer.seed=")) or "(defaults)"
    return {"job": job.name, "setting": setting, "seed": seed, "curve": dict(sorted(curve.items()))}


def legend_labels(settings: list[str], width: int = 60) -> dict[str, str]:
    """Each setting's legend label: the overrides that set it apart from the others (overrides every setting shares,
    such as a long ``model.path``, would otherwise fill the label and make the lines indistinguishable)."""
    shared = set.intersection(*(set(k.split(",")) for k in settings)) if len(settings) > 1 else set()
    return {k: (",".join(o for o in k.split(",") if o not in shared) or k)[:width] for k in settings}


def summarize(multirun: Path | list[Path], suite: str = "fixed64", out: Path | None = None) -> Path:
    dirs = multirun if isinstance(multirun, list) else [multirun]
    multirun = dirs[0] if len(dirs) == 1 else ", ".join(str(d) for d in dirs)
    out = out or dirs[0]
    jobs = [j for d in dirs for j in (load_job(p, suite) for p in sorted(d.iterdir()) if p.is_dir()) if j]
    if not jobs:
        raise SystemExit(f"no train.py jobs with .hydra/overrides.yaml under {multirun}")
    settings: dict[str, list[dict]] = {}
    for j in jobs:
        settings.setdefault(j["setting"], []).append(j)

    def stat(values):
        return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0) if values else None

    rows = []
    for setting, runs in settings.items():
        starts = [r["curve"][min(r["curve"])] for r in runs if r["curve"]]
        finals = [r["curve"][max(r["curve"])] for r in runs if r["curve"]]
        bests = [max(r["curve"].values()) for r in runs if r["curve"]]
        rows.append({"setting": setting, "seeds": len(runs), "start": stat(starts), "final": stat(finals),
                     "best": stat(bests)})

    def fmt(s):
        return "-" if s is None else f"{s[0]:.3f} ± {s[1]:.3f}"

    lines = [f"# Sweep summary: {multirun}", "", f"Eval suite: `{suite}` (success rate, mean ± std over seeds)", "",
             "| setting | seeds | start | final | best |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['seeds']} | {fmt(r['start'])} | {fmt(r['final'])} | {fmt(r['best'])} |"
              for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "seed", "job", "step", "success_rate"])
        for j in jobs:
            for step, value in j["curve"].items():
                writer.writerow([j["setting"], j["seed"], j["job"], step, value])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = legend_labels(list(settings))
    fig, ax = plt.subplots(figsize=(6, 4))
    for setting, runs in settings.items():
        steps = sorted({s for r in runs for s in r["curve"]})
        if not steps:
            continue
        vals = np.array([[r["curve"].get(s, np.nan) for s in steps] for r in runs])
        mean, std = np.nanmean(vals, axis=0), np.nanstd(vals, axis=0)
        ax.plot(steps, mean, marker="o", label=labels[setting])
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set(xlabel="step", ylabel=f"{suite} success rate", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)
    print("\n".join(lines))
    return out / "summary.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun", type=Path, nargs="+", help="Hydra multirun dirs (hydra.sweep.dir), pooled")
    parser.add_argument("--suite", default="fixed64")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    summarize(args.multirun, args.suite, args.out)


if __name__ == "__main__":
    main()
