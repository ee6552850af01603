"""Ring patterns run head-parallel: a ring on compact rows swapped for a whole segment on a share of the heads.

A ring pattern on compact rows (``ring_steps.dense_ring``) whose ring's ranks divide the query and kv heads
runs head-parallel where ``SWAPPED_RINGS`` says (causal rings): the segment's compact rows of ``1 / G`` of the
heads gathered on each of its ``G`` ranks by one all-to-all, the whole segment computed there as one local
pattern (every rank the same share of a causal segment: no cross blocks, no fp32 accumulators in flight), and
the results sent home by a second all-to-all as compact parts. The backward sends the compact q, k, v, out, dO
and lse the same way (nothing is kept between the directions) and brings dQ, dK, dV home. The swap itself is the
head strategy's (``head_parallel.PackedSwap``). The first all-to-all runs beside other patterns: posted before
them all on one stream, or at its turn where side streams run the local patterns (``run_swap``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .causal_split import route, split_backward, split_forward
from .head_parallel import PackedSwap
from .merge import accum_dtype
from .patterns import PatternPlan, plan_patterns
from .ring_steps import RingCall, dense_ring
from .side_streams import SideStreams


def swaps_rings(causal: bool) -> bool:
    """Whether rings on compact rows of this causal flag run head-parallel (``SWAPPED_RINGS``)."""
    return SWAPPED_RINGS == "all" or (causal and SWAPPED_RINGS == "causal")


# Which rings on compact rows whose ranks divide the query and kv heads run head-parallel instead
# (``SwappedPattern``): "causal" (every rank then does the same share of the causal segment), "all" or "none".
# Measured on 2 x H100 (LongNet, 32768 tokens per GPU, flash-attn-4, alternated in one process), swapped / ring:
# causal 0.94-0.95x replayed in a CUDA graph (peak 1.69x -> 1.58x own), 0.98-1.10x eagerly (host-bound at this
# size: it depends on the host); non-causal rings are balanced already: 0.97-1.0x replayed, 1.02-1.10x eagerly,
# so they stay rings.
SWAPPED_RINGS = "causal"
# Where among the call's other patterns a swapped pattern is computed (its first all-to-all is posted before them
# all; only the order of launches changes, not a bit of the result): second, so that the transfers hide behind the
# pattern computed first and its buffers meet one pattern's parts, not all of them. Measured on 2 x H200 (LongNet,
# 32768 tokens per GPU, flash-attn-4, eager steps alternated in one process), second against last: the same time
# within the noise of eager steps (0.98x in one run, 1.03x in another), peak 1.50x -> 1.42x own (1.39x posted at
# its turn: ``run_swap``); replayed in a CUDA graph second was already the faster.
SWAP_AFTER = 1


def swap_members(plan: PatternPlan, masked: bool, ring: RingCall, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[int, ...] | None:
    """The group ranks of ``plan``'s ring where it runs head-parallel (``SwappedPattern``), else ``None``: a ring on
    compact rows (``dense_ring``) of contiguous blocks, read by every query head (grouped mode gives a
    pattern some heads only: a kv head's other query heads would add to its gradient), whose ranks divide
    the query and the kv heads."""
    comm, layout = ring.comm, ring.layout
    if comm is None or not swaps_rings(ring.causal) or layout.zigzag \
            or dense_ring(plan, masked, layout, q, k) is None or -1 in plan.head_offsets(q.shape[2]):
        return None
    members = layout.members(comm.rank, plan.ring_size, comm.world_size // layout.stride)
    if len(members) < 2 or q.shape[2] % len(members) or k.shape[2] % len(members):
        return None
    return members


class SwappedPattern(PackedSwap):
    """A ring pattern on compact rows run head-parallel (module doc); ``ring`` and ``plan`` say what it computes."""

    def __init__(self, ring: RingCall, plan: PatternPlan, members: tuple[int, ...], direction: str) -> None:
        self.ring, self.plan = ring, plan
        super().__init__(ring.comm, members, ring.call, direction, f"call {ring.call}, {direction}, pattern "
                         f"{plan.index} (w={plan.segment}, r={plan.dilation})")


def _whole_plan(heads: torch.Tensor, kv: torch.Tensor) -> PatternPlan:
    """One segment over all of ``heads``' rows, rate 1: a swapped pattern's computation on its head-layout rows."""
    rows = heads.shape[1]
    return plan_patterns([rows], [1], seq_len=rows, local_len=rows, num_heads=heads.shape[2],
                         num_kv_heads=kv.shape[2])[0]


def swap_forward(swap: SwappedPattern) -> None:
    """A posted forward swap (q, k, v): computes this rank's heads and sends the results home (the rows are
    freed before the results travel)."""
    swap.send_home(_swapped_forward(swap.ring, *swap.heads()))


def _swapped_forward(ring: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """``[out, lse]`` of a swapped pattern's rows of this rank's heads."""
    plan = _whole_plan(q, k)
    _, pieces, part = route(ring.kernel, ring.causal, "fwd", plan, q, k, False)
    if part:
        out, lse = ring.kernel.forward_pattern(q, k, v, plan, packed=False, causal=ring.causal, scale=ring.scale)
    else:  # the plan covers every row and head: written fresh
        out = torch.empty(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
        lse = torch.empty(q.shape[:3], dtype=out.dtype, device=q.device)
        if pieces:
            split_forward(ring.kernel, pieces, q, k, v, out, lse, packed=False, scale=ring.scale, fresh=True)
        else:
            ring.kernel.forward_pattern_into(q, k, v, plan, out, lse, packed=False, causal=ring.causal,
                                             scale=ring.scale, fresh=True)
        out = out.to(q.dtype)
    return [out, lse]


def swap_backward(swap: SwappedPattern) -> None:
    """A posted backward swap (q, k, v, out, dO, lse): this rank's heads' gradients, sent home (the rows are
    freed before the gradients travel)."""
    swap.send_home(_swapped_backward(swap.ring, *swap.heads()))


def _swapped_backward(ring: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      dout: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of a swapped pattern's rows of this rank's heads."""
    plan = _whole_plan(q, k)
    _, pieces, part = route(ring.kernel, ring.causal, "bwd", plan, q, k, False)
    if part:
        grads = ring.kernel.backward_pattern_parts(q, k, v, plan, out, lse, dout, causal=ring.causal,
                                                   scale=ring.scale)
    else:  # the plan covers every row and head: written fresh
        acc = tuple(torch.empty(x.shape, dtype=accum_dtype(x.dtype), device=x.device) for x in (q, k, v))
        if pieces:
            split_backward(ring.kernel, pieces, q, k, v, out, lse, dout, *acc, packed=False, scale=ring.scale,
                            fresh=True)
        else:
            ring.kernel.backward_pattern(q, k, v, plan, out, lse, dout, *acc, packed=False, causal=ring.causal,
                                         scale=ring.scale, fresh=True)
        grads = tuple(g.to(x.dtype) for g, x in zip(acc, (q, k, v)))
    return list(grads)


