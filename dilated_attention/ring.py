"""The ring schedule, forward and backward: the one place the ring algorithm lives.

Every pattern is either local (its segments fit a rank's sequence block) or a
ring over the ranks holding a segment's chunks (``RingLayout``: consecutive blocks,
or, in the zigzag layout, the blocks holding a segment and its mirror). On a ring
each rank packs its dilated K/V once, then ``G - 1`` steps pass the packed block to
the next rank; the receive for step ``t + 1`` is posted before step ``t`` is
computed. Each step compares query chunks with key chunks by global chunk id
(``step_calls``): one kernel call per block, or per visible pair of half blocks. Ring steps
merge into an fp32 result (``forward_pattern_into``): a compact one of the pattern's rows (below),
or the running result of the block; local patterns merge into the running result too,
or, where the kernel says so (``PatternKernel.parts``), leave compact parts in the
inputs' dtype that one pass combines at the end with the running result, if any,
straight into the output dtype (``merge.combine_results``; in the backward
``merge.sum_grads``): fewer bytes than merging each pattern into fp32 and casting. The
first pattern merged in place, if it covers every row and head
(``PatternPlan.covers_all``), writes the running result or the gradient accumulators
fresh: no fill, no read.

Backward reuses the final ``out`` and ``lse`` (exact gradients without
differentiating the merge). K/V blocks go round again, and so do fp32 dK/dV
accumulators: each step computes its block's contribution into scratch while
the accumulator for that block is still in flight, then waits, adds and sends
it on, so both exchanges overlap compute. After ``G`` hops every accumulator is
home. With no backend (single device) every pattern is local: same code.

A dilated ring pattern (unmasked, each row and head in one chunk, its packed kv heads the kv heads in
order: every LongNet pattern) runs on compact copies of its query-side rows (``dense_view``): the rows
each head reads, ``(B, L / r, H, D)``, the layout of the packed K/V blocks, so every step is dense
attention and its result, dQ and the dK/dV accumulator that comes home are compact parts like a local
pattern's. Nothing of full size in fp32: a ring pattern merged in place held fp32 results and
gradients of the whole block (3 x its q's fp32 size in the backward) and filled them with zeros.

Key masks (padding, packed documents) cover the whole sequence on every rank (a
few bytes per token, gathered once per call): a step reads the slice of the
block it holds, so masks never travel round the ring.

Beside the ring, each in a module of its own: which rank holds which chunks and which calls a step makes
(``ring_steps.py``), causal rings balanced by sharing their cross blocks (``causal_share.py``), long causal
squares split for kernels with a ``causal_block`` (``causal_split.py``), causal local patterns on side streams
(``side_streams.py``), and rings on compact rows run head-parallel instead (``ring_swaps.py``).

Every exchange carries the call's 16-byte stamp in the same batch (``comm/stamps.py``): a
rank in another call or configuration raises instead of mixing blocks; the blocks themselves
and everything computed from them are untouched.
"""

from __future__ import annotations

import torch

from .causal_share import Helper, post_guests, plan_share, return_results
from .causal_split import causal_split, route, split_backward, split_forward
from .kernels.protocol import causal_block, clear_result_
from .merge import Part, accum_dtype, add_into_, combine_results, merge_into_, sum_grads
from .patterns import PatternPlan
from .ring_steps import (RingCall, RingLayout, block_mask, call_mask, compact, dense_ring, describe,
                         half_calls, step_calls)
from .ring_swaps import Travelling, run_swap, start_swaps, swap_backward, swap_forward, swap_order
from .side_streams import SideStreams
from .stacking import plan_stacks, stack_backward, stack_forward
from .views import pack_kv, unpack_add_

__all__ = ["RingCall", "RingLayout", "leaves_part", "ring_backward", "ring_forward"]


