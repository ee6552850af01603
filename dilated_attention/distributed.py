"""Sequence-parallel helpers: split a sequence across ranks, put it back, and what a training loop needs.

A sequence-parallel (SP) group of ``P`` ranks holds one sequence: rank ``j`` has
positions ``[jL, (j+1)L)``, ``L = N / P`` (docs/design.md section 2), or, with
``layout="zigzag"``, the sequence is cut in ``2P`` chunks of ``N / (2P)`` tokens and rank
``j`` holds chunk ``j`` followed by chunk ``2P - 1 - j`` (causal rings then give every
rank the same work). ``shard_indices`` gives a rank's positions in either layout, for a
data loader that shards itself. Three things a training loop must then do besides
calling the attention:

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
from .patterns import check_layout
from .ring.documents import undeal


def _backend(comm: str | CommBackend) -> CommBackend:
    backend = resolve_comm(comm)
    if backend is None:
        raise ValueError("comm must name a backend or be a CommBackend here, got None")
    return backend


def _chunks(world: int, rank: int, layout: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in its row order: of ``world`` chunks, or (zigzag) of ``2 world``."""
    check_layout(layout)
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def _chunk_length(seq_len: int, world: int, layout: str, what: str) -> int:
    chunks = 2 * world if layout == "zigzag" else world
    if seq_len % chunks:
        raise ValueError(f"{what} {seq_len} is not divisible by {chunks}: layout={layout!r} cuts it into "
                         + (f"2 x {world} chunks (world size {world})" if layout == "zigzag" else
                            f"one shard per rank (world size {world})"))
    return seq_len // chunks


def shard_indices(seq_len: int, world: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions ``(seq_len // world,)`` (int64) rank ``rank`` of ``world`` holds, in its row order.

    ``"contiguous"``: ``[rank L, (rank + 1) L)``. ``"zigzag"``: cut the sequence in ``2 world`` chunks of
    ``c = seq_len // (2 world)``; the rank holds chunk ``rank`` then chunk ``2 world - 1 - rank``, i.e.
    ``[rank c, (rank + 1) c)`` followed by ``[(2 world - 1 - rank) c, (2 world - rank) c)``. A data loader
    that shards by itself takes ``tokens[..., shard_indices(...)]``: what ``shard_sequence`` returns.
    """
    for name, value in (("seq_len", seq_len), ("world", world), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "rank" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'rank' else 'positive'} int, got {value!r}")
    if rank >= world:
        raise ValueError(f"rank must be below world={world}, got {rank}")
    check_layout(layout)
    _chunk_length(seq_len, world, layout, "seq_len")  # (raises where the layout does not cut it evenly)
    local = seq_len // world
    return undeal(rank, torch.arange(local), local, world, layout == "zigzag")


def shard_sequence(x: torch.Tensor, comm: str | CommBackend, dim: int = 1, layout: str = "contiguous"
                   ) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim``: block ``j`` for rank ``j``, or its two zigzag chunks
    (``layout="zigzag"``, ``shard_indices``). Pass the same ``layout`` to the attention."""
    backend = _backend(comm)
    size = _chunk_length(x.shape[dim], backend.world_size, layout, f"sequence length (dim {dim})")
    return torch.cat([x.narrow(dim, c * size, size) for c in _chunks(backend.world_size, backend.rank, layout)],
                     dim=dim)


def gather_sequence(x: torch.Tensor, comm: str | CommBackend, dim: int = 1, layout: str = "contiguous"
                    ) -> torch.Tensor:
    """Every rank's shard put back in sequence order along ``dim`` (the inverse of ``shard_sequence`` with the
    same ``layout``; no grad). Every rank of the group must call it with shards of the same shape."""
    backend = _backend(comm)
    world = backend.world_size
    shards = backend.all_gather(x.detach()).unbind(0)
    pieces = {}
    for rank, shard in enumerate(shards):
        chunks = _chunks(world, rank, layout)
        for c, piece in zip(chunks, shard.chunk(len(chunks), dim=dim)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=dim)


def shard_positions(seq_len: int, comm: str | CommBackend, device: torch.device | str | None = None,
                    layout: str = "contiguous") -> torch.Tensor:
    """Global position ids ``(L,)`` (int64) of this rank's shard of a ``seq_len``-token sequence.

    Pass them wherever a model needs positions (RoPE ``position_ids``, learned
    position embeddings): a shard's rows are positions ``[jL, (j+1)L)`` of the
    whole sequence (zigzag: its two chunks' positions), not ``[0, L)``. Defined as
    ``shard_sequence(arange(seq_len), layout=layout)``, so it always matches how
    ``shard_sequence`` splits the tokens.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return shard_sequence(torch.arange(seq_len, device=device), comm, dim=0, layout=layout)


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


__all__ = ["shard_sequence", "gather_sequence", "shard_positions", "shard_indices", "all_reduce_gradients"]
