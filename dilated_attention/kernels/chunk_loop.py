"""``ChunkLoop``: any ``BlockKernel`` as a ``PatternKernel``, one block call per head chunk on strided views.

Its pattern methods drive the block through ``forward``/``backward`` chunk by chunk (layouts in
``protocol.py``); a local pattern's chunks each fill their own heads of a compact part, so it leaves parts
wherever the layout allows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..merge import accum_dtype, merge_pattern_
from ..patterns import HeadChunk, PatternPlan
from ..views import chunk_views, compact_view, dilated_view, new_grad_parts, packed_view
from .protocol import BlockKernel, CallSpec, Grads, PatternKernelBase, Result, Saved, clear_grads_


def _mask_view(key_mask, plan, chunk):
    if key_mask is None:
        return {}
    view = dilated_view(key_mask.unsqueeze(-1), plan.local_segment, plan.dilation, chunk.offset, 0, 1)
    return {"key_mask": view.squeeze(-1)}


def _kv_views(k, v, plan, chunk, packed):
    if packed:
        return packed_view(k, chunk), packed_view(v, chunk)
    return chunk_views(k, plan, chunk, kv=True), chunk_views(v, plan, chunk, kv=True)


class ChunkLoop(PatternKernelBase):
    """A ``PatternKernel`` made from a ``BlockKernel`` (``inner``, whose name, flags and ``supports`` it takes):
    one block call per head chunk, on strided views. Its ``causal_block`` is 0 unless set (any kernel may carry
    one); it does not stack patterns."""

    def __init__(self, inner: BlockKernel) -> None:
        self.inner = inner
        self.name = inner.name
        self.key_masks = inner.key_masks
        self.padding_masks = inner.key_masks  # a block kernel takes a padding mask as any key mask
        self.deterministic_backward = inner.deterministic_backward

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return self.inner.supports(q, k)

    def forward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                        spec: CallSpec) -> Result:
        bsz, n, heads, dim = q.shape
        rows = n // plan.dilation
        out = torch.empty((bsz, rows, heads, dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((bsz, rows, heads), dtype=accum_dtype(q.dtype), device=q.device)
        for c in plan.chunks:
            kc, vc = _kv_views(k, v, plan, c, spec.packed)
            o, s = self.inner.forward(chunk_views(q, plan, c), kc, vc, causal=spec.causal, scale=spec.scale,
                                      **_mask_view(spec.key_mask, plan, c))
            compact_view(out, plan, c.h0, c.h1).copy_(o)
            compact_view(lse, plan, c.h0, c.h1).copy_(s)
        return out, lse

    def forward_pattern_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                             spec: CallSpec, running: Result, *, fresh: bool = False) -> None:
        merge_pattern_(*running, plan, *self.forward_pattern(q, k, v, plan, spec), fresh=fresh)

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        """Yes where the layout allows: the block kernel returns each chunk's result on its own anyway."""
        return plan.leaves_parts(direction, k.shape[2])

    def backward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, saved: Saved, grads: Grads, *, fresh: bool = False) -> None:
        dq, dk, dv = grads
        if fresh:
            clear_grads_(dq, dk, dv)
        for c, (gq, gk, gv) in self._chunk_grads(q, k, v, plan, spec, saved):
            chunk_views(dq, plan, c).add_(gq)
            dkc, dvc = _kv_views(dk, dv, plan, c, spec.packed)
            dkc.add_(gk)
            dvc.add_(gv)

    def backward_pattern_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                               spec: CallSpec, saved: Saved) -> Grads:
        if spec.packed or not self.parts("bwd", plan, q, k, causal=spec.causal, masked=spec.key_mask is not None):
            raise ValueError(f"pattern {plan.index} leaves no backward parts (a ring, or a kv head read at two "
                             f"offsets): call backward_pattern")
        grads = new_grad_parts(q, k, v, plan, zeroed=True)
        for c, chunk in self._chunk_grads(q, k, v, plan, spec, saved):
            for g, grad, (a, b) in zip(grads, chunk, ((c.h0, c.h1), (c.k0, c.k1), (c.k0, c.k1))):
                compact_view(g, plan, a, b).copy_(grad)
        return grads

    def _chunk_grads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, spec: CallSpec,
                     saved: Saved) -> Iterator[tuple[HeadChunk, Grads]]:
        out, lse, dout = saved
        for c in plan.chunks:
            kc, vc = _kv_views(k, v, plan, c, spec.packed)
            yield c, self.inner.backward(
                chunk_views(q, plan, c), kc, vc, chunk_views(out, plan, c),
                dilated_view(lse, plan.local_segment, plan.dilation, c.offset, c.h0, c.h1),
                chunk_views(dout, plan, c), causal=spec.causal, scale=spec.scale,
                **_mask_view(spec.key_mask, plan, c),
            )
