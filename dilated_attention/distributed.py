"""Sequence-parallel helpers: split a sequence across ranks, put it back, and what a training loop needs.

A sequence-parallel (SP) group of ``P`` ranks holds one sequence: rank ``j`` has
positions ``[jL, (j+1)L)``, ``L = N / P`` (docs/design.md section 2). Three things a
training loop must then do besides calling the attention:

* feed each rank's tokens at their *global* positions (RoPE, learned position
  embeddings): ``shard_positions``;
* sum parameter gradients over the SP group before the optimizer step, since each
  rank's backward only holds its own tokens' part of the gradient:
  ``all_reduce_gradients`` (with the loss of each rank being its share of the
  group's mean, ``sum(local loss) / global token count``);
* (optionally) gather an output back onto every rank: ``gather_sequence``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .comm import CommBackend, resolve_comm


def _backend(comm: str | CommBackend) -> CommBackend:
    backend = resolve_comm(comm)
    if backend is None:
        raise ValueError("comm must name a backend or be a CommBackend here, got None")
    return backend


def shard_sequence(x: torch.Tensor, comm: str | CommBackend, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``dim`` (rank ``j`` gets block ``j``)."""
    backend = _backend(comm)
    size, rank = backend.world_size, backend.rank
    if x.shape[dim] % size:
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) is not divisible by world size {size}")
    return x.chunk(size, dim=dim)[rank].contiguous()


def gather_sequence(x: torch.Tensor, comm: str | CommBackend, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (the inverse of ``shard_sequence``; no grad).

    Every rank of the group must call it with shards of the same shape.
    """
    backend = _backend(comm)
    return torch.cat(backend.all_gather(x.detach()).unbind(0), dim=dim)


def shard_positions(seq_len: int, comm: str | CommBackend,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global position ids ``(L,)`` (int64) of this rank's shard of a ``seq_len``-token sequence.

    Pass them wherever a model needs positions (RoPE ``position_ids``, learned
    position embeddings): a shard's rows are positions ``[jL, (j+1)L)`` of the
    whole sequence, not ``[0, L)``. Defined as ``shard_sequence(arange(seq_len))``,
    so it always matches how ``shard_sequence`` splits the tokens.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return shard_sequence(torch.arange(seq_len, device=device), comm, dim=0)


def all_reduce_gradients(module: nn.Module, comm: str | CommBackend) -> None:
    """Sum every parameter's ``.grad`` over ``comm``'s group, in place (call after ``backward``).

    Sequence parallelism splits the tokens, not the weights: each rank's backward
    yields the gradient of its own tokens' loss only. With each rank's loss being
    its share of the group's mean (``sum(local loss) / global tokens``), the sum
    over the group is the exact gradient of that mean. Data parallelism across
    SP groups (DDP, FSDP, DeepSpeed) then averages as usual; DeepSpeed engines
    given DeepSpeed's sequence-parallel ``mpu`` already sum over SP themselves.

    Parameters whose ``.grad`` is ``None`` are skipped: they must be ``None`` on
    every rank of the group. One collective per (device, dtype) of the grads.
    """
    backend = _backend(comm)
    if backend.world_size == 1:
        return
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in module.parameters():
        if p.grad is not None:
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])  # one flat buffer: one collective, not one per tensor
        dist.all_reduce(flat, group=backend.group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


__all__ = ["shard_sequence", "gather_sequence", "shard_positions", "all_reduce_gradients"]
