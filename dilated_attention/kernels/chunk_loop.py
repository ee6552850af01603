"""All heads of one pattern on one (local or ring) block, on top of the block seam.

``PatternKernel.forward_pattern``/``backward_pattern`` (``base.py``) are what the
strategies call. The fused Triton kernel implements them in one launch; any
``BlockKernel`` becomes one through ``ChunkLoop``, which drives it chunk by
chunk through ``forward``/``backward`` on strided views.

Layouts (``L`` local rows, ``r`` dilation, ``w`` = ``plan.local_segment``,
``M = w // r``, head ``h`` of chunk ``c`` uses offset ``c.offset``):

* ``q``: ``(B, L, H, D)`` local queries.
* ``k``, ``v``: ``packed=False``: local ``(B, L, Hk, D)``, dilated on the fly;
  ``packed=True``: a ring buffer half ``(B, L // r, Hp, D)`` from ``views.pack_kv``.
* ``forward_pattern_into`` merges the pattern into the running fp32 ``out``/``lse`` in full
  layout (ring steps); ``forward_pattern`` returns it alone in *compact* layout (local patterns' parts): ``out``
  ``(B, L // r, H, D)`` and ``lse`` ``(B, L // r, H)`` fp32 where row
  ``s * M + j`` of head ``h`` is local position ``s * w + offset(h) + r * j``.
  Heads outside the plan's chunks are left unspecified.
* ``key_mask`` (kernels with ``key_masks = True``): ``None`` or a bool ``(B, Lk)`` in the
  *full* layout of the key block, ``True`` = excluded: the local length for ``packed=False``,
  ``L`` (the sender's rows) for ``packed=True``; key row ``j`` of segment ``s`` read with
  offset ``o`` is position ``s * w + o + r * j`` either way.
* backward takes the final merged ``out``/``lse``/``dout`` in full layout
  (``(B, L, H, D)``, ``(B, L, H)``) and *adds* into fp32 accumulators ``dq``
  (full layout) and ``dk``/``dv`` (same layout as ``k``/``v``), or (``backward_pattern_parts``,
  local patterns) returns them in compact layout in the inputs' dtype, ``dk``/``dv`` ``(B, L // r, Hk, D)``.
* ``parts`` says, per local pattern and direction, which of the two a strategy calls: compact parts
  are combined in one pass at the end (``merge.combine_results``/``sum_grads``).
"""

from __future__ import annotations

import torch

from ..merge import accum_dtype, merge_pattern_
from ..patterns import PatternPlan
from ..views import chunk_views, compact_view, dilated_view, new_grad_parts, packed_view
from .base import BlockKernel


def clear_result_(out: torch.Tensor, lse: torch.Tensor) -> None:
    """The empty running result (0, ``-inf``): what rows no pattern covers hold (``ring.py``)."""
    out.zero_()
    lse.fill_(float("-inf"))


def clear_grads_(*grads: torch.Tensor) -> None:
    """Zeroed accumulators: how a kernel without a write-once path honours ``fresh`` in the backward."""
    for g in grads:
        g.zero_()


def _mask_view(key_mask, plan, chunk):
    if key_mask is None:
        return {}
    view = dilated_view(key_mask.unsqueeze(-1), plan.local_segment, plan.dilation, chunk.offset, 0, 1)
    return {"key_mask": view.squeeze(-1)}


def _kv_views(k, v, plan, chunk, packed):
    if packed:
        return packed_view(k, chunk), packed_view(v, chunk)
    return chunk_views(k, plan, chunk, kv=True), chunk_views(v, plan, chunk, kv=True)


class ChunkLoop:
    """A ``PatternKernel`` made from a ``BlockKernel``: one block call per head chunk, on strided views."""

    def __init__(self, block: BlockKernel) -> None:
        self.block = block
        self.name = block.name
        self.key_masks = block.key_masks
        self.deterministic_backward = block.deterministic_backward

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return self.block.supports(q, k)

    def forward_pattern(self, q, k, v, plan: PatternPlan, *, packed: bool, causal: bool, scale: float,
                        key_mask: torch.Tensor | None = None):
        bsz, n, heads, dim = q.shape
        rows = n // plan.dilation
        out = torch.empty((bsz, rows, heads, dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((bsz, rows, heads), dtype=accum_dtype(q.dtype), device=q.device)
        for c in plan.chunks:
            kc, vc = _kv_views(k, v, plan, c, packed)
            o, s = self.block.forward(chunk_views(q, plan, c), kc, vc, causal=causal, scale=scale,
                                      **_mask_view(key_mask, plan, c))
            compact_view(out, plan, c.h0, c.h1).copy_(o)
            compact_view(lse, plan, c.h0, c.h1).copy_(s)
        return out, lse

    def forward_pattern_into(self, q, k, v, plan: PatternPlan, out, lse, *, packed: bool, causal: bool,
                             scale: float, key_mask: torch.Tensor | None = None, fresh: bool = False) -> None:
        part = self.forward_pattern(q, k, v, plan, packed=packed, causal=causal, scale=scale, key_mask=key_mask)
        merge_pattern_(out, lse, plan, *part, fresh=fresh)

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        """Yes where the layout allows: the block kernel returns each chunk's result on its own anyway."""
        return plan.leaves_parts(direction, k.shape[2])

    def backward_pattern(self, q, k, v, plan: PatternPlan, out, lse, dout, dq, dk, dv, *,
                         packed: bool, causal: bool, scale: float, key_mask: torch.Tensor | None = None,
                         fresh: bool = False) -> None:
        if fresh:
            clear_grads_(dq, dk, dv)
        for c, (gq, gk, gv) in self._chunk_grads(q, k, v, plan, out, lse, dout, packed, causal, scale, key_mask):
            chunk_views(dq, plan, c).add_(gq)
            dkc, dvc = _kv_views(dk, dv, plan, c, packed)
            dkc.add_(gk)
            dvc.add_(gv)

    def backward_pattern_parts(self, q, k, v, plan: PatternPlan, out, lse, dout, *, causal: bool, scale: float,
                               key_mask: torch.Tensor | None = None):
        if not self.parts("bwd", plan, q, k, causal=causal, masked=key_mask is not None):
            raise ValueError(f"pattern {plan.index} leaves no backward parts (a ring, or a kv head read at two "
                             f"offsets): call backward_pattern")
        grads = new_grad_parts(q, k, v, plan, zeroed=True)
        for c, chunk in self._chunk_grads(q, k, v, plan, out, lse, dout, False, causal, scale, key_mask):
            for g, grad, (a, b) in zip(grads, chunk, ((c.h0, c.h1), (c.k0, c.k1), (c.k0, c.k1))):
                compact_view(g, plan, a, b).copy_(grad)
        return grads

    def _chunk_grads(self, q, k, v, plan, out, lse, dout, packed, causal, scale, key_mask):
        for c in plan.chunks:
            kc, vc = _kv_views(k, v, plan, c, packed)
            yield c, self.block.backward(
                chunk_views(q, plan, c), kc, vc, chunk_views(out, plan, c),
                dilated_view(lse, plan.local_segment, plan.dilation, c.offset, c.h0, c.h1),
                chunk_views(dout, plan, c), causal=causal, scale=scale, **_mask_view(key_mask, plan, c),
            )
