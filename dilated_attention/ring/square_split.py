"""Long causal squares split into pieces (``routes.split_pieces``), run on zero-copy views.

A kernel with a ``causal_block`` (``kernels/protocol.py``; flash-attn-4, cudnn-det: their causal backwards are
slow on long squares, their non-causal ones are not) gets a long causal square, local or a ring's own block, run as
one causal call of all diagonal blocks folded into the batch dimension, then one non-causal call per halving level
of each span's second half against its first, all merged into the running result (no compact parts).
"""

from __future__ import annotations

import torch

from ..kernels.protocol import CallSpec, Grads, PatternKernel, Result, Saved
from .routes import Piece

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ``(q, k, v)``


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


def _specs(spec: CallSpec) -> tuple[CallSpec, CallSpec]:
    """The calls of a causal square's pieces, ``[rectangle, diagonal]``: non-causal, and the square's own."""
    return CallSpec(False, spec.scale, spec.packed, spec.key_mask), spec


def split_forward(kernel: PatternKernel, pieces: tuple[Piece, ...], inputs: Inputs, running: Result,
                  spec: CallSpec, *, fresh: bool) -> None:
    """A causal square's pieces merged into the running ``(out, lse)``: ``inputs`` ``(q, k, v)``, ``spec`` the
    square's (causal) call; ``fresh``: the diagonal (every row) writes them."""
    (q, k, v), (out, lse), specs = inputs, running, _specs(spec)
    for piece in pieces:
        for qq, oo, ll, kk, vv in _piece_views(piece, spec.packed, (q, out, lse), (k, v)):
            kernel.forward_pattern_into(qq, kk, vv, piece.plan, specs[not piece.rectangle], (oo, ll),
                                        fresh=fresh and not piece.rectangle)


def split_backward(kernel: PatternKernel, pieces: tuple[Piece, ...], inputs: Inputs, saved: Saved, grads: Grads,
                   spec: CallSpec, *, fresh: bool) -> None:
    """A causal square's pieces' gradients added into ``grads`` ``(dq, dk, dv)``, from the final ``saved``
    ``(out, lse, dout)``; ``fresh``: the diagonal (every query and key row) writes them."""
    (q, k, v), (out, lse, dout), (dq, dk, dv), specs = inputs, saved, grads, _specs(spec)
    for piece in pieces:
        for qq, oo, ll, gg, dqq, kk, vv, dkk, dvv in _piece_views(piece, spec.packed, (q, out, lse, dout, dq),
                                                                  (k, v, dk, dv)):
            kernel.backward_pattern(qq, kk, vv, piece.plan, specs[not piece.rectangle], (oo, ll, gg), (dqq, dkk, dvv),
                                    fresh=fresh and not piece.rectangle)
