"""Head chunks: a long call runs its heads in a few groups, one after another, to bound its scratch memory.

A call's scratch is what it holds besides its own q, k, v, out, dout, dq, dk, dv: the fp32 accumulators
of patterns merged in place (``ring/block.py``), the compact parts of local patterns, and a ring's packed K/V
blocks and fp32 dK/dV accumulators in flight. Every one of them is per head, so running the heads in
``C`` chunks divides them by ``C``; the results are written into head slices of the call's output and
gradients (``block_forward``/``block_backward``'s ``into``), so nothing is copied. The cost is more,
smaller kernel calls and ring messages, which is why short calls run whole. The head strategy's swaps
count as scratch too (its head-layout tensors): in chunks they move one chunk's heads at a time, and the
backward swaps the chunk's q, k, v, out again rather than keeping them (``head_parallel.py``).

Rule: a call whose own bytes reach ``BOUND.floor`` runs in the fewest chunks (a divisor of its kv
heads: a chunk holds whole kv groups, so each kv head's gradient comes from one chunk) whose estimated
scratch is at most ``BOUND.share`` of its own bytes. The estimate depends on shapes and patterns only,
so every rank of a job chooses the same chunks (the cross-rank agreement compares the count).
``set_memory_bound`` moves both, process-wide: memory first below the floor, at the cost measured in
docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .ring.routes import Routes

DEFAULT_SCRATCH_SHARE = 0.4  # peak memory target: 1.4 x the call's own bytes
# own bytes (4 GiB: 131072 tokens of 16 x 128 bf16 heads) below which a call runs whole: LongNet's calls at
# 32768 tokens are small enough to be bound by launches, so two chunks cost 7-30% there on one H100 (1.6-1.9x on
# a 2-GPU ring), 1-2% at 131072; full attention's 2-head chunks cost 8% / 40% (non-causal / causal, 2 x H100)
DEFAULT_SCRATCH_FLOOR = 1 << 32
ACCUM_BYTES = 4  # fp32 accumulators (merge.accum_dtype)
# packed documents on a ring (``ring/documents.py``) hold their rows twice, the caller's and where they run: from the
# floor on, a group of documents at a time, in head chunks of at most this share of the call's own bytes, so that a
# packed call peaks within about 1.1x of an unpacked one (1.4x own bytes and this)
DOCUMENT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class MemoryBound:
    """The head-chunk rule's settings: ``share`` of a call's own bytes in scratch, for calls whose own bytes reach
    ``floor``; ``key`` is both, as planning's schedule keys read it. Immutable: the process-wide rule is ``BOUND``,
    which only ``set_memory_bound`` replaces (a reader holding one rule never sees it change)."""

    share: float
    floor: int
    key: tuple[float, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.share, self.floor))


BOUND = MemoryBound(DEFAULT_SCRATCH_SHARE, DEFAULT_SCRATCH_FLOOR)  # replaced only by set_memory_bound


@dataclass(frozen=True)
class HeadRange:
    """Local query heads ``[h0, h1)`` and the kv heads ``[k0, k1)`` they read."""

    h0: int
    h1: int
    k0: int
    k1: int

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The range's heads of a ``(B, N, H, ...)`` query-side tensor (q, out, lse, dout, dq): a view."""
        return x[:, :, self.h0:self.h1]

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """The range's heads of a ``(B, N, Hkv, D)`` key-side tensor (k, v, dk, dv): a view."""
        return x[:, :, self.k0:self.k1]


