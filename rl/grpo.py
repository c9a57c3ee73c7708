"""GRPO as pure functions: group advantages, KL estimators, the clipped policy loss, aggregation.

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
  (same maze, same cell) across a group are compared by their discounted returns, and that step-level
  advantage is added, weighted, to the episode-level one of every token of the turn.

Shapes: N sequences, T tokens. ``mask`` (N, T) is 1 on model-written tokens. Normalisers are
*global* (the whole step's batch over all ranks and micro-batches), so summing the losses of
micro-batches equals the full-batch loss and gradient accumulation / world size do not change
the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


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
