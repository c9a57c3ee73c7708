"""GRPO, in one file: group (and turn-level) advantages, KL estimators, the clipped policy loss and its
aggregation (pure functions), then the step's batch and the loss the update runs.

Departures from the GRPO paper (DeepSeekMath), each one config key:
- ``adv_estimator=rloo``: leave-one-out baseline instead of the group mean.
- ``norm_adv_by_std=false``: no division by the group std (Dr. GRPO).
- ``clip_high > clip_low``: asymmetric "clip-higher" (DAPO).
- ``ratio_level=sequence``: one length-normalised ratio per sequence (GSPO).
- ``loss_agg``: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (the paper),
  ``seq_mean_token_sum_norm`` (Dr. GRPO: sum over tokens / a constant length).
- KL to the reference with estimators k1/k2/k3 (Schulman), in the loss (the paper, k3) or
  subtracted from the reward (PPO-RLHF style).
- ``tis_cap``: truncated importance sampling between trainer and engine logprobs.
- ``adv_level=turn``: turn-level credit (GiGPO, Feng et al. 2025): turns taken from the same anchor state
  (for the maze: the same cell of the group's maze) across a group are compared by their discounted returns,
  and that step-level advantage is added, weighted, to the episode-level one of every token of the turn.

Shapes: N sequences, T tokens. ``mask`` (N, T) is 1 on model-written tokens. Normalisers are
*global* (the whole step's batch over all ranks and micro-batches), so summing the losses of
micro-batches equals the full-batch loss and gradient accumulation / world size do not change
the gradient.

The step: ``build_batch`` turns one rank's episodes and their rewards (numbers: the environment's, handed in by the
caller; for the maze, ``maze/rewards.py``) into the update's batch (``rl/update.py``), and ``loss`` is the GRPO
loss the update runs on each micro-batch. GRPO knows nothing of mazes: a turn's anchor state is the ``path`` entry
the trajectory recorded before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.forward import turn_index
from rl.rollout import Trajectory
from rl.update import Scoring, StepBatch, frozen_logprobs, token_tensors, training_rows


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo",
                     norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards (N,) group-major (N = B * G) -> advantages (N,).

    grpo: (r - mean_g) / (std_g + eps), std unbiased as in verl; without std normalisation
    r - mean_g. rloo: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g).
    """
    r = rewards.float().view(-1, group_size)  # (B, G)
    centred = r - r.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        adv = centred * group_size / (group_size - 1)
    elif estimator == "grpo":
        adv = centred / (r.std(dim=1, keepdim=True) + eps) if norm_by_std else centred
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return adv.reshape(-1)


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """R_t = sum_k>=t gamma^(k-t) r_k for one episode's per-turn rewards."""
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def turn_advantages(episode_adv: torch.Tensor, returns: list[list[float]], anchors: list[list], group_size: int,
                    weight: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6) -> list[list[float]]:
    """GiGPO's advantage of every turn: episode_adv[i] + weight * A_step, episodes group-major (N = B * G).

    A_step compares the turns of one group that start from the same anchor state (``anchors[i][t]``, e.g. the
    agent's cell): (R_t - mean) / (std + eps) over that anchor group's discounted returns (std unbiased, as for
    episodes; without std normalisation R_t - mean). An anchor visited once has no comparison: A_step = 0.
    """
    out = []
    for g in range(len(returns) // group_size):
        members = range(g * group_size, (g + 1) * group_size)
        by_anchor: dict = {}
        for i in members:
            for t, key in enumerate(anchors[i]):
                by_anchor.setdefault(key, []).append(returns[i][t])
        stats = {}
        for key, vals in by_anchor.items():
            v = torch.tensor(vals, dtype=torch.float64)
            stats[key] = (float(v.mean()), float(v.std()) if len(vals) > 1 else 0.0, len(vals))
        for i in members:
            row = []
            for t, key in enumerate(anchors[i]):
                mean, std, n = stats[key]
                step = 0.0 if n < 2 else (returns[i][t] - mean) / ((std + eps) if norm_by_std else 1.0)
                row.append(float(episode_adv[i]) + weight * step)
            out.append(row)
    return out


def nonzero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (N,) -> bool (N,): True where the sequence's group has reward variance (DAPO filter)."""
    r = rewards.float().view(-1, group_size)
    keep = (r.max(dim=1).values - r.min(dim=1).values) > 0
    return keep.repeat_interleave(group_size)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy. (N, T) -> (N, T).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = logp - ref_logp.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float,
              global_seqs: float, norm_len: float) -> torch.Tensor:
    """Reduce per-token values (N, T) to a scalar, normalised by *global* counts.

    token_mean: sum(v * m) / global_tokens.
    seq_mean_token_mean: sum_i [sum_t v * m / len_i] / global_seqs.
    seq_mean_token_sum_norm: sum(v * m) / (global_seqs * norm_len)   (Dr. GRPO).
    """
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        return (values * mask).sum() / max(global_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(global_seqs, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return (values * mask).sum() / (max(global_seqs, 1.0) * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass
class PolicyLossOut:
    loss_per_token: torch.Tensor  # (N, T) before aggregation, zero off the mask
    ratio: torch.Tensor  # (N, T) the ratio used (token or broadcast sequence ratio)
    clipped: torch.Tensor  # (N, T) bool: the clipped branch was taken
    tis_weight: torch.Tensor  # (N, T) truncated importance weight (1 when off)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float, clip_high: float, ratio_level: str = "token",
                rollout_logp: torch.Tensor | None = None, tis_cap: float = 0.0) -> PolicyLossOut:
    """Clipped surrogate, per token. logp/old_logp/rollout_logp/mask (N, T); advantages (N,) or (N, T).

    token: r_t = exp(logp_t - old_t). sequence (GSPO): s = exp(mean_t(logp - old)) per sequence,
    applied per token as sg(s) * exp(logp_t - sg(logp_t)) so its gradient is s * grad logp_t.
    TIS: each token's loss is weighted by min(exp(old - rollout), tis_cap) when tis_cap > 0.
    """
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (N, 1) per sequence, or (N, T) per token (turn level)
    log_ratio = (logp - old_logp) * m
    if ratio_level == "token":
        ratio = torch.exp(log_ratio)
    elif ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0)  # (N,)
        ratio = torch.exp(seq_log_ratio.detach()).unsqueeze(-1) * torch.exp(logp - logp.detach())
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    unclipped = ratio * adv
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(unclipped, clipped_ratio * adv)
    clipped = (clipped_ratio * adv < unclipped) & mask.bool()
    if rollout_logp is not None and tis_cap > 0:
        tis = torch.exp(old_logp - rollout_logp).clamp(max=tis_cap).detach()
    else:
        tis = torch.ones_like(logp)
    loss = -surrogate * tis * m
    return PolicyLossOut(loss, ratio.detach(), clipped, tis)


# ---------------------------------------------------------------- the step: its batch and its loss
def episode_turn_advantages(trajs: list[Trajectory], episode_adv: torch.Tensor, turn_rewards: list[list[float]],
                            algo) -> list[list[float]]:
    """Each episode's per-turn GiGPO advantages (``turn_advantages``) from the per-turn rewards' discounted returns;
    a turn's anchor is the state the trajectory's ``path`` records before it (the environment is the group's)."""
    returns = [discounted_returns(r, algo.gamma) for r in turn_rewards]
    anchors = [[tuple(p) for p in t.path[:-1]] for t in trajs]  # the state each turn starts from
    return turn_advantages(episode_adv, returns, anchors, algo.group_size, algo.step_adv_weight,
                           algo.norm_adv_by_std, algo.eps)


def turn_token_advantages(trajs: list[Trajectory], episode_adv: torch.Tensor, turn_rewards: list[list[float]],
                          mask: torch.Tensor, algo) -> torch.Tensor:
    """(N, T) advantages of whole-episode rows: each generated token gets its turn's GiGPO advantage."""
    per_turn = episode_turn_advantages(trajs, episode_adv, turn_rewards, algo)
    out = torch.zeros_like(mask)
    turns = turn_index(mask[:len(trajs)]).clamp(min=0)
    for i, row in enumerate(per_turn):
        if row:
            values = torch.tensor(row, dtype=out.dtype)
            out[i] = values[turns[i].clamp(max=len(row) - 1)] * (mask[i] > 0)
    return out


def build_batch(trajs: list[Trajectory], rewards: torch.Tensor, algo, s: Scoring, *, policy=None, reference=None,
                flip: bool = False, turn_rewards: list[list[float]] | None = None) -> StepBatch:
    """Everything the update needs from one rank's trajectories, in one place: the training rows (episodes, or their
    turns with ``env.history=K``), their masks and engine logprobs (N, T); the old policy's logprobs when there is
    more than one update per step (on-policy with one update, the update's own forward is the old policy: no extra
    pass); the reference's when KL is on (subtracted from the episodes' rewards with ``algo.kl_in=reward``); group
    advantages, per turn with ``algo.adv_level=turn`` (``flip``: negated, the learning test's fault); the rows kept
    by DAPO's zero-variance filter. ``rewards`` (E,) are the episodes'; ``turn_rewards`` (E lists), each episode's
    reward split over its turns, are what turn-level credit compares.
    """
    a = algo
    rows, episode, turn = training_rows(trajs)
    mask, rollout_lp = token_tensors(rows, len(rows))
    idx = list(range(len(rows)))
    ep = torch.tensor(episode, dtype=torch.long)  # (N,)
    multi_update = a.ppo_epochs > 1 or a.minibatches > 1
    old_lp = ref_lp = None
    if multi_update or (reference is not None and a.kl_in == "reward"):
        policy.eval()
        old_lp = frozen_logprobs(policy, rows, idx, a.micro_batch, s)
    if reference is not None:
        ref_lp = frozen_logprobs(reference, rows, idx, a.micro_batch, s)
    if ref_lp is not None and a.kl_in == "reward":
        per_row = (kl_estimate(old_lp, ref_lp, a.kl_estimator) * mask).sum(-1)  # (N,)
        rewards = rewards - a.kl_coef * torch.zeros_like(rewards).index_add(0, ep, per_row.to(rewards.dtype))
    episode_adv = group_advantages(rewards, a.group_size, a.adv_estimator, a.norm_adv_by_std, a.eps)  # (E,)
    if a.adv_level == "turn":  # GiGPO: per turn, from the anchor states the group shares
        if turn_rewards is None:
            raise ValueError("algo.adv_level=turn needs each episode's per-turn rewards (turn_rewards)")
        if not trajs[0].samples:
            advantages = turn_token_advantages(trajs, episode_adv, turn_rewards, mask, a)  # (N, T)
        else:
            per_turn = episode_turn_advantages(trajs, episode_adv, turn_rewards, a)
            advantages = torch.tensor([per_turn[e][t] for e, t in zip(episode, turn)])  # (N,)
    else:
        advantages = episode_adv[ep]  # (N,)
    if flip:
        advantages = -advantages
    keep = nonzero_std_groups(rewards, a.group_size) if a.filter_zero_std else torch.ones(len(trajs), dtype=torch.bool)
    return StepBatch(rows, mask, rollout_lp, advantages, old_lp if multi_update else None, ref_lp, rewards,
                     [r for r in idx if keep[episode[r]]], int(keep.sum()), torch.tensor(turn, dtype=torch.long))


def loss(algo) -> Callable:
    """The GRPO loss of one micro-batch (``rl.update.accumulate``'s ``loss_fn``): the clipped surrogate
    (``policy_loss``) aggregated by ``algo.loss_agg``, plus KL to the reference with ``algo.kl_in=loss``, minus the
    entropy bonus; its statistics: policy-gradient term, KL, entropy, clip fraction, ratio mean and max, TIS."""
    a = algo

    def grpo_loss(lp, ent, m, b: StepBatch, sel, width, g_tokens, g_seqs):
        old = b.old_lp[sel, :width] if b.old_lp is not None else lp.detach()
        adv = b.advantages[sel] if b.advantages.dim() == 1 else b.advantages[sel, :width]
        out = policy_loss(lp, old, adv, m, a.clip_low, a.clip_high, a.ratio_level, b.rollout_lp[sel, :width],
                          a.tis_cap)
        total = aggregate(out.loss_per_token, m, a.loss_agg, g_tokens, g_seqs, a.norm_len)
        stats = {"pg": total.item(), "kl": 0.0}
        if b.ref_lp is not None and a.kl_in == "loss":
            kl = aggregate(kl_estimate(lp, b.ref_lp[sel, :width], a.kl_estimator), m, a.loss_agg, g_tokens,
                           g_seqs, a.norm_len)
            total = total + a.kl_coef * kl
            stats["kl"] = kl.item()
        ent_term = aggregate(ent, m, a.loss_agg, g_tokens, g_seqs, a.norm_len)
        if a.entropy_coef:
            total = total - a.entropy_coef * ent_term
        stats["entropy"] = ent_term.item()
        stats["clip_frac"] = float(out.clipped.sum()) / max(g_tokens, 1.0)
        stats["ratio_mean"] = float((out.ratio * m).sum()) / max(g_tokens, 1.0)
        stats["ratio_max"] = float((out.ratio * m).max())
        stats["tis_mean"] = float((out.tis_weight * m).sum()) / max(g_tokens, 1.0)
        return total, stats

    return grpo_loss
