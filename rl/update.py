"""The trainer's side of one step: build the step's batch from trajectories, accumulate a minibatch's gradient.

``build_batch`` and ``accumulate`` are what train.py (and the benchmarks) run every step; they are functions so
that the tests can run the same update on one rank and on two (the gradient must not depend on the world size).

Every rank runs the same number of forward/backward calls: under FSDP2 each one is a sequence of
collectives, so a rank with less work (DAPO's filter keeps different numbers of groups per rank; the last
SFT batch may have fewer rows than ranks) would leave the others waiting forever. A rank short of
micro-batches runs zero-weight ones (a real trajectory with its loss mask zeroed): the same collectives,
no gradient. Normalisers (tokens, sequences) are global sums over ranks, so the summed micro-batch
losses are the full batch's loss whatever the world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl import dist as D
from rl.grpo import aggregate, group_advantages, kl_estimate, nonzero_std_groups, policy_loss
from rl.logprobs import gap_by_turn
from rl.types import Trajectory


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
    """One rank's trajectories and per-token tensors (N rows, T = the longest trajectory)."""

    trajs: list[Trajectory]
    mask: torch.Tensor  # (N, T) 1 on trained tokens (0 everywhere on zero-weight padding rows)
    rollout_lp: torch.Tensor  # (N, T) engine logprobs
    advantages: torch.Tensor  # (N,)
    old_lp: torch.Tensor | None = None  # (N, T) when there is more than one update per step
    ref_lp: torch.Tensor | None = None  # (N, T) when KL is on
    rewards: torch.Tensor | None = None  # (n,) the real rows' rewards (after KL-in-reward)
    kept: list[int] | None = None  # rows the update trains on (DAPO's filter drops zero-variance groups)


def turn_token_advantages(trajs: list[Trajectory], episode_adv: torch.Tensor, mask: torch.Tensor, algo,
                          reward_cfg) -> torch.Tensor:
    """(N, T) advantages: each generated token gets its turn's GiGPO advantage (``rl.grpo.turn_advantages``) from
    the per-turn rewards' discounted returns; a turn's anchor is the agent's cell before it (the maze is the
    group's)."""
    from rl.grpo import discounted_returns, turn_advantages
    from rl.logprobs import turn_index
    from rl.rewards import turn_rewards

    returns = [discounted_returns(turn_rewards(t, reward_cfg), algo.gamma) for t in trajs]
    anchors = [[tuple(p) for p in t.path[:-1]] for t in trajs]  # the cell each turn starts from
    per_turn = turn_advantages(episode_adv, returns, anchors, algo.group_size, algo.step_adv_weight,
                               algo.norm_adv_by_std, algo.eps)
    out = torch.zeros_like(mask)
    turns = turn_index(mask[:len(trajs)]).clamp(min=0)
    for i, row in enumerate(per_turn):
        if row:
            values = torch.tensor(row, dtype=out.dtype)
            out[i] = values[turns[i].clamp(max=len(row) - 1)] * (mask[i] > 0)
    return out


def build_batch(trajs: list[Trajectory], rewards: torch.Tensor, algo, s: Scoring, *, sft: bool = False,
                n_real: int | None = None, policy=None, reference=None, flip: bool = False,
                reward_cfg=None) -> StepBatch:
    """Everything the update needs from one rank's trajectories, in one place: the masks and engine logprobs
    (N, T); the old policy's logprobs when there is more than one update per step (on-policy with one update,
    the update's own forward is the old policy: no extra pass); the reference's when KL is on (subtracted from
    the rewards with ``algo.kl_in=reward``); group advantages (``flip``: negated, the learning test's fault);
    the rows kept by DAPO's zero-variance filter. Rows past ``n_real`` are zero-weight stand-ins.
    """
    a = algo
    n_real = len(trajs) if n_real is None else n_real
    width = max(len(t.token_ids) for t in trajs)
    mask = torch.zeros((len(trajs), width), dtype=torch.float32)  # (N, T)
    rollout_lp = torch.zeros_like(mask)
    for i, t in enumerate(trajs[:n_real]):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout_lp[i, :len(t.rollout_logprobs)] = torch.tensor(t.rollout_logprobs)
    rows = list(range(n_real))
    if sft:
        return StepBatch(trajs, mask, rollout_lp, torch.zeros(len(trajs)), rewards=rewards, kept=rows)
    multi_update = a.ppo_epochs > 1 or a.minibatches > 1
    old_lp = ref_lp = None
    if multi_update or (reference is not None and a.kl_in == "reward"):
        policy.eval()
        old_lp = frozen_logprobs(policy, trajs, rows, a.micro_batch, s)
    if reference is not None:
        ref_lp = frozen_logprobs(reference, trajs, rows, a.micro_batch, s)
    if ref_lp is not None and a.kl_in == "reward":
        rewards = rewards - a.kl_coef * (kl_estimate(old_lp, ref_lp, a.kl_estimator) * mask).sum(-1)
    advantages = group_advantages(rewards, a.group_size, a.adv_estimator, a.norm_adv_by_std, a.eps)
    if a.adv_level == "turn":  # GiGPO: per turn, from the anchor states the group shares
        if reward_cfg is None:
            raise ValueError("algo.adv_level=turn needs the reward config (per-turn rewards)")
        advantages = turn_token_advantages(trajs[:n_real], advantages, mask, a, reward_cfg)
    if flip:
        advantages = -advantages
    keep = nonzero_std_groups(rewards, a.group_size) if a.filter_zero_std else torch.ones(len(rows), dtype=torch.bool)
    return StepBatch(trajs, mask, rollout_lp, advantages, old_lp if multi_update else None, ref_lp, rewards,
                     [i for i in rows if keep[i]])


