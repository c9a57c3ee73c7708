"""The reproduction study: SFT start vs GRPO end on every frozen suite over seeds, failures before and
after, and the sweeps' curves, written as results/README.md + PNGs (no event files).

    python sweeps/study.py --seeds multirun/study_seeds --start checkpoints/tiny_sft \\
        --sweep group_size=multirun/group_size --sweep kl=multirun/kl --out results

``--seeds`` is a multirun of the default job over ``trainer.seed`` (``python train.py -m
trainer.seed=0,1,2``). Every final checkpoint and the start are evaluated greedily on ``--suites``
with ``evaluate.py`` (skipped where ``<out>/eval/<name>/report.json`` already holds every suite); each
``--sweep NAME=DIR[:SUITE]`` is summarised with ``sweeps/summarize.py`` on SUITE (default fixed64; a recipe choice
is shown on ``select64``, where it was made) and its table and curves copied in.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.build import weights_sha256  # noqa: E402
from rl.evaluation import suite_ceiling, wilson_interval  # noqa: E402

SUITES = ["fixed64", "size7", "size11", "size13", "size15", "gen_backtracker", "gen_prim", "gen_kruskal", "braided",
          "random_placement", "size17", "gen_sidewinder", "braided11", "braided13"]  # every frozen suite but select*


def hydra_quoted(value: object) -> str:
    """A value for a Hydra override, quoted: a multirun job's dir (``0_trainer.seed=0,...``) holds ``=`` and ``,``."""
    if any(c in str(value) for c in "\"\\"):
        raise SystemExit(f"study: {value} holds a quote or a backslash; move it to a plain path")
    return f'"{value}"'


