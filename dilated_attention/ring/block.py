"""A rank's block: every pattern of a call run by its route, forward and backward, and combined.

The block is the rank's rows of the sequence (after a team's head swap, ``head_parallel.py``), or a whole
sequence's batch (``batching.py``). Its ``RingPlan`` says how each pattern runs (``routes.py``): locally or as a
ring (``kv_ring.py``), merged into one fp32 running result, or as a compact part in the inputs' dtype (a local
kernel's, a stack's, a compact ring's, a swapped ring's), and in which order. One pass at the end combines the
running result, if any, with every part straight into the output dtype (``merge.combine_results``; in the backward
``merge.sum_grads``): fewer bytes than merging each pattern into fp32 and casting. The first pattern merged in
place, if it covers every row and head (``Route.fresh``), writes the running result or the gradient accumulators
fresh: no fill, no read.

Backward reuses the final ``out`` and ``lse``: every pattern's gradient is computed from them, exactly, without
differentiating the merge. Causal local patterns run on side streams (``side_streams.py``); swapped rings post
their all-to-alls beside the others (``swapped.py``). With no backend (single device) every pattern is local:
same code.
"""

from __future__ import annotations

import torch

from ..kernels.protocol import CallSpec, Saved, clear_result_
from ..merge import Part, accum_dtype, combine_results, sum_grads
from ..views import compact, pack_kv, unpack_add_
from .kv_ring import compact_backward, compact_forward, ring_backward, ring_forward
from .layout import block_mask
from .routes import RingCall, RingPlan, Route, Routes, Stack, Way
from .side_streams import SideStreams
from .square_split import split_backward, split_forward
from .stacking import stack_backward, stack_forward
from .swapped import Travelling, run_swap, start_swaps, swap_backward, swap_forward


def _checked(plan: RingPlan, key_mask: torch.Tensor | None) -> None:
    """The routes were decided for a block with (or without) a key mask: a block that differs would run a masked
    pattern on an unmasked route (stacks and compact rings ignore masks)."""
    if (key_mask is not None) != plan.masked:
        raise RuntimeError(f"a block planned {'with' if plan.masked else 'without'} a key mask ran "
                           f"{'with' if key_mask is not None else 'without'} one: plan the call again")