def _ring_blocks(k, v, plan, comm, layout, call, direction):
    """Yield ``(step, packed K/V block, sequence block it came from)`` round the ring; the next block's
    exchange is in flight while the caller computes on this one."""
    members = layout.members(comm.rank, plan.ring_size, comm.world_size // layout.stride)
    size = len(members)
    pos, nxt, prv = comm.ring_peers(members)
    block, spare = pack_kv(k, v, plan), None
    stamp = comm.stamp(call, direction)
    for step in range(size):
        pending = None
        if step < size - 1:
            spare = torch.empty_like(block) if spare is None else spare
            pending = comm.send_recv(block, nxt, spare, prv, describe(call, direction, plan, step, size, "K/V block"),
                                     stamp=stamp)
        yield step, block, members[(pos - step) % size] // layout.stride
        if pending is not None:
            pending.wait()
            block, spare = spare, block


def _ring_forward(q, k, v, key_mask, plan, comm, layout, call, kernel, causal, scale, split, out, lse, view=None):
    """``split``: the causal block a causal call is split into (``causal_split``; 0: none). ``view``: the plan
    the queries are read with (``dense_view`` on compact ``q``/``out``/``lse``; default ``plan``); K/V blocks
    are packed by ``plan``."""
    own, blocks = comm.rank // layout.stride, comm.world_size // layout.stride
    members = layout.members(comm.rank, plan.ring_size, blocks)
    share = plan_share(view or plan, layout, causal, members, comm.rank, q.shape[1], view is not None)
    stamp = comm.stamp(call, "forward")
    if share is not None:
        guests, arriving = post_guests(comm, share, (q,), describe(call, "forward", plan, 0, len(members),
                                                                  "queries of shared cross blocks"), stamp)
        results = []
    for step, block, src in _ring_blocks(k, v, plan, comm, layout, call, "forward"):
        for c in step_calls(view or plan, layout, own, src, blocks, q.shape[1], causal, share is not None):
            pieces = causal_split(c.plan, split) if c.causal else ()
            if pieces:
                split_forward(kernel, pieces, q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys],
                               out[:, c.rows], lse[:, c.rows], packed=True, scale=scale, fresh=False)
                continue
            kernel.forward_pattern_into(q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys], c.plan,
                                        out[:, c.rows], lse[:, c.rows], packed=True, causal=c.causal, scale=scale,
                                        **call_mask(key_mask, c))
        if step == 0 and share is not None:  # the guests' second halves against our own K/V
            arriving.wait()
            for (gq,) in guests:
                go = torch.empty(gq.shape, dtype=out.dtype, device=out.device)
                gl = torch.empty(gq.shape[:3], dtype=lse.dtype, device=lse.device)
                clear_result_(go, gl)
                for c in half_calls(view or plan, own, q.shape[1]):
                    kernel.forward_pattern_into(gq, block[0][:, c.keys], block[1][:, c.keys], c.plan, go, gl,
                                                packed=True, causal=False, scale=scale, **call_mask(key_mask, c))
                results.append((go, gl))
    if share is not None:
        rest = (out[:, share.half:], lse[:, share.half:])
        what = describe(call, "forward", plan, 0, len(members), "results of shared cross blocks")
        for ho, hl in return_results(comm, share, results, rest, what, stamp):
            merge_into_(*rest, ho, hl)


