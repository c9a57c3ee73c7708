"""The SFT recipe: next-token loss on the assistant tokens of expert conversations (``rl/experts.py``),
``algo.sft_epochs`` passes in shuffled batches of ``algo.sft_batch`` conversations split over ranks, on the same
run set-up (``rl/run.py``) and update (``rl/update.py``) as GRPO.

    python train.py algo=sft                           # from the shipped start's config
    python train.py algo=sft model.path=null algo.sft_lookahead=8   # from a random tiny model
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
from omegaconf import DictConfig

from rl import dist as D
from rl import faults
from rl.experts import expert_dataset
from rl.rollout import Trajectory
from rl.run import Run
from rl.update import StepBatch, token_tensors, training_rows, update_step


def batch(trajs: list[Trajectory], n_real: int) -> StepBatch:
    """An SFT batch: the assistant tokens of expert conversations (or, with ``env.history=K``, of their turns);
    conversations past ``n_real`` are zero-weight stand-ins (a rank with no conversation this step still runs
    the collectives)."""
    rows, episode, _ = training_rows(trajs)
    n_rows = sum(1 for i in episode if i < n_real)  # rows are in episode order
    mask, rollout_lp = token_tensors(rows, n_rows)
    return StepBatch(rows, mask, rollout_lp, torch.zeros(len(rows)), kept=list(range(n_rows)), kept_episodes=n_real)


def loss(lp, ent, m, b, sel, width, g_tokens, g_seqs):
    """Next-token loss of one micro-batch (``rl.update.accumulate``'s ``loss_fn``): the mean over the step's
    assistant tokens."""
    nll = -(lp * m).sum() / max(g_tokens, 1.0)
    return nll, {"pg": nll.item()}


def total_steps(cfg: DictConfig) -> int:
    """Optimizer steps of the run: ``algo.sft_epochs`` passes over ``algo.sft_mazes`` conversations."""
    return cfg.algo.sft_epochs * math.ceil(cfg.algo.sft_mazes / cfg.algo.sft_batch)


def train_sft(cfg: DictConfig, run_dir: str, plan: Callable[[], str] | None = None) -> float | None:
    """The SFT loop (``plan``: the launch plan a fresh run prints). Returns the last eval's score on the first eval
    suite."""
    a = cfg.algo
    run = Run.start(cfg, run_dir, total_steps(cfg), temperature=1.0, with_reference=False, plan=plan)
    expert = expert_dataset(cfg, run.processor, run.env)
    steps_per_epoch = math.ceil(len(expert) / a.sft_batch)
    run.engine.sleep()  # the engine only plays the evals: vLLM frees the GPU; eval pushes the weights first
    for step in range(run.start_step, run.total_steps):
        t_step = time.time()
        fault = faults.due(run.faults, step + 1, run.rank, run.world)
        epoch, k = divmod(step, steps_per_epoch)
        order = np.random.default_rng([cfg.trainer.seed, epoch]).permutation(len(expert))
        trajs = [expert[i] for i in order[k * a.sft_batch:(k + 1) * a.sft_batch][run.rank::run.world]]
        n_real = len(trajs)
        if not trajs:  # the last batch has fewer rows than ranks: a zero-weight stand-in keeps the collectives
            trajs = [expert[order[0]]]
        b = batch(trajs, n_real)

        t0 = time.time()
        run.policy.train()
        stats, n_updates, skipped = update_step(run.policy, run.optimizer, b, [b.kept], a.micro_batch, a.grad_clip,
                                                run.scoring, loss, fsdp=run.fsdp, ddp=run.ddp,
                                                nan_fault="nan_loss" in fault)
        run.scheduler.step()
        t_update = time.time() - t0
        run.check_nonfinite(step, skipped)
        run.engine_stale = run.push_weights  # pushed before the next eval, not every step

        step_done = step + 1
        tot = {key: D.all_reduce_sum(v) for key, v in {
            "n": float(n_real), "turns": float(sum(t.num_turns for t in trajs[:n_real])),
            "tokens": float(sum(len(b.rows[i].token_ids) for i in b.kept)),
            "trained": float(b.mask.sum())}.items()}
        if run.writer is not None:
            n_upd = max(n_updates, 1)
            scalars = {"loss/total": stats["loss"] / n_upd, "loss/grad_norm": stats["grad_norm"] / n_upd,
                       "sft/conversations": tot["n"], "sft/turns_mean": tot["turns"] / max(tot["n"], 1.0),
                       "sft/trained_tokens": tot["trained"], "train/lr": run.scheduler.get_last_lr()[0],
                       "train/skipped_update": float(skipped), "perf/update_s": t_update,
                       "perf/step_s": time.time() - t_step,
                       "perf/trained_tokens_per_s": tot["tokens"] / max(t_update, 1e-9)}
            run.log(scalars, step_done)
            D.print0(f"step {step_done}/{run.total_steps} (epoch {epoch + 1}) | loss {scalars['loss/total']:.4f} "
                     f"gnorm {scalars['loss/grad_norm']:.3f} lr {scalars['train/lr']:.2e} | update {t_update:.1f}s")
        if run.end_step(step_done, sleep_after_eval=True):
            break
    return run.close()