def evaluate(checkpoint: Path, out: Path, suites: list[str]) -> dict:
    """``out/report.json`` of ``checkpoint`` on ``suites``, evaluated unless that report already holds every suite
    and was made from the same weights (a start re-made under the same path is evaluated again)."""
    report = out / "report.json"
    weights = weights_sha256(checkpoint)
    cached = json.loads(report.read_text()) if report.is_file() else {}
    if not (set(suites) <= set(cached.get("suites", {})) and weights and cached.get("weights_sha256") == weights):
        cmd = [sys.executable, str(ROOT / "evaluate.py"), f"checkpoint={hydra_quoted(checkpoint)}",
               f"suites=[{','.join(suites)}]", f"hydra.run.dir={hydra_quoted(out)}", "figures=true"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(report.read_text())


def final_checkpoint(job: Path) -> Path:
    steps = sorted((job / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        raise SystemExit(f"study: no checkpoint in {job}")
    return steps[-1]


def seed_jobs(multirun: Path) -> list[tuple[str, Path]]:
    """``(seedS, job dir)`` for each job of a multirun over ``trainer.seed``, in seed order, named by the seed each
    job recorded (its dir name is Hydra's job number and overrides)."""
    jobs = [p for p in multirun.iterdir() if (p / ".hydra" / "config.yaml").is_file()]
    seeds = {p: int(yaml.safe_load((p / ".hydra" / "config.yaml").read_text())["trainer"]["seed"]) for p in jobs}
    if len(set(seeds.values())) != len(jobs):
        raise SystemExit(f"study: the jobs of {multirun} do not differ in trainer.seed alone: {sorted(seeds.values())}")
    return [(f"seed{seeds[p]}", p) for p in sorted(jobs, key=seeds.get)]


def pooled(reports: list[dict], suite: str) -> tuple[float, tuple[float, float], list[float]]:
    rates = [r["suites"][suite]["success_rate"] for r in reports]
    succ = sum(round(r["suites"][suite]["success_rate"] * r["suites"][suite]["n"]) for r in reports)
    n = sum(r["suites"][suite]["n"] for r in reports)
    return succ / n, wilson_interval(succ, n), rates


def paired(start: dict, end: dict, suite: str) -> tuple[int, int]:
    """Mazes of ``suite`` the end solves and the start does not (gained), and the reverse (lost): the same
    episodes (maze, sample) played by both, so a gain is not a different draw of mazes."""
    def solved(report: dict) -> dict:
        return {(e["maze_hash"], e["sample"]): e["success"] for e in report["episodes"] if e["suite"] == suite}

    a, b = solved(start), solved(end)
    if a.keys() != b.keys():
        raise SystemExit(f"study: the start and an end played different episodes of {suite}")
    return sum(b[k] and not a[k] for k in a), sum(a[k] and not b[k] for k in a)


def failures_table(start: dict, ends: list[dict], suite: str) -> list[str]:
    classes = sorted({k for r in [start, *ends] for k in r["suites"][suite]["failures"]})
    metrics = ["mean_bumps", "mean_invalid_actions", "mean_revisits", "mean_loops", "mean_dead_end_entries"]
    lines = [f"| {suite} | SFT start | GRPO end (mean over {len(ends)} seeds) |", "| --- | --- | --- |"]
    n_start = start["suites"][suite]["n"]
    for c in classes:
        a = start["suites"][suite]["failures"].get(c, 0) / n_start
        b = sum(r["suites"][suite]["failures"].get(c, 0) / r["suites"][suite]["n"] for r in ends) / len(ends)
        lines.append(f"| failure: {c} (share of episodes) | {a:.3f} | {b:.3f} |")
    for m in metrics:
        a = start["suites"][suite][m]
        b = sum(r["suites"][suite][m] for r in ends) / len(ends)
        lines.append(f"| {m.replace('mean_', 'per episode: ')} | {a:.2f} | {b:.2f} |")
    return lines


def failures_by_suite(start: dict, ends: list[dict], suites: list[str]) -> list[str]:
    """Every suite, one row: each failure class as a share of episodes, start -> end (mean over seeds),
    and the path efficiency of solved episodes (steps taken / shortest path)."""
    classes = sorted({k for r in [start, *ends] for s in suites for k in r["suites"][s]["failures"]})
    lines = ["| suite | " + " | ".join(classes) + " | step ratio (solved) | revisits | junctions right |",
             "| --- |" + " --- |" * (len(classes) + 3)]

    def share(r: dict, s: str, c: str) -> float:
        return r["suites"][s]["failures"].get(c, 0) / r["suites"][s]["n"]

    def mean_over(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for s in suites:
        cells = [f"{share(start, s, c):.2f} → {mean_over([share(r, s, c) for r in ends]):.2f}" for c in classes]
        ratio = (fmt(start["suites"][s]["mean_step_ratio"]) + " → "
                 + fmt(mean_over([r["suites"][s]["mean_step_ratio"] for r in ends])))
        rev = (f"{start['suites'][s]['mean_revisits']:.1f} → "
               f"{mean_over([r['suites'][s]['mean_revisits'] for r in ends]):.1f}")
        junctions = (fmt(start["suites"][s].get("junction_accuracy")) + " → "
                     + fmt(mean_over([r["suites"][s].get("junction_accuracy") for r in ends])))
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {ratio} | {rev} | {junctions} |")
    return lines


def solve_rows(start: dict, ends: list[dict], suites: list[str]) -> list[str]:
    """One row per suite: its ceiling (what any policy could solve in the budget), the start, the pooled end with
    its interval, each seed, and the paired gains."""
    lines = ["| suite | n | ceiling | SFT start | GRPO end (pooled) | per seed | diff "
             "| paired per seed: net (gained, lost) mazes | intervals apart |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in suites:
        a = start["suites"][s]
        rate, ci, rates = pooled(ends, s)
        apart = ci[0] > a["ci95"][1] or ci[1] < a["ci95"][0]
        lines.append(f"| {s} | {a['n']} | {suite_ceiling(start, s):.3f} | "
                     f"{a['success_rate']:.3f} [{a['ci95'][0]:.2f}, {a['ci95'][1]:.2f}] | "
                     f"{rate:.3f} [{ci[0]:.2f}, {ci[1]:.2f}] | {' / '.join(f'{r:.3f}' for r in rates)} | "
                     f"{rate - a['success_rate']:+.3f} | "
                     f"{'; '.join(f'{g - lo:+d} ({g}, {lo})' for g, lo in (paired(start, e, s) for e in ends))} | "
                     f"{'yes' if apart else 'no'} |")
    return lines


def study_tables(start: dict, ends: list[dict], names: list[str], suites: list[str], notes: str = "",
                 unseen: tuple[str, ...] = ()) -> list[str]:
    """results/README.md's tables from the start's and each seed's final evaluate.py report; the ``unseen`` suites
    (kinds the training distribution never draws) get a table of their own after the others."""
    lines = ["# Results: tiny Qwen3-VL on CPU, SFT start -> GRPO", "",
             "Produced by `sweeps/study.py`; greedy decoding, one episode per "
             "maze, 95 % Wilson intervals. GRPO end pools the final checkpoints of "
             f"{len(ends)} seeds ({', '.join(names)}); each seed plays the same mazes, so its pooled interval "
             "measures episode noise on these mazes, and the per-seed column shows how much seeds differ.", ""]
    if notes:
        lines += [notes.strip(), ""]
    if unseen:
        lines += ["## Solve rate on unseen mazes of trained kinds, SFT start vs GRPO end", "",
                  *solve_rows(start, ends, [s for s in suites if s not in unseen]), "",
                  "## Solve rate on unseen kinds, SFT start vs GRPO end", "",
                  *solve_rows(start, ends, [s for s in suites if s in unseen])]
    else:
        lines += ["## Solve rate, SFT start vs GRPO end", "", *solve_rows(start, ends, suites)]
    head = "fixed64" if "fixed64" in suites else suites[0]
    lines += ["", f"## Failure breakdown before and after ({head})", "", *failures_table(start, ends, head), "",
              "## Failures on every suite (share of episodes, SFT start → GRPO end, mean over seeds)", "",
              *failures_by_suite(start, ends, suites), ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=Path, required=True)
    ap.add_argument("--start", type=Path, default=ROOT / "checkpoints" / "tiny_sft")
    ap.add_argument("--sweep", action="append", default=[],
                    help="NAME=DIR[+DIR...][:SUITE] (dirs pooled in one table; SUITE: the eval suite, fixed64)")
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--notes", type=Path, default=None, help="markdown put under the intro (provenance)")
    ap.add_argument("--unseen", default="", help="comma-separated suites of kinds the training never draws: "
                    "tabulated apart from the others")
    ap.add_argument("--curve-suite", default="fixed64", help="the suite of the seeds' learning curves")
    args = ap.parse_args()
    suites = args.suites.split(",")
    unseen = tuple(s for s in args.unseen.split(",") if s)
    if not set(unseen) <= set(suites):
        raise SystemExit(f"study: --unseen {sorted(set(unseen) - set(suites))} not among --suites")
    out = args.out
    (out / "eval").mkdir(parents=True, exist_ok=True)

    start = evaluate(args.start, out / "eval" / "sft_start", suites)
    jobs = seed_jobs(args.seeds)
    ends = [evaluate(final_checkpoint(job), out / "eval" / f"grpo_end_{name}", suites) for name, job in jobs]

    notes = args.notes.read_text() if args.notes else ""
    lines = study_tables(start, ends, [name for name, _ in jobs], suites, notes, unseen)

    seeds_summary = out / "seeds"
    subprocess.run([sys.executable, str(ROOT / "sweeps/summarize.py"), str(args.seeds), "--out", str(seeds_summary),
                    "--suite", args.curve_suite], check=True)
    shutil.copy(seeds_summary / "curves.png", out / "curve_seeds.png")
    lines += [f"## GRPO learning curve ({args.curve_suite}, mean ± std over seeds)", "", "![](curve_seeds.png)", ""]
    for spec in args.sweep:
        name, _, path = spec.partition("=")
        path, _, suite = path.partition(":")
        dest = out / name
        subprocess.run([sys.executable, str(ROOT / "sweeps/summarize.py"), *path.split("+"), "--out", str(dest),
                        "--suite", suite or "fixed64"], check=True)
        shutil.copy(dest / "curves.png", out / f"curve_{name}.png")
        lines += [f"## Sweep: {name}", "", (dest / "summary.md").read_text().strip(), "",
                  f"![](curve_{name}.png)", ""]
    for sub in [seeds_summary, *[out / s.partition("=")[0] for s in args.sweep]]:
        for f in sub.glob("*.png"):
            f.unlink()  # the copies above are the ones linked
    for d in (out / "eval").iterdir():  # keep reports and figures, not TensorBoard event files
        for ev in d.rglob("events.out.tfevents.*"):
            ev.unlink()
    (out / "README.md").write_text("\n".join(lines))
    print(f"wrote {out / 'README.md'}")


if __name__ == "__main__":
    main()
