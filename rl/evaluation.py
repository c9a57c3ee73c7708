"""Evaluation on frozen suites, shared by train.py (periodic) and evaluate.py (standalone).

Writes the ``report.json`` schema documented in README:
``{"suites": {NAME: {"n", "success_rate", "ci95", "mean_step_ratio", "failures", ...}},
"episodes": [...], "checkpoint", "step"}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from maze.evalsets import load_suite
from models.engines.base import SamplingParams
from rl.rollout import EnvSettings, rollout
from rl.types import Trajectory


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval for a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def failure_class(traj: Trajectory) -> str:
    if traj.success:
        return "success"
    return {"stop_wrong": "stopped_wrong_cell", "max_turns": "timed_out",
            "context": "context_limit"}.get(traj.finish, traj.finish or "unknown")


def episode_record(suite: str, traj: Trajectory) -> dict:
    info = traj.final_info
    steps, optimal = info.get("moves", 0), info.get("optimal_steps", 0)
    return {
        "suite": suite, "maze_hash": traj.maze.content_hash, "seed": traj.maze.seed,
        "size": traj.maze.size, "success": traj.success, "failure": failure_class(traj),
        "turns": traj.num_turns, "steps": steps, "optimal_steps": optimal,
        "step_ratio": (steps / optimal) if traj.success and optimal > 0 else None,
        "bumps": info.get("bumps", 0), "invalid_actions": info.get("invalid_actions", 0),
        "revisits": info.get("revisits", 0), "path": [list(p) for p in traj.path],
    }


def summarize(records: list[dict]) -> dict:
    n = len(records)
    wins = sum(r["success"] for r in records)
    ratios = [r["step_ratio"] for r in records if r["step_ratio"] is not None]
    failures: dict[str, int] = {}
    for r in records:
        if not r["success"]:
            failures[r["failure"]] = failures.get(r["failure"], 0) + 1
    return {
        "n": n, "successes": wins, "success_rate": wins / n if n else 0.0,
        "ci95": list(wilson_interval(wins, n)),
        "mean_step_ratio": float(np.mean(ratios)) if ratios else None,
        "median_step_ratio": float(np.median(ratios)) if ratios else None,
        "failures": failures,
        "mean_bumps": float(np.mean([r["bumps"] for r in records])) if n else 0.0,
        "mean_invalid_actions": float(np.mean([r["invalid_actions"] for r in records])) if n else 0.0,
        "mean_revisits": float(np.mean([r["revisits"] for r in records])) if n else 0.0,
    }


def evaluate_suites(engine, processor, suites: list[str], env: EnvSettings, max_new_tokens: int,
                    progress: bool = False) -> tuple[dict, list[Trajectory]]:
    """Greedy episodes on every maze of every suite. Returns (report, trajectories)."""
    report = {"suites": {}, "episodes": []}
    all_trajs = []
    for name in suites:
        mazes = list(load_suite(name).mazes)
        trajs = rollout(engine, processor, mazes, 1, env,
                        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                        progress=progress, desc=f"eval {name}")
        records = [episode_record(name, t) for t in trajs]
        report["suites"][name] = summarize(records)
        report["episodes"].extend(records)
        all_trajs.extend(trajs)
    return report, all_trajs


def write_report(report: dict, out_dir: str | Path, checkpoint: str | None, step: int | None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {**report, "checkpoint": checkpoint, "step": step}
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=1))
    return path