def start_swaps(ring: RingCall, plans: list[PatternPlan], q: torch.Tensor, k: torch.Tensor, masked: bool,
                direction: str, sends: Callable[[PatternPlan], list[torch.Tensor]], sides: SideStreams
           ) -> dict[int, SwappedPattern]:
    """Each swapped pattern of ``plans`` (by position), its first all-to-all (of ``sends(plan)``) posted now
    unless it is posted at its turn (``at_turn``)."""
    swaps = {}
    for i, plan in enumerate(plans):
        members = swap_members(plan, masked, ring, q, k)
        if members is not None:
            swaps[i] = SwappedPattern(ring, plan, members, direction)
            if not at_turn(sides):
                swaps[i].post(sends(plan))
    return swaps


def at_turn(sides: SideStreams) -> bool:
    """Whether swaps are posted at their turn and their results awaited at once: where side streams run the local
    patterns (``run_swap``)."""
    return bool(sides.pool)


def run_swap(swap: SwappedPattern, compute: Callable[[SwappedPattern], None],
             sends: Callable[[PatternPlan], list[torch.Tensor]], sides: SideStreams) -> None:
    """``compute`` (``swap_forward`` or ``swap_backward``) of ``swap`` at its turn. Beside side streams its first
    all-to-all is posted only now (the patterns they run hide it) and its results' is awaited at once (nothing
    else runs on the caller's stream meanwhile): its buffers then meet only the parts computed before it, and no
    kernel's workspace (2 x H200, LongNet causal at 32768 tokens per GPU, flash-attn-4: peak 1.42x -> 1.39x own)."""
    now = at_turn(sides)
    if now:
        swap.post(sends(swap.plan))
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


def swap_order(count: int, swaps: dict[int, SwappedPattern], rest: list[int] | None = None) -> list[int]:
    """The positions of ``count`` patterns in the order they are computed: ``rest`` (default: plan order) with the
    swapped ones after ``SWAP_AFTER`` of the others."""
    order = [i for i in (range(count) if rest is None else rest) if i not in swaps]
    order[SWAP_AFTER:SWAP_AFTER] = sorted(swaps)
    return order
