"""Evaluation harness: reference policies, failure analysis, intervals, report schema, CLI errors."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import maze
from maze.analysis import count_loops, dead_end_stats, failure_class
from maze.core import MOVES, Maze
from maze.env import EnvSettings
from rl.evaluation import evaluate_suites, pass_at_k, suite_ceiling, summarize, wilson_interval
from rl.policies import play

ROOT = Path(__file__).resolve().parents[1]
ENV = EnvSettings(max_turns=30, size=9)


def test_oracle_solves_every_suite_optimally():
    report, _ = evaluate_suites(lambda mazes, k: play("oracle", mazes, ENV, 0, k), maze.suite_names())
    for name, s in report["suites"].items():
        assert s["success_rate"] == 1.0, name
        assert s["mean_step_ratio"] == pytest.approx(1.0), name
        assert s["mean_loops"] == 0 and s["mean_dead_end_entries"] == 0 and s["failures"] == {}


def test_each_suite_ceiling_is_what_the_oracle_solves_at_the_reference_budget():
    """At 20 turns a 9x9 maze whose shortest path has 20+ moves cannot be solved (the stop is a turn): the report's
    ``ceiling`` counts the episodes that fit, and the oracle solves exactly those."""
    report, _ = evaluate_suites(lambda mazes, k: play("oracle", mazes, EnvSettings(), 0, k), maze.suite_names())
    for name, s in report["suites"].items():
        assert s["success_rate"] == s["ceiling"], name
    for r in report["episodes"]:
        assert r["solvable"] == r["success"] == (r["optimal_steps"] + 1 <= maze.env.turn_budget(r["size"])), r
    assert report["suites"]["fixed64"]["ceiling"] == 1.0  # the reference's 64 all fit its budget
    assert min(s["ceiling"] for s in report["suites"].values()) < 1.0
    # reports written before the key: the same ceiling from their episodes and recorded env
    old = {"suites": {n: {k: v for k, v in s.items() if k != "ceiling"} for n, s in report["suites"].items()},
           "episodes": [{k: v for k, v in r.items() if k != "solvable"} for r in report["episodes"]],
           "env": dataclasses.asdict(EnvSettings())}
    assert all(suite_ceiling(old, n) == s["ceiling"] for n, s in report["suites"].items())
    old["env"]["max_turns"] = 30
    assert suite_ceiling(old, "select64") == 1.0


def test_fewest_turns_counts_moves_per_turn_and_the_stop():
    m = maze.load_suite("fixed64").mazes[0]
    moves = maze.core.optimal_steps(m)
    for per_turn, stop, want in ((1, True, moves + 1), (1, False, moves), (3, True, -(-moves // 3) + 1)):
        e = maze.MazeEnv(EnvSettings(max_moves_per_turn=per_turn, require_stop=stop))
        e.reset(options={"maze": m})
        assert e.fewest_turns == want
        _, _, _, _, info = e.step("<action>up</action>")
        assert info["fewest_turns"] == want and info["turn_budget"] == 20


def expected_random_success(m: Maze, turns: int) -> float:
    """Exact chance that the uniform random walker (bumps stay put) reaches the goal within turns-1 moves."""
    size = m.size
    prob = np.zeros((size, size))
    prob[m.start] = 1.0
    absorbed = 0.0
    for _ in range(turns - 1):
        nxt = np.zeros_like(prob)
        for r, c in zip(*np.nonzero(prob)):
            for dr, dc in MOVES.values():
                target = (r + dr, c + dc) if m.is_floor((r + dr, c + dc)) else (r, c)
                nxt[target] += prob[r, c] / 4
        absorbed += nxt[m.goal]
        nxt[m.goal] = 0.0
        prob = nxt
    return absorbed


def test_random_policy_matches_its_exact_expected_rate():
    env = EnvSettings(max_turns=40, size=9)
    mazes = list(maze.load_suite("size7").mazes)
    expected = float(np.mean([expected_random_success(m, env.turns_for(m.size)) for m in mazes]))
    trajs = play("random", mazes, env, seed=1, samples=40)
    rate = float(np.mean([t.success for t in trajs]))
    sigma = np.sqrt(expected * (1 - expected) / len(trajs))
    assert 0.05 < expected < 0.9
    assert abs(rate - expected) < 4 * sigma, (rate, expected)


def test_wall_follower_solves_small_perfect_mazes_given_time():
    env = EnvSettings(max_turns=200, size=9)
    trajs = play("wall_follower", list(maze.load_suite("size7").mazes), env)
    assert all(t.success for t in trajs)
    assert np.mean([t.final_info["moves"] / t.final_info["optimal_steps"] for t in trajs]) > 1.0


def test_loop_detector_on_hand_built_paths():
    a, b, c, d, e = (1, 1), (1, 2), (1, 3), (2, 3), (2, 2)
    assert count_loops([a, b, a, b]) == 1  # oscillation
    assert count_loops([a, b, a, b, a, b]) == 2
    assert count_loops([a, b, c, d, e, b, c, d, e, b]) == 1  # around a cycle twice
    assert count_loops([a, b, c, b, a]) == 0  # backtracking out of a dead end is not a loop
    assert count_loops([a, a, a, b, b, c]) == 0  # bumps collapse
    assert count_loops([a, b, a, c]) == 0


def test_dead_end_detector_on_a_hand_built_maze():
    m = Maze.from_rows(["#######",
                        "#S....#",
                        "#.###.#",
                        "#.#G#.#",
                        "#.#.#.#",
                        "#...#.#",
                        "#######"])
    path_cells = [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (5, 2), (5, 3), (4, 3), (3, 3)]
    assert maze.shortest_path(m) == path_cells
    detour = [(1, 1), (1, 2), (1, 3), (1, 2), (1, 1), (2, 1)]  # into the right branch and back
    stats = dead_end_stats(m, detour)
    assert stats == {"dead_end_entries": 1, "dead_end_backtracks": 1, "ended_in_dead_end": False}
    stuck = dead_end_stats(m, [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 5)])
    assert stuck == {"dead_end_entries": 1, "dead_end_backtracks": 0, "ended_in_dead_end": True}


def test_junction_decisions_on_a_hand_built_maze():
    from maze.analysis import junction_stats

    m = Maze.from_rows(["#######",
                        "#S....#",
                        "###.#.#",
                        "#...#.#",
                        "#.###.#",
                        "#....G#",
                        "#######"])
    # (1, 3) is the one junction on the way (left, right, down); right is 6 -> 5 moves from the goal, down 6 -> 7
    right = junction_stats(m, [(1, 1), (1, 2), (1, 3), (1, 3), (1, 4), (1, 5)])  # a bump at (1, 3) collapses
    assert right == {"junction_decisions": 1, "junction_right": 1}
    wrong = junction_stats(m, [(1, 1), (1, 2), (1, 3), (2, 3), (3, 3), (2, 3), (1, 3), (1, 4)])
    assert wrong == {"junction_decisions": 1, "junction_right": 0}  # the second visit to (1, 3) is not a decision
    assert junction_stats(m, [(1, 1), (1, 2)]) == {"junction_decisions": 0, "junction_right": 0}


@pytest.mark.parametrize("kwargs,cls", [
    (dict(success=True, finish="success"), "success"),
    (dict(finish="stop_wrong", loops=3), "stopped_wrong_cell"),
    (dict(finish="context"), "context_limit"),
    (dict(loops=1, ended_in_dead_end=True), "looping"),
    (dict(ended_in_dead_end=True), "stuck_in_dead_end"),
    (dict(invalid_actions=20), "invalid_actions"),
    (dict(bumps=20), "wall_bumping"),
    (dict(), "timed_out"),
])
def test_failure_classes(kwargs, cls):
    base = dict(success=False, finish="max_turns", turns=30, loops=0, ended_in_dead_end=False,
                invalid_actions=0, bumps=0)
    assert failure_class(**{**base, **kwargs}) == cls


def test_failure_classes_from_real_episodes():
    m = maze.load_suite("fixed64").mazes[0]
    env = maze.MazeEnv(size=9, max_turns=6)
    env.reset(options={"maze": m})
    _, _, term, _, info = env.step("<action>stop</action>")
    assert term and info["stopped_wrong"]
    trajs = play("random", [m], EnvSettings(max_turns=6), seed=0, samples=20)
    records = summarize([__import__("rl.evaluation", fromlist=["x"]).episode_record("t", t) for t in trajs])
    assert sum(records["failures"].values()) + records["successes"] == 20


def test_wilson_interval_known_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)


def test_pass_at_k():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0


def _evaluate(args, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "evaluate.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_evaluate_cli_report_schema_figures_and_compare(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for policy, out in [("oracle", a), ("wall_follower", b)]:
        proc = _evaluate([f"policy={policy}", "suites=[fixed64,size7,size11]", f"hydra.run.dir={out}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((a / "report.json").read_text())
    assert set(report) >= {"suites", "episodes", "checkpoint", "step"}
    s = report["suites"]["fixed64"]
    assert set(s) >= {"n", "success_rate", "ci95", "mean_step_ratio", "failures", "mean_loops",
                      "mean_dead_end_entries", "dead_end_backtrack_rate"}
    ep = report["episodes"][0]
    assert set(ep) >= {"suite", "maze_hash", "success", "failure", "steps", "optimal_steps", "step_ratio", "loops",
                       "bumps", "invalid_actions", "dead_end_entries", "path"}
    assert (a / "report.md").read_text().count("| fixed64 |") == 1
    for fig in ["success_vs_size.png", "failure_breakdown.png"]:
        assert (a / fig).stat().st_size > 1000
    assert (b / "failed_episodes.png").is_file()
    proc = _evaluate([f"compare=[{a}/report.json,{b}/report.json]"])
    assert proc.returncode == 0 and "| fixed64 |" in proc.stdout and "yes" in proc.stdout


def test_evaluate_oracle_with_the_reference_interface(tmp_path):
    """``+experiment=reference_8b``: the reference's rendering, prompt, action format and 20-step budget."""
    proc = _evaluate(["policy=oracle", "+experiment=reference_8b", "suites=[fixed64]", "figures=false",
                      f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["env"]["interface"] == "reference" and report["env"]["max_turns"] == 20
    assert (report["env"]["pixels_per_cell"], report["env"]["pad_to"], report["env"]["view"]) == (25, 1, "global")
    assert report["suites"]["fixed64"]["success_rate"] == 1.0
    assert max(ep["turns"] for ep in report["episodes"]) == 17  # 16 moves + the stop, within 20


@pytest.mark.parametrize("args,message", [
    (["suites=[fixed64,nope]"], "unknown suite 'nope'"),
    (["checkpoint=/does/not/exist"], "checkpoint=/does/not/exist does not exist"),
    (["policy=greedyy"], "policy='greedyy' is not one of"),
])
def test_evaluate_cli_bad_input_is_one_line(args, message):
    proc = _evaluate(args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_evaluate_rejects_a_corrupt_checkpoint(tmp_path):
    from models.tiny import build_tiny
    from rl.checkpoint import save_checkpoint

    model, processor = build_tiny(0)
    ckpt = save_checkpoint(tmp_path, 1, model, processor)
    weights = ckpt / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = _evaluate([f"checkpoint={ckpt}"])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "is corrupt" in lines[0], proc.stderr


def test_suites_list():
    proc = _evaluate(["suites=list"])
    assert proc.returncode == 0 and "fixed64" in proc.stdout and "braided" in proc.stdout


def test_checkpoint_records_its_run_and_evaluate_uses_it(tmp_path):
    """A run trained on a global 16 px view: evaluate.py with no env override evaluates on that observation (and its
    report says so); a key given on the command line wins; a policy dir without a recorded config warns."""
    import json

    run = tmp_path / "run"
    train = subprocess.run([sys.executable, str(ROOT / "train.py"), "env.view=global", "env.pixels_per_cell=16",
                            "env.pad_before=0", "algo.mazes_per_step=2", "algo.group_size=2", "env.max_turns=2",
                            "algo.max_new_tokens=12", "trainer.steps=1", "trainer.eval_every=0",
                            f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert train.returncode == 0, train.stderr[-3000:]
    ckpt = run / "checkpoints/step_1"
    proc = _evaluate([f"checkpoint={ckpt}", "suites=[size7]", "figures=false", "env.max_turns=3",
                      f"hydra.run.dir={tmp_path / 'eval'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads((tmp_path / "eval/report.json").read_text())["env"]
    assert env["view"] == "global" and env["pixels_per_cell"] == 16 and env["pad_before"] == 0
    assert env["max_turns"] == 3  # given here: wins over the run's 2
    said = proc.stdout + proc.stderr
    assert "env.view=global" in said and "env.max_turns=3 (run: 2)" in said
    # a policy without a recorded config (a hub model; here the shipped start without its record): defaults, and
    # one warning line saying so
    shutil.copytree(ROOT / "checkpoints/tiny_sft", tmp_path / "no_record")
    (tmp_path / "no_record/vlmaze_config.yaml").unlink()
    bare = _evaluate([f"checkpoint={tmp_path / 'no_record'}", "suites=[size7]", "figures=false", "env.max_turns=1",
                      f"hydra.run.dir={tmp_path / 'bare'}"])
    assert bare.returncode == 0 and "records no run config" in bare.stdout + bare.stderr, bare.stderr[-2000:]


def test_evaluate_a_checkpoint_trained_on_a_mixture(tmp_path):
    """A run's recorded ``env.train_mix`` (a list of typed kinds) is adopted like any other key: the generalist's
    start evaluates, and says it adopted the mixture it was trained on."""
    proc = _evaluate(["checkpoint=checkpoints/tiny_sft_mix", "suites=[size7]", "figures=false", "env.max_turns=1",
                      f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "env.train_mix=[{'size': 7," in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "report.json").read_text())["suites"]["size7"]["n"] == 32


def test_greedy_explores_the_pocket_and_lookahead8_does_not():
    from maze.core import Maze
    from maze.env import EnvSettings
    from rl.policies import play
    from tests.test_maze import POCKETS

    m = Maze.from_rows(POCKETS)
    env = EnvSettings(size=7, max_turns=40)
    greedy, look = play("greedy", [m], env)[0], play("lookahead8", [m], env)[0]
    assert greedy.success and look.success
    # greedy heads right (nearest the goal) and walks the 6-cell pocket and back; then up and down tie on distance
    # (up first, the fixed move order): the 2-cell pocket and back; then the route down
    assert greedy.actions[0].endswith("<action>right</action>") and greedy.final_info["moves"] == 8 + 2 * 6 + 2 * 2
    assert look.final_info["moves"] == 8 and look.final_info["optimal_steps"] == 8
