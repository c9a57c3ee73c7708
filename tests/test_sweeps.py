"""A 2-job Hydra multirun of tiny runs completes and sweeps/summarize.py tabulates it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conf.schema import register

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf/sweep").glob("*.yaml")))
def test_every_committed_sweep_composes(name):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+sweep={name}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert "trainer.seed" in params and len(params) >= 2


def test_multirun_and_summary(tmp_path, monkeypatch):
    sweep_dir = tmp_path / "multirun"
    args = ["-m", "algo.group_size=2,3", "algo.mazes_per_step=1", "env.max_turns=2", "algo.max_new_tokens=8",
            "trainer.steps=1", "trainer.eval_every=1", "trainer.eval_suites=[size7]", "trainer.save_every=0",
            f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert len(jobs) == 2 and all((j / "eval/step_1/report.json").is_file() for j in jobs)
    proc = subprocess.run([sys.executable, str(ROOT / "sweeps/summarize.py"), str(sweep_dir), "--suite", "size7"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = (sweep_dir / "summary.md").read_text()
    assert "| algo.group_size=2," in table and "| algo.group_size=3," in table
    assert (sweep_dir / "curves.png").stat().st_size > 1000
    rows = (sweep_dir / "summary.csv").read_text().splitlines()
    assert rows[0] == "setting,seed,job,step,success_rate" and len(rows) == 1 + 2 * 2  # 2 jobs x steps 0 and 1

    # the study's tables from the same real reports: step 0 as the start, each job's step 1 as a seed's end
    sys.path.insert(0, str(ROOT / "sweeps"))
    from study import study_tables

    start = json.loads((jobs[0] / "eval/step_0/report.json").read_text())
    ends = [json.loads((j / "eval/step_1/report.json").read_text()) for j in jobs]
    text = "\n".join(study_tables(start, ends, [j.name for j in jobs], ["size7"], notes="Made by the test."))
    row = next(line for line in text.splitlines() if line.startswith("| size7 | 32 |"))
    pooled = sum(e["suites"]["size7"]["successes"] for e in ends) / 64
    assert f"| {pooled:.3f} [" in row and row.count(" / ") == 1
    solved = [{(e["maze_hash"], e["sample"]) for e in r["episodes"] if e["success"]} for r in [start, *ends]]
    nets = [f"{len(end - solved[0]) - len(solved[0] - end):+d} ({len(end - solved[0])}, {len(solved[0] - end)})"
            for end in solved[1:]]
    assert f"| {'; '.join(nets)} |" in row  # paired: the same mazes, gained and lost
    assert "Made by the test." in text and "## Failures on every suite" in text
    split = "\n".join(study_tables(start, ends, [j.name for j in jobs], ["size7"], unseen=("size7",)))
    trained, _, unseen = split.partition("## Solve rate on unseen kinds")
    assert "## Solve rate on unseen mazes of trained kinds" in trained and "| size7 | 32 |" not in trained
    assert row in unseen.splitlines()  # the same row, in the unseen kinds' table
    for failure in start["suites"]["size7"]["failures"]:
        assert f"failure: {failure}" in text

    # the study's own evaluation: a job's dir (Hydra names it "0_algo.group_size=2,...") reaches evaluate.py as one
    # override, and a cached report is reused only for the same suites and the same weights
    import study
    from safetensors.torch import load_file, save_file

    from models.build import weights_sha256

    with pytest.raises(SystemExit, match="do not differ in trainer.seed alone"):
        study.seed_jobs(sweep_dir)  # these jobs differ in group size, not seed
    runs = []
    real_run = study.subprocess.run
    monkeypatch.setattr(study.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real_run(cmd, **kw))
    ckpt = study.final_checkpoint(jobs[0])
    assert "=" in str(ckpt) and "," in str(ckpt)
    report = study.evaluate(ckpt, tmp_path / "eval_job", ["size7"])
    assert report["weights_sha256"] == weights_sha256(ckpt / "policy") and len(runs) == 1
    assert study.evaluate(ckpt, tmp_path / "eval_job", ["size7"]) == report and len(runs) == 1  # cached
    policy = tmp_path / "start"  # a start re-made under the same path: other weights, same name
    shutil.copytree(ckpt / "policy", policy)
    study.evaluate(policy, tmp_path / "eval_start", ["size7"])
    weights = load_file(policy / "model.safetensors")
    name = next(iter(weights))
    save_file({**weights, name: weights[name] + 1.0}, policy / "model.safetensors", metadata={"format": "pt"})
    again = study.evaluate(policy, tmp_path / "eval_start", ["size7"])
    assert len(runs) == 3 and again["weights_sha256"] == weights_sha256(policy) != report["weights_sha256"]


def test_pick_start_draws_groups_from_the_recorded_training_distribution(tmp_path):
    """sweeps/pick_start.py measures a start's GRPO groups on the mazes a run from it trains on: the distribution
    its run recorded (a mixture of sizes for the generalist's start, 9x9 for the default one)."""
    import yaml

    sys.path.insert(0, str(ROOT / "sweeps"))
    from pick_start import recorded_env

    from maze.sampler import TrainSampler

    default = TrainSampler.from_config(recorded_env(ROOT / "checkpoints/tiny_sft"), seed=7).take(8)
    assert [m.layout_hash for m in default] == [m.layout_hash for m in TrainSampler(sizes=(9,), seed=7).take(8)]
    policy = tmp_path / "mix_start"
    shutil.copytree(ROOT / "checkpoints/tiny_sft", policy)
    record = yaml.safe_load((policy / "vlmaze_config.yaml").read_text())
    record["env"]["train_mix"] = [{"size": 7, "generator": "prim", "braid": 0.0, "placement": "corners4",
                                   "weight": 1.0},
                                  {"size": 13, "generator": "wilson", "braid": 0.0, "placement": "corners4",
                                   "weight": 1.0}]
    (policy / "vlmaze_config.yaml").write_text(yaml.safe_dump(record))
    sizes = {m.size for m in TrainSampler.from_config(recorded_env(policy), seed=7).take(16)}
    assert sizes == {7, 13}


def test_pick_start_admits_the_default_start_and_prefers_the_greedy_rate_nearest_the_target():
    """The pick's rule at its defaults, on stage 3's measured rows for the committed start (greedy select64 0.469 /
    0.484, mixed groups 0.250 / 0.281 at steps 128 / 256): it keeps step 128, the one GRPO lifted; a run whose
    groups are mixed less often than the bar gets nothing, and a tie goes to the earlier step."""
    sys.path.insert(0, str(ROOT / "sweeps"))
    from pick_start import choose, parser

    args = parser().parse_args(["run"])
    rows = [(Path("run/checkpoints/step_128"), {"greedy": 0.469, "mixed": 0.250}),
            (Path("run/checkpoints/step_256"), {"greedy": 0.484, "mixed": 0.281})]
    assert choose(rows, args.target, args.min_mixed) == rows[0][0]
    assert choose([(c, {**m, "mixed": 0.188}) for c, m in rows], args.target, args.min_mixed) is None
    tie = [(Path("run/checkpoints/step_256"), {"greedy": 0.5, "mixed": 0.5}),
           (Path("run/checkpoints/step_128"), {"greedy": 0.5, "mixed": 0.5})]
    assert choose(tie, args.target, args.min_mixed) == Path("run/checkpoints/step_128")


def test_slurm_multirun_dry_run_writes_job_scripts(tmp_path):
    """cluster=slurm composes with the submitit launcher config, and a dry-run multirun writes one sbatch
    script per job with submitit's generator (no Slurm here, so nothing is submitted)."""
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["cluster=slurm", "hydra/launcher=vlmaze_slurm",
                                                       "cluster.partition=h200", "cluster.nnodes=2"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.nodes, launcher.gpus_per_node) == ("h200", 2, 8)

    sweep_dir = tmp_path / "multirun"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", "cluster=slurm", "dry_run=true",
                           "cluster.partition=h200", "algo.group_size=4,8", f"hydra.sweep.dir={sweep_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    scripts = sorted(sweep_dir.glob("*/submitit/job.sbatch"))
    assert len(scripts) == 2
    for script, g in zip(scripts, (4, 8)):
        text = script.read_text()
        assert "#SBATCH --partition=h200" in text and "#SBATCH --gpus-per-node=8" in text
        args = text.split("train.py", 1)[1].split()
        assert f"algo.group_size={g}" in args and not any(a.startswith("dry_run") for a in args)


def test_the_reading_bench_tells_reading_faults_from_acting_faults():
    """``bench/reading.score`` on scripted turns: the expert's own thoughts read every pocket; a thought
    that misses a pocket and walks in is a reading fault; one that names it and walks in anyway acts against it."""
    from types import SimpleNamespace

    from bench.reading import HEADER, row, score
    from maze.core import MOVES, dead_ends, generate_maze
    from maze.thought import thought

    m = next(m for s in range(50) if dead_ends(m := generate_maze(size=9, seed=s), m.start, 8))
    way = dead_ends(m, m.start, 8)[0]
    inside = (m.start[0] + MOVES[way][0], m.start[1] + MOVES[way][1])
    right = thought(m, m.start, "right", 8)  # names the pocket
    assert way in right.split("; not ")[1]
    blind = right.split(";")[0] + "</think>"  # the same thought without the pocket

    def turns(text):
        return [SimpleNamespace(maze=m, actions=[f"{text}<action>{way}</action>"], infos=[{"position": inside}])]

    c, by_depth, by_way = score(turns(right), 8)
    assert by_way[way][:2] == [1, 1] and sum(v[1] for v in by_way.values()) == c["true_pockets"]
    assert c["pockets"] == 1 and c["missed"] == 0 and c["open"] == 1
    assert (c["into_true"], c["into_true_named"], c["into_named"]) == (1, 1, 1)  # named it, walked in: acting
    c, by_depth, by_way = score(turns(blind), 8)
    assert by_way[way][0] == 0 and by_way[way][1] == 1
    assert c["pockets"] == 0 and c["missed"] >= 1 and c["open"] == 1
    assert (c["into_true"], c["into_true_named"], c["into_named"]) == (1, 0, 0)  # did not see it: reading
    depth = min(k for k in range(1, 9) if way in dead_ends(m, m.start, k))
    assert by_depth[depth][1] >= 1 and by_depth[depth][0] == 0
    assert sum(tot for _, tot in by_depth.values()) == c["true_pockets"]
    # the table row: the blind thought's pocket share and the depth column of the pocket it missed
    cells = [x.strip() for x in row("blind", 8, 0.0, c, by_depth, by_way).strip("|").split("|")]
    assert len(cells) == HEADER.count("|") - 1 and cells[4] == "0.00" and cells[3] == "1.00"
    assert cells[6].split(" / ")[min(depth, 4) - 1] == "0.00"


def test_the_reading_bench_prints_one_row_per_checkpoint_and_refuses_a_wrong_path(tmp_path, monkeypatch, capsys):
    """``python bench/reading.py A B``: one table with a row per checkpoint, each scored at its recorded
    lookahead; a path that holds no policy fails before any rollout, in one line naming it."""
    import bench.reading as reading

    start = ROOT / "checkpoints" / "tiny_sft"
    monkeypatch.setattr(sys, "argv", ["reading.py", str(start), str(start), "--mazes", "2"])
    reading.main()
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith(f"| {start} |")]
    assert len(table) == 4 and table[0] == table[2]  # printed as it goes, then in the table; both rows the same
    assert table[0].split("|")[2].strip() == "8"  # the start's recorded algo.sft_lookahead
    # --fresh: mazes from a sampler stream no run trains on, never an eval layout, the ceiling stated
    monkeypatch.setattr(sys, "argv", ["reading.py", str(start), "--fresh", "3"])
    reading.main()
    out = capsys.readouterr().out
    assert "reading, 3 fresh 9x9 mazes" in out and "the ceiling" in out
    from itertools import islice

    from maze import eval_layouts
    from maze.sampler import TrainSampler
    fresh = list(islice(TrainSampler(seed=reading.FRESH_SEED), 3))
    assert not {m.layout_hash for m in fresh} & eval_layouts()
    assert not {m.content_hash for m in fresh} & {m.content_hash for m in islice(TrainSampler(seed=0), 3000)}
    monkeypatch.setattr(sys, "argv", ["reading.py", str(start), str(tmp_path)])
    with pytest.raises(SystemExit, match=f"{tmp_path} is neither a policy directory"):
        reading.main()


def test_legend_labels_show_what_sets_a_setting_apart():
    import importlib.util

    spec = importlib.util.spec_from_file_location("summarize", ROOT / "sweeps" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    start = "model.path=outputs/a_long_start_dir/checkpoints/step_256/policy"
    a, b = f"{start},algo.adv_level=turn", f"{start},algo.adv_level=episode"
    assert mod.legend_labels([a, b]) == {a: "algo.adv_level=turn", b: "algo.adv_level=episode"}
    assert mod.legend_labels([a]) == {a: a[:60]}
