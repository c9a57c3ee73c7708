"""The SFT recipe: next-token loss on the assistant tokens of expert conversations (``rl/experts.py``),
``algo.sft_epochs`` passes in shuffled batches of ``algo.sft_batch`` conversations split over ranks, on the same
run set-up (``rl/run.py``) and update (``rl/update.py``) as GRPO.

    python train.py algo=sft                           # from the shipped start's config
    python train.py algo=sft model.path=null algo.sft_lookahead=8   # from a random tiny model

A visual auxiliary target (``algo.sft_aux_weight`` > 0): each expert frame carries a target vector for one of its
merged image tokens (``ImageInput.target``, set by the data); a fixed random linear readout of that token's vision
feature (``AuxReadout``: drawn from a fixed seed, never trained, so nothing new is saved and a resumed run is the
same) predicts it under a binary cross-entropy added to the next-token loss. The gradient reaches the vision
tower directly, not only through the language model's attention to the token.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from omegaconf import DictConfig

from models.forward import observing_vision
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


class AuxReadout:
    """The visual auxiliary target's readout and loss (the module docstring). Observes the trainer's vision
    features (``models.forward.observing_vision``) and turns those of a micro-batch into a loss term.

    Per micro-batch: ``weight`` x the binary cross-entropy summed over its distinct target-carrying images and their
    target entries, / the step's count of such images (over micro-batches and ranks: ``begin_step``) and entries,
    so the terms sum to ``weight`` x the step's mean whatever the micro-batch size or the number of ranks."""

    SEED = 20_261_207  # the readout's fixed draw

    def __init__(self, weight: float):
        self.weight, self._w, self._seen, self._n = weight, None, [], 1.0

    def begin_step(self, b: StepBatch, rows: list[int], micro_batch: int) -> None:
        """Count the step's target-carrying images as the forwards will see them: distinct within each
        micro-batch of ``rows`` (``rl.update.micro_batches``' split), summed over micro-batches and ranks (a
        collective: every rank calls it)."""
        n = sum(len({id(im) for i in rows[lo:lo + micro_batch] for im in b.rows[i].images if im.target is not None})
                for lo in range(0, len(rows), micro_batch))
        self._n = max(D.all_reduce_sum(float(n)), 1.0)

    def __call__(self, images, features) -> None:
        self._seen += [(f[im.target[0]], im.target[1]) for im, f in zip(images, features) if im.target is not None]

    def readout(self, hidden: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
        if self._w is None:
            g = torch.Generator().manual_seed(self.SEED)
            self._w = torch.randn(hidden, n_out, generator=g) / math.sqrt(hidden)
        return self._w.to(like.device, like.dtype)

    def loss_fn(self, base: Callable) -> Callable:
        """``base`` (a recipe's ``loss_fn``) plus this micro-batch's auxiliary term; the stats gain ``aux`` (its
        value), the open-way entries it reads right, the true pockets it finds and the pockets it says."""
        def fn(lp, ent, m, b, sel, width, g_tokens, g_seqs):
            total, stats = base(lp, ent, m, b, sel, width, g_tokens, g_seqs)
            seen, self._seen = self._seen, []
            real = bool(m.sum() > 0)  # a zero-weight padding micro-batch trains nothing
            if not seen or not real:
                return total, stats
            feats = torch.stack([f for f, _ in seen])  # (n, hidden)
            target = torch.tensor([t for _, t in seen], dtype=torch.float32, device=feats.device)  # (n, 2K)
            logits = feats.float() @ self.readout(feats.shape[1], target.shape[1], feats).float()
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum")
            term = self.weight * bce / (self._n * target.shape[1])
            said, half = (logits > 0).float(), target.shape[1] // 2
            pocket, said_pocket = target[:, half:], said[:, half:]
            stats.update(aux=term.item(), aux_entries=float(target[:, :half].numel()),
                         aux_open_right=float((said[:, :half] == target[:, :half]).sum()),
                         aux_pockets=float(pocket.sum()), aux_pockets_found=float((said_pocket * pocket).sum()),
                         aux_pockets_said=float(said_pocket.sum()))
            return total + term, stats
        return fn


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
    aux = AuxReadout(a.sft_aux_weight) if a.sft_aux_weight > 0 else None  # a forward it cannot observe raises
    step_loss = aux.loss_fn(loss) if aux is not None else loss
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
        if aux is not None:
            aux.begin_step(b, b.kept, a.micro_batch)
        with observing_vision(aux) if aux is not None else contextlib.nullcontext():
            stats, n_updates, skipped = update_step(run.policy, run.optimizer, b, [b.kept], a.micro_batch,
                                                    a.grad_clip, run.scoring, step_loss, fsdp=run.fsdp, ddp=run.ddp,
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
        aux_scalars = {}
        if aux is not None:  # collectives: on every rank
            got = {k: D.all_reduce_sum(stats.get(k, 0.0)) for k in
                   ("aux", "aux_entries", "aux_open_right", "aux_pockets", "aux_pockets_found", "aux_pockets_said")}
            aux_scalars = {"sft/aux_loss": got["aux"],  # the readout: open ways right, pockets found (recall) and
                           # the share of the pockets it says that are pockets (precision)
                           "sft/aux_open_right": got["aux_open_right"] / max(got["aux_entries"], 1.0),
                           "sft/aux_pocket_recall": got["aux_pockets_found"] / max(got["aux_pockets"], 1.0),
                           "sft/aux_pocket_precision": got["aux_pockets_found"] / max(got["aux_pockets_said"], 1.0)}
        if run.writer is not None:
            n_upd = max(n_updates, 1)
            scalars = {"loss/total": stats["loss"] / n_upd, "loss/grad_norm": stats["grad_norm"] / n_upd,
                       "sft/conversations": tot["n"], "sft/turns_mean": tot["turns"] / max(tot["n"], 1.0),
                       "sft/trained_tokens": tot["trained"], "train/lr": run.scheduler.get_last_lr()[0],
                       "train/skipped_update": float(skipped), "perf/update_s": t_update,
                       "perf/step_s": time.time() - t_step,
                       "perf/trained_tokens_per_s": tot["tokens"] / max(t_update, 1e-9)}
            scalars.update(aux_scalars)
            run.log(scalars, step_done)
            D.print0(f"step {step_done}/{run.total_steps} (epoch {epoch + 1}) | loss {scalars['loss/total']:.4f} "
                     f"gnorm {scalars['loss/grad_norm']:.3f} lr {scalars['train/lr']:.2e} | update {t_update:.1f}s")
        if run.end_step(step_done, sleep_after_eval=True):
            break
    return run.close()