def _ring_backward(q, k, v, key_mask, out, lse, dout, plan, comm, layout, call, kernel, causal, scale, split, dq,
                   view=None) -> torch.Tensor:
    """Adds this block's queries' dQ into ``dq``; returns the fp32 dK/dV accumulator of this rank's own packed
    block, home after the ring (``pack_kv``'s layout). ``view``: as ``_ring_forward``'s."""
    own, blocks = comm.rank // layout.stride, comm.world_size // layout.stride
    members = layout.members(comm.rank, plan.ring_size, blocks)
    size = len(members)
    _, nxt, prv = comm.ring_peers(members)
    scratch = outgoing = incoming = grads_pending = None
    stamp = comm.stamp(call, "backward")
    share = plan_share(view or plan, layout, causal, members, comm.rank, q.shape[1], view is not None)
    if share is not None:
        guests, arriving = post_guests(comm, share, (q, out, lse, dout),
                                        describe(call, "backward", plan, 0, size, "rows of shared cross blocks"), stamp)
    helper = None if share is None or not share.guests else \
        Helper(kernel, guests, arriving, k, v, plan, view or plan, own, q.shape[1], key_mask, scale)
    for step, block, src in _ring_blocks(k, v, plan, comm, layout, call, "backward"):
        calls = step_calls(view or plan, layout, own, src, blocks, q.shape[1], causal, share is not None)
        if scratch is None:
            scratch, outgoing, incoming = (torch.empty(block.shape, dtype=accum_dtype(block.dtype),
                                                       device=block.device) for _ in range(3))
        if calls:  # this block's dK/dV from our queries, while its accumulator travels
            scratch.zero_()
            for c in calls:
                pieces = causal_split(c.plan, split) if c.causal else ()
                if pieces:
                    split_backward(kernel, pieces, q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys],
                                    out[:, c.rows], lse[:, c.rows], dout[:, c.rows], dq[:, c.rows],
                                    scratch[0][:, c.keys], scratch[1][:, c.keys], packed=True, scale=scale,
                                    fresh=False)
                    continue
                kernel.backward_pattern(q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys], c.plan,
                                        out[:, c.rows], lse[:, c.rows], dout[:, c.rows], dq[:, c.rows],
                                        scratch[0][:, c.keys], scratch[1][:, c.keys], packed=True, causal=c.causal,
                                        scale=scale, **call_mask(key_mask, c))
        if not calls and helper is not None and helper.pending:
            helper.step(scratch)  # an idle step: the next guest's second half (``Helper``)
        if step == 0:  # our own block (always visible): its accumulator starts here
            scratch, outgoing = outgoing, scratch
        else:
            grads_pending.wait()
            if calls:
                incoming.add_(scratch)
            outgoing, incoming = incoming, outgoing  # the old outgoing buffer has been sent: reuse it
        if size > 1:
            grads_pending = comm.send_recv(outgoing, nxt, incoming, prv,
                                           describe(call, "backward", plan, step, size, "dK/dV accumulator"),
                                           stamp=stamp)
    if share is not None:
        if helper is None:
            arriving.wait()  # our sends
        while helper is not None and helper.pending:  # (a rank has as many idle steps as guests: none are left)
            helper.step(scratch)
        rest = dq[:, share.half:]
        for (hdq,) in return_results(comm, share, helper.results if helper is not None else [], (rest,),
                                      describe(call, "backward", plan, 0, size, "dQ of shared cross blocks"), stamp):
            add_into_(rest, hdq)
    if size == 1:  # a ring of one rank (zigzag: the middle segment held whole): nothing travelled
        return outgoing
    grads_pending.wait()  # after size hops the accumulator of our own block is home
    if helper is not None:
        add_into_(incoming, scratch)  # the guests' dK/dV of our block
    return incoming


# The backward runs rings on compact rows after this many of its other patterns (by causal flag): their blocks
# and fp32 accumulators then meet fewer local parts, the backward's peak. The parts still sum in plan order and
# patterns merged in place keep theirs, so no bit depends on it. Non-causal, first: on 2 x H100 (LongNet, 32768
# tokens per GPU, alternated runs) after the first against last measured the same time at 1.41x own instead of
# 1.69x, and on 2 x H200 (flash-attn-4) first against after the first 1.39x instead of 1.41x at 1.00-1.02x the time.
# Causal rings (those not swapped: ``ring_swaps.SwappedPattern``) stay last: 1.41x instead of 1.69x after the first
# (flash-attn-4; cuDNN 1.61x -> 1.33x) but 0.99-1.05x the time on an idle host and 1.08-1.09x on a loaded one:
# issued last, a causal ring's host work hides behind the local patterns queued on side streams.
RING_AFTER = {False: 0, True: 1 << 30}  # (a count past the others: last)

