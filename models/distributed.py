"""FSDP2 for the VLM: shard units and the full weights an unsharded engine copy needs.

Units: the vision tower, each text decoder layer, then the root. Rollouts do not run on the
sharded module: ranks run different numbers of forwards (episodes end at different turns), and
every FSDP2 forward is a collective, so they would deadlock. The hf engine instead holds an
unsharded copy that receives the full weights after each optimizer step (the same weight-sync
step a vLLM engine takes).
"""

from __future__ import annotations


def wrap_fsdp2(policy) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(policy.model.visual)
    for layer in policy.model.language_model.layers:
        fully_shard(layer)
    fully_shard(policy)


def full_state_dict(policy, cpu_offload: bool = True) -> dict:
    """Gather the unsharded weights (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
