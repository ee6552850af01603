"""Contiguity-safe strided views: an index gather on a sliced view can read the wrong memory on GPUs.

Dilation and head slicing are pure views of ``(B, N, H, ...)`` tensors of any
strides: splitting the sequence dim with ``unflatten`` is always a view, and
``select``/``narrow`` keep the strides explicit. Nothing here uses
index gathers; data that must travel is copied with ``copy_`` into a buffer
that is contiguous by construction.
"""

from __future__ import annotations

import torch

from . import caches
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


def new_grad_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, *, zeroed: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New compact ``(B, L // r, heads, D)`` tensors in q's dtype for a pattern's dq, dk, dv (``zeroed``: for a
    kernel that writes only its chunks' heads; a part's other heads must read 0)."""
    rows, new = q.shape[1] // plan.dilation, torch.zeros if zeroed else torch.empty
    return tuple(new((x.shape[0], rows, *x.shape[2:]), dtype=q.dtype, device=q.device) for x in (q, k, v))


def compact_view(x: torch.Tensor, plan: PatternPlan, h0: int, h1: int) -> torch.Tensor:
    """Heads ``[h0, h1)`` of a compact ``(B, L // r, H, ...)`` tensor as ``(B, S, M, h, ...)``."""
    m = plan.local_segment // plan.dilation
    return x.unflatten(1, (x.shape[1] // m, m)).narrow(3, h0, h1 - h0)


Unit = tuple[int, int, int, int]  # (offset, first head in the full tensor, first head in the compact one, heads)


@caches.memoize("views.steps", 1024)  # asked per pattern on the hot path (merges, ring packs); plans are few
def _steps(units: tuple[Unit, ...]) -> tuple[int, int, int] | None:
    """``(offset, full head, compact head)`` steps from each unit to the next if all three are constant and
    every unit has as many heads (every LongNet plan), else ``None``."""
    first = units[0]
    steps = tuple(b - a for a, b in zip(first[:3], units[1][:3])) if len(units) > 1 else (0, 0, 0)
    even = all(u[3] == first[3] and tuple(x - y for x, y in zip(u[:3], first[:3])) == tuple(i * s for s in steps)
               for i, u in enumerate(units))
    return steps if even else None


def _strided_pair(full: torch.Tensor, compact: torch.Tensor, plan: PatternPlan, units: tuple[Unit, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One ``(full-layout rows, compact rows)`` view pair, ``(B, S, M, A, h, *rest)`` each, covering ``units``
    (``A`` of ``h`` heads) where they step evenly (``_steps``), else ``None``: one op per pattern instead of one
    per unit. ``as_strided`` from each tensor's own strides and offset reads the addresses the per-unit views
    (``dilated_view``, ``compact_view``) read."""
    steps = _steps(units)
    if steps is None:
        return None
    offset, head, slot, heads = units[0]
    bsz, n, _, *rest = full.shape
    w, r = plan.local_segment, plan.dilation
    shape = (bsz, n // w, w // r, len(units), heads, *rest)
    s_b, s_n, s_h, *s_rest = full.stride()
    rows = full.as_strided(shape, (s_b, w * s_n, r * s_n, steps[0] * s_n + steps[1] * s_h, s_h, *s_rest),
                           full.storage_offset() + offset * s_n + head * s_h)
    p_b, p_n, p_h, *p_rest = compact.stride()
    part = compact.as_strided(shape, (p_b, w // r * p_n, p_n, steps[2] * p_h, p_h, *p_rest),
                              compact.storage_offset() + slot * p_h)
    return rows, part


def region_views(full: torch.Tensor, compact: torch.Tensor, plan: PatternPlan, whole: bool = True, kv: bool = False
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching ``(full-layout rows, compact rows)`` view pairs that together cover a pattern (``kv``: its kv
    heads, each read at one offset, ``PatternPlan.head_offsets``).

    One pair for the whole pattern (``_strided_pair`` over its head runs) when its runs step evenly
    (every LongNet plan with ``r | H`` or ``H | r``, and every grouped plan) and ``full`` is contiguous
    (a tensor we allocated) and ``whole`` allows it, else one pair per chunk, ``(B, S, M, 1, h, *rest)``.
    """
    if kv:
        units = tuple((c.offset, c.k0, c.k0, c.k1 - c.k0) for c in plan.chunks)
    else:
        units = tuple((offset, h0, h0, h1 - h0) for offset, h0, h1 in plan.head_runs)
    pair = _strided_pair(full, compact, plan, units) if whole and full.is_contiguous() else None
    if pair is not None:
        return [pair]
    w, r = plan.local_segment, plan.dilation
    spans = [(c.offset, *((c.k0, c.k1) if kv else (c.h0, c.h1))) for c in plan.chunks]
    return [(dilated_view(full, w, r, offset, h0, h1).unsqueeze(3), compact_view(compact, plan, h0, h1).unsqueeze(3))
            for offset, h0, h1 in spans]


def _packed_units(plan: PatternPlan) -> tuple[Unit, ...]:
    """A ring pattern's chunks as units of its kv heads and their heads in the packed buffer."""
    return tuple((c.offset, c.k0, c.buffer_head, c.k1 - c.k0) for c in plan.chunks)


def _even_steps(plan: PatternPlan) -> tuple[int, int, int] | None:
    """``_steps`` of a ring pattern's packed units where it has several chunks (one chunk is one copy anyway)."""
    return _steps(_packed_units(plan)) if len(plan.chunks) > 1 else None


def _packed_regions(x: torch.Tensor, half: torch.Tensor, plan: PatternPlan
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching ``(x's dilated kv rows, the packed buffer half's heads)`` view pairs covering a ring pattern's
    chunks on a block of one segment chunk: one pair where the chunks step evenly (one copy per tensor instead
    of one per chunk: the ring packs on every call), else one pair per chunk."""
    if _even_steps(plan) is not None:
        return [_strided_pair(x, half, plan, _packed_units(plan))]
    return [(chunk_views(x, plan, c, kv=True).squeeze(1), packed_view(half, c).squeeze(1)) for c in plan.chunks]


def _widens(x: torch.Tensor) -> bool:
    """Whether ``x`` can be seen as 16-byte elements: ``readable`` with a last dim of a multiple of 16 bytes, and a
    storage offset of whole 16-byte elements (what ``Tensor.view(dtype)`` asks)."""
    size = x.element_size()
    return readable(x) and (x.shape[-1] * size) % ALIGN_BYTES == 0 and \
        (x.storage_offset() * size) % ALIGN_BYTES == 0


def widened(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, N, H, D)`` tensors of one dtype to copy rows between, seen as 16-byte elements (complex128: ``D`` in
    fewer, wider ones) where both allow it, else as they are: torch's strided copy moves an element per step, and
    the 2-byte steps of bf16 rows ran LongNet's gathers at under half the copy's bandwidth (H200)."""
    if src.dtype == dst.dtype and src.dim() == 4 and _widens(src) and _widens(dst):
        return src.view(torch.complex128), dst.view(torch.complex128)
    return src, dst


def compact(x: torch.Tensor, plan: PatternPlan) -> torch.Tensor:
    """A new compact ``(B, L / r, H, ...)`` copy of the rows and heads ``plan`` reads of ``x`` (a compact ring's
    query-side rows, ``ring/routes.py``)."""
    out = x.new_empty((x.shape[0], x.shape[1] // plan.dilation, *x.shape[2:]))
    for rows, part in region_views(x, out, plan):
        part.copy_(rows)
    return out


def pack_kv(k: torch.Tensor, v: torch.Tensor, plan: PatternPlan) -> torch.Tensor:
    """Copy the dilated K and V rows every chunk needs into one contiguous send buffer.

    Layout ``(2, B, L // r, packed_heads, D)``; each (kv head, offset) pair once.
    """
    bsz, n, _, dim = k.shape
    buf = torch.empty((2, bsz, n // plan.dilation, plan.packed_heads, dim), dtype=k.dtype, device=k.device)
    for x, half in zip((k, v), buf):
        for rows, heads in _packed_regions(x, half, plan):
            heads.copy_(rows)
    return buf


def packed_view(half: torch.Tensor, chunk: HeadChunk) -> torch.Tensor:
    """A chunk's heads in one half ``(B, L // r, Hp, D)`` of a packed buffer, as ``(B, 1, L // r, k1 - k0, D)``."""
    return half.narrow(2, chunk.buffer_head, chunk.k1 - chunk.k0).unsqueeze(1)


def unpack_add_(dk: torch.Tensor, dv: torch.Tensor, buf: torch.Tensor, plan: PatternPlan) -> None:
    """Add packed ring gradients ``buf`` (same layout as ``pack_kv``) into local ``dk``/``dv``."""
    for x, half in zip((dk, dv), buf):
        for rows, heads in _packed_regions(x, half, plan):
            rows.add_(heads)


ALIGN_BYTES = 16  # what fused attention ops (cuDNN's TMA loads, flash's vector loads) assume of addresses and strides


def layout_key(t: torch.Tensor) -> tuple:
    """What the checks, the kernel choice and the call plans read of a tensor besides its values: shape,
    strides, dtype, device and address alignment (``readable``)."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % ALIGN_BYTES)


def readable(v: torch.Tensor) -> bool:
    """Whether a fused attention op (cuDNN, torch's flash) can read this view in place: unit-stride last
    dim, every other stride (of a dim longer than 1) a positive multiple of 16 bytes, 16-byte aligned start."""
    if v.numel() == 0:
        return True
    if v.stride(-1) != 1 or v.data_ptr() % ALIGN_BYTES:
        return False
    unit = ALIGN_BYTES // v.element_size()
    return all(st > 0 and st % unit == 0 for n, st in zip(v.shape[:-1], v.stride()[:-1]) if n > 1)
