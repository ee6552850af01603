"""Long causal squares split for kernels whose causal calls are slow on them.

A kernel with a ``causal_block`` (``kernels/protocol.py``; flash-attn-4, cudnn-det: their causal backwards are
slow on long squares, their non-causal ones are not) gets a long causal square (more than ``WHOLE_BLOCKS``
blocks), local or a ring's own block, split (``causal_split``): one causal call of all diagonal blocks folded
into the batch dimension, then one non-causal call per halving level of each span's second half against its
first, all merged into the running result (no compact parts). ``route`` says how a pattern runs: split or
whole, as a compact part or merged in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import caches
from .kernels.protocol import causal_block
from .patterns import PatternPlan


@dataclass(frozen=True)
class Piece:
    """One kernel call of a split causal square (``causal_split``): ``plan`` on views that cut the rows in
    spans of ``span`` dilated rows, each span one batch row of the call. ``rectangle``: the queries of each
    span's second half against the keys of its first half, non-causal; else the spans themselves, causal."""

    span: int
    rectangle: bool
    plan: PatternPlan


# A causal square of at most this many blocks runs as one call: split, it costs more (more, smaller calls, and
# fp32 merges in place of compact parts) than the slow long causal kernel it avoids. Measured on an H100, dense
# causal forward+backward, split / whole: cudnn-det in blocks of 4096 rows 1.00x at 16384 rows, 0.96x at 32768,
# 0.86x at 65536; flash4 in blocks of 8192 1.13x at 16384, 1.06x at 32768, 0.78x at 65536. LongNet's squares
# (at most 8192 rows in its usual patterns) ran 1.3-1.7x slower split in blocks of 2048.
WHOLE_BLOCKS = 4


@caches.memoize("causal_split.pieces", 1024)  # asked per causal pattern and call; a model has few configurations
def causal_split(plan: PatternPlan, block: int) -> tuple[Piece, ...]:
    """A causal square of ``M = plan.local_segment / r`` rows (every segment of the plan) as kernel calls
    whose causal squares have at most ``block`` rows; ``()`` where it stays one call.

    Why: flash-attn-4's and cuDNN's deterministic causal backwards are slow on long causal squares (full causal
    attention over 65536 rows: FA4 0.77-0.87x of cuDNN's atomic one), while their non-causal backwards and small
    causal blocks are fast; split, FA4 measured 0.91-1.05x. Only squares of more than ``WHOLE_BLOCKS`` blocks are
    split (why: there). Blocks have ``b = M / 2^j`` rows, the least ``j >= 1`` with ``b <= block`` (``()`` if
    ``M <= WHOLE_BLOCKS * block``, ``block <= 0`` or ``2^j`` does not divide ``M``). Calls, all zero-copy views:

    * the diagonal: every block of ``b`` rows, causal, in one call (blocks folded into the batch dimension;
      ``plan`` read on segments of ``b * r`` rows);
    * per span ``t = M, M / 2, ..., 2b`` (``j`` calls): every span's second half of queries against its first
      half of keys, non-causal, in one call (``plan`` on segments of ``t / 2 * r`` rows).

    A (query, key) pair below the diagonal blocks lies in exactly one rectangle: that of the smallest span
    holding both. Every dilated row stays whole (spans are multiples of ``r`` rows): each view is the kernel's
    usual dilated view of a block, so what it reads in place it still reads in place.
    """
    m = plan.local_segment // plan.dilation
    if block <= 0 or m <= WHOLE_BLOCKS * block:
        return ()
    levels = 1
    while m >> levels > block:
        levels += 1
    if m % (1 << levels):
        return ()
    b, r = m >> levels, plan.dilation
    diagonal = Piece(b, False, plan.with_local_segment(b * r))
    return (diagonal, *(Piece(m >> j, True, plan.with_local_segment((m >> j) // 2 * r)) for j in range(levels)))


def _cut(x: torch.Tensor, rows: int, half: int | None) -> torch.Tensor:
    """``x`` ``(B, N, ...)`` cut into spans of ``rows`` rows, ``(B, N / rows, rows, ...)``, or (``half`` 0 or 1) one
    half of every span, ``(B, N / rows, rows / 2, ...)``: a view."""
    spans = x.unflatten(1, (x.shape[1] // rows, rows))
    return spans if half is None else spans.unflatten(2, (2, rows // 2)).select(2, half)


def _batched(views: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """``(B, S, rows, ...)`` views as one call's operands, ``(B * S, rows, ...)``, where every one folds its batch
    and span dims into one stride (views); else one call per batch row, ``(S, rows, ...)`` each."""
    if all(v.shape[0] == 1 or v.shape[1] == 1 or v.stride(0) == v.shape[1] * v.stride(1) for v in views):
        return [tuple(v.view(-1, *v.shape[2:]) for v in views)]
    return [tuple(v[i] for v in views) for i in range(views[0].shape[0])]


def _piece_views(piece: Piece, packed: bool, queries, keys) -> list[tuple[torch.Tensor, ...]]:
    """Each call's ``(*queries, *keys)`` views of one piece: query-row tensors (full layout) and key-row tensors
    (full layout, or a packed block's dilated rows)."""
    rows = piece.span * piece.plan.dilation
    qh, kh = (1, 0) if piece.rectangle else (None, None)
    return _batched([_cut(x, rows, qh) for x in queries] + [_cut(x, piece.span if packed else rows, kh) for x in keys])


def split_forward(kernel, pieces, q, k, v, out, lse, *, packed: bool, scale: float, fresh: bool) -> None:
    """A causal square's pieces merged into the running ``out``/``lse``; ``fresh``: the diagonal (every row)
    writes them."""
    for piece in pieces:
        for qq, oo, ll, kk, vv in _piece_views(piece, packed, (q, out, lse), (k, v)):
            kernel.forward_pattern_into(qq, kk, vv, piece.plan, oo, ll, packed=packed, causal=not piece.rectangle,
                                        scale=scale, fresh=fresh and not piece.rectangle)


def split_backward(kernel, pieces, q, k, v, out, lse, dout, dq, dk, dv, *, packed: bool, scale: float,
                    fresh: bool) -> None:
    """A causal square's pieces' gradients added into ``dq``/``dk``/``dv``; ``fresh``: the diagonal (every query
    and key row) writes them."""
    for piece in pieces:
        for qq, oo, ll, gg, dqq, kk, vv, dkk, dvv in _piece_views(piece, packed, (q, out, lse, dout, dq),
                                                                  (k, v, dk, dv)):
            kernel.backward_pattern(qq, kk, vv, piece.plan, oo, ll, gg, dqq, dkk, dvv, packed=packed,
                                    causal=not piece.rectangle, scale=scale, fresh=fresh and not piece.rectangle)


def route(kernel, causal: bool, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor,
           masked: bool) -> tuple[int, tuple[Piece, ...], bool]:
    """How ``plan`` runs in ``direction``: the causal block its causal calls split into (``causal_split``; 0 for
    none: unmasked causal calls only, a key mask's slices stay whole), a local pattern's split pieces, and
    whether it leaves a compact part (``PatternKernel.parts``; a split one never does)."""
    split = causal_block(kernel, direction, plan, q, k) if causal and not masked else 0
    pieces = causal_split(plan, split) if plan.ring_size == 1 else ()
    part = plan.ring_size == 1 and not pieces and kernel.parts(direction, plan, q, k, causal=causal, masked=masked)
    return split, pieces, part

