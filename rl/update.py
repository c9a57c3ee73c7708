"""The update both recipes run (GRPO, ``rl/grpo.py``; SFT, ``rl/sft.py``): the step's batch of training rows, the
trainer's scoring of their tokens, and the micro-batched forward/backward with global normalisers, then the
optimizer steps.

Every rank runs the same number of forward/backward calls: under FSDP2 each one is a sequence of
collectives, so a rank with less work (DAPO's filter keeps different numbers of groups per rank; the last
SFT batch may have fewer rows than ranks) would leave the others waiting forever. A rank short of
micro-batches runs zero-weight ones (a real trajectory with its loss mask zeroed): the same collectives,
no gradient. Normalisers (tokens, sequences) are global sums over ranks, so the summed micro-batch
losses are the full batch's loss whatever the world size.

A recipe's loss is a function ``loss_fn(lp, ent, m, b, sel, width, g_tokens, g_seqs) -> (loss, stats)`` of one
micro-batch: its logprobs and entropies ``lp``/``ent`` (n, T), its loss mask ``m`` (n, T; zero on a padding
micro-batch), the step's batch ``b`` and the rows ``sel`` it holds, the micro-batch's width, and the global token
and sequence counts; ``stats`` are floats summed over micro-batches (a key ending in ``_max``: the maximum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.forward import compute_context, gap_by_turn, sequence_logprobs
from rl import dist as D
from rl.rollout import Trajectory


@dataclass
class Scoring:
    """How the trainer's forward scores tokens (the same for policy, old policy and reference)."""

    pad_id: int
    image_id: int
    banned: list[int]
    temperature: float
    packing: bool = False
    share_images: bool = True  # off under FSDP2 (its sharded vision tower runs inside the root forward only)
    compute_dtype: torch.dtype = torch.float32


@dataclass
class StepBatch:
    """One rank's training rows and per-token tensors (N rows, T = the longest row). A row is a whole episode
    (a ``Trajectory``) or, with ``env.history=K``, one turn (a ``TurnSample``)."""

    rows: list  # (N,) Trajectory or TurnSample: token_ids, images, loss_mask, rollout_logprobs
    mask: torch.Tensor  # (N, T) 1 on trained tokens (0 everywhere on zero-weight padding rows)
    rollout_lp: torch.Tensor  # (N, T) engine logprobs
    advantages: torch.Tensor  # (N,) or (N, T) (turn-level credit on whole episodes)
    old_lp: torch.Tensor | None = None  # (N, T) when there is more than one update per step
    ref_lp: torch.Tensor | None = None  # (N, T) when KL is on
    rewards: torch.Tensor | None = None  # (E,) the episodes' rewards (after KL-in-reward)
    kept: list[int] | None = None  # rows the update trains on (DAPO's filter drops zero-variance groups)
    kept_episodes: int = 0  # episodes those rows come from
    first_turn: torch.Tensor | None = None  # (N,) long: the episode turn of each row's first response


def training_rows(trajs: list[Trajectory]) -> tuple[list, list[int], list[int]]:
    """(rows, episode of each row, episode turn of each row's first response): the episodes themselves, or with
    ``env.history=K`` their turns, each trained with exactly the context it was sampled with."""
    if not any(t.samples for t in trajs):
        return list(trajs), list(range(len(trajs))), [0] * len(trajs)
    rows, episode, turn = [], [], []
    for i, t in enumerate(trajs):
        for sample in t.samples:
            rows.append(sample)
            episode.append(i)
            turn.append(sample.turn)
    return rows, episode, turn


def token_tensors(trajs: list, n_real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) loss mask and engine logprobs, right-padded; rows past ``n_real`` stay zero."""
    width = max(len(t.token_ids) for t in trajs)
    mask = torch.zeros((len(trajs), width), dtype=torch.float32)  # (N, T)
    rollout_lp = torch.zeros_like(mask)
    for i, t in enumerate(trajs[:n_real]):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout_lp[i, :len(t.rollout_logprobs)] = torch.tensor(t.rollout_logprobs)
    return mask, rollout_lp


def logprobs(model, trajs: list[Trajectory], sel: list[int], s: Scoring, with_entropy: bool = False):
    """Per-token logprobs (and entropy) of trajectories ``sel`` (``models.forward.sequence_logprobs``), returned
    on the CPU where masks and advantages are (differentiable copies from the GPU; no-ops on CPU)."""

    with compute_context(model, s.compute_dtype):
        out = sequence_logprobs(model, [trajs[i].token_ids for i in sel], [trajs[i].images for i in sel], s.pad_id,
                                s.image_id, s.banned, s.temperature, with_entropy, s.packing, s.share_images)
    return tuple(o.cpu() for o in out) if with_entropy else out.cpu()


@torch.no_grad()
def frozen_logprobs(model, trajs: list[Trajectory], rows: list[int], micro_batch: int, s: Scoring) -> torch.Tensor:
    """Logprobs (N, T_max) of every token of the selected trajectories, in micro-batches, no grad. Every rank
    holds the same number of rows (whole groups, mazes_per_step divisible by the world size), so the
    sharded reference's forwards line up."""
    width = max(len(trajs[i].token_ids) for i in rows)
    chunks = []
    for lo in range(0, len(rows), micro_batch):
        lp = logprobs(model, trajs, rows[lo:lo + micro_batch], s)
        chunks.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
    return torch.cat(chunks, dim=0)


