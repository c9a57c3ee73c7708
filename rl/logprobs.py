"""The trainer's forward: per-token logprobs (and entropy) of given token ids under the policy.

This is the quantity the engines report for sampled tokens (see ``models.engines.base``):
banned tokens removed, logits divided by the temperature. Qwen3-VL needs ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids`` on every forward; ``rope_deltas`` is cached on the
model between generate calls, so it is reset before each scoring forward.
"""

from __future__ import annotations

import torch

from models.engines.base import ImageInput


def collate(sequences: list[list[int]], images: list[list[ImageInput]], pad_id: int, image_token_id: int,
            left_pad: bool = False, with_pixels: bool = True) -> dict[str, torch.Tensor]:
    """Pad token-id sequences into one batch with their images (rows in order).

    Returns input_ids (B, T), attention_mask (B, T), mm_token_type_ids (B, T) and, when any
    image is present, image_grid_thw (num_images, 3) and (``with_pixels``) pixel_values (sum patches, D).
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        sl = slice(width - len(seq), width) if left_pad else slice(0, len(seq))
        ids[row, sl] = torch.tensor(seq, dtype=torch.long)
        mask[row, sl] = 1
    batch = {"input_ids": ids, "attention_mask": mask,
             "mm_token_type_ids": (ids == image_token_id).long() * mask}
    flat = [im for row in images for im in row]
    if flat:
        if with_pixels:
            batch["pixel_values"] = torch.cat([im.pixels() for im in flat], dim=0)
        batch["image_grid_thw"] = torch.stack([im.grid_thw for im in flat], dim=0)
    return batch


def shared_image_features(model, images: list[ImageInput]) -> dict:
    """Vision features for a flat list of image occurrences, each distinct image encoded once.

    A GRPO group's G samples start from the same frame, and samples that walk the same cells share
    later frames too (``rl.rollout.Conversation`` hands out one ``ImageInput`` per distinct frame).
    The vision tower runs once per distinct image; every occurrence uses that output, so its
    gradient is the sum over occurrences — the same gradient as encoding each occurrence alone.
    Returns ``mm_encoder_outputs`` for the model's forward (with grad when grad is enabled).
    """
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    uniq = list({id(im): im for im in images}.values())
    index = {id(im): k for k, im in enumerate(uniq)}
    p = next(model.parameters())
    out = model.model.get_image_features(torch.cat([im.pixels() for im in uniq]).to(p.device, p.dtype),
                                         torch.stack([im.grid_thw for im in uniq]).to(p.device))
    pooled = tuple(out.pooler_output[index[id(im)]] for im in images)
    deep = [tuple(layer[index[id(im)]] for im in images) for layer in out.deepstack_features]
    return {"image": BaseModelOutputWithDeepstackFeatures(pooler_output=pooled, deepstack_features=deep)}


def to_model(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Move a CPU-built batch to the model's device (pixel values also to its dtype)."""
    p = next(model.parameters())
    return {k: v.to(p.device, p.dtype) if k == "pixel_values" else v.to(p.device) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def masked_logits(logits: torch.Tensor, banned_ids: list[int], temperature: float) -> torch.Tensor:
    """logits (..., V) -> the sampling distribution's logits: banned removed, / temperature."""
    logits = logits.float()
    if banned_ids:
        logits = logits.index_fill(-1, torch.tensor(banned_ids, device=logits.device), float("-inf"))
    if temperature > 0:
        logits = logits / temperature
    return logits


def token_logprobs(model, batch: dict[str, torch.Tensor], banned_ids: list[int], temperature: float,
                   with_entropy: bool = False, images: list[ImageInput] | None = None):
    """Logprob of every token given its prefix.

    Returns logprobs (B, T) with column 0 set to 0 (no prefix), and, if asked, the entropy
    (B, T) of the sampling distribution at each predicted position (column 0 = 0). With
    ``images`` (the batch's image occurrences in order) each distinct image is encoded once
    (``shared_image_features``) instead of once per occurrence from ``pixel_values``.
    """
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # stale state from a previous generate
    batch = to_model(model, batch)
    if images:
        batch.pop("pixel_values", None)
        batch["mm_encoder_outputs"] = shared_image_features(model, images)
    out = model(**batch, use_cache=False)
    logits = masked_logits(out.logits[:, :-1], banned_ids, temperature)  # (B, T-1, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    target = batch["input_ids"][:, 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, target).squeeze(-1)  # (B, T-1)
    # prompt/pad positions may hold banned ids (image pads): -inf there, never trained on
    logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    logp = torch.nn.functional.pad(logp, (1, 0))
    if not with_entropy:
        return logp
    probs = logp_all.exp()
    ent = -(probs * torch.where(probs > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp, torch.nn.functional.pad(ent, (1, 0))


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """mask (N, T), 1 on model-written tokens -> (N, T) long: the assistant turn each token belongs to
    (0 for the first turn's tokens; -1 before it). A turn is a run of 1s."""
    starts = mask * (1 - torch.nn.functional.pad(mask[:, :-1], (1, 0)))  # (N, T): 1 where a turn begins
    return starts.cumsum(-1).long() - 1


def gap_by_turn(logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                turns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of |trainer - engine| logprob and token count per turn index (turns >= ``turns`` - 1 pooled).

    logp, engine_logp, mask: (N, T). Returns two (turns,) float64 tensors: gap sums and token counts.
    """
    on = mask > 0
    idx = turn_index(mask).clamp(0, turns - 1)[on]
    diff = (logp.detach() - engine_logp).abs()[on].double()
    sums = torch.zeros(turns, dtype=torch.float64).index_add_(0, idx, diff)
    counts = torch.zeros(turns, dtype=torch.float64).index_add_(0, idx, torch.ones_like(diff))
    return sums, counts