def leaves_part(kernel, causal: bool, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor,
                masked: bool) -> bool:
    """Whether ``plan`` leaves compact parts in such a call, run locally or as a ring on compact rows
    (``memory.py``'s estimate asks)."""
    return route(kernel, causal, direction, plan, q, k, masked)[2] or \
        dense_ring(plan, masked, RingLayout(), q, k) is not None


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                 ring: RingCall, into: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over this rank's block: ``(out, lse)``; spanning patterns run as rings. ``into``:
    ``(out, lse)`` views (a head range of the caller's result) to write them to.

    ``key_mask``: ``None`` or bool ``(B, blocks * L)`` over the whole sequence, ``True`` = excluded key.
    Not differentiable itself: ``ring_backward`` is its exact gradient (``execution.py`` pairs them).
    """
    comm, layout = ring.comm, ring.layout
    own = block_mask(key_mask, comm.rank // layout.stride if comm is not None else 0, q.shape[1])
    acc = accum_dtype(q.dtype)
    running, parts = None, {}
    plans = [p for p in ring.plans if p.chunks]  # (no local head may use a pattern: grouped mode, head-parallel)

    def sends(plan: PatternPlan) -> list[torch.Tensor]:
        return [compact(q, plan), *pack_kv(k, v, plan)]

    sides = SideStreams(q, ring.causal)
    swaps = start_swaps(ring, plans, q, k, key_mask is not None, "forward", sends, sides)
    stacked = plan_stacks(ring.kernel, "fwd", plans, q, k, ring.causal, key_mask is not None)
    travelling = Travelling()
    for i in swap_order(len(plans), swaps):
        plan = plans[i]
        travelling.turn(swaps.get(i))
        if i in swaps:
            run_swap(swaps[i], swap_forward, sends, sides)
            continue
        if i in stacked:
            if i not in parts:  # the stack's first member: one call for every member
                stack = stacked[i]
                res = sides.issue(stack_forward, ring.kernel, stack, q, k, v, causal=ring.causal, scale=ring.scale)
                for j, part in stack.slices(res):
                    parts[j] = Part(plans[j], *part)
            continue
        split, pieces, part = route(ring.kernel, ring.causal, "fwd", plan, q, k, key_mask is not None)
        if part:
            parts[i] = Part(plan, *sides.issue(ring.kernel.forward_pattern, q, k, v, plan, packed=False,
                                               causal=ring.causal, scale=ring.scale, **own))
            continue
        dense = dense_ring(plan, key_mask is not None, layout, q, k)
        if dense is not None:
            parts[i] = _dense_forward(q, k, v, plan, dense, ring)
            continue
        fresh = running is None and plan.covers_all(q.shape[2], k.shape[2])
        if running is None:
            running = (torch.empty(q.shape, dtype=acc, device=q.device),
                       torch.empty(q.shape[:3], dtype=acc, device=q.device))
            if not fresh:  # rows no pattern covers stay (0, -inf)
                clear_result_(*running)
        if pieces:
            split_forward(ring.kernel, pieces, q, k, v, *running, packed=False, scale=ring.scale, fresh=fresh)
        elif plan.ring_size == 1:
            ring.kernel.forward_pattern_into(q, k, v, plan, *running, packed=False, causal=ring.causal,
                                             scale=ring.scale, fresh=fresh, **own)
        else:
            _ring_forward(q, k, v, key_mask, plan, comm, layout, ring.call, ring.kernel, ring.causal, ring.scale,
                          split, *running)
    sides.join()
    for i, swap in swaps.items():
        parts[i] = Part(plans[i], *swap.home())
    return combine_results(running, [parts[i] for i in sorted(parts)], q, into, consume=True)  # in plan order


def _dense_forward(q, k, v, plan: PatternPlan, dense: PatternPlan, ring: RingCall) -> Part:
    """A ring pattern on compact rows (module doc): its result as a compact part."""
    qc = compact(q, plan)
    out = torch.empty(qc.shape, dtype=accum_dtype(q.dtype), device=q.device)
    lse = torch.empty(qc.shape[:3], dtype=out.dtype, device=q.device)
    clear_result_(out, lse)
    split = causal_block(ring.kernel, "fwd", dense, qc, k) if ring.causal else 0
    _ring_forward(qc, k, v, None, plan, ring.comm, ring.layout, ring.call, ring.kernel, ring.causal, ring.scale,
                  split, out, lse, view=dense)
    return Part(plan, out.to(q.dtype), lse)


def _dense_backward(q, k, v, out, lse, dout, plan: PatternPlan, dense: PatternPlan, ring: RingCall
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ring pattern's gradients on compact rows (module doc): dQ, dK, dV as compact parts."""
    qc, oc, lc, gc = (compact(x, plan) for x in (q, out, lse, dout))
    dq = torch.zeros(qc.shape, dtype=accum_dtype(q.dtype), device=q.device)
    split = causal_block(ring.kernel, "bwd", dense, qc, k) if ring.causal else 0
    home = _ring_backward(qc, k, v, None, oc, lc, gc, plan, ring.comm, ring.layout, ring.call, ring.kernel,
                          ring.causal, ring.scale, split, dq, view=dense)
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(k.dtype)


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, ring: RingCall,
                  into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``ring_forward``'s ``out`` for ``dout``, from its final ``out`` and ``lse``; ``into``:
    views (a head range of the caller's gradients) to write them to."""
    comm, layout = ring.comm, ring.layout
    own = block_mask(key_mask, comm.rank // layout.stride if comm is not None else 0, q.shape[1])
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # kernels read the head dim with unit stride
    acc = accum_dtype(q.dtype)
    running, held = None, {}
    sides = SideStreams(q, ring.causal)
    plans = [p for p in ring.plans if p.chunks]

    def sends(plan: PatternPlan) -> list[torch.Tensor]:
        return [compact(q, plan), *pack_kv(k, v, plan), *(compact(x, plan) for x in (out, dout, lse))]

    swaps = start_swaps(ring, plans, q, k, key_mask is not None, "backward", sends, sides)
    stacked = plan_stacks(ring.kernel, "bwd", plans, q, k, ring.causal, key_mask is not None)
    dense = [dense_ring(p, key_mask is not None, layout, q, k) for p in plans]
    order = [i for i, d in enumerate(dense) if d is None]
    at = RING_AFTER[ring.causal]
    order[at:at] = [i for i, d in enumerate(dense) if d is not None]
    travelling = Travelling()
    for i in swap_order(len(plans), swaps, order):
        plan = plans[i]
        travelling.turn(swaps.get(i))
        if i in swaps:
            run_swap(swaps[i], swap_backward, sends, sides)
            continue
        if i in stacked:
            if i not in held:  # the stack's first member: one call for every member
                stack = stacked[i]
                res = sides.issue(stack_backward, ring.kernel, stack, q, k, v, out, lse, dout, causal=ring.causal,
                                  scale=ring.scale)
                held.update(stack.slices(res))
            continue
        split, pieces, part = route(ring.kernel, ring.causal, "bwd", plan, q, k, key_mask is not None)
        if part or dense[i] is not None:
            held[i] = (sides.issue(ring.kernel.backward_pattern_parts, q, k, v, plan, out, lse, dout,
                                   causal=ring.causal, scale=ring.scale, **own) if part
                       else _dense_backward(q, k, v, out, lse, dout, plan, dense[i], ring))
            continue
        fresh = running is None and plan.covers_all(q.shape[2], k.shape[2])
        if running is None:
            new = torch.empty if fresh else torch.zeros
            running = tuple(new(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        if pieces:
            split_backward(ring.kernel, pieces, q, k, v, out, lse, dout, *running, packed=False, scale=ring.scale,
                            fresh=fresh)
        elif plan.ring_size == 1:
            ring.kernel.backward_pattern(q, k, v, plan, out, lse, dout, *running, packed=False,
                                         causal=ring.causal, scale=ring.scale, fresh=fresh, **own)
        else:
            home = _ring_backward(q, k, v, key_mask, out, lse, dout, plan, comm, layout, ring.call, ring.kernel,
                                  ring.causal, ring.scale, split, running[0])
            unpack_add_(running[1], running[2], home, plan)
    sides.join()
    for i, swap in swaps.items():
        held[i] = swap.home()
    parts = [[Part(plans[i], held[i][g], kv=g > 0) for i in sorted(held)] for g in range(3)]  # in plan order
    return tuple(sum_grads(running[g] if running is not None else None, parts[g], x,
                           None if into is None else into[g], consume=True) for g, x in enumerate((q, k, v)))