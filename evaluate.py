"""Evaluate a policy on frozen maze suites: success with intervals, pass@k, failure analysis, figures.

    python evaluate.py checkpoint=outputs/…/checkpoints/step_10            # greedy, default suites
    python evaluate.py checkpoint=… suites=[fixed64,size13,braided] samples=8 temperature=1.0
    python evaluate.py policy=oracle                  # random | wall_follower | greedy | lookahead8 too
    python evaluate.py suites=list                                          # what suites exist
    python evaluate.py compare=[runA/report.json,runB/report.json]          # side by side

Writes report.json, report.md and PNG figures (success vs size, failure breakdown, failed
episodes' paths) to its run dir, and the same to TensorBoard under eval/.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from conf.recorded import RecordError, run_config
from conf.schema import given_keys, register_evaluate
from maze.env import EnvSettings, render_path
from maze.suites import load_suite, suite_names
from rl.evaluation import compare_reports, evaluate_suites, model_player, report_markdown, write_report
from rl.policies import POLICIES, play

register_evaluate()
log = logging.getLogger("vlmaze.evaluate")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def resolve_checkpoint(path: str) -> Path | str:
    """A vlmaze checkpoint dir (verified), its policy/ dir, an HF model dir, or a hub id."""
    from models.build import resolve_path  # rl.checkpoint imports the model classes: seconds, only for a checkpoint
    from rl.checkpoint import verify

    p = Path(resolve_path(path))
    if p.is_dir() and (p / "manifest.json").exists():
        problem = verify(p)
        if problem:
            fail(f"checkpoint={path} is corrupt: {problem}")
        return p / "policy"
    if p.is_dir():
        if not (p / "config.json").is_file():
            fail(f"checkpoint={path} is neither a vlmaze checkpoint nor a model dir (no config.json)")
        return p
    if "/" in path and not path.startswith((".", "/")) and not Path(path).suffix:
        return path  # hub id, e.g. Qwen/Qwen3-VL-8B-Instruct
    fail(f"checkpoint={path} does not exist")
    return ""


RUN_KEYS = ("env", "model")  # what a policy was trained on: its observation and its model/processor settings
NOT_ADOPTED = {"model.path", "model.gradient_checkpointing", "model.init_seed"}


def adopt_run_settings(cfg: DictConfig, policy_dir: Path | str) -> None:
    """Take the environment and model settings from the run that wrote the checkpoint (``policy/vlmaze_config.yaml``)
    and the per-turn token limit, so a policy is evaluated on the observation it was trained on. Keys given on the
    command line win, and are logged; a checkpoint without a recorded config is evaluated with the defaults and a
    warning line."""
    try:
        recorded = run_config(policy_dir) if Path(str(policy_dir)).is_dir() else None
    except RecordError as err:
        raise SystemExit(f"checkpoint={cfg.checkpoint}: {err}") from None
    if recorded is None:
        log.warning("checkpoint=%s records no run config (%s): evaluating with the env/model settings given here "
                    "and the defaults", cfg.checkpoint, "older run or hub model")
        return
    given = given_keys()
    adopted, kept = [], []
    for group in RUN_KEYS:
        for key, value in (recorded.get(group) or {}).items():
            name = f"{group}.{key}"
            if name in NOT_ADOPTED or OmegaConf.select(cfg, name, default="<absent>") == "<absent>":
                continue
            if name in given:
                if OmegaConf.select(cfg, name) != value:
                    kept.append(f"{name}={OmegaConf.select(cfg, name)} (run: {value})")
                continue
            if OmegaConf.select(cfg, name) != value:  # a list (env.train_mix) is validated element by element
                OmegaConf.update(cfg, name, value, merge=isinstance(value, list))
                adopted.append(f"{name}={value}")
    if cfg.max_new_tokens == 0 and "algo" in recorded:
        cfg.max_new_tokens = int(recorded["algo"]["max_new_tokens"])
    log.info("evaluating with the run's recorded settings%s%s", f": {', '.join(adopted)}" if adopted else
             " (the defaults match them)", f"; given here, kept: {', '.join(kept)}" if kept else "")


def figures(report: dict, trajs: list, out: Path, failed_grid: int) -> dict[str, Path]:
    import matplotlib  # plotting only when figures are asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    paths = {}
    suites = report["suites"]
    sized = sorted({(rec["size"], rec["suite"]) for rec in report["episodes"]
                    if rec["suite"] in ("fixed64",) or rec["suite"].startswith("size")})
    if sized:
        xs = [s for s, _ in sized]
        ys = [suites[n]["success_rate"] for _, n in sized]
        lo = [suites[n]["success_rate"] - suites[n]["ci95"][0] for _, n in sized]
        hi = [suites[n]["ci95"][1] - suites[n]["success_rate"] for _, n in sized]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4)
        ax.set(xlabel="maze size (cells)", ylabel="success rate", ylim=(-0.02, 1.02), title="success vs maze size")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths["success_vs_size"] = out / "success_vs_size.png"
        fig.savefig(paths["success_vs_size"], dpi=120)
        plt.close(fig)
    classes = sorted({c for s in suites.values() for c in s["failures"]})
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(suites)), 3.5))
    bottom = np.zeros(len(suites))
    ax.bar(list(suites), [s["success_rate"] for s in suites.values()], color="tab:green", label="success")
    bottom += [s["success_rate"] for s in suites.values()]
    for c in classes:
        vals = np.array([s["failures"].get(c, 0) / max(s["n"], 1) for s in suites.values()])
        ax.bar(list(suites), vals, bottom=bottom, label=c)
        bottom += vals
    ax.set(ylabel="fraction of episodes", title="outcomes per suite")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    paths["failure_breakdown"] = out / "failure_breakdown.png"
    fig.savefig(paths["failure_breakdown"], dpi=120)
    plt.close(fig)
    failed = [(rec, t) for rec, t in zip(report["episodes"], trajs) if not rec["success"]][:failed_grid]
    if failed:
        tiles = [render_path(t.maze, t.path, pixels_per_cell=16, title=rec["failure"]) for rec, t in failed]
        side = max(im.size[0] for im in tiles)
        cols = min(4, len(tiles))
        rows = (len(tiles) + cols - 1) // cols
        grid = Image.new("RGB", (cols * (side + 4), rows * (side + 4)), "white")
        for k, im in enumerate(tiles):
            grid.paste(im, ((k % cols) * (side + 4), (k // cols) * (side + 4)))
        paths["failed_episodes"] = out / "failed_episodes.png"
        grid.save(paths["failed_episodes"])
    return paths


@hydra.main(config_path="conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    if cfg.compare:
        for p in cfg.compare:
            if not Path(p).is_file():
                fail(f"compare: {p} does not exist")
        print(compare_reports(list(cfg.compare)))
        return None
    if isinstance(cfg.suites, str) and cfg.suites != "list":
        cfg.suites = [cfg.suites]
    if cfg.suites == "list" or list(cfg.suites) == ["list"]:
        for name in suite_names():
            s = load_suite(name)
            print(f"{name:18s} {len(s):3d} mazes  {s.description}")
        return None
    known = suite_names()
    for name in cfg.suites:
        if name not in known:
            fail(f"unknown suite {name!r}; available: {', '.join(known)} (or suites=list)")
    if cfg.policy not in ("model", *POLICIES):
        fail(f"policy={cfg.policy!r} is not one of model, {', '.join(POLICIES)}")
    if cfg.samples < 1:
        fail(f"samples={cfg.samples} must be >= 1")
    out = Path(HydraConfig.get().runtime.output_dir)
    policy_dir = resolve_checkpoint(cfg.checkpoint) if cfg.policy == "model" and cfg.checkpoint else None
    if policy_dir is not None:
        adopt_run_settings(cfg, policy_dir)
    env = EnvSettings.from_config(cfg.env)
    checkpoint = None
    if cfg.policy == "model":
        from models.build import load_policy, weights_sha256  # the model classes take seconds: only for a model
        from models.engines.hf import HFEngine

        if cfg.checkpoint is None and cfg.model.name != "tiny":
            fail("policy=model needs checkpoint=PATH (or model=tiny for a random tiny model)")
        model_cfg = OmegaConf.merge(cfg.model, {"path": str(policy_dir)} if policy_dir is not None else {})
        try:
            model, processor = load_policy(model_cfg)
        except (OSError, ValueError) as err:
            fail(f"checkpoint={cfg.checkpoint} could not be loaded: {str(err).splitlines()[0]}")
        checkpoint = cfg.checkpoint
        engine = HFEngine(model.eval(), processor, micro_batch=cfg.engine.micro_batch)
        player = model_player(engine, processor, env, cfg.max_new_tokens or cfg.algo.max_new_tokens, cfg.temperature,
                              cfg.seed, progress=True)
    else:
        def player(mazes, samples):
            return play(cfg.policy, mazes, env, cfg.seed, samples)

    report, trajs = evaluate_suites(player, list(cfg.suites), cfg.samples)
    report["policy"] = cfg.policy
    if policy_dir is not None:
        report["weights_sha256"] = weights_sha256(policy_dir)  # the weights, not the path, made this report
    path = write_report(report, out, checkpoint, None, env)
    table = report_markdown(report)
    (out / "report.md").write_text(f"# Evaluation: {checkpoint or cfg.policy}\n\n{table}")
    print(table)
    if cfg.figures:
        from torch.utils.tensorboard import SummaryWriter  # tensorboard only when asked for

        figs = figures(report, trajs, out, cfg.failed_grid)
        writer = SummaryWriter(str(out / "tb"))

        for name, s in report["suites"].items():
            writer.add_scalar(f"eval/{name}/success_rate", s["success_rate"], 0)
        for name, p in figs.items():
            writer.add_image(f"eval/{name}", np.asarray(Image.open(p).convert("RGB")), 0, dataformats="HWC")
        writer.close()
    print(f"wrote {path}")
    return report["suites"][cfg.suites[0]]["success_rate"]


if __name__ == "__main__":
    main()
