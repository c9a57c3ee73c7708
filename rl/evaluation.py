"""Evaluation on frozen suites, shared by train.py (periodic) and evaluate.py (standalone).

Writes the ``report.json`` schema documented in docs/evaluation.md:
``{"suites": {NAME: {"n", "success_rate", "ci95", "mean_step_ratio", "failures", ...}},
"episodes": [...], "checkpoint", "step"}``. Per-episode records carry everything needed to
recompute the summaries (path included).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from maze.analysis import count_loops, dead_end_stats, failure_class, junction_stats
from maze.core import Maze
from maze.env import EnvSettings, fewest_turns, turn_budget
from maze.suites import load_suite
from models.engines.base import SamplingParams
from rl import dist as D
from rl.rollout import Trajectory, rollout

Player = Callable[[list[Maze], int], list[Trajectory]]  # (mazes, samples per maze) -> trajectories


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval for a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def episode_record(suite: str, traj: Trajectory, sample: int = 0) -> dict:
    info = traj.final_info
    steps, optimal = info.get("moves", 0), info.get("optimal_steps", 0)
    path = traj.path
    loops = count_loops(path)
    dead = dead_end_stats(traj.maze, path)
    turns = traj.num_turns
    return {
        "suite": suite, "maze_hash": traj.maze.content_hash, "seed": traj.maze.seed, "size": traj.maze.size,
        "generator": traj.maze.generator, "sample": sample, "success": traj.success,
        "failure": failure_class(traj.success, traj.finish, turns, loops, dead["ended_in_dead_end"],
                                 info.get("invalid_actions", 0), info.get("bumps", 0)),
        "turns": turns, "steps": steps, "optimal_steps": optimal,
        # solvable within the turn budget by any policy (the BFS path and the stop fit): the suite's ceiling
        "solvable": info.get("fewest_turns", 0) <= info.get("turn_budget", turns),
        "step_ratio": (steps / optimal) if traj.success and optimal > 0 else None,
        "wasted_steps": (steps - optimal) if traj.success else None,
        "bumps": info.get("bumps", 0), "invalid_actions": info.get("invalid_actions", 0),
        "revisits": info.get("revisits", 0), "loops": loops, **dead, **junction_stats(traj.maze, path),
        "path": [list(p) for p in path],
    }


def summarize(records: list[dict], samples: int = 1) -> dict:
    n = len(records)
    wins = sum(r["success"] for r in records)
    ratios = [r["step_ratio"] for r in records if r["step_ratio"] is not None]
    failures: dict[str, int] = {}
    for r in records:
        if not r["success"]:
            failures[r["failure"]] = failures.get(r["failure"], 0) + 1

    def mean(key):
        return float(np.mean([r[key] for r in records])) if n else 0.0

    out = {
        "n": n, "successes": wins, "success_rate": wins / n if n else 0.0, "ci95": list(wilson_interval(wins, n)),
        # the share of episodes any policy could solve in the budget (the oracle's rate): 1.0 on fixed64, 0.922 on
        # select64 (5 mazes need 20+ moves and a stop in 20 turns)
        "ceiling": sum(r.get("solvable", True) for r in records) / n if n else 0.0,
        "mean_step_ratio": float(np.mean(ratios)) if ratios else None,
        "median_step_ratio": float(np.median(ratios)) if ratios else None,
        "failures": failures,
        "mean_bumps": mean("bumps"), "mean_invalid_actions": mean("invalid_actions"),
        "mean_revisits": mean("revisits"), "mean_loops": mean("loops"),
        "mean_dead_end_entries": mean("dead_end_entries"),
        "dead_end_backtrack_rate": (sum(r["dead_end_backtracks"] for r in records)
                                    / max(1, sum(r["dead_end_entries"] for r in records))),
        # first-visit moves out of junctions that went towards the goal (maze/analysis.py): reading vs guessing
        "junction_accuracy": (sum(r.get("junction_right", 0) for r in records)
                              / max(1, sum(r.get("junction_decisions", 0) for r in records))),
    }
    if samples > 1:
        by_maze: dict[str, list[bool]] = {}
        for r in records:
            by_maze.setdefault(r["maze_hash"], []).append(r["success"])
        for k in sorted({1, samples} | ({samples // 2} if samples >= 4 else set())):
            out[f"pass@{k}"] = float(np.mean([pass_at_k(len(v), sum(v), k) for v in by_maze.values()]))
    return out


def suite_ceiling(report: dict, suite: str) -> float:
    """A suite's ``ceiling`` in ``report``: the share of its episodes any policy could solve within the budget.
    Reports written before the key existed get it from their episodes and recorded ``env`` settings."""
    s = report["suites"][suite]
    if "ceiling" in s:
        return s["ceiling"]
    env = {**dataclasses.asdict(EnvSettings()), **(report.get("env") or {})}
    eps = [e for e in report["episodes"] if e["suite"] == suite]
    fits = [fewest_turns(e["optimal_steps"], env["max_moves_per_turn"], env["require_stop"])
            <= turn_budget(e["size"], env["max_turns"], env["size"]) for e in eps]
    return sum(fits) / len(fits) if fits else 0.0


def model_player(engine, processor, env: EnvSettings, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, progress: bool = False) -> Player:
    """The policy model through its engine: greedy by default, sampled when temperature > 0."""

    def play(mazes: list[Maze], samples: int) -> list[Trajectory]:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                  seed=seed if temperature > 0 else None)
        return rollout(engine, processor, mazes, samples, env, sampling, progress=progress, desc="eval")

    return play


def evaluate_suites(player: Player, suites: list[str], samples: int = 1, rank: int = 0,
                    world: int = 1) -> tuple[dict, list[Trajectory]]:
    """Play every maze of every suite. Returns (report without checkpoint/step, trajectories).

    With ``world`` > 1 (every rank calls it: a collective) each rank plays mazes ``rank::world`` and the
    records are gathered in suite order, so every rank returns the report a single process would write;
    the trajectories returned are this rank's own (rank 0's begin with each suite's first maze).
    """

    report = {"suites": {}, "episodes": []}
    all_trajs = []
    for name in suites:
        suite = load_suite(name)
        mine = list(range(len(suite.mazes)))[rank::world]
        trajs = player([suite.mazes[i] for i in mine], samples) if mine else []
        local = [(mine[k // samples], k % samples, episode_record(name, t, k % samples)) for k, t in enumerate(trajs)]
        parts = D.all_gather_objects(local) if world > 1 else [local]
        records = [r for _, _, r in sorted((x for part in parts for x in part), key=lambda x: (x[0], x[1]))]
        report["suites"][name] = summarize(records, samples)
        report["episodes"].extend(records)
        all_trajs.extend(trajs)
    return report, all_trajs


def write_report(report: dict, out_dir: str | Path, checkpoint: str | None, step: int | None,
                 env: EnvSettings | None = None) -> Path:
    """``report.json``; ``env`` records the environment settings the episodes were played with."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    extra = {"env": dataclasses.asdict(env)} if env is not None else {}
    path.write_text(json.dumps({**report, "checkpoint": checkpoint, "step": step, **extra}, indent=1))
    return path


