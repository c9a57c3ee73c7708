"""The trainer's forward: per-token logprobs (and entropy) of given token ids under the policy.

This is the quantity the engines report for sampled tokens (see ``models.engines.base``):
banned tokens removed, logits divided by the temperature. Qwen3-VL needs ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids`` on every forward; ``rope_deltas`` is cached on the
model between generate calls, so it is reset before each scoring forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

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


def encoder_outputs_supported(model) -> bool:
    """Whether this transformers' Qwen3-VL takes precomputed vision features (``mm_encoder_outputs``, 5.19).
    Older ones (5.17, on the GPU check machine) swallow the unknown keyword and run without the images, so
    callers fall back to ``pixel_values`` there."""
    import inspect

    inner = getattr(model, "model", model)
    return "mm_encoder_outputs" in inspect.signature(type(inner).forward).parameters


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


LOGPROB_CHUNK = 2**27  # elements of one chunk's (positions x vocabulary) fp32 logits: 512 MiB, 883 positions at
# Qwen3-VL's 151,936 entries (the tiny model's small vocabulary fits a whole micro-batch in one chunk)


def chunk_positions(vocab: int) -> int:
    """Positions per chunk of the trainer's vocabulary projection."""
    return max(1, LOGPROB_CHUNK // vocab)


def _chunk_scores(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, banned: torch.Tensor | None,
                  temperature: float, with_entropy: bool) -> torch.Tensor:
    """hidden (n, H), weight (V, H), targets (n,) -> (n, 2): logprob of each target and the entropy of the
    sampling distribution (banned removed, / temperature), in fp32. The (n, V) logits live only here."""
    logits = torch.nn.functional.linear(hidden, weight).float()  # (n, V)
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    if temperature > 0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (n,)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        ent = logz - (probs * logits.masked_fill(probs == 0, 0.0)).sum(-1)
    else:
        ent = torch.zeros_like(lp)
    return torch.stack([lp, ent], dim=-1)


class LogprobHead(torch.nn.Linear):
    """The model's ``lm_head`` (same weight, same state-dict key) that can score instead of emitting logits.

    Outside ``scoring`` it is the plain linear layer (generate, vLLM export). Inside, its output for
    hidden states (B, T, H) is (B, T, 2): the fp32 logprob of ``targets[b, t]`` and the entropy at each
    position, computed ``chunk_positions(V)`` positions at a time under activation checkpointing, so no
    full-vocabulary tensor is kept for backward (at Qwen3-VL's 151,936 entries a kept fp32 logits +
    log-softmax + probabilities cost 1.8 MB a token; here only the hidden states are kept and one chunk's
    logits are rebuilt in backward). Running inside the model's forward keeps FSDP2's handling of the root
    unit (the head's weight is gathered with it and its gradient reduce-scattered with it).
    """

    _score: tuple | None = None

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, banned_ids: list[int], temperature: float, with_entropy: bool):
        banned = torch.tensor(banned_ids, device=targets.device) if banned_ids else None
        self._score = (targets, banned, temperature, with_entropy)
        try:
            yield
        finally:
            self._score = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._score is None:
            return super().forward(hidden)
        targets, banned, temperature, with_entropy = self._score
        b, t, h = hidden.shape
        flat_h, flat_t = hidden.reshape(b * t, h), targets.reshape(b * t).to(hidden.device)
        if banned is not None:
            banned = banned.to(hidden.device)
        out, step = [], chunk_positions(self.weight.shape[0])
        for lo in range(0, b * t, step):
            args = (flat_h[lo:lo + step], self.weight, flat_t[lo:lo + step], banned, temperature,
                    with_entropy)
            if torch.is_grad_enabled():
                out.append(torch.utils.checkpoint.checkpoint(_chunk_scores, *args, use_reentrant=False))
            else:
                out.append(_chunk_scores(*args))
        return torch.cat(out, dim=0).view(b, t, 2).clone()  # not a view: FSDP2 hooks the root forward's outputs


def logprob_head(model) -> LogprobHead:
    """The model's ``lm_head`` as a ``LogprobHead`` (converted in place the first time: same module, same
    parameter, so optimizer, FSDP2 units and checkpoints are unaffected)."""
    head = model.lm_head
    if not isinstance(head, LogprobHead):
        if type(head) is not torch.nn.Linear or head.bias is not None:
            raise TypeError(f"lm_head is {type(head).__name__}; the scorer expects a bias-free nn.Linear")
        head.__class__ = LogprobHead
    return head


def scored_forward(model, batch: dict[str, torch.Tensor], banned_ids: list[int], temperature: float,
                   with_entropy: bool):
    """Run ``model(**batch)`` with the head scoring each next token. Returns logprobs (B, T) with column 0
    set to 0 (no prefix) and banned/pad targets 0, and the entropy (B, T) (column 0 = 0) or None."""
    ids = batch["input_ids"]
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # position t predicts token t + 1
    head = logprob_head(model)
    with head.scoring(targets, banned_ids, temperature, with_entropy):
        scores = model(**batch, use_cache=False).logits[:, :-1].float()  # (B, T-1, 2)
    logp = scores[..., 0]
    # prompt/pad positions may hold banned ids (image pads): -inf there, never trained on
    logp = torch.nn.functional.pad(torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)), (1, 0))
    if not with_entropy:
        return logp, None
    return logp, torch.nn.functional.pad(scores[..., 1], (1, 0))


def token_logprobs(model, batch: dict[str, torch.Tensor], banned_ids: list[int], temperature: float,
                   with_entropy: bool = False, images: list[ImageInput] | None = None):
    """Logprob of every token given its prefix.

    Returns logprobs (B, T) with column 0 set to 0 (no prefix), and, if asked, the entropy
    (B, T) of the sampling distribution at each predicted position (column 0 = 0). With
    ``images`` (the batch's image occurrences in order) each distinct image is encoded once
    (``shared_image_features``) instead of once per occurrence from ``pixel_values``.
    The vocabulary projection runs in chunks (``LogprobHead``).
    """
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # stale state from a previous generate
    if images and not encoder_outputs_supported(model):
        raise RuntimeError("this transformers' Qwen3-VL has no mm_encoder_outputs: score with pixel_values "
                           "(share_images=False)")
    batch = to_model(model, batch)
    if images:
        batch.pop("pixel_values", None)
        batch["mm_encoder_outputs"] = shared_image_features(model, images)
    logp, ent = scored_forward(model, batch, banned_ids, temperature, with_entropy)
    return (logp, ent) if with_entropy else logp


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
