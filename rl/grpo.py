"""GRPO, in one file: rewards from episodes, group (and turn-level) advantages, KL estimators, the clipped
policy loss and its aggregation (pure functions), then the step's batch and the micro-batched update.

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

Rewards (conf/reward). Success is logged separately.

sparse: ``success`` on success, else 0.
shaped: sparse + ``progress`` * (d_start - d_end) / d_start  (BFS distance to the goal)
        - ``step_cost`` * turns - ``bump_penalty`` * bumps - ``invalid_penalty`` * invalid actions
        - ``revisit_penalty`` * revisits - ``wrong_stop_penalty`` if it stopped away from the goal.
Either, with ``thought_pockets`` > 0: + ``thought_pockets`` for each turn whose thought names exactly the dead-end
pockets next to the agent (``thought_reward``).

The step (``build_batch``, ``accumulate``):
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
import re
from dataclasses import dataclass

import torch

from models.forward import compute_context, gap_by_turn, sequence_logprobs, turn_index
from rl import dist as D
from rl.rollout import Trajectory


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


# ---------------------------------------------------------------- rewards
# The lookahead thought as the rollout reads it (rl.sft.thought writes it): ``<think>open up down; not down</think>``
_NAMED_POCKETS = re.compile(r"not ([a-z ]+)</think>")


def named_pockets(text: str) -> set[str]:
    """The ways a lookahead thought in ``text`` calls pockets (``<think>open up down; not down</think>``); a
    thought that names none, or no well-formed thought, names the empty set."""
    said = _NAMED_POCKETS.search(text)
    return set(said.group(1).split()) if said else set()


def first_move(text: str) -> str | None:
    """The turn's first move as the environment parses it (synonyms included), or None for an invalid action."""
    from maze.env import parse_action

    moves = parse_action(text, max_moves=1 << 10).moves
    return moves[0] if moves else None


def against_thought(text: str) -> bool:
    """Whether the turn's first move goes into a way its own thought called a pocket
    (``<think>open up down; not down</think><action>down</action>``): a policy that reads but does not act."""
    move = first_move(text)
    return move is not None and move in named_pockets(text)


def thought_reward(traj: Trajectory, cfg) -> list[float]:
    """Per turn, ``cfg.thought_pockets`` if the turn's thought named exactly the ways out of the agent's cell that
    enter a dead-end pocket at most ``cfg.thought_lookahead`` cells deep (``maze.core.dead_ends``; the
    ``algo.sft_lookahead`` thought, ``<think>open up down left; not down</think>``), else 0. A turn on the goal has
    no pockets to name. The truth is the environment's, so the reward cannot be met by anything but reading."""
    if not cfg.thought_pockets:
        return [0.0] * len(traj.infos)
    from rl.sft import pockets

    out, pos = [], traj.maze.start
    for text, info in zip(traj.actions, traj.infos):
        right = named_pockets(text) == pockets(traj.maze, pos, cfg.thought_lookahead)
        out.append(float(cfg.thought_pockets) if right else 0.0)
        pos = tuple(info["position"])
    return out


def episode_reward(traj: Trajectory, cfg) -> float:
    info = traj.final_info
    reward = cfg.success if info.get("success") else 0.0
    if cfg.thought_pockets:  # off: the episode's final info is all a reward reads
        reward += sum(thought_reward(traj, cfg))
    if cfg.name == "sparse":
        return float(reward)
    start = max(info["optimal_steps"], 1)
    reward += cfg.progress * (start - info["distance_to_goal"]) / start
    reward -= cfg.step_cost * info["turns"]
    reward -= cfg.bump_penalty * info["bumps"]
    reward -= cfg.invalid_penalty * info["invalid_actions"]
    reward -= cfg.revisit_penalty * info["revisits"]
    reward -= cfg.wrong_stop_penalty * bool(info.get("stopped_wrong"))
    return float(reward)


def turn_rewards(traj: Trajectory, cfg) -> list[float]:
    """The episode reward split over its turns (they sum to ``episode_reward``): the BFS progress of each turn,
    its step cost, the bumps, invalid actions and revisits it added, and the success bonus on the last turn."""
    out, prev = [], {"distance_to_goal": None, "bumps": 0, "invalid_actions": 0, "revisits": 0}
    thought = thought_reward(traj, cfg)
    for k, info in enumerate(traj.infos):
        last = k == len(traj.infos) - 1
        r = cfg.success if last and info.get("success") else 0.0
        r += thought[k]
        if cfg.name != "sparse":
            start = max(info["optimal_steps"], 1)
            before = info["optimal_steps"] if prev["distance_to_goal"] is None else prev["distance_to_goal"]
            r += cfg.progress * (before - info["distance_to_goal"]) / start
            r -= cfg.step_cost
            r -= cfg.bump_penalty * (info["bumps"] - prev["bumps"])
            r -= cfg.invalid_penalty * (info["invalid_actions"] - prev["invalid_actions"])
            r -= cfg.revisit_penalty * (info["revisits"] - prev["revisits"])
            r -= cfg.wrong_stop_penalty * bool(info.get("stopped_wrong"))
        prev = info
        out.append(float(r))
    return out


