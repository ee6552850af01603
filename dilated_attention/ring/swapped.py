"""Compact rings run head-parallel (``routes.Way.SWAPPED``): a whole segment on a share of the heads.

A compact ring whose ranks divide the query and kv heads runs head-parallel where ``routes.Tuning.swapped_rings``
says (causal rings): the segment's compact rows of ``1 / G`` of the heads gathered on each of its ``G`` ranks by
one all-to-all, the whole segment computed there as one local pattern (every rank the same share of a causal
segment: no cross blocks, no fp32 accumulators in flight), and the results sent home by a second all-to-all as
compact parts. The backward sends the compact q, k, v, out, dO and lse the same way (nothing is kept between the
directions) and brings dQ, dK, dV home. The swap itself is the head strategy's (``head_parallel.PackedSwap``).
The first all-to-all runs beside other patterns: posted before them all on one stream, or at its turn where side
streams run the local patterns (``run_swap``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..head_parallel import PackedSwap
from ..kernels.protocol import CallSpec
from ..merge import accum_dtype
from .routes import Route, RingCall, Routes, Way
from .side_streams import SideStreams
from .square_split import split_backward, split_forward


class SwappedPattern(PackedSwap):
    """A compact ring run head-parallel (module doc); ``ring`` and ``route`` say what it computes."""

    def __init__(self, ring: RingCall, route: Route, direction: str) -> None:
        self.ring, self.route = ring, route
        plan = route.plan
        super().__init__(ring.comm, route.members, ring.call, direction, f"call {ring.call}, {direction}, pattern "
                         f"{plan.index} (w={plan.segment}, r={plan.dilation})")


def swap_forward(swap: SwappedPattern) -> None:
    """A posted forward swap (q, k, v): computes this rank's heads and sends the results home (the rows are
    freed before the results travel)."""
    swap.send_home(_swapped_forward(swap.ring, swap.route.inner, *swap.heads()))


def _swapped_forward(ring: RingCall, inner: Route, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> list[torch.Tensor]:
    """``[out, lse]`` of a swapped pattern's rows of this rank's heads (``inner``: their local route)."""
    kernel, spec = ring.plan.kernel, CallSpec(ring.plan.causal, ring.plan.scale)
    if inner.way is Way.PART:
        out, lse = kernel.forward_pattern(q, k, v, inner.plan, spec)
    else:  # the plan covers every row and head: written fresh
        out = torch.empty(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
        lse = torch.empty(q.shape[:3], dtype=out.dtype, device=q.device)
        if inner.pieces:
            split_forward(kernel, inner.pieces, (q, k, v), (out, lse), spec, fresh=True)
        else:
            kernel.forward_pattern_into(q, k, v, inner.plan, spec, (out, lse), fresh=True)
        out = out.to(q.dtype)
    return [out, lse]


def swap_backward(swap: SwappedPattern) -> None:
    """A posted backward swap (q, k, v, out, dO, lse): this rank's heads' gradients, sent home (the rows are
    freed before the gradients travel)."""
    swap.send_home(_swapped_backward(swap.ring, swap.route.inner, *swap.heads()))


def _swapped_backward(ring: RingCall, inner: Route, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of a swapped pattern's rows of this rank's heads."""
    kernel, spec = ring.plan.kernel, CallSpec(ring.plan.causal, ring.plan.scale)
    if inner.way is Way.PART:
        grads = kernel.backward_pattern_parts(q, k, v, inner.plan, spec, (out, lse, dout))
    else:  # the plan covers every row and head: written fresh
        acc = tuple(torch.empty(x.shape, dtype=accum_dtype(x.dtype), device=x.device) for x in (q, k, v))
        if inner.pieces:
            split_backward(kernel, inner.pieces, (q, k, v), (out, lse, dout), acc, spec, fresh=True)
        else:
            kernel.backward_pattern(q, k, v, inner.plan, spec, (out, lse, dout), acc, fresh=True)
        grads = tuple(g.to(x.dtype) for g, x in zip(acc, (q, k, v)))
    return list(grads)


def start_swaps(ring: RingCall, routes: Routes, direction: str, sends: Callable[[Route], list[torch.Tensor]],
                sides: SideStreams) -> dict[int, SwappedPattern]:
    """Each swapped pattern of ``routes`` (by position), its first all-to-all (of ``sends(route)``) posted now
    unless it is posted at its turn (``at_turn``)."""
    swaps = {}
    for route in routes.routes:
        if route.way is Way.SWAPPED:
            swaps[route.position] = swap = SwappedPattern(ring, route, direction)
            if not at_turn(sides):
                swap.post(sends(route))
    return swaps


def at_turn(sides: SideStreams) -> bool:
    """Whether swaps are posted at their turn and their results awaited at once: where side streams run the local
    patterns (``run_swap``)."""
    return bool(sides.pool)


def run_swap(swap: SwappedPattern, compute: Callable[[SwappedPattern], None],
             sends: Callable[[Route], list[torch.Tensor]], sides: SideStreams) -> None:
    """``compute`` (``swap_forward`` or ``swap_backward``) of ``swap`` at its turn. Beside side streams its first
    all-to-all is posted only now (the patterns they run hide it) and its results' is awaited at once (nothing
    else runs on the caller's stream meanwhile): its buffers then meet only the parts computed before it, and no
    kernel's workspace (2 x H200, LongNet causal at 32768 tokens per GPU, flash-attn-4: peak 1.42x -> 1.39x own)."""
    now = at_turn(sides)
    if now:
        swap.post(sends(swap.route))
    compute(swap)
    if now:
        swap.land()


class Travelling:
    """Swaps whose results travel home while the call issues its next pattern: awaited once that pattern is
    issued (a stream wait after its kernels: the transfer runs beside them), so that their sent buffers go before
    the later patterns' parts and workspaces come. Beside side streams ``run_swap`` awaits them at once."""

    def __init__(self) -> None:
        self.swaps: list[SwappedPattern] = []
        self.issued = False  # a pattern was issued since the swaps

    def turn(self, swap: SwappedPattern | None) -> None:
        """At each pattern's turn: ``swap`` if the pattern is swapped, else ``None``."""
        if self.swaps and self.issued:
            for travelling in self.swaps:
                travelling.land()
            self.swaps = []
        if swap is not None:
            self.swaps.append(swap)
        self.issued = swap is None and bool(self.swaps)
