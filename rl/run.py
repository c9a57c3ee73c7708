"""A training run's set-up and bookkeeping, shared by the recipes (GRPO in ``train.py``, SFT in ``rl/sft.py``):
ranks and seeds, the models and the engine, the optimizer and its schedule, resume, TensorBoard, signals, and at
the end of each step the weight sync, eval and checkpoint. A recipe's loop is its own; everything around it is
here, once.

Precision: model.dtype is the compute dtype; the trainer's parameters and AdamW moments are fp32 (the master
copy). FSDP2 (any world size under torchrun, cluster=1gpu included) casts each unit to the compute dtype for
its forward and reduces gradients in fp32; one process or DDP runs its forwards under autocast. vLLM and the
hf engine's copy (under FSDP2) need the new weights after each update (``sync_weights``: streamed, one tensor
at a time); plain hf shares the trainer's module.
"""

from __future__ import annotations

import copy
import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from maze.env import EnvSettings, render_path
from maze.sampler import TrainSampler
from models.build import DTYPES, load_policy
from models.distributed import stream_full_weights, wrap_fsdp2
from models.engines.base import Engine
from models.engines.hf import HFEngine
from rl import checkpoint as ckpt_io
from rl import dist as D
from rl import faults
from rl.evaluation import evaluate_suites, model_player, write_report
from rl.update import Scoring


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def start_ranks(cfg: DictConfig) -> tuple[int, int, str]:
    """Process group (under torchrun), device, CPU threads and seeds: ``(rank, world, device)``."""
    if D.under_torchrun():
        D.init(cfg.cluster.backend, cfg.cluster.collective_timeout_min)
    rank, world = D.rank(), D.world_size()
    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    seed_everything(cfg.trainer.seed + rank, cfg.trainer.deterministic)
    return rank, world, device


def resume_point(cfg: DictConfig, run_dir: str) -> Path | None:
    """The checkpoint to resume from: the run dir's newest complete one (auto), none, or the one named."""
    if cfg.trainer.resume == "auto":
        return ckpt_io.find_resume_point(run_dir)
    if cfg.trainer.resume == "never":
        return None
    problem = ckpt_io.verify(Path(cfg.trainer.resume))
    if problem:
        raise SystemExit(f"trainer.resume={cfg.trainer.resume}: {problem}")
    return Path(cfg.trainer.resume)


def build_models(cfg: DictConfig, start_ckpt: Path | None, device: str, fsdp: bool, with_reference: bool):
    """``(policy, processor, engine, reference, push_weights)`` (the module docstring's precision). A vLLM engine
    starts last, after the policy is sharded (so the GPU holds only the shards beside vLLM's budget), with random
    weights: ``push_weights`` is true and ``Run.start`` pushes the trainer's weights before anything generates."""
    compute_dtype = DTYPES[cfg.model.dtype]
    model_cfg = cfg.model.copy()
    if start_ckpt is not None:
        model_cfg.path = str(start_ckpt / "policy")  # the structure; dcp/ then restores the fp32 masters
    policy, processor = load_policy(model_cfg, device)  # in the compute dtype
    engine = None
    if cfg.engine.name == "hf" and fsdp:  # an unsharded compute-dtype copy generates (FSDP2 forwards are collectives)
        engine = HFEngine(copy.deepcopy(policy).eval().requires_grad_(False), processor,
                          micro_batch=cfg.engine.micro_batch)
    elif cfg.engine.name == "hf":  # shares the trainer's module (and its autocast)
        engine = HFEngine(policy, processor, micro_batch=cfg.engine.micro_batch, compute_dtype=compute_dtype)
    push_weights = cfg.engine.name == "vllm" or fsdp
    policy.float()  # the fp32 master copy
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    if fsdp:
        wrap_fsdp2(policy, compute_dtype)  # vision tower, each decoder layer, root; fp32 shards, bf16 compute
    reference = None
    if with_reference:  # compute dtype, sharded like the policy
        reference, _ = load_policy(cfg.model, device)
        reference.eval().requires_grad_(False)
        if fsdp:
            wrap_fsdp2(reference, compute_dtype, frozen=True)
    if cfg.engine.name == "vllm":
        from models.engines.vllm import VLLMEngine  # optional: vllm is installed only where it runs

        if device == "cuda":
            torch.cuda.empty_cache()  # vLLM sizes its budget from the device's free memory
        engine = VLLMEngine.from_config(cfg, policy, processor)
    return policy, processor, engine, reference, push_weights