# ---------------------------------------------------------------- the step: its batch and the update
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

    @classmethod
    def for_sft(cls, trajs: list[Trajectory], n_real: int) -> StepBatch:
        """An SFT batch: the assistant tokens of expert conversations (or, with ``env.history=K``, of their turns);
        conversations past ``n_real`` are zero-weight stand-ins (a rank with no conversation this step still runs
        the collectives)."""
        rows, episode, _ = training_rows(trajs)
        n_rows = sum(1 for i in episode if i < n_real)  # rows are in episode order
        mask, rollout_lp = _token_tensors(rows, n_rows)
        return cls(rows, mask, rollout_lp, torch.zeros(len(rows)), kept=list(range(n_rows)), kept_episodes=n_real)


def episode_turn_advantages(trajs: list[Trajectory], episode_adv: torch.Tensor, algo, reward_cfg) -> list[list[float]]:
    """Each episode's per-turn GiGPO advantages (``turn_advantages``) from the per-turn rewards' discounted returns;
    a turn's anchor is the agent's cell before it (the maze is the group's)."""
    returns = [discounted_returns(turn_rewards(t, reward_cfg), algo.gamma) for t in trajs]
    anchors = [[tuple(p) for p in t.path[:-1]] for t in trajs]  # the cell each turn starts from
    return turn_advantages(episode_adv, returns, anchors, algo.group_size, algo.step_adv_weight,
                           algo.norm_adv_by_std, algo.eps)


def turn_token_advantages(trajs: list[Trajectory], episode_adv: torch.Tensor, mask: torch.Tensor, algo,
                          reward_cfg) -> torch.Tensor:
    """(N, T) advantages of whole-episode rows: each generated token gets its turn's GiGPO advantage."""
    per_turn = episode_turn_advantages(trajs, episode_adv, algo, reward_cfg)
    out = torch.zeros_like(mask)
    turns = turn_index(mask[:len(trajs)]).clamp(min=0)
    for i, row in enumerate(per_turn):
        if row:
            values = torch.tensor(row, dtype=out.dtype)
            out[i] = values[turns[i].clamp(max=len(row) - 1)] * (mask[i] > 0)
    return out


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


def _token_tensors(trajs: list, n_real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) loss mask and engine logprobs, right-padded; rows past ``n_real`` stay zero."""
    width = max(len(t.token_ids) for t in trajs)
    mask = torch.zeros((len(trajs), width), dtype=torch.float32)  # (N, T)
    rollout_lp = torch.zeros_like(mask)
    for i, t in enumerate(trajs[:n_real]):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout_lp[i, :len(t.rollout_logprobs)] = torch.tensor(t.rollout_logprobs)
    return mask, rollout_lp


def build_batch(trajs: list[Trajectory], rewards: torch.Tensor, algo, s: Scoring, *, policy=None, reference=None,
                flip: bool = False, reward_cfg=None) -> StepBatch:
    """Everything the update needs from one rank's trajectories, in one place: the training rows (episodes, or their
    turns with ``env.history=K``), their masks and engine logprobs (N, T); the old policy's logprobs when there is
    more than one update per step (on-policy with one update, the update's own forward is the old policy: no extra
    pass); the reference's when KL is on (subtracted from the episodes' rewards with ``algo.kl_in=reward``); group
    advantages, per turn with ``algo.adv_level=turn`` (``flip``: negated, the learning test's fault); the rows kept
    by DAPO's zero-variance filter. ``rewards`` (E,) are the episodes'.
    """
    a = algo
    rows, episode, turn = training_rows(trajs)
    mask, rollout_lp = _token_tensors(rows, len(rows))
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
        if reward_cfg is None:
            raise ValueError("algo.adv_level=turn needs the reward config (per-turn rewards)")
        if not trajs[0].samples:
            advantages = turn_token_advantages(trajs, episode_adv, mask, a, reward_cfg)  # (N, T)
        else:
            per_turn = episode_turn_advantages(trajs, episode_adv, a, reward_cfg)
            advantages = torch.tensor([per_turn[e][t] for e, t in zip(episode, turn)])  # (N,)
    else:
        advantages = episode_adv[ep]  # (N,)
    if flip:
        advantages = -advantages
    keep = nonzero_std_groups(rewards, a.group_size) if a.filter_zero_std else torch.ones(len(trajs), dtype=torch.bool)
    return StepBatch(rows, mask, rollout_lp, advantages, old_lp if multi_update else None, ref_lp, rewards,
                     [r for r in idx if keep[episode[r]]], int(keep.sum()), torch.tensor(turn, dtype=torch.long))


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
        lp, ent = logprobs(policy, b.rows, sel, s, with_entropy=True)
        width = lp.shape[1]
        m = b.mask[sel, :width] * float(real)  # (n, T); a padding micro-batch trains nothing
        if gap_turns is not None and real:
            offset = b.first_turn[sel] if b.first_turn is not None else None
            gap_turns += torch.stack(gap_by_turn(lp, b.rollout_lp[sel, :width], m, gap_turns.shape[1], offset))
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
