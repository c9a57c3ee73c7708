"""A GRPO step's TensorBoard scalars and console line, from the step's sums over ranks (the environment's own
scalars come from the environment: ``maze.analysis.rollout_scalars``).

``tot``: ``success``, ``reward``, ``n`` (episodes), ``turns``, ``resp_tokens`` (generated), ``kept`` (episodes the
update trained on), ``tokens`` (trained). ``stats``: the update's sums (``rl.update.update_step``) over
``n_updates`` optimizer steps. ``gap_turns`` (2, turns): per turn index, the summed |engine - trainer| logprob
gap and its token count.
"""

from __future__ import annotations

import torch


def logprob_gap(gap_turns: torch.Tensor) -> float:
    """Mean |engine - trainer| logprob per trained token."""
    return float(gap_turns[0].sum() / gap_turns[1].sum().clamp(min=1.0))


def step_scalars(tot: dict, stats: dict, n_updates: int, gap_turns: torch.Tensor, lr: float, skipped: bool,
                 seconds: dict[str, float], cache_stats: dict) -> dict[str, float]:
    n_upd, turns = max(n_updates, 1), max(tot["turns"], 1.0)
    out = {
        "rollout/success_rate": tot["success"] / tot["n"], "rollout/reward_mean": tot["reward"] / tot["n"],
        "rollout/turns_mean": tot["turns"] / tot["n"],
        "rollout/response_tokens_per_turn": tot["resp_tokens"] / turns,
        "rollout/kept_fraction": tot["kept"] / tot["n"],
        "loss/total": stats["loss"] / n_upd, "loss/pg": stats["pg"] / n_upd, "loss/kl": stats["kl"] / n_upd,
        "loss/entropy": stats["entropy"] / n_upd, "loss/clip_fraction": stats["clip_frac"] / n_upd,
        "loss/ratio_mean": stats["ratio_mean"] / n_upd, "loss/ratio_max": stats["ratio_max"],
        "loss/tis_weight_mean": stats["tis_mean"] / n_upd, "loss/grad_norm": stats["grad_norm"] / n_upd,
        "loss/logprob_gap": logprob_gap(gap_turns),
        "train/lr": lr, "train/skipped_update": float(skipped),
        **{f"perf/{k}_s": v for k, v in seconds.items()},
        "perf/trained_tokens_per_s": tot["tokens"] / max(seconds["update"], 1e-9),
        "perf/generated_tokens_per_s": tot["resp_tokens"] / max(seconds["rollout"], 1e-9),
    }
    if cache_stats.get("prompt_tokens"):  # prompt tokens the engine served from its cache (this rank's)
        out["perf/prompt_cache_hit_rate"] = 1 - cache_stats["prefilled_tokens"] / cache_stats["prompt_tokens"]
    for k in torch.nonzero(gap_turns[1]).flatten().tolist():  # does the gap grow with the images in context?
        out[f"logprob_gap_by_turn/turn_{k:02d}"] = float(gap_turns[0, k] / gap_turns[1, k])
    return out


def step_line(step_done: int, steps: int, s: dict[str, float]) -> str:
    return (f"step {step_done}/{steps} | success {s['rollout/success_rate']:.3f} "
            f"reward {s['rollout/reward_mean']:+.3f} turns {s['rollout/turns_mean']:.1f} | "
            f"loss {s['loss/total']:+.4f} gnorm {s['loss/grad_norm']:.3f} "
            f"gap {s['loss/logprob_gap']:.1e} | rollout {s['perf/rollout_s']:.1f}s update {s['perf/update_s']:.1f}s")