def micro_batches(rows: list[int], size: int, pad_row: int) -> list[tuple[list[int], bool]]:
    """``rows`` in micro-batches of ``size``, padded with zero-weight micro-batches ``([pad_row], False)`` up
    to the largest count over ranks (a collective)."""
    own = math.ceil(len(rows) / size)
    total = max(int(D.all_reduce_max(own)), 1)
    out = [(rows[k * size:(k + 1) * size], True) for k in range(own)]
    return out + [([pad_row], False)] * (total - own)


def merge_stats(into: dict[str, float], out: dict[str, float]) -> dict[str, float]:
    """Add ``out``'s loss statistics into ``into`` (a key ending in ``_max``: the maximum); returns ``into``."""
    for key, v in out.items():
        into[key] = max(into.get(key, 0.0), v) if key.endswith("_max") else into.get(key, 0.0) + v
    return into


def accumulate(policy, b: StepBatch, rows: list[int], micro_batch: int, s: Scoring, loss_fn: Callable, *,
               pad_row: int = 0, sharded: bool = False, ddp: bool = False, gap_turns: torch.Tensor | None = None,
               nan_fault: bool = False) -> dict:
    """Forward/backward of minibatch ``rows`` (this rank's part) under ``loss_fn`` (the module docstring), leaving
    the global gradient in ``.grad``.

    ``sharded``: FSDP2 averages gradients over ranks, so the (globally normalised) loss is scaled by the
    world size; ``ddp``: gradients are summed over ranks here. ``gap_turns`` (2, turns) accumulates the
    engine-vs-trainer logprob gap per turn. Returns the step's loss statistics (this rank's share).
    """
    g_tokens = D.all_reduce_sum(float(b.mask[rows].sum()) if rows else 0.0)
    g_seqs = D.all_reduce_sum(float(len(rows)))
    stats: dict[str, float] = {}
    for sel, real in micro_batches(rows, micro_batch, pad_row):
        lp, ent = logprobs(policy, b.rows, sel, s, with_entropy=True)
        width = lp.shape[1]
        m = b.mask[sel, :width] * float(real)  # (n, T); a padding micro-batch trains nothing
        if gap_turns is not None and real:
            offset = b.first_turn[sel] if b.first_turn is not None else None
            gap_turns += torch.stack(gap_by_turn(lp, b.rollout_lp[sel, :width], m, gap_turns.shape[1], offset))
        loss, out = loss_fn(lp, ent, m, b, sel, width, g_tokens, g_seqs)
        merge_stats(stats, out)
        if nan_fault:  # fault injection (rl.faults nan_loss)
            loss = loss * float("nan")
        if sharded:
            loss = loss * D.world_size()  # FSDP2 averages gradients over ranks; losses are global sums
        loss.backward()
        stats["loss"] = stats.get("loss", 0.0) + loss.item()
    if ddp:
        D.all_reduce_grads(policy)
    return stats


def update_step(policy, optimizer, batch: StepBatch, rows_per_minibatch: list[list[int]], micro_batch: int,
                grad_clip: float, s: Scoring, loss_fn: Callable, *, fsdp: bool, ddp: bool, gap_turns=None,
                nan_fault: bool = False) -> tuple[dict, int, bool]:
    """Optimizer steps over ``rows_per_minibatch`` (one per minibatch), each micro-batched with global normalisers
    (``accumulate``). A non-finite loss or gradient on any rank skips that step everywhere.
    Returns (summed loss statistics, ``grad_norm`` included; optimizer steps taken; whether one was skipped)."""
    stats: dict[str, float] = {"grad_norm": 0.0}
    n_updates, skipped = 0, False
    for rows in rows_per_minibatch:
        optimizer.zero_grad(set_to_none=True)
        out = accumulate(policy, batch, rows, micro_batch, s, loss_fn, sharded=fsdp, ddp=ddp, gap_turns=gap_turns,
                         nan_fault=nan_fault)
        merge_stats(stats, out)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
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