def report_markdown(report: dict) -> str:
    """One table of all suites plus the failure breakdown."""
    lines = ["| suite | n | success | 95% CI | ceiling | mean step ratio | loops | bumps | invalid | dead-end entries "
             "| backtrack rate | junction accuracy | failures |", "|" + " --- |" * 13]
    for name, s in report["suites"].items():
        ratio = f"{s['mean_step_ratio']:.2f}" if s["mean_step_ratio"] is not None else "-"
        fails = ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items(), key=lambda kv: -kv[1])) or "-"
        lines.append(f"| {name} | {s['n']} | {s['success_rate']:.3f} | [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}] | "
                     f"{s.get('ceiling', 1.0):.3f} | {ratio} | {s['mean_loops']:.2f} | {s['mean_bumps']:.2f} | "
                     f"{s['mean_invalid_actions']:.2f} | "
                     f"{s['mean_dead_end_entries']:.2f} | {s['dead_end_backtrack_rate']:.2f} | "
                     f"{s.get('junction_accuracy', float('nan')):.2f} | {fails} |")
    passes = {k for s in report["suites"].values() for k in s if k.startswith("pass@")}
    if passes:
        keys = sorted(passes, key=lambda k: int(k[5:]))
        lines += ["", "| suite | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 1)]
        for name, s in report["suites"].items():
            lines.append(f"| {name} | " + " | ".join(f"{s.get(k, 0):.3f}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def compare_reports(paths: list[str]) -> str:
    """Side-by-side success rates; marks differences whose 95 % intervals do not overlap."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    names = [n for n in reports[0]["suites"] if all(n in r["suites"] for r in reports[1:])]
    runs = " | ".join(f"{Path(p).parent.name or p}" for p in paths)
    head = f"| suite | {runs} | diff (last - first) | outside CIs |"
    lines = [head, "|" + " --- |" * (len(paths) + 3)]
    for n in names:
        ss = [r["suites"][n] for r in reports]
        cells = [f"{s['success_rate']:.3f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]" for s in ss]
        a, b = ss[0], ss[-1]
        separate = a["ci95"][1] < b["ci95"][0] or b["ci95"][1] < a["ci95"][0]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {b['success_rate'] - a['success_rate']:+.3f} | "
                     f"{'yes' if separate else 'no'} |")
    return "\n".join(lines) + "\n"
