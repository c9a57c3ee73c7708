"""A few rank helpers (not a framework)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def all_reduce_sum(value: float) -> float:
    if not dist.is_initialized():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_sums(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of a float64 vector over ranks, in one collective."""
    if not dist.is_initialized():
        return values
    out = values.clone()
    dist.all_reduce(out)
    return out


def all_reduce_grads(model) -> None:
    """Sum gradients over ranks (losses are already normalised by global counts)."""
    if not dist.is_initialized():
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def params_checksum(model) -> float:
    """A float64 fingerprint of the full parameters (FSDP2 shards are gathered first)."""
    total = torch.zeros((), dtype=torch.float64)
    for k, p in enumerate(model.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        total += full.detach().double().flatten().mul(1.0 + 1e-3 * (k % 97)).sum()
    return float(total)


def check_in_sync(model) -> float:
    """Raise if the ranks' weights differ; returns the checksum."""
    value = params_checksum(model)
    if dist.is_initialized():
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        if max(values) - min(values) > 1e-6 * max(1.0, abs(value)):
            raise RuntimeError(f"ranks out of sync: parameter checksums {values}")
    return value