def logprobs(model, trajs: list[Trajectory], sel: list[int], s: Scoring, with_entropy: bool = False):
    """Per-token logprobs (and entropy) of trajectories ``sel`` (``rl.packing.sequence_logprobs``), returned
    on the CPU where masks and advantages are (differentiable copies from the GPU; no-ops on CPU)."""
    from models.distributed import compute_context
    from rl.packing import sequence_logprobs

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


def accumulate(policy, b: StepBatch, rows: list[int], algo, s: Scoring, *, sft: bool, pad_row: int = 0,
               sharded: bool = False, ddp: bool = False, gap_turns: torch.Tensor | None = None,
               nan_fault: bool = False) -> dict:
    """Forward/backward of minibatch ``rows`` (this rank's part), leaving the global gradient in ``.grad``.

    ``sharded``: FSDP2 averages gradients over ranks, so the (globally normalised) loss is scaled by the
    world size; ``ddp``: gradients are summed over ranks here. ``gap_turns`` (2, turns) accumulates the
    engine-vs-trainer logprob gap per turn. Returns the step's loss statistics (this rank's share).
    """
    a = algo
    g_tokens = D.all_reduce_sum(float(b.mask[rows].sum()) if rows else 0.0)
    g_seqs = D.all_reduce_sum(float(len(rows)))
    stats = {"pg": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0,
             "tis_mean": 0.0, "loss": 0.0}
    for sel, real in micro_batches(rows, a.micro_batch, pad_row):
        lp, ent = logprobs(policy, b.trajs, sel, s, with_entropy=True)
        width = lp.shape[1]
        m = b.mask[sel, :width] * float(real)  # (n, T); a padding micro-batch trains nothing
        if gap_turns is not None and real:
            gap_turns += torch.stack(gap_by_turn(lp, b.rollout_lp[sel, :width], m, gap_turns.shape[1]))
        if sft:
            loss = -(lp * m).sum() / max(g_tokens, 1.0)
            stats["pg"] += loss.item()
        else:
            old = b.old_lp[sel, :width] if b.old_lp is not None else lp.detach()
            adv = b.advantages[sel] if b.advantages.dim() == 1 else b.advantages[sel, :width]
            out = policy_loss(lp, old, adv, m, a.clip_low, a.clip_high, a.ratio_level,
                              b.rollout_lp[sel, :width], a.tis_cap)
            loss = aggregate(out.loss_per_token, m, a.loss_agg, g_tokens, g_seqs, a.norm_len)
            stats["pg"] += loss.item()
            if b.ref_lp is not None and a.kl_in == "loss":
                kl = aggregate(kl_estimate(lp, b.ref_lp[sel, :width], a.kl_estimator), m, a.loss_agg, g_tokens,
                               g_seqs, a.norm_len)
                loss = loss + a.kl_coef * kl
                stats["kl"] += kl.item()
            ent_term = aggregate(ent, m, a.loss_agg, g_tokens, g_seqs, a.norm_len)
            if a.entropy_coef:
                loss = loss - a.entropy_coef * ent_term
            stats["entropy"] += ent_term.item()
            stats["clip_frac"] += float(out.clipped.sum()) / max(g_tokens, 1.0)
            stats["ratio_mean"] += float((out.ratio * m).sum()) / max(g_tokens, 1.0)
            stats["ratio_max"] = max(stats["ratio_max"], float((out.ratio * m).max()))
            stats["tis_mean"] += float((out.tis_weight * m).sum()) / max(g_tokens, 1.0)
        if nan_fault:  # fault injection (rl.faults nan_loss)
            loss = loss * float("nan")
        if sharded:
            loss = loss * D.world_size()  # FSDP2 averages gradients over ranks; losses are global sums
        loss.backward()
        stats["loss"] += loss.item()
    if ddp:
        D.all_reduce_grads(policy)
    return stats
