"""Contiguity-safe strided views (the seeds' illegal-memory-access lesson).

Dilation and head slicing are pure views of ``(B, N, H, ...)`` tensors of any
strides: splitting the sequence dim with ``unflatten`` is always a view, and
``select``/``narrow`` keep the strides explicit. Nothing here calls
``index_select``; data that must travel is copied with ``copy_`` into a buffer
that is contiguous by construction.
"""

from __future__ import annotations

import torch

from .patterns import HeadChunk, PatternPlan


def dilated_view(x: torch.Tensor, segment: int, dilation: int, offset: int, h0: int, h1: int) -> torch.Tensor:
    """View ``(B, N, H, *rest) -> (B, N // segment, segment // dilation, h1 - h0, *rest)``.

    Row ``j`` of segment ``s`` is position ``s * segment + offset + dilation * j``.
    """
    n = x.shape[1]
    if n % segment or segment % dilation or not 0 <= offset < dilation:
        raise ValueError(
            f"dilated_view: sequence {n}, segment {segment}, dilation {dilation}, offset {offset} do not fit"
        )
    split = x.unflatten(1, (n // segment, segment // dilation, dilation))
    return split.select(3, offset).narrow(3, h0, h1 - h0)


def chunk_views(x: torch.Tensor, plan: PatternPlan, chunk: HeadChunk, kv: bool = False) -> torch.Tensor:
    """The rows and heads of a chunk in a rank's local tensor (query heads, or kv heads)."""
    a, b = (chunk.k0, chunk.k1) if kv else (chunk.h0, chunk.h1)
    return dilated_view(x, plan.local_segment, plan.dilation, chunk.offset, a, b)


def pack_kv(k: torch.Tensor, v: torch.Tensor, plan: PatternPlan) -> torch.Tensor:
    """Copy the dilated K and V rows every chunk needs into one contiguous send buffer.

    Layout ``(2, B, L // r, packed_heads, D)``; each (kv head, offset) pair once.
    """
    bsz, n, _, dim = k.shape
    buf = torch.empty((2, bsz, n // plan.dilation, plan.packed_heads, dim), dtype=k.dtype, device=k.device)
    for c in plan.chunks:
        dst = buf[:, :, :, c.packed : c.packed + c.k1 - c.k0]
        dst[0].copy_(chunk_views(k, plan, c, kv=True).squeeze(1))
        dst[1].copy_(chunk_views(v, plan, c, kv=True).squeeze(1))
    return buf


def packed_view(half: torch.Tensor, chunk: HeadChunk) -> torch.Tensor:
    """A chunk's heads in one half ``(B, L // r, Hp, D)`` of a packed buffer, as ``(B, 1, L // r, k1 - k0, D)``."""
    return half.narrow(2, chunk.packed, chunk.k1 - chunk.k0).unsqueeze(1)


def unpack_add_(dk: torch.Tensor, dv: torch.Tensor, buf: torch.Tensor, plan: PatternPlan) -> None:
    """Add packed ring gradients ``buf`` (same layout as ``pack_kv``) into local ``dk``/``dv``."""
    for c in plan.chunks:
        chunk_views(dk, plan, c, kv=True).add_(packed_view(buf[0], c))
        chunk_views(dv, plan, c, kv=True).add_(packed_view(buf[1], c))


def require_unit_last_stride(name: str, x: torch.Tensor) -> None:
    """Kernels that read through strides need the head dim packed."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tuple(x.stride())}")
