"""The ring schedule, forward and backward: the one place the ring algorithm lives.

Every pattern is either local (its segments fit a rank's sequence block) or a
ring over ``G`` ranks holding consecutive blocks. On a ring each rank packs its
dilated K/V once, then ``G - 1`` steps pass the packed block to the next rank;
the receive for step ``t + 1`` is posted before step ``t`` is computed. Ring steps
merge into one running fp32 result (``forward_pattern_into``); local patterns do too,
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

Causal local patterns run on two side streams (``_SideStreams``: the tails of their small calls overlap),
joined before the combine; each writes its own parts, so no bit depends on it.

Key masks (padding, packed documents) cover the whole sequence on every rank (a
few bytes per token, gathered once per call): a step reads the slice of the
block it holds, so masks never travel round the ring.

Every exchange carries the call's 16-byte stamp in the same batch (``comm/stamps.py``): a
rank in another call or configuration raises instead of mixing blocks; the blocks themselves
and everything computed from them are untouched.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from . import caches
from .comm.base import CommBackend
from .kernels.protocol import PatternKernel, clear_result_
from .merge import Part, accum_dtype, combine_results, sum_grads
from .patterns import PatternPlan
from .views import pack_kv, unpack_add_


class Visibility(enum.Enum):
    """How a query block sees a key block on a causal (or full) ring."""

    FULL = "full"        # every key visible (non-causal, or a block from an earlier rank)
    CAUSAL = "causal"    # the rank's own block: keys up to the query's position
    HIDDEN = "hidden"    # a later rank's block under causal masking: skipped (still forwarded)


def _visibility(causal: bool, src: int, pos: int) -> Visibility:
    if not causal or src < pos:
        return Visibility.FULL
    return Visibility.CAUSAL if src == pos else Visibility.HIDDEN


@dataclass(frozen=True)
class RingLayout:
    """Which group ranks hold which sequence block.

    ``stride`` ranks share each block (head-parallel inside a block: rank ``j`` holds block
    ``j // stride`` for head slice ``j % stride``); a ring joins the ranks with the same head
    slice over ``G`` consecutive blocks. ``stride = 1`` is the plain sequence-parallel ring.
    """

    stride: int = 1

    def members(self, rank: int, ring_size: int) -> tuple[int, ...]:
        block, lane = divmod(rank, self.stride)
        start = (block // ring_size) * ring_size
        return tuple(lane + self.stride * b for b in range(start, start + ring_size))


def _what(call: int, direction: str, plan: PatternPlan, step: int, size: int, exchange: str) -> str:
    return (f"call {call}, {direction}, pattern {plan.index} (w={plan.segment}, r={plan.dilation}), "
            f"ring step {step + 1}/{size}, {exchange}")


def _block_mask(key_mask: torch.Tensor | None, block: int, length: int) -> dict:
    """Kernel keyword for sequence block ``block`` (``length`` rows) of a whole-sequence key mask."""
    return {} if key_mask is None else {"key_mask": key_mask[:, block * length:(block + 1) * length]}


def _ring_blocks(k, v, plan, comm, layout, call, direction, causal):
    """Yield ``(step, packed K/V block, visibility, sequence block it came from)`` round the ring; the
    next block's exchange is in flight while the caller computes on this one."""
    size = plan.ring_size
    pos, nxt, prv = comm.ring_peers(layout.members(comm.rank, size))
    first = comm.rank // layout.stride - pos  # the ring's first sequence block
    block, spare = pack_kv(k, v, plan), None
    stamp = comm.stamp(call, direction)
    for step in range(size):
        pending = None
        if step < size - 1:
            spare = torch.empty_like(block) if spare is None else spare
            pending = comm.send_recv(block, nxt, spare, prv, _what(call, direction, plan, step, size, "K/V block"),
                                     stamp=stamp)
        src = (pos - step) % size
        yield step, block, _visibility(causal, src, pos), first + src
        if pending is not None:
            pending.wait()
            block, spare = spare, block


def _ring_forward(q, k, v, key_mask, plan, comm, layout, call, kernel, causal, scale, out, lse):
    for _, block, seen, src in _ring_blocks(k, v, plan, comm, layout, call, "forward", causal):
        if seen is not Visibility.HIDDEN:
            kernel.forward_pattern_into(q, block[0], block[1], plan, out, lse, packed=True,
                                        causal=seen is Visibility.CAUSAL, scale=scale,
                                        **_block_mask(key_mask, src, q.shape[1]))


def _ring_backward(q, k, v, key_mask, out, lse, dout, plan, comm, layout, call, kernel, causal, scale, dq, dk, dv):
    size = plan.ring_size
    _, nxt, prv = comm.ring_peers(layout.members(comm.rank, size))
    scratch = outgoing = incoming = grads_pending = None
    stamp = comm.stamp(call, "backward")
    for step, block, seen, src in _ring_blocks(k, v, plan, comm, layout, call, "backward", causal):
        if scratch is None:
            scratch, outgoing, incoming = (torch.empty(block.shape, dtype=accum_dtype(block.dtype),
                                                       device=block.device) for _ in range(3))
        if seen is not Visibility.HIDDEN:  # this block's dK/dV from our queries, while its accumulator travels
            scratch.zero_()
            kernel.backward_pattern(q, block[0], block[1], plan, out, lse, dout, dq, scratch[0], scratch[1],
                                    packed=True, causal=seen is Visibility.CAUSAL, scale=scale,
                                    **_block_mask(key_mask, src, q.shape[1]))
        if step == 0:  # our own block: its accumulator starts here
            scratch, outgoing = outgoing, scratch
        else:
            grads_pending.wait()
            if seen is not Visibility.HIDDEN:
                incoming.add_(scratch)
            outgoing, incoming = incoming, outgoing  # the old outgoing buffer has been sent: reuse it
        grads_pending = comm.send_recv(outgoing, nxt, incoming, prv,
                                       _what(call, "backward", plan, step, size, "dK/dV accumulator"), stamp=stamp)
    grads_pending.wait()  # after size hops the accumulator of our own block is home
    unpack_add_(dk, dv, incoming, plan)


CAUSAL_PART_STREAMS = 2  # side streams for causal local patterns (1: none); why, in _SideStreams
_STREAM_POOLS: dict[int, tuple[torch.cuda.Stream, ...]] = {}
caches.register("ring.side_streams", _STREAM_POOLS.__len__)  # held: one pool per device, reused by every call


class _SideStreams:
    """Causal local patterns issued round-robin on side streams, joined before the combine.

    A causal LongNet pattern's calls are small (r = 16: one call of 256 query tiles, most of them short),
    so one after another the GPU idles in each call's tail. On side streams the tails overlap: measured on
    an H200 with LongNet's ten cuDNN calls per direction, causal
    forward 1.30 -> 1.08 ms and backward 3.64 -> 3.38 ms on two streams; non-causal calls are long enough
    that it does not pay (forward 1.68 -> 1.82 ms), so they stay on the caller's stream. Each pattern writes
    tensors of its own (parts), so the order of the streams' work does not change a bit of the result. The
    parts are handed to the caller's stream (``record_stream``): the allocator then keeps their memory until
    the caller's stream is done with them."""

    def __init__(self, q: torch.Tensor, causal: bool) -> None:
        """Side streams for a call on ``q`` if it is causal on CUDA (not under CUDA-graph capture); else none,
        and ``issue`` runs inline."""
        self.pool: tuple[torch.cuda.Stream, ...] = ()
        self.turn = 0
        if not (causal and q.is_cuda and CAUSAL_PART_STREAMS > 1) or torch.cuda.is_current_stream_capturing():
            return
        self.main = torch.cuda.current_stream(q.device)
        index = q.device.index
        if index not in _STREAM_POOLS:
            _STREAM_POOLS[index] = tuple(torch.cuda.Stream(q.device) for _ in range(CAUSAL_PART_STREAMS))
        self.pool = _STREAM_POOLS[index]
        for side in self.pool:  # the inputs were made on the caller's stream
            side.wait_stream(self.main)

    def issue(self, fn, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        """``fn``'s tensors, computed on the next side stream and handed to the caller's stream."""
        if not self.pool:
            return fn(*args, **kwargs)
        with torch.cuda.stream(self.pool[self.turn % len(self.pool)]):
            result = fn(*args, **kwargs)
        self.turn += 1
        for t in result:
            t.record_stream(self.main)
        return result

    def join(self) -> None:
        for side in self.pool:
            self.main.wait_stream(side)


@dataclass(frozen=True)
class RingCall:
    """What one call's attention on this rank's block needs besides tensors (forward and backward)."""

    plans: tuple[PatternPlan, ...]
    comm: CommBackend | None
    layout: RingLayout
    call: int
    kernel: PatternKernel
    causal: bool
    scale: float


def _parts(ring: "RingCall", direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, mask: dict
           ) -> bool:
    return plan.ring_size == 1 and ring.kernel.parts(direction, plan, q, k, causal=ring.causal, masked=bool(mask))


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                 ring: RingCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over this rank's block: ``(out, lse)``; spanning patterns run as rings.

    ``key_mask``: ``None`` or bool ``(B, blocks * L)`` over the whole sequence, ``True`` = excluded key.
    Not differentiable itself: ``ring_backward`` is its exact gradient (``functional.py`` pairs them).
    """
    comm, layout = ring.comm, ring.layout
    own = _block_mask(key_mask, comm.rank // layout.stride if comm is not None else 0, q.shape[1])
    acc = accum_dtype(q.dtype)
    running, parts = None, []
    sides = _SideStreams(q, ring.causal)
    for plan in (p for p in ring.plans if p.chunks):  # (no local head may use a pattern: grouped mode, head-parallel)
        if _parts(ring, "fwd", plan, q, k, own):
            parts.append(Part(plan, *sides.issue(ring.kernel.forward_pattern, q, k, v, plan, packed=False,
                                                 causal=ring.causal, scale=ring.scale, **own)))
            continue
        fresh = running is None and plan.covers_all(q.shape[2], k.shape[2])
        if running is None:
            running = (torch.empty(q.shape, dtype=acc, device=q.device),
                       torch.empty(q.shape[:3], dtype=acc, device=q.device))
            if not fresh:  # rows no pattern covers stay (0, -inf)
                clear_result_(*running)
        if plan.ring_size == 1:
            ring.kernel.forward_pattern_into(q, k, v, plan, *running, packed=False, causal=ring.causal,
                                             scale=ring.scale, fresh=fresh, **own)
        else:
            _ring_forward(q, k, v, key_mask, plan, comm, layout, ring.call, ring.kernel, ring.causal, ring.scale,
                          *running)
    sides.join()
    return combine_results(running, parts, q)


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, ring: RingCall
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``ring_forward``'s ``out`` for ``dout``, from its final ``out`` and ``lse``."""
    comm, layout = ring.comm, ring.layout
    own = _block_mask(key_mask, comm.rank // layout.stride if comm is not None else 0, q.shape[1])
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # kernels read the head dim with unit stride
    acc = accum_dtype(q.dtype)
    running, parts = None, ([], [], [])
    sides = _SideStreams(q, ring.causal)
    for plan in (p for p in ring.plans if p.chunks):
        if _parts(ring, "bwd", plan, q, k, own):
            grads = sides.issue(ring.kernel.backward_pattern_parts, q, k, v, plan, out, lse, dout,
                                causal=ring.causal, scale=ring.scale, **own)
            for held, grad, kv in zip(parts, grads, (False, True, True)):
                held.append(Part(plan, grad, kv=kv))
            continue
        fresh = running is None and plan.covers_all(q.shape[2], k.shape[2])
        if running is None:
            new = torch.empty if fresh else torch.zeros
            running = tuple(new(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        if plan.ring_size == 1:
            ring.kernel.backward_pattern(q, k, v, plan, out, lse, dout, *running, packed=False,
                                         causal=ring.causal, scale=ring.scale, fresh=fresh, **own)
        else:
            _ring_backward(q, k, v, key_mask, out, lse, dout, plan, comm, layout, ring.call, ring.kernel,
                           ring.causal, ring.scale, *running)
    sides.join()
    return tuple(sum_grads(running[i] if running is not None else None, parts[i], x)
                 for i, x in enumerate((q, k, v)))
