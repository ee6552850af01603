"""The ring proper: a spanning pattern's packed K/V blocks passed round the ranks holding its segment.

Each rank packs its dilated K/V for the pattern once (``views.pack_kv``); ``G - 1`` steps pass the packed block to
the next rank of the ring (``RingLayout.members``), the receive for step ``t + 1`` posted before step ``t`` is
computed. Each step compares query chunks with key chunks by global chunk id (``layout.step_calls``): one kernel
call per block, or per visible pair of half blocks, merged into an fp32 result. Causal rings on contiguous blocks
may share their cross blocks (``cross_share.py``, ``Route.share``).

The backward reuses the final ``out`` and ``lse`` (exact gradients without differentiating the merge). K/V blocks
go round again, and so do fp32 dK/dV accumulators: each step computes its block's contribution into scratch while
the accumulator for that block is still in flight, then waits, adds and sends it on, so both exchanges overlap
compute. After ``G`` hops every accumulator is home.

A compact ring (``routes.Way.COMPACT_RING``) runs the same ring on compact copies of its query rows
(``views.compact``), read with the route's dense view: every step is dense attention, and its result, dQ and the
dK/dV accumulator that comes home are compact parts. Key masks cover the whole sequence on every rank: a step
reads the slice of the block it holds, so masks never travel. Every exchange carries the call's 16-byte stamp in
the same batch (``comm/stamps.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..kernels.protocol import CallSpec, clear_result_
from ..merge import accum_dtype, add_into_, merge_into_
from ..views import compact, pack_kv
from .cross_share import Helper, post_guests, return_results
from .layout import StepCall, call_mask, describe, half_calls, step_calls
from .routes import Piece, RingCall, Route, split_pieces
from .square_split import split_backward, split_forward


def _pieces(route: Route, call: StepCall) -> tuple[Piece, ...]:
    """A ring step's causal call split into pieces where the route splits causal calls (``Route.split``)."""
    return split_pieces(call.plan, route.split) if call.causal and route.split else ()