class _Pass:
    """One direction over a block's routes: each way's computation (``_Forward``, ``_Backward``), run in route
    order; each pattern's result kept by position (``held``), merged ones in one running fp32 result."""

    def __init__(self, ring: RingCall, routes: Routes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_mask: torch.Tensor | None, saved: Saved | tuple[()] = ()) -> None:
        plan, comm = ring.plan, ring.comm
        _checked(plan, key_mask)
        self.ring, self.routes, self.key_mask, self.saved = ring, routes, key_mask, saved
        self.q, self.k, self.v = q, k, v
        self.kernel = plan.kernel
        # every local call of the block scores alike: one spec (its block of the key mask; stacks and splits are
        # routed only where there is none)
        self.spec = CallSpec(plan.causal, plan.scale, **block_mask(
            key_mask, comm.rank // plan.layout.stride if comm is not None else 0, q.shape[1]))
        self.running, self.held = None, {}
        self.sides = SideStreams(q, plan.causal)

    def sends(self, route: Route) -> list[torch.Tensor]:
        """What a swapped pattern sends out (``swapped.py``): its compact query rows and packed K/V, and in the
        backward its compact ``out``, ``dout`` and ``lse``."""
        out = (self.saved[0], self.saved[2], self.saved[1]) if self.saved else ()
        return [compact(self.q, route.plan), *pack_kv(self.k, self.v, route.plan),
                *(compact(x, route.plan) for x in out)]

    def run(self) -> None:
        swaps = start_swaps(self.ring, self.routes, self.direction, self.sends, self.sides)
        ways = {Way.SWAPPED: lambda i, route: run_swap(swaps[i], self.swap, self.sends, self.sides),
                Way.STACKED: self.stacked, Way.PART: self.part, Way.COMPACT_RING: self.compact_ring,
                Way.MERGED: self.merged}
        travelling = Travelling()
        for i in self.routes.order:
            travelling.turn(swaps.get(i))
            route = self.routes.routes[i]
            ways[route.way](i, route)
        self.sides.join()
        for i, swap in swaps.items():
            self.held[i] = swap.home()

    def stacked(self, i: int, route: Route) -> None:
        if i not in self.held:  # the stack's first member: one call for every member
            self.held.update(route.stack.slices(self.sides.issue(self.stack_call, route.stack)))


class _Forward(_Pass):
    direction = "forward"

    def swap(self, swap) -> None:
        swap_forward(swap)

    def stack_call(self, stack: Stack) -> tuple[torch.Tensor, ...]:
        return stack_forward(self.kernel, stack, (self.q, self.k, self.v), self.spec)

    def part(self, i: int, route: Route) -> None:
        self.held[i] = self.sides.issue(self.kernel.forward_pattern, self.q, self.k, self.v, route.plan, self.spec)

    def compact_ring(self, i: int, route: Route) -> None:
        self.held[i] = compact_forward(self.q, self.k, self.v, route, self.ring)

    def merged(self, i: int, route: Route) -> None:
        q, k, v = self.q, self.k, self.v
        if self.running is None:
            self.running = (torch.empty(q.shape, dtype=accum_dtype(q.dtype), device=q.device),
                            torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device))
            if not route.fresh:  # rows no pattern covers stay (0, -inf)
                clear_result_(*self.running)
        if route.pieces:
            split_forward(self.kernel, route.pieces, (q, k, v), self.running, self.spec, fresh=route.fresh)
        elif route.plan.ring_size == 1:
            self.kernel.forward_pattern_into(q, k, v, route.plan, self.spec, self.running, fresh=route.fresh)
        else:
            ring_forward(q, k, v, self.key_mask, route, self.ring, self.running)


class _Backward(_Pass):
    direction = "backward"

    def swap(self, swap) -> None:
        swap_backward(swap)

    def stack_call(self, stack: Stack) -> tuple[torch.Tensor, ...]:
        return stack_backward(self.kernel, stack, (self.q, self.k, self.v), self.saved, self.spec)

    def part(self, i: int, route: Route) -> None:
        self.held[i] = self.sides.issue(self.kernel.backward_pattern_parts, self.q, self.k, self.v, route.plan,
                                        self.spec, self.saved)

    def compact_ring(self, i: int, route: Route) -> None:
        self.held[i] = compact_backward(self.q, self.k, self.v, self.saved, route, self.ring)

    def merged(self, i: int, route: Route) -> None:
        q, k, v = self.q, self.k, self.v
        if self.running is None:
            new = torch.empty if route.fresh else torch.zeros
            self.running = tuple(new(x.shape, dtype=accum_dtype(q.dtype), device=x.device) for x in (q, k, v))
        if route.pieces:
            split_backward(self.kernel, route.pieces, (q, k, v), self.saved, self.running, self.spec,
                           fresh=route.fresh)
        elif route.plan.ring_size == 1:
            self.kernel.backward_pattern(q, k, v, route.plan, self.spec, self.saved, self.running, fresh=route.fresh)
        else:
            home = ring_backward(q, k, v, self.key_mask, route, self.ring, self.saved, self.running[0])
            unpack_add_(self.running[1], self.running[2], home, route.plan)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, ring: RingCall,
                  into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over this rank's block: ``(out, lse)``. ``into``: ``(out, lse)`` views (a head range of the
    caller's result) to write them to.

    ``key_mask``: ``None`` or bool ``(B, blocks * L)`` over the whole sequence, ``True`` = excluded key.
    Not differentiable itself: ``block_backward`` is its exact gradient (``execution.py`` pairs them).
    """
    step = _Forward(ring, ring.plan.routes(q, k)[0], q, k, v, key_mask)
    step.run()
    parts = [Part(ring.plan.plans[i], *step.held[i]) for i in sorted(step.held)]  # in plan order
    return combine_results(step.running, parts, q, into, consume=True)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                   saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ring: RingCall,
                   into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``block_forward``'s ``out`` for ``dout``, from ``saved = (out, lse, dout)`` (the final
    ``out`` and ``lse``); ``into``: views (a head range of the caller's gradients) to write them to."""
    out, lse, dout = saved
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # kernels read the head dim with unit stride
    step = _Backward(ring, ring.plan.routes(q, k)[1], q, k, v, key_mask, (out, lse, dout))
    step.run()
    held, running = step.held, step.running
    parts = [[Part(ring.plan.plans[i], held[i][g], kv=g > 0) for i in sorted(held)] for g in range(3)]  # plan order
    return tuple(sum_grads(running[g] if running is not None else None, parts[g], x,
                           None if into is None else into[g], consume=True) for g, x in enumerate((q, k, v)))
