"""A few rank helpers (not a framework).

Every collective here puts its buffer on the process group's device: NCCL reduces CUDA tensors only
(a CPU tensor fails at the first call), gloo CPU tensors. ``collective_device`` is the one place that
decides, from the group's backend and ``LOCAL_RANK``; results come back as Python numbers or CPU
tensors, wherever the collective ran.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init(backend: str, timeout_min: float | None = None) -> None:
    """The default process group; ``timeout_min``: how long a collective waits for the slowest rank (torch's
    default, 10 minutes for NCCL, 30 for gloo, when None)."""
    if not dist.is_initialized():
        kwargs = {} if timeout_min is None else {"timeout": timedelta(minutes=timeout_min)}
        dist.init_process_group(backend=backend, **kwargs)


def is_initialized() -> bool:
    return dist.is_initialized()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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


def device_for_backend(backend: str, local_rank: int) -> torch.device:
    """Where a collective's tensors must live: ``cuda:LOCAL_RANK`` for NCCL, the CPU for gloo."""
    return torch.device("cuda", local_rank) if str(backend).lower() == "nccl" else torch.device("cpu")


def collective_device() -> torch.device:
    """The default process group's device (the CPU when there is no group)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    return device_for_backend(dist.get_backend(), int(os.environ.get("LOCAL_RANK", 0)))


def _reduce(values: torch.Tensor, op) -> torch.Tensor:
    out = values.detach().to(collective_device(), torch.float64, copy=True)
    dist.all_reduce(out, op=op)
    return out.cpu()


def all_reduce_sum(value: float) -> float:
    if not dist.is_initialized():
        return float(value)
    return float(_reduce(torch.tensor([float(value)], dtype=torch.float64), dist.ReduceOp.SUM)[0])


def all_reduce_max(value: float) -> float:
    if not dist.is_initialized():
        return float(value)
    return float(_reduce(torch.tensor([float(value)], dtype=torch.float64), dist.ReduceOp.MAX)[0])


def all_reduce_sums(values: torch.Tensor) -> torch.Tensor:
    """Element-wise float64 sum of a tensor over ranks, in one collective (returned on the CPU)."""
    if not dist.is_initialized():
        return values.double()
    return _reduce(values, dist.ReduceOp.SUM)


def all_reduce_grads(model) -> None:
    """Sum gradients over ranks (losses are already normalised by global counts). The gradients live on
    the model's device, which is the group's device (the trainer runs where its backend reduces)."""
    if not dist.is_initialized():
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def all_gather_objects(obj) -> list:
    """Every rank's ``obj`` in rank order (pickled; the group's device carries the bytes)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_sharded(model) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors), at any world size."""
    return any(hasattr(p, "to_local") for p in model.parameters())


def params_checksum(model) -> float:
    """A float64 fingerprint of the full parameters: each weighted by its index, summed. FSDP2: each rank sums its
    own shards and the sums are added over ranks (a collective; no parameter is gathered)."""
    total = torch.zeros((), dtype=torch.float64)
    for k, p in enumerate(model.parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.detach().double().flatten().mul(1.0 + 1e-3 * (k % 97)).sum().cpu()
    return all_reduce_sum(float(total)) if is_sharded(model) else float(total)


def check_in_sync(model) -> float:
    """Raise if the ranks' weights differ (each rank holds a full copy: one process, DDP); returns the checksum.
    Under FSDP2 every rank holds its own shards, so there is no copy to compare: the checksum is their sum."""
    value = params_checksum(model)
    if is_sharded(model):
        return value
    values = all_gather_objects(value)
    if max(values) - min(values) > 1e-6 * max(1.0, abs(value)):
        raise RuntimeError(f"ranks out of sync: parameter checksums {values}")
    return value