def _ring_blocks(k: torch.Tensor, v: torch.Tensor, route: Route, ring: RingCall, direction: str
                 ) -> Iterator[tuple[int, torch.Tensor, int]]:
    """Yield ``(step, packed K/V block, sequence block it came from)`` round the ring; the next block's
    exchange is in flight while the caller computes on this one."""
    comm, layout, plan, members = ring.comm, ring.plan.layout, route.plan, route.members
    size = len(members)
    pos, nxt, prv = comm.ring_peers(members)
    block, spare = pack_kv(k, v, plan), None
    stamp = comm.stamp(ring.call, direction)
    for step in range(size):
        pending = None
        if step < size - 1:
            spare = torch.empty_like(block) if spare is None else spare
            pending = comm.send_recv(block, nxt, spare, prv,
                                     describe(ring.call, direction, plan, step, size, "K/V block"), stamp=stamp)
        yield step, block, members[(pos - step) % size] // layout.stride
        if pending is not None:
            pending.wait()
            block, spare = spare, block


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, route: Route,
                 ring: RingCall, into: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Merges the ring's result for the block's queries ``q`` into ``into`` (fp32 ``(out, lse)``). ``q`` and ``into``
    are compact rows where the route reads them with a dense view (``Route.dense``); K/V blocks are packed by the
    route's plan."""
    comm, layout, plan = ring.comm, ring.plan.layout, route.plan
    reads, kernel, causal, scale = route.dense or plan, ring.plan.kernel, ring.plan.causal, ring.plan.scale
    out, lse = into
    own, blocks = comm.rank // layout.stride, comm.world_size // layout.stride
    size = len(route.members)
    share = route.share
    stamp = comm.stamp(ring.call, "forward")
    if share is not None:
        guests, arriving = post_guests(comm, share, (q,), describe(ring.call, "forward", plan, 0, size,
                                                                  "queries of shared cross blocks"), stamp)
        results = []
    for step, block, src in _ring_blocks(k, v, route, ring, "forward"):
        for c in step_calls(reads, layout, own, src, blocks, q.shape[1], causal, share is not None):
            pieces, spec = _pieces(route, c), CallSpec(c.causal, scale, packed=True, **call_mask(key_mask, c))
            qkv, running = (q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys]), (out[:, c.rows], lse[:, c.rows])
            if pieces:
                split_forward(kernel, pieces, qkv, running, spec, fresh=False)
            else:
                kernel.forward_pattern_into(*qkv, c.plan, spec, running)
        if step == 0 and share is not None:  # the guests' second halves against our own K/V
            arriving.wait()
            for (gq,) in guests:
                go = torch.empty(gq.shape, dtype=out.dtype, device=out.device)
                gl = torch.empty(gq.shape[:3], dtype=lse.dtype, device=lse.device)
                clear_result_(go, gl)
                for c in half_calls(reads, own, q.shape[1]):
                    kernel.forward_pattern_into(gq, block[0][:, c.keys], block[1][:, c.keys], c.plan,
                                                CallSpec(False, scale, packed=True, **call_mask(key_mask, c)), (go, gl))
                results.append((go, gl))
    if share is not None:
        rest = (out[:, share.half:], lse[:, share.half:])
        what = describe(ring.call, "forward", plan, 0, size, "results of shared cross blocks")
        for ho, hl in return_results(comm, share, results, rest, what, stamp):
            merge_into_(*rest, ho, hl)


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, route: Route,
                  ring: RingCall, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dq: torch.Tensor
                  ) -> torch.Tensor:
    """Adds this block's queries' dQ into ``dq`` (``saved``: the final ``out``, ``lse`` and ``dout`` of its rows);
    returns the fp32 dK/dV accumulator of this rank's own packed block, home after the ring (``pack_kv``'s layout).
    Compact rows as ``ring_forward``'s."""
    comm, layout, plan = ring.comm, ring.plan.layout, route.plan
    reads, kernel, causal, scale = route.dense or plan, ring.plan.kernel, ring.plan.causal, ring.plan.scale
    out, lse, dout = saved
    own, blocks = comm.rank // layout.stride, comm.world_size // layout.stride
    size = len(route.members)
    _, nxt, prv = comm.ring_peers(route.members)
    scratch = outgoing = incoming = grads_pending = None
    stamp = comm.stamp(ring.call, "backward")
    share = route.share
    if share is not None:
        guests, arriving = post_guests(comm, share, (q, out, lse, dout),
                                       describe(ring.call, "backward", plan, 0, size, "rows of shared cross blocks"),
                                       stamp)
    helper = None if share is None or not share.guests else \
        Helper(ring, route, (guests, arriving), (k, v), own, q.shape[1], key_mask)
    for step, block, src in _ring_blocks(k, v, route, ring, "backward"):
        calls = step_calls(reads, layout, own, src, blocks, q.shape[1], causal, share is not None)
        if scratch is None:
            scratch, outgoing, incoming = (torch.empty(block.shape, dtype=accum_dtype(block.dtype),
                                                       device=block.device) for _ in range(3))
        if calls:  # this block's dK/dV from our queries, while its accumulator travels
            scratch.zero_()
            for c in calls:
                pieces, spec = _pieces(route, c), CallSpec(c.causal, scale, packed=True, **call_mask(key_mask, c))
                qkv = (q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys])
                final = (out[:, c.rows], lse[:, c.rows], dout[:, c.rows])
                grads = (dq[:, c.rows], scratch[0][:, c.keys], scratch[1][:, c.keys])
                if pieces:
                    split_backward(kernel, pieces, qkv, final, grads, spec, fresh=False)
                else:
                    kernel.backward_pattern(*qkv, c.plan, spec, final, grads)
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
                                           describe(ring.call, "backward", plan, step, size, "dK/dV accumulator"),
                                           stamp=stamp)
    if share is not None:
        if helper is None:
            arriving.wait()  # our sends
        while helper is not None and helper.pending:  # (a rank has as many idle steps as guests: none are left)
            helper.step(scratch)
        rest = dq[:, share.half:]
        for (hdq,) in return_results(comm, share, helper.results if helper is not None else [], (rest,),
                                     describe(ring.call, "backward", plan, 0, size, "dQ of shared cross blocks"),
                                     stamp):
            add_into_(rest, hdq)
    if size == 1:  # a ring of one rank (zigzag: the middle segment held whole): nothing travelled
        return outgoing
    grads_pending.wait()  # after size hops the accumulator of our own block is home
    if helper is not None:
        add_into_(incoming, scratch)  # the guests' dK/dV of our block
    return incoming


def compact_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: Route, ring: RingCall
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A compact ring (module doc): its result as a compact part, ``(out, lse)``."""
    qc = compact(q, route.plan)
    out = torch.empty(qc.shape, dtype=accum_dtype(q.dtype), device=q.device)
    lse = torch.empty(qc.shape[:3], dtype=out.dtype, device=q.device)
    clear_result_(out, lse)
    ring_forward(qc, k, v, None, route, ring, (out, lse))
    return out.to(q.dtype), lse


def compact_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], route: Route, ring: RingCall
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A compact ring's gradients (``saved``: the block's final ``out``, ``lse``, ``dout``): dQ, dK, dV as compact
    parts."""
    qc, oc, lc, gc = (compact(x, route.plan) for x in (q, *saved))
    dq = torch.zeros(qc.shape, dtype=accum_dtype(q.dtype), device=q.device)
    home = ring_backward(qc, k, v, None, route, ring, (oc, lc, gc), dq)
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(k.dtype)
