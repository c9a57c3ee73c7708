"""Padding-free packing of multi-turn VLM trajectories for the trainer's forward.

Trajectories of very different lengths (an episode solved in 6 turns next to one that ran out
of 30) waste most of a right-padded batch on pad tokens. Packing places several trajectories
end to end in one row (first-fit decreasing into rows of ``capacity`` tokens, at least the
longest trajectory), and keeps each one exactly as it would be alone:

- **positions**: Qwen3-VL's 3D mrope position ids are computed per trajectory (``get_rope_index``
  on it alone, its own images) and concatenated, each trajectory starting again at 0; the text
  position channel restarts at 0 for every trajectory too.
- **attention**: no 2D attention mask is passed, so transformers derives a block-diagonal causal
  mask from the restarting text positions (``masking_utils.find_packed_sequence_indices``):
  a token attends only to earlier tokens of its own trajectory, under sdpa, eager and flash.
- **images**: pixel values and grid sizes follow the order the image tokens appear in the rows.

``packed_token_logprobs`` returns the same (N, T) matrices as ``rl.logprobs.token_logprobs`` on
the padded batch (equal within 1e-5 in fp32; ``tests/test_packing.py``).
"""

from __future__ import annotations

import torch

from rl.logprobs import (
    collate,
    encoder_outputs_supported,
    scored_forward,
    shared_image_features,
    to_model,
    token_logprobs,
)


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


def packed_batch(model, sequences: list[list[int]], images: list[list], pad_id: int, image_token_id: int,
                 capacity: int = 0, share_images: bool = False) -> tuple[dict, list[tuple[int, int, int]]]:
    """Pack sequences into rows. Returns (model inputs, placement) with placement[i] = (row, start, length).

    ``share_images``: each distinct image is encoded once (``rl.logprobs.shared_image_features``).
    """
    share_images = share_images and encoder_outputs_supported(model)
    lengths = [len(s) for s in sequences]
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
    """Like ``rl.logprobs.token_logprobs`` on the right-padded batch, computed from packed rows.

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
    module's forward). Returns (N, longest) logprobs (and entropy), as ``rl.logprobs.token_logprobs``."""
    share_images = share_images and encoder_outputs_supported(model)
    if packing:
        return packed_token_logprobs(model, sequences, images, pad_id, image_token_id, banned_ids, temperature,
                                     with_entropy, share_images=share_images)
    flat = [im for row in images for im in row] if share_images else None
    batch = collate(sequences, images, pad_id, image_token_id, with_pixels=not share_images)
    return token_logprobs(model, batch, banned_ids, temperature, with_entropy, images=flat)
