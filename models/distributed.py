"""FSDP2 and mixed precision for the VLM; the streamed weight sync an engine copy needs.

Precision (every parallel mode): the trainer's parameters and AdamW moments are fp32 (the master copy);
``model.dtype`` is the *compute* dtype. Under FSDP2 that is ``MixedPrecisionPolicy(param_dtype=compute,
reduce_dtype=float32)``: each unit's fp32 shard is all-gathered and cast to bf16 for its forward and
backward, and gradients are reduce-scattered in fp32 onto the fp32 shards. Without FSDP2 (one process, or
DDP) the same intent is ``torch.autocast(compute)`` around the trainer's forwards (``models.forward.compute_context``).

Units: the vision tower, each text decoder layer, then the root. Rollouts do not run on the sharded
module: ranks run different numbers of forwards (episodes end at different turns), and every FSDP2
forward is a collective, so they would deadlock. The hf engine instead holds an unsharded copy that
receives the full weights after each optimizer step (the step a vLLM engine takes too); with vLLM there
is no copy. The weights travel one tensor at a time (``stream_full_weights``): no rank ever holds the full
gathered state besides the engine's own copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def mixed_precision_policy(compute_dtype: torch.dtype):
    """fp32 shards and gradient reduction, ``compute_dtype`` for the forward/backward."""
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def wrap_fsdp2(model, compute_dtype: torch.dtype = torch.float32, frozen: bool = False) -> None:
    """Shard ``model`` in place (vision tower, each decoder layer, root) with the mixed-precision policy.

    A trained model's ``reshard_after_forward`` is left to FSDP2: units reshard after their forward, the root keeps
    its gathered embeddings and lm_head until backward (passing it explicitly would make the root regather them).
    A ``frozen`` model (the KL reference: no-grad forwards, never a backward) reshards its root after each forward
    too; left to FSDP2, its gathered embeddings and lm_head would stay on every rank for the whole run."""
    mp = mixed_precision_policy(compute_dtype)
    fully_shard(model.model.visual, mp_policy=mp)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp, **({"reshard_after_forward": True} if frozen else {}))


def stream_full_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every entry of the state dict, one at a time (a collective per sharded
    tensor: every rank iterates in the same order). Shards are cast to ``dtype`` before the all-gather, so
    the gather moves and holds compute-dtype bytes."""
    for name, t in model.state_dict().items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def full_state_dict(policy, cpu_offload: bool = True) -> dict:
    """Gather the unsharded weights (a collective: every rank calls it; with ``cpu_offload`` only rank 0
    receives them, on the CPU)."""
    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
