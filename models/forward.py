"""The trainer's forward, in one place: per-token logprobs and entropy of given token ids under the policy, on a
padded batch or packed without padding, with each image encoded once, in the compute dtype.

This is the quantity the engines report for sampled tokens (see ``models.engines.base``):
banned tokens removed, logits divided by the temperature. Qwen3-VL needs ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids`` on every forward; ``rope_deltas`` is cached on the
model between generate calls, so it is reset before each scoring forward. The hf engine uses the same
batching (``collate``), banned-token masking and shared image encoding.

Precision (``compute_context``): FSDP2 casts each unit to the compute dtype by itself; an unsharded fp32 model
under a lower compute dtype runs its forward under autocast; fp32 compute runs as is.

Packing (``packed_token_logprobs``, ``trainer.packing``):
Trajectories of very different lengths (an episode solved in 6 turns next to one that ran out
of 30) waste most of a right-padded batch on pad tokens. Packing places several trajectories
end to end in one row (first-fit decreasing into rows of ``capacity`` tokens, at least the
longest trajectory), and keeps each one exactly as it would be alone:

- **positions**: Qwen3-VL's 3D mrope position ids are computed per trajectory (``get_rope_index``
  on it alone, its own images) and concatenated, each trajectory starting again at 0; the text
  position channel restarts at 0 for every trajectory too.
- **attention**: no 2D attention mask is passed. Under sdpa and eager, transformers derives a block-diagonal
  causal mask from the restarting text positions (``masking_utils.find_packed_sequence_indices``), whatever the
  number of rows. Flash-attention takes no mask: transformers finds the trajectories' boundaries from the
  positions only in a one-row batch (``modeling_flash_attention_utils._is_packed_sequence``) and otherwise runs
  each row as one causal sequence, so under flash-attention (``packs_into_one_row``) a micro-batch is packed into
  one row. Either way a token attends only to earlier tokens of its own trajectory.
- **images**: pixel values and grid sizes follow the order the image tokens appear in the rows.

``packed_token_logprobs`` returns the same (N, T) matrices as ``token_logprobs`` on
the padded batch (equal within 1e-5 in fp32; ``tests/test_packing.py``).

Observing the vision tower (``observing_vision``): inside the context, every scoring forward that encodes images
once each hands the observer the images it encoded and the vision tower's merged output for each, with grad, so a
recipe can add a loss on what the vision tower reads (SFT's visual auxiliary target, ``rl/sft.py``).
"""


from __future__ import annotations

import contextlib
import inspect

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
    inner = getattr(model, "model", model)
    return "mm_encoder_outputs" in inspect.signature(type(inner).forward).parameters


_VISION_OBSERVERS: list = []


@contextlib.contextmanager
def observing_vision(observer):
    """Within the context, ``observer(images, features)`` is called by every shared-image encoding
    (``shared_image_features``): ``images`` the distinct ``ImageInput``s encoded, ``features`` the vision tower's
    merged output of each ((tokens, hidden), with grad when grad is enabled). A forward that encodes images from
    ``pixel_values`` inside the model (FSDP2, ``share_images=False``) cannot be observed and raises instead."""
    _VISION_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _VISION_OBSERVERS.remove(observer)


def _unobservable() -> None:
    if _VISION_OBSERVERS:
        raise RuntimeError("the vision tower is observed (observing_vision) but this forward encodes the images "
                           "inside the model (share_images=False): use the shared-image forward")


def shared_image_features(model, images: list[ImageInput]) -> dict:
    """Vision features for a flat list of image occurrences, each distinct image encoded once.

    A GRPO group's G samples start from the same frame, and samples that walk the same cells share
    later frames too (``rl.rollout.Conversation`` hands out one ``ImageInput`` per distinct frame).
    The vision tower runs once per distinct image; every occurrence uses that output, so its
    gradient is the sum over occurrences — the same gradient as encoding each occurrence alone.
    Returns ``mm_encoder_outputs`` for the model's forward (with grad when grad is enabled).
    """
    # transformers' model classes take seconds to import: only where a model is built
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    uniq = list({id(im): im for im in images}.values())
    index = {id(im): k for k, im in enumerate(uniq)}
    p = next(model.parameters())
    out = model.model.get_image_features(torch.cat([im.pixels() for im in uniq]).to(p.device, p.dtype),
                                         torch.stack([im.grid_thw for im in uniq]).to(p.device))
    for observer in _VISION_OBSERVERS:
        observer(uniq, out.pooler_output)
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