def scratch_bytes(routes: Routes, rows: int, heads: int, kv_heads: int, dim: int, elem: int,
                  causal: bool = False) -> int:
    """Estimated scratch of one batch row's backward (the larger pass) over ``rows`` rows, from its ``routes``.

    A pattern whose gradients are compact parts (``Route.leaves_part``) holds them in the inputs' dtype; any other
    accumulates into fp32 tensors of the full shape. A ring holds its packed K/V block and the next one, and fp32
    dK/dV scratch, outgoing and incoming. ``causal``: rings on the full rows share their cross blocks
    (``ring/cross_share.py``); the first rank of a ring of ``G`` holds ``G - 1`` later ranks' half rows (q, out,
    dout; lse and dQ in fp32) and its own K/V block packed again. Stacks add their gathered rows
    (``gathered_bytes``)."""
    per_row = (heads + 2 * kv_heads) * dim  # dq, dk, dv elements of one row
    running = ACCUM_BYTES * rows * per_row if any(not r.leaves_part for r in routes.routes) else 0
    parts = sum(elem * (rows // r.plan.dilation) * per_row for r in routes.routes if r.leaves_part)
    ring = max((2 * (rows // p.dilation) * p.packed_heads * dim * (2 * elem + 3 * ACCUM_BYTES)
                + (causal and not r.leaves_part) * (2 * (rows // p.dilation) * p.packed_heads * dim * elem
                                                    + (p.ring_size - 1) * rows // 2 * heads
                                                    * (3 * elem * dim + ACCUM_BYTES * (dim + 1)))
                for r in routes.routes for p in (r.plan,) if p.ring_size > 1), default=0)
    return running + parts + ring + gathered_bytes(routes, rows, heads, kv_heads, dim, elem)


def gathered_bytes(routes: Routes, rows: int, heads: int, kv_heads: int, dim: int, elem: int) -> int:
    """What a stacked backward over ``rows`` rows (of every batch row) holds at once besides its parts: the largest
    stack's gathered q, out, dout, k, v (the inputs' dtype, ``elem`` bytes) and lse (fp32); 0 if nothing stacks."""
    return max((sum(rows // p.dilation for p in s.plans) * ((3 * heads + 2 * kv_heads) * dim * elem + 4 * heads)
                for s in routes.stacks()), default=0)


def set_memory_bound(scratch_share: float = DEFAULT_SCRATCH_SHARE, from_bytes: int = DEFAULT_SCRATCH_FLOOR
                     ) -> tuple[float, int]:
    """Bound every later call whose own q, k, v, out, dout, dq, dk, dv reach ``from_bytes`` (this rank's, the
    whole batch) to about ``scratch_share`` of them in scratch, by running its heads in chunks; returns the previous
    ``(scratch_share, from_bytes)``. Process-wide: every rank of a job must set the same (a rank that chunks
    otherwise raises ``ValueError`` in the cross-rank check). ``from_bytes=0`` chunks every call whose estimate
    exceeds the share, at more, smaller kernel calls (2 x H100, 32768 tokens per GPU, ``(0.4, 0)``: the
    non-causal full-attention ring 4.0x -> 1.42x own for 7% more time; causal rings and LongNet pay 2.7-3.2x;
    the head strategy's swaps are chunked too, its backward swapping q, k, v, out again: docs/performance.md). The defaults restore the speed-first rule."""
    if isinstance(scratch_share, bool) or not isinstance(scratch_share, (int, float)) or not scratch_share >= 0:
        raise ValueError(f"scratch_share must be a number >= 0 (a fraction of the call's own bytes, e.g. 0.4), "
                         f"got {scratch_share!r}")
    if isinstance(from_bytes, bool) or not isinstance(from_bytes, int) or from_bytes < 0:
        raise ValueError(f"from_bytes must be an int >= 0 (0: every call), got {from_bytes!r}")
    global BOUND
    previous = BOUND.key
    BOUND = MemoryBound(float(scratch_share), from_bytes)
    return previous


def own_bytes(rows: int, heads: int, kv_heads: int, dim: int, elem: int) -> int:
    """Bytes of one batch row's q, out, dout, dq (query heads) and k, v, dk, dv (kv heads)."""
    return 4 * elem * rows * (heads + kv_heads) * dim


def head_ranges(scratch: int | Callable[[], int], own: int, heads: int, kv_heads: int, share: float | None = None
                ) -> tuple[HeadRange, ...]:
    """The head chunks of a call whose scratch and own bytes are ``scratch`` and ``own`` (the module's rule);
    ``scratch`` may be a function, asked only when ``own`` reaches the floor. ``share``: of own bytes, in place of
    ``BOUND.share``."""
    chunks = 1
    if own >= BOUND.floor:
        scratch = scratch() if callable(scratch) else scratch
        counts = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0]
        share = BOUND.share if share is None else share
        chunks = next((c for c in counts if scratch <= share * own * c), counts[-1])
    group, kv = heads // kv_heads, kv_heads // chunks
    return tuple(HeadRange(i * kv * group, (i + 1) * kv * group, i * kv, (i + 1) * kv) for i in range(chunks))
