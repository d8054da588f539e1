"""Parameters and optimizer state that may be sharded, read and written as whole tensors.

Under FSDP2 the parameters (and AdamW's moments) are DTensors holding this process's rows of dim
0 (placement Shard(0), torch.chunk's split: ceil(rows / processes) rows each, the last ones
fewer or none). Checkpoints, the final adapter and the loaders deal in whole tensors, so they
go through these helpers, which leave plain tensors alone: one process, and DDP, are unchanged.
"""

from __future__ import annotations

import torch


def is_sharded(t) -> bool:
    """Whether `t` is a DTensor (FSDP2's parameters and their optimizer state)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every process for a sharded one (a collective: every
    process calls it, in the same order), `t` itself otherwise."""
    return t.full_tensor() if is_sharded(t) else t


def shard_rows(p) -> slice:
    """This process's rows of sharded `p` (dim 0)."""
    from torch.distributed.tensor import Shard

    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"expected a parameter sharded by rows, got placements {p.placements}")
    n, world = p.shape[0], p.device_mesh.size()
    size = -(-n // world)
    start = min(p.device_mesh.get_local_rank() * size, n)
    stop = min(start + size, n)
    if p.to_local().shape[0] != stop - start:
        raise ValueError(f"this process holds {p.to_local().shape[0]} rows of a {tuple(p.shape)} "
                         f"tensor, not the {stop - start} of an even split")
    return slice(start, stop)


@torch.no_grad()
def copy_full_into(p: torch.Tensor, full: torch.Tensor) -> None:
    """p <- full (the whole tensor): for a sharded `p` this process's rows of it."""
    if is_sharded(p):
        p.to_local().copy_(full[shard_rows(p)])
    else:
        p.copy_(full)


def like_param(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A whole optimizer-state tensor laid out as its parameter `p` is: sharded like a sharded
    `p` when it has p's shape (AdamW's moments), else as it is (the step count)."""
    if not is_sharded(p) or tuple(value.shape) != tuple(p.shape):
        return value
    from torch.distributed.tensor import DTensor

    local = p.to_local()
    rows = value[shard_rows(p)].to(device=local.device, dtype=local.dtype)
    return DTensor.from_local(rows, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())