def _chunk_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           banned: torch.Tensor | None, temperature: float, with_entropy: bool) -> torch.Tensor:
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

    _scoring_args: tuple | None = None  # (targets, banned ids, temperature, with_entropy) inside ``scoring``

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, banned_ids: list[int], temperature: float, with_entropy: bool):
        banned = torch.tensor(banned_ids, device=targets.device) if banned_ids else None
        self._scoring_args = (targets, banned, temperature, with_entropy)
        try:
            yield
        finally:
            self._scoring_args = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._scoring_args is None:
            return super().forward(hidden)
        targets, banned, temperature, with_entropy = self._scoring_args
        b, t, h = hidden.shape
        flat_h, flat_t = hidden.reshape(b * t, h), targets.reshape(b * t).to(hidden.device)
        if banned is not None:
            banned = banned.to(hidden.device)
        out, step = [], chunk_positions(self.weight.shape[0])
        for lo in range(0, b * t, step):
            args = (flat_h[lo:lo + step], self.weight, flat_t[lo:lo + step], banned, temperature,
                    with_entropy)
            if torch.is_grad_enabled():
                out.append(torch.utils.checkpoint.checkpoint(_chunk_logprob_entropy, *args, use_reentrant=False))
            else:
                out.append(_chunk_logprob_entropy(*args))
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


def gap_by_turn(logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, turns: int,
                offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of |trainer - engine| logprob and token count per turn index (turns >= ``turns`` - 1 pooled).

    logp, engine_logp, mask: (N, T); ``offset`` (N,): the episode turn of each row's first response (rows that
    are single turns). Returns two (turns,) float64 tensors: gap sums and token counts.
    """
    on = mask > 0
    index = turn_index(mask) + (offset.view(-1, 1) if offset is not None else 0)
    idx = index.clamp(0, turns - 1)[on]
    diff = (logp.detach() - engine_logp).abs()[on].double()
    sums = torch.zeros(turns, dtype=torch.float64).index_add_(0, idx, diff)
    counts = torch.zeros(turns, dtype=torch.float64).index_add_(0, idx, torch.ones_like(diff))
    return sums, counts


def is_sharded(model) -> bool:
    """True for an FSDP2-wrapped module (its forward casts to the compute dtype itself)."""
    from torch.distributed.fsdp import FSDPModule  # slow to import; rl/update.py imports this module

    return isinstance(model, FSDPModule)


def compute_context(model, compute_dtype: torch.dtype):
    """The trainer forward's precision context: FSDP2 casts by itself; an unsharded fp32 model under a
    lower compute dtype runs under autocast; fp32 compute runs as is."""
    if compute_dtype == torch.float32 or is_sharded(model):
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=compute_dtype)


# ---------------------------------------------------------------- padding-free packing
def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped into rows whose lengths sum to <= capacity."""
    capacity = max(capacity, max(lengths))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def _positions(model, ids: torch.Tensor, image_token_id: int, grids: list[torch.Tensor]) -> torch.Tensor:
    """(4, L) position ids of one trajectory alone: [text; temporal; height; width]."""
    mm = (ids == image_token_id).long()[None]
    grid = torch.stack(grids) if grids else None
    if grid is None:
        pos3 = torch.arange(len(ids)).view(1, -1).expand(3, -1)
    else:
        pos3, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=mm, image_grid_thw=grid)
        pos3 = pos3[:, 0]
    return torch.cat([torch.arange(len(ids))[None], pos3], dim=0)


def packs_into_one_row(model) -> bool:
    """Whether the model's attention takes no mask and finds packed sequences from the position ids only in a
    one-row batch: the flash-attention family (transformers gives them ``flash_attention_mask``, which returns no
    mask for a batch without padding), read from the attention implementation the model's config names."""
    # transformers' masking utilities: imported where a packed batch is built, not by the light modules above
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl is not None and ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl) is flash_attention_mask


