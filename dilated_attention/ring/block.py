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

from ..kernels.protocol import clear_result_
from ..merge import Part, accum_dtype, combine_results, sum_grads
from ..views import compact, pack_kv, unpack_add_
from .kv_ring import compact_backward, compact_forward, ring_backward, ring_forward
from .layout import block_mask
from .routes import Route, RingCall, RingPlan, Way
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


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, ring: RingCall,
                  into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over this rank's block: ``(out, lse)``. ``into``: ``(out, lse)`` views (a head range of the
    caller's result) to write them to.

    ``key_mask``: ``None`` or bool ``(B, blocks * L)`` over the whole sequence, ``True`` = excluded key.
    Not differentiable itself: ``block_backward`` is its exact gradient (``execution.py`` pairs them).
    """
    plan, comm = ring.plan, ring.comm
    _checked(plan, key_mask)
    own = block_mask(key_mask, comm.rank // plan.layout.stride if comm is not None else 0, q.shape[1])
    kernel, causal, scale = plan.kernel, plan.causal, plan.scale
    running, parts = None, {}

    def sends(route: Route) -> list[torch.Tensor]:
        return [compact(q, route.plan), *pack_kv(k, v, route.plan)]

    sides = SideStreams(q, causal)
    swaps = start_swaps(ring, plan.forward, "forward", sends, sides)
    travelling = Travelling()
    for i in plan.forward.order:
        route = plan.forward.routes[i]
        travelling.turn(swaps.get(i))
        way = route.way
        if way is Way.SWAPPED:
            run_swap(swaps[i], swap_forward, sends, sides)
        elif way is Way.STACKED:
            if i not in parts:  # the stack's first member: one call for every member
                res = sides.issue(stack_forward, kernel, route.stack, q, k, v, causal=causal, scale=scale)
                for j, part in route.stack.slices(res):
                    parts[j] = Part(plan.plans[j], *part)
        elif way is Way.PART:
            parts[i] = Part(route.plan, *sides.issue(kernel.forward_pattern, q, k, v, route.plan, packed=False,
                                                     causal=causal, scale=scale, **own))
        elif way is Way.COMPACT_RING:
            parts[i] = compact_forward(q, k, v, route, ring)
        else:
            if running is None:
                running = (torch.empty(q.shape, dtype=accum_dtype(q.dtype), device=q.device),
                           torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device))
                if not route.fresh:  # rows no pattern covers stay (0, -inf)
                    clear_result_(*running)
            if route.pieces:
                split_forward(kernel, route.pieces, q, k, v, *running, packed=False, scale=scale, fresh=route.fresh)
            elif route.plan.ring_size == 1:
                kernel.forward_pattern_into(q, k, v, route.plan, *running, packed=False, causal=causal, scale=scale,
                                            fresh=route.fresh, **own)
            else:
                ring_forward(q, k, v, key_mask, route, ring, running)
    sides.join()
    for i, swap in swaps.items():
        parts[i] = Part(plan.plans[i], *swap.home())
    return combine_results(running, [parts[i] for i in sorted(parts)], q, into, consume=True)  # in plan order


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                   saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ring: RingCall,
                   into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``block_forward``'s ``out`` for ``dout``, from ``saved = (out, lse, dout)`` (the final
    ``out`` and ``lse``); ``into``: views (a head range of the caller's gradients) to write them to."""
    plan, comm = ring.plan, ring.comm
    _checked(plan, key_mask)
    out, lse, dout = saved
    own = block_mask(key_mask, comm.rank // plan.layout.stride if comm is not None else 0, q.shape[1])
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # kernels read the head dim with unit stride
    kernel, causal, scale = plan.kernel, plan.causal, plan.scale
    running, held = None, {}
    sides = SideStreams(q, causal)

    def sends(route: Route) -> list[torch.Tensor]:
        return [compact(q, route.plan), *pack_kv(k, v, route.plan), *(compact(x, route.plan) for x in (out, dout, lse))]

    swaps = start_swaps(ring, plan.backward, "backward", sends, sides)
    travelling = Travelling()
    for i in plan.backward.order:
        route = plan.backward.routes[i]
        travelling.turn(swaps.get(i))
        way = route.way
        if way is Way.SWAPPED:
            run_swap(swaps[i], swap_backward, sends, sides)
        elif way is Way.STACKED:
            if i not in held:  # the stack's first member: one call for every member
                res = sides.issue(stack_backward, kernel, route.stack, q, k, v, out, lse, dout, causal=causal,
                                  scale=scale)
                held.update(route.stack.slices(res))
        elif way is Way.PART:
            held[i] = sides.issue(kernel.backward_pattern_parts, q, k, v, route.plan, out, lse, dout, causal=causal,
                                  scale=scale, **own)
        elif way is Way.COMPACT_RING:
            held[i] = compact_backward(q, k, v, (out, lse, dout), route, ring)
        else:
            if running is None:
                new = torch.empty if route.fresh else torch.zeros
                running = tuple(new(x.shape, dtype=accum_dtype(q.dtype), device=x.device) for x in (q, k, v))
            if route.pieces:
                split_backward(kernel, route.pieces, q, k, v, out, lse, dout, *running, packed=False, scale=scale,
                               fresh=route.fresh)
            elif route.plan.ring_size == 1:
                kernel.backward_pattern(q, k, v, route.plan, out, lse, dout, *running, packed=False, causal=causal,
                                        scale=scale, fresh=route.fresh, **own)
            else:
                home = ring_backward(q, k, v, key_mask, route, ring, (out, lse, dout), running[0])
                unpack_add_(running[1], running[2], home, route.plan)
    sides.join()
    for i, swap in swaps.items():
        held[i] = swap.home()
    parts = [[Part(plan.plans[i], held[i][g], kv=g > 0) for i in sorted(held)] for g in range(3)]  # in plan order
    return tuple(sum_grads(running[g] if running is not None else None, parts[g], x,
                           None if into is None else into[g], consume=True) for g, x in enumerate((q, k, v)))
