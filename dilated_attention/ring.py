"""The ring schedule and its autograd.Function: the one place the algorithm lives.

Every pattern is either local (its segments fit a rank's shard) or a ring over
``G`` consecutive ranks. On a ring each rank packs its dilated K/V once, then
``G - 1`` steps pass the packed block to the next rank; the receive for step
``t + 1`` is posted before step ``t`` is computed. Ring steps merge in the
pattern's compact layout; patterns are then combined in fp32 in two passes
(``combine_patterns``). Backward reuses the final ``out`` and
``lse`` (exact gradients without differentiating the merge) and sends fp32
dK/dV accumulators round the ring with the blocks, so they arrive back home.
With no backend (single device) every pattern is local: same code, no ring.
"""

from __future__ import annotations

import torch

from .comm.base import CommBackend
from .kernels.base import BlockKernel
from .kernels.pattern import pattern_backward, pattern_forward
from .merge import accum_dtype, merge_two, normalize_lse
from .patterns import PatternPlan
from .views import pack_kv, region_views, unpack_add_


def _visibility(causal: bool, src: int, pos: int) -> str | None:
    """How a query shard at ring position ``pos`` sees the block from ``src``."""
    if not causal or src < pos:
        return "full"
    return "causal" if src == pos else None


def combine_patterns(partials, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every pattern's keys: the total LSE first, then one weighted add per region.

    ``partials`` holds ``(plan, out, lse)`` in compact layout (``lse`` as a kernel gave it). Two passes of a few ops
    per pattern (``views.region_views``) beat merging pattern by pattern (a dozen ops
    over the whole fp32 accumulator each time). Rows no pattern covers keep
    ``lse = -inf`` and ``out = 0``.
    """
    bsz, n, heads, dim = like.shape
    acc = accum_dtype(like.dtype)
    total = torch.full((bsz, n, heads), float("-inf"), dtype=acc, device=like.device)
    partials = [(plan, out, normalize_lse(lse)) for plan, out, lse in partials]
    for plan, _, lse in partials:
        for rows, part in region_views(total, lse, plan):
            rows.copy_(torch.logaddexp(rows, part))
    safe = torch.where(torch.isfinite(total), total, torch.zeros((), dtype=acc, device=like.device))
    out = torch.zeros((bsz, n, heads, dim), dtype=acc, device=like.device)
    for plan, part_out, lse in partials:
        weights = [torch.exp(part - rows) for rows, part in region_views(safe, lse, plan)]
        for (rows, part), weight in zip(region_views(out, part_out, plan), weights):
            rows.addcmul_(part, weight.unsqueeze(-1))
    return out.to(like.dtype), total


def _ring_forward(q, k, v, plan, comm, kernel, causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    size = plan.ring_size
    pos, nxt, prv = comm.ring_peers(size)
    block, spare = pack_kv(k, v, plan), None
    merged = None  # the pattern's partial in compact layout: steps merge there in one op each
    for step in range(size):
        pending = None
        if step < size - 1:
            spare = torch.empty_like(block) if spare is None else spare
            pending = comm.send_recv(block, nxt, spare, prv)
        seen = _visibility(causal, (pos - step) % size, pos)
        if seen is not None:
            part = pattern_forward(kernel, q, block[0], block[1], plan, packed=True, causal=seen == "causal", scale=scale)
            merged = part if merged is None else merge_two(*merged, *part)
        if pending is not None:
            pending.wait()
            block, spare = spare, block
    return merged  # never None: every rank sees at least its own block


def _ring_backward(q, k, v, out, lse, dout, plan, comm, kernel, causal, scale, dq, dk, dv) -> None:
    size = plan.ring_size
    pos, nxt, prv = comm.ring_peers(size)
    block, spare = pack_kv(k, v, plan), None
    grads = torch.zeros(block.shape, dtype=accum_dtype(block.dtype), device=block.device)
    grads_spare = torch.empty_like(grads)
    grads_pending = None
    for step in range(size):
        pending = None
        if step < size - 1:
            spare = torch.empty_like(block) if spare is None else spare
            pending = comm.send_recv(block, nxt, spare, prv)
        if grads_pending is not None:  # dK/dV of this step's block, accumulated by earlier ranks
            grads_pending.wait()
            grads, grads_spare = grads_spare, grads
        seen = _visibility(causal, (pos - step) % size, pos)
        if seen is not None:
            pattern_backward(
                kernel, q, block[0], block[1], plan, out, lse, dout, dq, grads[0], grads[1],
                packed=True, causal=seen == "causal", scale=scale,
            )
        grads_pending = comm.send_recv(grads, nxt, grads_spare, prv)
        if pending is not None:
            pending.wait()
            block, spare = spare, block
    grads_pending.wait()  # after size hops the accumulator of our own block is home
    unpack_add_(dk, dv, grads_spare, plan)


class RingDilatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plans: tuple[PatternPlan, ...], comm: CommBackend | None,
                kernel: BlockKernel, causal: bool, scale: float):
        partials = []
        for plan in plans:
            if plan.ring_size == 1:
                out, lse = pattern_forward(kernel, q, k, v, plan, packed=False, causal=causal, scale=scale)
            else:
                out, lse = _ring_forward(q, k, v, plan, comm, kernel, causal, scale)
            partials.append((plan, out, lse))
        out, lse = combine_patterns(partials, q)
        del partials
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.comm, ctx.kernel, ctx.causal, ctx.scale = plans, comm, kernel, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = accum_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for plan in ctx.plans:
            if plan.ring_size == 1:
                pattern_backward(
                    ctx.kernel, q, k, v, plan, out, lse, dout, dq, dk, dv,
                    packed=False, causal=ctx.causal, scale=ctx.scale,
                )
            else:
                _ring_backward(
                    q, k, v, out, lse, dout, plan, ctx.comm, ctx.kernel, ctx.causal, ctx.scale, dq, dk, dv
                )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