def make_optimizer(policy, a, total_steps: int):
    """AdamW on the fp32 masters; linear warmup, then constant or cosine to 0 at the last step."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=a.weight_decay, betas=(0.9, 0.99))

    def lr_factor(s: int) -> float:
        warm = min(1.0, (s + 1) / a.warmup_steps) if a.warmup_steps else 1.0
        if a.lr_schedule == "cosine":
            span = max(total_steps - a.warmup_steps, 1)
            return warm * 0.5 * (1 + math.cos(math.pi * min(max(s - a.warmup_steps, 0), span) / span))
        return warm

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def stop_on_signals() -> dict:
    """SIGTERM/SIGINT finish the step, save and exit; a second signal exits at once (the last checkpoint stands)."""
    stop_requested = {"signal": None}

    def request_stop(signum, _frame):
        if stop_requested["signal"] is not None:
            raise SystemExit(128 + signum)
        stop_requested["signal"] = signum
        D.print0(f"received signal {signum}: finishing step, then saving and exiting (again to abort)")

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop_requested


@dataclass
class Run:
    """One run's state, built by ``Run.start``; a recipe's loop reads it and calls ``end_step`` after each step."""

    cfg: DictConfig
    run_dir: str
    rank: int
    world: int
    fsdp: bool
    ddp: bool
    compute_dtype: torch.dtype
    policy: torch.nn.Module
    processor: object
    engine: Engine
    reference: torch.nn.Module | None
    push_weights: bool
    env: EnvSettings
    eval_env: EnvSettings
    sampler: TrainSampler
    scoring: Scoring
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    start_step: int
    metrics_state: dict
    writer: object
    faults: frozenset
    score: float | None = None
    stop_requested: dict = field(default_factory=dict)
    nonfinite_in_row: int = 0
    engine_stale: bool = False  # the trainer's weights changed since the engine last got them

    @classmethod
    def start(cls, cfg: DictConfig, run_dir: str, total_steps: int, *, temperature: float, with_reference: bool,
              plan: Callable[[], str] | None = None) -> Run:
        """Ranks and seeds, models and engine, the training sampler, optimizer and schedule, resume, TensorBoard
        (a fresh run logs its resolved config and ``plan()``), signals; then the step-0 eval of a fresh run."""
        rank, world, device = start_ranks(cfg)
        fault_schedule = faults.schedule()
        start_ckpt = resume_point(cfg, run_dir)
        compute_dtype = DTYPES[cfg.model.dtype]
        fsdp = D.is_initialized() and cfg.cluster.parallel == "fsdp2"
        policy, processor, engine, reference, push_weights = build_models(cfg, start_ckpt, device, fsdp,
                                                                          with_reference)
        env = EnvSettings.from_config(cfg.env)
        eval_env = replace(env, max_turns=cfg.trainer.eval_max_turns or cfg.env.max_turns)
        # the GRPO runs' sampler (an SFT run saves it too, so GRPO can resume from an SFT run's stream)
        sampler = TrainSampler.from_config(cfg.env, cfg.trainer.seed)
        scoring = Scoring(engine.pad_id, policy.config.image_token_id, engine.banned_token_ids, temperature,
                          cfg.trainer.packing, share_images=not fsdp, compute_dtype=compute_dtype)
        optimizer, scheduler = make_optimizer(policy, cfg.algo, total_steps)
        start_step, metrics_state = 0, {}
        if start_ckpt is not None:  # fp32 masters, AdamW moments, schedule, sampler, this rank's RNG
            # loading builds AdamW's state with a step on zero gradients (the optimizer phase's memory): vLLM's
            # budget is planned for the rollout and sync phases, so the engine sleeps (the first push wakes it)
            engine.sleep()
            state = ckpt_io.load_checkpoint(start_ckpt, policy, optimizer)
            scheduler.load_state_dict(state["scheduler"])
            sampler.load_state_dict(state["sampler"])
            D.print0(f"resumed from {start_ckpt} at step {int(state['step'])}")
            start_step, metrics_state = int(state["step"]), state["metrics"]
        writer = None
        if D.is_main():
            from torch.utils.tensorboard import SummaryWriter  # heavy (tensorboard): only where it writes

            writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)
            if start_step == 0:
                writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "\n```", 0)
                D.print0(OmegaConf.to_yaml(cfg, resolve=True))
                if plan is not None:
                    D.print0(plan())
        run = cls(cfg, run_dir, rank, world, fsdp, cfg.cluster.parallel == "ddp" and world > 1, compute_dtype,
                  policy, processor, engine, reference, push_weights, env, eval_env, sampler, scoring, optimizer,
                  scheduler, total_steps, start_step, metrics_state, writer, fault_schedule,
                  stop_requested=stop_on_signals())
        # vLLM starts without the weights; a resumed run's hf copy holds the start's, not the restored ones
        run.engine_stale = push_weights and (cfg.engine.name == "vllm" or start_ckpt is not None)
        run.score = (run.eval(0) if start_step == 0 and cfg.trainer.eval_at_start
                     else metrics_state.get("last_score"))
        return run

    # ---------------------------------------------------------------- during a step
    def sync_weights(self) -> None:
        """The engine gets the new weights, streamed one tensor at a time, in the compute dtype (vLLM; the hf
        engine's copy under FSDP2); plain hf shares the trainer's module. A recipe that generates only at evals
        (SFT) sets ``engine_stale`` instead, and ``eval`` pushes once before it plays."""
        if self.push_weights:
            self.engine.update_weights(stream_full_weights(self.policy, self.compute_dtype))
        self.engine_stale = False

    def refresh_engine(self) -> None:
        """Push the trainer's weights if the engine lacks them (``engine_stale``); before anything generates."""
        if self.engine_stale:
            self.sync_weights()

    def check_nonfinite(self, step: int, skipped: bool) -> None:
        """Count steps in a row whose update was skipped for a non-finite loss or gradient; stop at
        ``trainer.max_nonfinite_steps``."""
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
        if skipped:
            D.print0(f"step {step}: non-finite loss or gradient, update skipped ({self.nonfinite_in_row} in a row)")
        if self.nonfinite_in_row >= self.cfg.trainer.max_nonfinite_steps:
            raise SystemExit(f"stopping: {self.nonfinite_in_row} steps in a row had a non-finite loss or gradient "
                             f"(trainer.max_nonfinite_steps={self.cfg.trainer.max_nonfinite_steps})")

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, v in scalars.items():
                self.writer.add_scalar(key, v, step)

    # ---------------------------------------------------------------- after a step
    def eval(self, step: int) -> float | None:
        """Eval suites greedily, each rank playing its share of the mazes with its own engine (no rank waits on
        another's episodes); rank 0 gathers the records and writes report.json, TensorBoard, transcripts. Returns
        the first suite's success rate (rank 0)."""
        cfg = self.cfg
        if not cfg.trainer.eval_every or not cfg.trainer.eval_suites:
            return None
        self.refresh_engine()
        t0 = time.time()
        player = model_player(self.engine, self.processor, self.eval_env, cfg.algo.max_new_tokens,
                              progress=D.is_main())
        report, trajs = evaluate_suites(player, list(cfg.trainer.eval_suites), rank=D.rank(), world=D.world_size())
        if not D.is_main():
            return None
        write_report(report, os.path.join(self.run_dir, "eval", f"step_{step}"), None, step, self.eval_env)
        for name, s in report["suites"].items():
            for key in ("success_rate", "mean_step_ratio", "mean_bumps", "mean_revisits",
                        "mean_invalid_actions", "mean_loops", "mean_dead_end_entries", "junction_accuracy"):
                if s[key] is not None:
                    self.writer.add_scalar(f"eval/{name}/{key}", s[key], step)
        for k, t in enumerate(trajs[: cfg.trainer.log_transcripts]):
            self.writer.add_text(f"eval/transcript_{k}", "\n\n".join(
                f"turn {i}: `{act[:200]}` -> {info['event']}" for i, (act, info) in enumerate(zip(t.actions,
                                                                                                   t.infos))), step)
            self.writer.add_image(f"eval/path_{k}", np.asarray(render_path(t.maze, t.path, pixels_per_cell=20)),
                                  step, dataformats="HWC")
        D.print0(f"eval step {step}: " + "  ".join(
            f"{n} {s['success_rate']:.3f} [{s['ci95'][0]:.2f},{s['ci95'][1]:.2f}]"
            for n, s in report["suites"].items()) + f"  ({time.time() - t0:.0f}s)")
        return report["suites"][cfg.trainer.eval_suites[0]]["success_rate"]

    def save(self, step: int) -> None:
        """An atomic checkpoint of every rank's state (rl/checkpoint.py), with the resolved config."""
        t0 = time.time()
        checksum = D.check_in_sync(self.policy)  # every rank must hold the same weights
        if D.world_size() > 1:
            D.print0(f"ranks in sync at step {step}: parameter checksum {checksum:.6f}")
        path = ckpt_io.save_checkpoint(self.run_dir, step, self.policy, self.processor, self.optimizer,
                                       self.scheduler, self.sampler,
                                       {"last_score": self.metrics_state.get("last_score")},
                                       keep_last=self.cfg.trainer.keep_last, export_dtype=self.compute_dtype,
                                       config=OmegaConf.to_container(self.cfg, resolve=True))
        D.print0(f"saved {path} in {time.time() - t0:.1f} s")

    def end_step(self, step_done: int, sleep_after_eval: bool = False) -> bool:
        """Eval every ``trainer.eval_every`` steps and at the last; save every ``trainer.save_every``, at the last
        and on a signal. Returns whether the loop stops here (a signal)."""
        t = self.cfg.trainer
        last = step_done == self.total_steps
        if t.eval_every and (step_done % t.eval_every == 0 or last):
            self.score = self.eval(step_done)
            self.metrics_state["last_score"] = self.score
            if sleep_after_eval:
                self.engine.sleep()  # vLLM: free the GPU until the next eval; hf: drop the eval's kept caches
        stop = self.stop_requested["signal"]  # read once: a signal arriving between two reads would skip the save
        if last or stop or (t.save_every and step_done % t.save_every == 0):
            self.save(step_done)
        if stop and not last:
            D.print0(f"received signal {stop}: saved step {step_done}, exiting")
            return True
        return False

    def close(self) -> float | None:
        """Close TensorBoard, the engine (first: vLLM's teardown also ends the default process group) and the
        process group; returns the last eval's score."""
        if self.writer is not None:
            self.writer.close()
        self.engine.close()
        D.destroy()
        return self.score
