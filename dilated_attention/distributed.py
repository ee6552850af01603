"""Split a sequence across ranks and put it back together."""

from __future__ import annotations

import torch

from .comm import CommBackend, resolve_comm


def shard_sequence(x: torch.Tensor, comm: str | CommBackend, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``dim`` (rank ``j`` gets block ``j``)."""
    backend = resolve_comm(comm)
    size, rank = backend.world_size, backend.rank
    if x.shape[dim] % size:
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) is not divisible by world size {size}")
    return x.chunk(size, dim=dim)[rank].contiguous()


def gather_sequence(x: torch.Tensor, comm: str | CommBackend, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (the inverse of ``shard_sequence``; no grad)."""
    backend = resolve_comm(comm)
    return torch.cat(backend.all_gather(x.detach()).unbind(0), dim=dim)