def packed_batch(model, sequences: list[list[int]], images: list[list], pad_id: int, image_token_id: int,
                 capacity: int = 0, share_images: bool = False) -> tuple[dict, list[tuple[int, int, int]]]:
    """Pack sequences into rows. Returns (model inputs, placement) with placement[i] = (row, start, length).

    ``share_images``: each distinct image is encoded once (``shared_image_features``).
    """
    share_images = share_images and encoder_outputs_supported(model)
    if not share_images:
        _unobservable()
    lengths = [len(s) for s in sequences]
    if packs_into_one_row(model):  # flash-attention: the boundaries are found from the positions of one row only
        capacity = sum(lengths)
    rows = pack_rows(lengths, capacity or max(lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((4, len(rows), width), dtype=torch.long)
    place: list[tuple[int, int, int]] = [(0, 0, 0)] * len(sequences)
    pixels, grids, occurrences = [], [], []
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            seq = torch.tensor(sequences[i], dtype=torch.long)
            ids[r, at:at + len(seq)] = seq
            pos[:, r, at:at + len(seq)] = _positions(model, seq, image_token_id, [im.grid_thw for im in images[i]])
            place[i] = (r, at, len(seq))
            for im in images[i]:
                if not share_images:
                    pixels.append(im.pixels())
                grids.append(im.grid_thw)
                occurrences.append(im)
            at += len(seq)
        # the tail is padding: its own sequence (positions restart), never read back
        pos[:, r, at:] = torch.arange(width - at)
    batch = {"input_ids": ids, "position_ids": pos, "mm_token_type_ids": (ids == image_token_id).long()}
    if grids:
        batch["image_grid_thw"] = torch.stack(grids, dim=0)
        if share_images:
            batch["mm_encoder_outputs"] = shared_image_features(model, occurrences)
        else:
            batch["pixel_values"] = torch.cat(pixels, dim=0)
    return batch, place


def packed_token_logprobs(model, sequences: list[list[int]], images: list[list], pad_id: int, image_token_id: int,
                          banned_ids: list[int], temperature: float, with_entropy: bool = False, capacity: int = 0,
                          share_images: bool = False):
    """Like ``token_logprobs`` on the right-padded batch, computed from packed rows.

    Returns logprobs (N, T) with T the longest sequence, column 0 and padding = 0 (and entropy).
    """
    batch, place = packed_batch(model, sequences, images, pad_id, image_token_id, capacity, share_images)
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    batch = to_model(model, batch)
    # no attention_mask: block-diagonal causal from the positions; the head scores in chunks
    tok, ent_all = scored_forward(model, batch, banned_ids, temperature, with_entropy)  # (R, W), column 0 = 0
    tok, ent_all = tok[:, 1:], (ent_all[:, 1:] if with_entropy else None)  # position p predicts token p + 1
    width = max(n for _, _, n in place)
    lp = tok.new_zeros((len(sequences), width))
    ent = tok.new_zeros((len(sequences), width)) if with_entropy else None
    for i, (r, start, n) in enumerate(place):
        # token start+k (k >= 1) is predicted at packed position start+k-1
        lp[i, 1:n] = tok[r, start:start + n - 1]
        if with_entropy:
            ent[i, 1:n] = ent_all[r, start:start + n - 1]
    return (lp, ent) if with_entropy else lp


def sequence_logprobs(model, sequences: list[list[int]], images: list[list], pad_id: int, image_token_id: int,
                      banned_ids: list[int], temperature: float, with_entropy: bool = False, packing: bool = False,
                      share_images: bool = True):
    """The trainer's forward over whole trajectories: packed or right-padded, each distinct image encoded
    once (``share_images``; off under FSDP2, whose sharded vision tower is only entered through the root
    module's forward). Returns (N, longest) logprobs (and entropy), as ``token_logprobs``."""
    share_images = share_images and encoder_outputs_supported(model)
    if packing:
        return packed_token_logprobs(model, sequences, images, pad_id, image_token_id, banned_ids, temperature,
                                     with_entropy, share_images=share_images)
    flat = [im for row in images for im in row] if share_images else None
    if not share_images:
        _unobservable()
    batch = collate(sequences, images, pad_id, image_token_id, with_pixels=not share_images)
    return token_logprobs(model, batch, banned_ids, temperature, with_entropy, images=flat)
