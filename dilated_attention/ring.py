"""The ring schedule, forward and backward: the one place the ring algorithm lives.

Every pattern is either local (its segments fit a rank's sequence block) or a
ring over the ranks holding a segment's chunks (``RingLayout``: consecutive blocks,
or, in the zigzag layout, the blocks holding a segment and its mirror). On a ring
each rank packs its dilated K/V once, then ``G - 1`` steps pass the packed block to
the next rank; the receive for step ``t + 1`` is posted before step ``t`` is
computed. Each step compares query chunks with key chunks by global chunk id
(``_step_calls``): one kernel call per block, or per visible pair of half blocks. Ring steps
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
order: every LongNet pattern) runs on compact copies of its query-side rows (``_dense_view``): the rows
each head reads, ``(B, L / r, H, D)``, the layout of the packed K/V blocks, so every step is dense
attention and its result, dQ and the dK/dV accumulator that comes home are compact parts like a local
pattern's. Nothing of full size in fp32: a ring pattern merged in place held fp32 results and
gradients of the whole block (3 x its q's fp32 size in the backward) and filled them with zeros.

Causal local patterns run on two side streams (``_SideStreams``: the tails of their small calls overlap),
joined before the combine; each writes its own parts, so no bit depends on it.

A kernel with a ``causal_block`` (flash-attn-4, cudnn-det: their causal backwards are slow on long squares,
their non-causal ones are not) gets a long causal square (more than ``WHOLE_BLOCKS`` blocks), local or a ring's
own block, split (``_causal_split``): one causal call of all diagonal blocks folded into the batch dimension,
then one non-causal call per halving level of each span's second half against its first, all merged into the
running result (no compact parts).

Key masks (padding, packed documents) cover the whole sequence on every rank (a
few bytes per token, gathered once per call): a step reads the slice of the
block it holds, so masks never travel round the ring.

A causal ring on contiguous blocks of the caller's rows (full attention) shares its cross blocks
(``_Share``): each rank computes half of its rows against the earlier blocks and the other half of the
later ranks' rows against its own K/V, so the last rank no longer does all the cross work.

Every exchange carries the call's 16-byte stamp in the same batch (``comm/stamps.py``): a
rank in another call or configuration raises instead of mixing blocks; the blocks themselves
and everything computed from them are untouched.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import caches
from .comm.base import Blocks, CommBackend, Pending
from .kernels.protocol import PatternKernel, clear_result_
from .kernels.wrapper import KernelWrapper
from .merge import Part, accum_dtype, add_into_, combine_results, merge_into_, sum_grads
from .patterns import PatternPlan, plan_patterns
from .views import pack_kv, region_views, unpack_add_


class Visibility(enum.Enum):
    """How a query chunk sees a key chunk on a ring."""

    FULL = "full"        # every key visible (non-causal, or an earlier chunk of the segment)
    CAUSAL = "causal"    # the same chunk: keys up to the query's position
    HIDDEN = "hidden"    # a later chunk under causal masking, or another segment: skipped (still forwarded)


def _visibility(causal: bool, key: int, query: int, span: int) -> Visibility:
    """Key chunk ``key`` seen from query chunk ``query`` (global chunk ids; a segment spans ``span`` chunks)."""
    if key // span != query // span:
        return Visibility.HIDDEN
    if not causal or key < query:
        return Visibility.FULL
    return Visibility.CAUSAL if key == query else Visibility.HIDDEN


@dataclass(frozen=True)
class RingLayout:
    """Which group ranks hold which chunks of the sequence.

    ``stride`` ranks share each block (head-parallel inside a block: rank ``j`` holds block
    ``j // stride`` for head slice ``j % stride``); a ring joins the ranks with the same head slice.
    ``zigzag=False``: block ``b`` of ``K`` is chunk ``b``, and a ring is the ``G`` consecutive blocks
    one segment spans. ``zigzag=True``: the sequence is cut in ``2K`` chunks, block ``b`` holds chunks
    ``b`` and ``2K - 1 - b`` (its halves), and a ring is the blocks holding one segment's chunks; they
    hold its mirror segment too, so every rank of a causal ring gets the same share of work.
    ``stride = 1``, ``zigzag=False`` is the plain sequence-parallel ring.
    """

    stride: int = 1
    zigzag: bool = False

    def chunks(self, block: int, blocks: int) -> tuple[int, ...]:
        """The global chunk ids block ``block`` of ``blocks`` holds, in its row order."""
        return (block, 2 * blocks - 1 - block) if self.zigzag else (block,)

    def members(self, rank: int, span: int, blocks: int) -> tuple[int, ...]:
        """The group ranks of ``rank``'s ring for a segment of ``span`` chunks, ascending. Zigzag rings have
        ``span`` ranks, but the segment holding the sequence's middle (its own mirror) ``span / 2``."""
        block, lane = divmod(rank, self.stride)
        first = block // span * span  # the first chunk of the segment holding chunk ``block``
        holders = sorted({min(c, 2 * blocks - 1 - c) if self.zigzag else c for c in range(first, first + span)})
        return tuple(lane + self.stride * b for b in holders)


@dataclass(frozen=True)
class _Call:
    """One kernel call of a ring step: local query rows ``rows`` against the visiting block's packed rows
    ``keys``, whose key mask is ``mask`` of the whole-sequence mask (block order), with ``plan``."""

    rows: slice
    keys: slice
    mask: slice
    plan: PatternPlan
    causal: bool


@caches.memoize("ring.step_calls", 4096)  # asked per pattern and ring step; a model has few configurations
def _step_calls(plan: PatternPlan, layout: RingLayout, own: int, src: int, blocks: int, rows: int, causal: bool,
                shared: bool = False) -> tuple[_Call, ...]:
    """The kernel calls of a ring step on block ``own`` (``rows`` rows) with block ``src``'s K/V.

    Each (query chunk, key chunk) pair is compared by global chunk id. Where the pairs see each other as the
    block's own rows do (all visible, or causal by local row: rows are in global order in both layouts), one
    call covers the block; else one call per visible pair on half-block views (zigzag). For a segment
    spanning the whole sequence that is, causal, on every rank: its own block (one causal call), then per
    step either both query halves against the first key half or the second query half against both key
    halves: half a block's work each step, whatever the rank. ``shared`` (``_Share``): an earlier block
    is seen by the first half of the rows only, the other half being a helper's.
    """
    queries, keys = layout.chunks(own, blocks), layout.chunks(src, blocks)
    seen = [[_visibility(causal, kc, qc, plan.ring_size) for kc in keys] for qc in queries]
    pairs = [(i, j) for i in range(len(queries)) for j in range(len(keys))]
    if all(seen[i][j] is Visibility.HIDDEN for i, j in pairs):
        return ()
    if shared and src != own:
        return _half_calls(plan, src, rows)
    for whole in (False, True):  # the block's own rows: full, or causal by row
        if all(seen[i][j] is _visibility(whole, j, i, len(keys)) for i, j in pairs):
            return (_Call(slice(0, rows), slice(0, rows // plan.dilation), slice(src * rows, (src + 1) * rows),
                          plan, whole),)
    size = rows // len(queries)
    packed = size // plan.dilation  # a chunk's rows in the packed K/V block
    half = plan.with_local_segment(size)
    return tuple(_Call(slice(i * size, (i + 1) * size), slice(j * packed, (j + 1) * packed),
                       slice(src * rows + j * size, src * rows + (j + 1) * size), half, seen[i][j] is Visibility.CAUSAL)
                 for i, j in pairs if seen[i][j] is not Visibility.HIDDEN)


@caches.memoize("ring.half_calls", 1024)  # asked per shared ring step; a model has few configurations
def _half_calls(plan: PatternPlan, src: int, rows: int) -> tuple[_Call, _Call]:
    """Half of a block's ``rows`` query rows against both halves of block ``src``'s packed K/V, non-causal:
    two calls of half blocks (a kernel call's queries and keys have equally many rows per segment)."""
    size = rows // 2
    packed, half = size // plan.dilation, plan.with_local_segment(size)
    return tuple(_Call(slice(0, size), slice(j * packed, (j + 1) * packed),
                       slice(src * rows + j * size, src * rows + (j + 1) * size), half, False) for j in range(2))


# Causal rings share their cross blocks (``_Share``) where a block has at least this many rows. Measured on 2 x H100
# (causal, 16 x 128 heads, bf16, flash-attn-4), shared / unshared time: full attention 0.73x at 32768 rows, 0.98x at
# 16384, 1.01x at 8192.
SHARE_MIN_ROWS = 16384
# ... and LongNet's rings on compact rows at least this many compact rows: never. Run eagerly, their extra calls
# and exchanges cost more than the balance saves; replayed in a CUDA graph it gains at most 3%. LongNet causal at
# 32768 / 131072 tokens per GPU (4096 / 8192 compact rows), shared / unshared: eager 1.20x / 1.12x (cuDNN only:
# 1.10x / 1.08x), graph 0.99x / 0.985x (cuDNN 0.98x / 0.97x).
SHARE_MIN_COMPACT_ROWS = 1 << 30
# ... and at most this many ranks: the first rank of a ring of G holds G - 1 later ranks' half rows (and their dQ),
# which grows with the ring; longer causal rings balance with zigzag shards.
SHARE_MAX_RANKS = 4


@dataclass(frozen=True)
class _Share:
    """A causal ring on contiguous blocks, balanced: the ring position ``p`` sees ``p`` earlier blocks whole, so
    the last rank would do ``G - 1`` blocks of cross work while the first does none. Here each rank computes
    only its first ``half`` query rows against the earlier blocks; its second half goes to every earlier rank
    of the ring (its ``helpers``), which computes it against its own K/V and sends the result back (forward,
    at its first step: fp32 ``out``/``lse``; backward, at its first idle step: fp32 dQ, the dK/dV of its own
    block kept apart until that block's accumulator is home). Every rank then does its causal block plus
    ``G - 1`` half blocks. ``guests``: the later ranks whose second halves this rank computes."""

    half: int
    helpers: tuple[int, ...]
    guests: tuple[int, ...]


def _share(reads: PatternPlan, layout: RingLayout, causal: bool, members: tuple[int, ...], rank: int,
           rows: int, compact: bool = False) -> _Share | None:
    """How a ring of ``members`` on blocks of ``rows`` query rows, read with ``reads`` (a compact ring's dense
    view, else the pattern's plan), shares its cross blocks: causal rings on contiguous blocks of at least
    ``SHARE_MIN_ROWS`` rows (``SHARE_MIN_COMPACT_ROWS`` for ``compact`` ones), whole dilated rows per half, of at
    most ``SHARE_MAX_RANKS`` ranks; else ``None``."""
    least = SHARE_MIN_COMPACT_ROWS if compact else SHARE_MIN_ROWS
    if not causal or layout.zigzag or not 2 <= len(members) <= SHARE_MAX_RANKS or rows < least \
            or rows % (2 * reads.dilation):
        return None
    pos = members.index(rank)
    return _Share(rows // 2, members[:pos], members[pos + 1:])


def _trade(comm: CommBackend, sends: list[tuple[int, tuple[torch.Tensor, ...]]], peers: tuple[int, ...],
           likes: tuple[torch.Tensor, ...], what: str, stamp) -> tuple[list[tuple[torch.Tensor, ...]], Pending]:
    """Post ``(group rank, tensors)`` sends and receive tensors shaped like ``likes`` from each of ``peers``, in
    one batch: ``(what each peer sent, pending)``."""
    got = [tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in likes) for _ in peers]
    pending = comm.exchange([(x, r) for r, xs in sends for x in xs],
                            [(x, r) for r, xs in zip(peers, got) for x in xs], what, stamp=stamp)
    return got, pending


def _post_guests(comm: CommBackend, share: _Share, tensors: tuple[torch.Tensor, ...], what: str, stamp
                 ) -> tuple[list[tuple[torch.Tensor, ...]], Pending]:
    """Our second half of each of ``tensors`` to every helper; the guests' halves received: ``(per guest, pending)``."""
    mine = tuple(x[:, share.half:].contiguous() for x in tensors) if share.helpers else ()
    return _trade(comm, [(h, mine) for h in share.helpers], share.guests,
                  tuple(x[:, share.half:] for x in tensors), what, stamp)


def _return_results(comm: CommBackend, share: _Share, results: list[tuple[torch.Tensor, ...]],
                    likes: tuple[torch.Tensor, ...], what: str, stamp) -> list[tuple[torch.Tensor, ...]]:
    """Each guest's results sent home; the helpers' results for our second half (shaped like ``likes``), in
    ring order, once they have arrived."""
    got, pending = _trade(comm, list(zip(share.guests, results)), share.helpers, likes, what, stamp)
    pending.wait()
    return got


def _what(call: int, direction: str, plan: PatternPlan, step: int, size: int, exchange: str) -> str:
    return (f"call {call}, {direction}, pattern {plan.index} (w={plan.segment}, r={plan.dilation}), "
            f"ring step {step + 1}/{size}, {exchange}")


def _block_mask(key_mask: torch.Tensor | None, block: int, length: int) -> dict:
    """Kernel keyword for sequence block ``block`` (``length`` rows) of a whole-sequence key mask."""
    return {} if key_mask is None else {"key_mask": key_mask[:, block * length:(block + 1) * length]}


def _call_mask(key_mask: torch.Tensor | None, call: _Call) -> dict:
    return {} if key_mask is None else {"key_mask": key_mask[:, call.mask]}


@dataclass(frozen=True)
class _Piece:
    """One kernel call of a split causal square (``_causal_split``): ``plan`` on views that cut the rows in
    spans of ``span`` dilated rows, each span one batch row of the call. ``rectangle``: the queries of each
    span's second half against the keys of its first half, non-causal; else the spans themselves, causal."""

    span: int
    rectangle: bool
    plan: PatternPlan


# A causal square of at most this many blocks runs as one call: split, it costs more (more, smaller calls, and
# fp32 merges in place of compact parts) than the slow long causal kernel it avoids. Measured on an H100, dense
# causal forward+backward, split / whole: cudnn-det in blocks of 4096 rows 1.00x at 16384 rows, 0.96x at 32768,
# 0.86x at 65536; flash4 in blocks of 8192 1.13x at 16384, 1.06x at 32768, 0.78x at 65536. LongNet's squares
# (at most 8192 rows in its usual patterns) ran 1.3-1.7x slower split in blocks of 2048.
WHOLE_BLOCKS = 4


@caches.memoize("ring.causal_split", 1024)  # asked per causal pattern and call; a model has few configurations
def _causal_split(plan: PatternPlan, block: int) -> tuple[_Piece, ...]:
    """A causal square of ``M = plan.local_segment / r`` rows (every segment of the plan) as kernel calls
    whose causal squares have at most ``block`` rows; ``()`` where it stays one call.

    Why: flash-attn-4's and cuDNN's deterministic causal backwards are slow on long causal squares (full causal
    attention over 65536 rows: FA4 0.77-0.87x of cuDNN's atomic one), while their non-causal backwards and small
    causal blocks are fast; split, FA4 measured 0.91-1.05x. Only squares of more than ``WHOLE_BLOCKS`` blocks are
    split (why: there). Blocks have ``b = M / 2^j`` rows, the least ``j >= 1`` with ``b <= block`` (``()`` if
    ``M <= WHOLE_BLOCKS * block``, ``block <= 0`` or ``2^j`` does not divide ``M``). Calls, all zero-copy views:

    * the diagonal: every block of ``b`` rows, causal, in one call (blocks folded into the batch dimension;
      ``plan`` read on segments of ``b * r`` rows);
    * per span ``t = M, M / 2, ..., 2b`` (``j`` calls): every span's second half of queries against its first
      half of keys, non-causal, in one call (``plan`` on segments of ``t / 2 * r`` rows).

    A (query, key) pair below the diagonal blocks lies in exactly one rectangle: that of the smallest span
    holding both. Every dilated row stays whole (spans are multiples of ``r`` rows): each view is the kernel's
    usual dilated view of a block, so what it reads in place it still reads in place.
    """
    m = plan.local_segment // plan.dilation
    if block <= 0 or m <= WHOLE_BLOCKS * block:
        return ()
    levels = 1
    while m >> levels > block:
        levels += 1
    if m % (1 << levels):
        return ()
    b, r = m >> levels, plan.dilation
    diagonal = _Piece(b, False, plan.with_local_segment(b * r))
    return (diagonal, *(_Piece(m >> j, True, plan.with_local_segment((m >> j) // 2 * r)) for j in range(levels)))


def _cut(x: torch.Tensor, rows: int, half: int | None) -> torch.Tensor:
    """``x`` ``(B, N, ...)`` cut into spans of ``rows`` rows, ``(B, N / rows, rows, ...)``, or (``half`` 0 or 1) one
    half of every span, ``(B, N / rows, rows / 2, ...)``: a view."""
    spans = x.unflatten(1, (x.shape[1] // rows, rows))
    return spans if half is None else spans.unflatten(2, (2, rows // 2)).select(2, half)


def _batched(views: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """``(B, S, rows, ...)`` views as one call's operands, ``(B * S, rows, ...)``, where every one folds its batch
    and span dims into one stride (views); else one call per batch row, ``(S, rows, ...)`` each."""
    if all(v.shape[0] == 1 or v.shape[1] == 1 or v.stride(0) == v.shape[1] * v.stride(1) for v in views):
        return [tuple(v.view(-1, *v.shape[2:]) for v in views)]
    return [tuple(v[i] for v in views) for i in range(views[0].shape[0])]


def _piece_views(piece: _Piece, packed: bool, queries, keys) -> list[tuple[torch.Tensor, ...]]:
    """Each call's ``(*queries, *keys)`` views of one piece: query-row tensors (full layout) and key-row tensors
    (full layout, or a packed block's dilated rows)."""
    rows = piece.span * piece.plan.dilation
    qh, kh = (1, 0) if piece.rectangle else (None, None)
    return _batched([_cut(x, rows, qh) for x in queries] + [_cut(x, piece.span if packed else rows, kh) for x in keys])


def _split_forward(kernel, pieces, q, k, v, out, lse, *, packed: bool, scale: float, fresh: bool) -> None:
    """A causal square's pieces merged into the running ``out``/``lse``; ``fresh``: the diagonal (every row)
    writes them."""
    for piece in pieces:
        for qq, oo, ll, kk, vv in _piece_views(piece, packed, (q, out, lse), (k, v)):
            kernel.forward_pattern_into(qq, kk, vv, piece.plan, oo, ll, packed=packed, causal=not piece.rectangle,
                                        scale=scale, fresh=fresh and not piece.rectangle)


def _split_backward(kernel, pieces, q, k, v, out, lse, dout, dq, dk, dv, *, packed: bool, scale: float,
                    fresh: bool) -> None:
    """A causal square's pieces' gradients added into ``dq``/``dk``/``dv``; ``fresh``: the diagonal (every query
    and key row) writes them."""
    for piece in pieces:
        for qq, oo, ll, gg, dqq, kk, vv, dkk, dvv in _piece_views(piece, packed, (q, out, lse, dout, dq),
                                                                  (k, v, dk, dv)):
            kernel.backward_pattern(qq, kk, vv, piece.plan, oo, ll, gg, dqq, dkk, dvv, packed=packed,
                                    causal=not piece.rectangle, scale=scale, fresh=fresh and not piece.rectangle)


def _split_block(kernel, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor) -> int:
    """The ``causal_block`` of the kernel that runs this pattern's causal calls in ``direction`` (0: none): a
    kernel's own, else, for a wrapper (the guard, ``auto``'s router, debug mode), its target's."""
    while True:
        block = getattr(kernel, "causal_block", None)
        if block is not None or not isinstance(kernel, KernelWrapper):
            return block or 0
        kernel = kernel.target(direction, plan, True, q, k, False)


@caches.memoize("ring.dense_view", 256)  # asked per ring pattern and call; a model has few configurations
def _dense_view(plan: PatternPlan) -> PatternPlan:
    """``plan`` read on its compact rows (``(B, L / r, H, D)``: row ``j`` of head ``h`` is the block's row
    ``j * r + offset(h)``): rate 1, every chunk at offset 0, segments ``1 / r`` as long."""
    r = plan.dilation
    runs: list[tuple[int, int, int]] = []
    for _, h0, h1 in plan.head_runs:  # one offset now: adjacent runs join
        if runs and runs[-1][2] == h0:
            runs[-1] = (0, runs[-1][1], h1)
        else:
            runs.append((0, h0, h1))
    return PatternPlan(plan.index, plan.segment // r, 1, plan.local_segment // r, plan.ring_size,
                       tuple(replace(c, offset=0) for c in plan.chunks), tuple(runs))


def _dense_ring(plan: PatternPlan, masked: bool, layout: RingLayout, q: torch.Tensor, k: torch.Tensor
                ) -> PatternPlan | None:
    """``_dense_view(plan)`` where a ring pattern can run on compact rows (module doc), else ``None``: rate
    above 1, no key mask (its rows differ per head offset), each query and kv head in one chunk, the packed
    heads the kv heads in order (so the dK/dV accumulator is the kv part), whole dilated rows per chunk."""
    if plan.ring_size == 1 or plan.dilation == 1 or masked:
        return None
    heads, kv_heads = q.shape[2], k.shape[2]
    if plan.head_offsets(heads) is None or plan.head_offsets(kv_heads, kv=True) is None:
        return None
    if plan.packed_heads != kv_heads or any(c.buffer_head != c.k0 for c in plan.chunks):
        return None
    if q.shape[1] % (plan.dilation * (2 if layout.zigzag else 1)):
        return None
    return _dense_view(plan)


def _compact(x: torch.Tensor, plan: PatternPlan) -> torch.Tensor:
    """A new compact ``(B, L / r, H, ...)`` copy of the rows and heads ``plan`` reads of ``x``."""
    out = x.new_empty((x.shape[0], x.shape[1] // plan.dilation, *x.shape[2:]))
    for rows, part in region_views(x, out, plan):
        part.copy_(rows)
    return out


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
            pending = comm.send_recv(block, nxt, spare, prv, _what(call, direction, plan, step, size, "K/V block"),
                                     stamp=stamp)
        yield step, block, members[(pos - step) % size] // layout.stride
        if pending is not None:
            pending.wait()
            block, spare = spare, block


def _ring_forward(q, k, v, key_mask, plan, comm, layout, call, kernel, causal, scale, split, out, lse, view=None):
    """``split``: the causal block a causal call is split into (``_causal_split``; 0: none). ``view``: the plan
    the queries are read with (``_dense_view`` on compact ``q``/``out``/``lse``; default ``plan``); K/V blocks
    are packed by ``plan``."""
    own, blocks = comm.rank // layout.stride, comm.world_size // layout.stride
    members = layout.members(comm.rank, plan.ring_size, blocks)
    share = _share(view or plan, layout, causal, members, comm.rank, q.shape[1], view is not None)
    stamp = comm.stamp(call, "forward")
    if share is not None:
        guests, arriving = _post_guests(comm, share, (q,), _what(call, "forward", plan, 0, len(members),
                                                                  "queries of shared cross blocks"), stamp)
        results = []
    for step, block, src in _ring_blocks(k, v, plan, comm, layout, call, "forward"):
        for c in _step_calls(view or plan, layout, own, src, blocks, q.shape[1], causal, share is not None):
            pieces = _causal_split(c.plan, split) if c.causal else ()
            if pieces:
                _split_forward(kernel, pieces, q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys],
                               out[:, c.rows], lse[:, c.rows], packed=True, scale=scale, fresh=False)
                continue
            kernel.forward_pattern_into(q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys], c.plan,
                                        out[:, c.rows], lse[:, c.rows], packed=True, causal=c.causal, scale=scale,
                                        **_call_mask(key_mask, c))
        if step == 0 and share is not None:  # the guests' second halves against our own K/V
            arriving.wait()
            for (gq,) in guests:
                go = torch.empty(gq.shape, dtype=out.dtype, device=out.device)
                gl = torch.empty(gq.shape[:3], dtype=lse.dtype, device=lse.device)
                clear_result_(go, gl)
                for c in _half_calls(view or plan, own, q.shape[1]):
                    kernel.forward_pattern_into(gq, block[0][:, c.keys], block[1][:, c.keys], c.plan, go, gl,
                                                packed=True, causal=False, scale=scale, **_call_mask(key_mask, c))
                results.append((go, gl))
    if share is not None:
        rest = (out[:, share.half:], lse[:, share.half:])
        for ho, hl in _return_results(comm, share, results, rest,
                                      _what(call, "forward", plan, 0, len(members), "results of shared cross blocks"),
                                      stamp):
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
    share = _share(view or plan, layout, causal, members, comm.rank, q.shape[1], view is not None)
    if share is not None:
        guests, arriving = _post_guests(comm, share, (q, out, lse, dout),
                                        _what(call, "backward", plan, 0, size, "rows of shared cross blocks"), stamp)
    helped = []
    for step, block, src in _ring_blocks(k, v, plan, comm, layout, call, "backward"):
        calls = _step_calls(view or plan, layout, own, src, blocks, q.shape[1], causal, share is not None)
        if scratch is None:
            scratch, outgoing, incoming = (torch.empty(block.shape, dtype=accum_dtype(block.dtype),
                                                       device=block.device) for _ in range(3))
        if calls:  # this block's dK/dV from our queries, while its accumulator travels
            scratch.zero_()
            for c in calls:
                pieces = _causal_split(c.plan, split) if c.causal else ()
                if pieces:
                    _split_backward(kernel, pieces, q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys],
                                    out[:, c.rows], lse[:, c.rows], dout[:, c.rows], dq[:, c.rows],
                                    scratch[0][:, c.keys], scratch[1][:, c.keys], packed=True, scale=scale,
                                    fresh=False)
                    continue
                kernel.backward_pattern(q[:, c.rows], block[0][:, c.keys], block[1][:, c.keys], c.plan,
                                        out[:, c.rows], lse[:, c.rows], dout[:, c.rows], dq[:, c.rows],
                                        scratch[0][:, c.keys], scratch[1][:, c.keys], packed=True, causal=c.causal,
                                        scale=scale, **_call_mask(key_mask, c))
        if not calls and share is not None and share.guests and not helped:
            # our first idle step: the guests' second halves. Their dK/dV wait in ``scratch``, free from here on,
            # for our block's accumulator to come home: added at step 0, they would hold it back from the next rank.
            helped = _help_backward(kernel, guests, arriving, k, v, plan, view or plan, own, q.shape[1], key_mask,
                                    scale, scratch)
        if step == 0:  # our own block (always visible): its accumulator starts here
            scratch, outgoing = outgoing, scratch
        else:
            grads_pending.wait()
            if calls:
                incoming.add_(scratch)
            outgoing, incoming = incoming, outgoing  # the old outgoing buffer has been sent: reuse it
        if size > 1:
            grads_pending = comm.send_recv(outgoing, nxt, incoming, prv,
                                           _what(call, "backward", plan, step, size, "dK/dV accumulator"),
                                           stamp=stamp)
    if share is not None:
        if not share.guests:  # (a rank with guests helped at its first idle step: every one has idle steps)
            arriving.wait()  # our sends
        rest = dq[:, share.half:]
        for (hdq,) in _return_results(comm, share, helped, (rest,),
                                      _what(call, "backward", plan, 0, size, "dQ of shared cross blocks"), stamp):
            add_into_(rest, hdq)
    if size == 1:  # a ring of one rank (zigzag: the middle segment held whole): nothing travelled
        return outgoing
    grads_pending.wait()  # after size hops the accumulator of our own block is home
    if helped:
        add_into_(incoming, scratch)  # the guests' dK/dV of our block
    return incoming


def _help_backward(kernel, guests, arriving: Pending, k, v, plan: PatternPlan, reads: PatternPlan, own: int, rows: int,
                   key_mask, scale: float, scratch: torch.Tensor) -> list[tuple[torch.Tensor]]:
    """The guests' second halves (read with ``reads``) against our own K/V (packed by ``plan`` again: the ring
    buffers hold other blocks by now): their dQ, returned per guest, and their dK/dV of our block written into
    ``scratch``."""
    arriving.wait()
    mine = pack_kv(k, v, plan)
    scratch.zero_()
    helped = []
    for gq, go, gl, gd in guests:
        gdq = torch.zeros(gq.shape, dtype=scratch.dtype, device=gq.device)
        for c in _half_calls(reads, own, rows):
            kernel.backward_pattern(gq, mine[0][:, c.keys], mine[1][:, c.keys], c.plan, go, gl, gd, gdq,
                                    scratch[0][:, c.keys], scratch[1][:, c.keys], packed=True, causal=False,
                                    scale=scale, **_call_mask(key_mask, c))
        helped.append((gdq,))
    return helped


# The backward runs rings on compact rows after this many of its other patterns (by causal flag): their blocks
# and fp32 accumulators then meet fewer local parts, the backward's peak. The parts still sum in plan order and
# patterns merged in place keep theirs, so no bit depends on it. Non-causal, first: on 2 x H100 (LongNet, 32768
# tokens per GPU, alternated runs) after the first against last measured the same time at 1.41x own instead of
# 1.69x, and on 2 x H200 (flash-attn-4) first against after the first 1.39x instead of 1.41x at 1.00-1.02x the time.
# Causal rings (those not swapped: ``_Swapped``) stay last: 1.41x instead of 1.69x after the first
# (flash-attn-4; cuDNN 1.61x -> 1.33x) but 0.99-1.05x the time on an idle host and 1.08-1.09x on a loaded one:
# issued last, a causal ring's host work hides behind the local patterns queued on side streams.
RING_AFTER = {False: 0, True: 1 << 30}  # (a count past the others: last)

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


def _route(kernel, causal: bool, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor,
           masked: bool) -> tuple[int, tuple[_Piece, ...], bool]:
    """How ``plan`` runs in ``direction``: the causal block its causal calls split into (``_causal_split``; 0 for
    none: unmasked causal calls only, a key mask's slices stay whole), a local pattern's split pieces, and
    whether it leaves a compact part (``PatternKernel.parts``; a split one never does)."""
    split = _split_block(kernel, direction, plan, q, k) if causal and not masked else 0
    pieces = _causal_split(plan, split) if plan.ring_size == 1 else ()
    part = plan.ring_size == 1 and not pieces and kernel.parts(direction, plan, q, k, causal=causal, masked=masked)
    return split, pieces, part


def leaves_part(kernel, causal: bool, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor,
                masked: bool) -> bool:
    """Whether ``plan`` leaves compact parts in such a call, run locally or as a ring on compact rows
    (``memory.py``'s estimate asks)."""
    return _route(kernel, causal, direction, plan, q, k, masked)[2] or \
        _dense_ring(plan, masked, RingLayout(), q, k) is not None


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                 ring: RingCall, into: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over this rank's block: ``(out, lse)``; spanning patterns run as rings. ``into``:
    ``(out, lse)`` views (a head range of the caller's result) to write them to.

    ``key_mask``: ``None`` or bool ``(B, blocks * L)`` over the whole sequence, ``True`` = excluded key.
    Not differentiable itself: ``ring_backward`` is its exact gradient (``functional.py`` pairs them).
    """
    comm, layout = ring.comm, ring.layout
    own = _block_mask(key_mask, comm.rank // layout.stride if comm is not None else 0, q.shape[1])
    acc = accum_dtype(q.dtype)
    running, parts = None, {}
    plans = [p for p in ring.plans if p.chunks]  # (no local head may use a pattern: grouped mode, head-parallel)

    def sends(plan: PatternPlan) -> list[torch.Tensor]:
        return [_compact(q, plan), *pack_kv(k, v, plan)]

    sides = _SideStreams(q, ring.causal)
    swaps = _swaps(ring, plans, q, k, key_mask is not None, "forward", sends, sides)
    travelling = _Travelling()
    for i in _swap_order(len(plans), swaps):
        plan = plans[i]
        travelling.turn(swaps.get(i))
        if i in swaps:
            _run_swap(swaps[i], _swap_forward, sends, sides)
            continue
        split, pieces, part = _route(ring.kernel, ring.causal, "fwd", plan, q, k, key_mask is not None)
        if part:
            parts[i] = Part(plan, *sides.issue(ring.kernel.forward_pattern, q, k, v, plan, packed=False,
                                               causal=ring.causal, scale=ring.scale, **own))
            continue
        dense = _dense_ring(plan, key_mask is not None, layout, q, k)
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
            _split_forward(ring.kernel, pieces, q, k, v, *running, packed=False, scale=ring.scale, fresh=fresh)
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
    qc = _compact(q, plan)
    out = torch.empty(qc.shape, dtype=accum_dtype(q.dtype), device=q.device)
    lse = torch.empty(qc.shape[:3], dtype=out.dtype, device=q.device)
    clear_result_(out, lse)
    split = _split_block(ring.kernel, "fwd", dense, qc, k) if ring.causal else 0
    _ring_forward(qc, k, v, None, plan, ring.comm, ring.layout, ring.call, ring.kernel, ring.causal, ring.scale,
                  split, out, lse, view=dense)
    return Part(plan, out.to(q.dtype), lse)


def _dense_backward(q, k, v, out, lse, dout, plan: PatternPlan, dense: PatternPlan, ring: RingCall
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ring pattern's gradients on compact rows (module doc): dQ, dK, dV as compact parts."""
    qc, oc, lc, gc = (_compact(x, plan) for x in (q, out, lse, dout))
    dq = torch.zeros(qc.shape, dtype=accum_dtype(q.dtype), device=q.device)
    split = _split_block(ring.kernel, "bwd", dense, qc, k) if ring.causal else 0
    home = _ring_backward(qc, k, v, None, oc, lc, gc, plan, ring.comm, ring.layout, ring.call, ring.kernel,
                          ring.causal, ring.scale, split, dq, view=dense)
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(k.dtype)


# A causal ring pattern on compact rows whose ring's ranks divide the query and kv heads runs head-parallel instead
# (``_Swapped``): every rank then does the same share of the causal segment. Measured on 2 x H100 (LongNet, 32768
# tokens per GPU, flash-attn-4, alternated in one process), swapped / ring: causal 0.94-0.95x replayed in a CUDA
# graph (peak 1.69x -> 1.58x own), 0.98-1.10x eagerly (host-bound at this size: it depends on the host);
# non-causal rings are balanced already: 0.97-1.0x replayed, 1.02-1.10x eagerly, so they stay rings.
SWAP_COMPACT = {False: False, True: True}  # by causal flag
# Where among the call's other patterns a swapped pattern is computed (its first all-to-all is posted before them
# all; only the order of launches changes, not a bit of the result): second, so that the transfers hide behind the
# pattern computed first and its buffers meet one pattern's parts, not all of them. Measured on 2 x H200 (LongNet,
# 32768 tokens per GPU, flash-attn-4, eager steps alternated in one process), second against last: the same time
# within the noise of eager steps (0.98x in one run, 1.03x in another), peak 1.50x -> 1.42x own (1.39x posted at
# its turn: ``_run_swap``); replayed in a CUDA graph second was already the faster.
SWAP_AFTER = 1


def _swap_members(plan: PatternPlan, masked: bool, ring: RingCall, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[int, ...] | None:
    """The group ranks of ``plan``'s ring where it runs head-parallel (``_Swapped``), else ``None``: a ring on
    compact rows (``_dense_ring``) of contiguous blocks, read by every query head (grouped mode gives a
    pattern some heads only: a kv head's other query heads would add to its gradient), whose ranks divide
    the query and the kv heads."""
    comm, layout = ring.comm, ring.layout
    if comm is None or not SWAP_COMPACT[ring.causal] or layout.zigzag \
            or _dense_ring(plan, masked, layout, q, k) is None or -1 in plan.head_offsets(q.shape[2]):
        return None
    members = layout.members(comm.rank, plan.ring_size, comm.world_size // layout.stride)
    if len(members) < 2 or q.shape[2] % len(members) or k.shape[2] % len(members):
        return None
    return members


class _Swapped:
    """A ring pattern on compact rows run head-parallel: the segment's compact rows of ``1 / G`` of the heads
    gathered on each of its ``G`` ranks by one all-to-all, the whole segment computed there as one local
    pattern (every rank the same share of a causal segment: no cross blocks, no fp32 accumulators in flight),
    and the results sent home by a second all-to-all as compact parts, like ``_dense_forward``'s. The backward
    sends the compact q, k, v, out, dO and lse the same way (nothing is kept between the directions) and brings
    dQ, dK, dV home. The first all-to-all runs beside other patterns: posted before them all on one stream, or
    at its turn where side streams run the local patterns (``_run_swap``). Each all-to-all packs its tensors into
    one buffer per rank, the call's stamp in its last 16 bytes: one transfer per peer and direction (each
    all-to-all costs the host a launch)."""

    def __init__(self, ring: RingCall, plan: PatternPlan, members: tuple[int, ...], direction: str) -> None:
        self.ring, self.plan, self.members, self.direction = ring, plan, members, direction
        self.stamp = ring.comm.stamp(ring.call, direction)
        self.pending = None

    def post(self, sends: list[torch.Tensor]) -> None:
        """The first all-to-all, of ``sends``: compact ``(B, L / r, heads, ...)`` tensors, heads divisible by
        ``G``."""
        g = len(self.members)
        self._post([x.unflatten(2, (g, x.shape[2] // g)).movedim(2, 0) for x in sends], "rows out")

    def _post(self, blocks: list[torch.Tensor], what: str) -> None:
        """An all-to-all of ``blocks`` (each ``(G, ...)``, any strides: block ``m`` to member ``m``), packed."""
        sizes = [-(-x[0].numel() * x.element_size() // _ALIGN) * _ALIGN for x in blocks]
        # (each member's block, the stamp after it: one transfer per peer, stamp included)
        buffer = Blocks((len(self.members), sum(sizes)), torch.uint8, blocks[0].device).raw
        self.views = []
        for x, at in zip(blocks, itertools.accumulate([0, *sizes[:-1]])):
            view = buffer[:, at:at + x[0].numel() * x.element_size()].view(x.dtype).unflatten(1, x.shape[1:])
            view.copy_(x)
            self.views.append((at, view.shape, x.dtype))
        blocks.clear()  # packed: each goes before the receiving buffer comes (its caller holds none)
        plan = self.plan
        (self.got,), self.pending = self.ring.comm.all_to_all(
            [buffer], self.members, f"call {self.ring.call}, {self.direction}, pattern {plan.index} "
            f"(w={plan.segment}, r={plan.dilation}), head swap of ranks {list(self.members)}, {what}",
            stamp=self.stamp, stamp_room=True)

    def land(self) -> None:
        """Orders the caller's stream after the posted all-to-all (no host sync) and lets go of the sent buffer,
        which the wait holds: called early where that stream has nothing else to run meanwhile."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def _received(self) -> list[torch.Tensor]:
        """The landed blocks, views of the receiving buffer, which the swap lets go of: the rows' copies that
        ``heads`` and ``home`` make free it, not the swap's end."""
        self.land()
        got, self.got = self.got, None
        return [got[:, at:at + math.prod(shape[1:]) * dtype.itemsize].view(dtype).unflatten(1, shape[1:])
                for at, shape, dtype in self.views]

    def heads(self) -> list[torch.Tensor]:
        """The segment's rows of this rank's heads, ``(B, G L / r, heads / G, ...)`` each (waits for them)."""
        return [x.movedim(0, 1).flatten(1, 2) for x in self._received()]

    def send_home(self, results: list[torch.Tensor]) -> None:
        """Results ``(B, G L / r, heads / G, ...)`` of ``heads()``' rows, each member's rows to it. ``results``
        is emptied: each result is freed once packed."""
        g = len(self.members)
        blocks = [x.unflatten(1, (g, x.shape[1] // g)).movedim(1, 0) for x in results]
        results.clear()
        self._post(blocks, "results home")

    def home(self) -> list[torch.Tensor]:
        """This rank's compact rows of the results, every head (waits for them)."""
        return [x.movedim(0, 2).flatten(2, 3) for x in self._received()]


_ALIGN = 16  # bytes: where each tensor starts in a packed buffer (any dtype's view is aligned)


def _whole_plan(heads: torch.Tensor, kv: torch.Tensor) -> PatternPlan:
    """One segment over all of ``heads``' rows, rate 1: a swapped pattern's computation on its head-layout rows."""
    rows = heads.shape[1]
    return plan_patterns([rows], [1], seq_len=rows, local_len=rows, num_heads=heads.shape[2],
                         num_kv_heads=kv.shape[2])[0]


def _swap_forward(swap: _Swapped) -> None:
    """A posted forward swap (q, k, v): computes this rank's heads and sends the results home (the rows are
    freed before the results travel)."""
    swap.send_home(_swapped_forward(swap.ring, *swap.heads()))


def _swapped_forward(ring: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """``[out, lse]`` of a swapped pattern's rows of this rank's heads."""
    plan = _whole_plan(q, k)
    _, pieces, part = _route(ring.kernel, ring.causal, "fwd", plan, q, k, False)
    if part:
        out, lse = ring.kernel.forward_pattern(q, k, v, plan, packed=False, causal=ring.causal, scale=ring.scale)
    else:  # the plan covers every row and head: written fresh
        out = torch.empty(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
        lse = torch.empty(q.shape[:3], dtype=out.dtype, device=q.device)
        if pieces:
            _split_forward(ring.kernel, pieces, q, k, v, out, lse, packed=False, scale=ring.scale, fresh=True)
        else:
            ring.kernel.forward_pattern_into(q, k, v, plan, out, lse, packed=False, causal=ring.causal,
                                             scale=ring.scale, fresh=True)
        out = out.to(q.dtype)
    return [out, lse]


def _swap_backward(swap: _Swapped) -> None:
    """A posted backward swap (q, k, v, out, dO, lse): this rank's heads' gradients, sent home (the rows are
    freed before the gradients travel)."""
    swap.send_home(_swapped_backward(swap.ring, *swap.heads()))


def _swapped_backward(ring: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      dout: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of a swapped pattern's rows of this rank's heads."""
    plan = _whole_plan(q, k)
    _, pieces, part = _route(ring.kernel, ring.causal, "bwd", plan, q, k, False)
    if part:
        grads = ring.kernel.backward_pattern_parts(q, k, v, plan, out, lse, dout, causal=ring.causal,
                                                   scale=ring.scale)
    else:  # the plan covers every row and head: written fresh
        acc = tuple(torch.empty(x.shape, dtype=accum_dtype(x.dtype), device=x.device) for x in (q, k, v))
        if pieces:
            _split_backward(ring.kernel, pieces, q, k, v, out, lse, dout, *acc, packed=False, scale=ring.scale,
                            fresh=True)
        else:
            ring.kernel.backward_pattern(q, k, v, plan, out, lse, dout, *acc, packed=False, causal=ring.causal,
                                         scale=ring.scale, fresh=True)
        grads = tuple(g.to(x.dtype) for g, x in zip(acc, (q, k, v)))
    return list(grads)


def _swaps(ring: RingCall, plans: list[PatternPlan], q: torch.Tensor, k: torch.Tensor, masked: bool,
           direction: str, sends: Callable[[PatternPlan], list[torch.Tensor]], sides: _SideStreams
           ) -> dict[int, _Swapped]:
    """Each swapped pattern of ``plans`` (by position), its first all-to-all (of ``sends(plan)``) posted now
    unless it is posted at its turn (``_at_turn``)."""
    swaps = {}
    for i, plan in enumerate(plans):
        members = _swap_members(plan, masked, ring, q, k)
        if members is not None:
            swaps[i] = _Swapped(ring, plan, members, direction)
            if not _at_turn(sides):
                swaps[i].post(sends(plan))
    return swaps


def _at_turn(sides: _SideStreams) -> bool:
    """Whether swaps are posted at their turn and their results awaited at once: where side streams run the local
    patterns (``_run_swap``)."""
    return bool(sides.pool)


def _run_swap(swap: _Swapped, compute: Callable[[_Swapped], None], sends: Callable[[PatternPlan], list[torch.Tensor]],
              sides: _SideStreams) -> None:
    """``compute`` (``_swap_forward`` or ``_swap_backward``) of ``swap`` at its turn. Beside side streams its first
    all-to-all is posted only now (the patterns they run hide it) and its results' is awaited at once (nothing
    else runs on the caller's stream meanwhile): its buffers then meet only the parts computed before it, and no
    kernel's workspace (2 x H200, LongNet causal at 32768 tokens per GPU, flash-attn-4: peak 1.42x -> 1.39x own)."""
    at_turn = _at_turn(sides)
    if at_turn:
        swap.post(sends(swap.plan))
    compute(swap)
    if at_turn:
        swap.land()


class _Travelling:
    """Swaps whose results travel home while the call issues its next pattern: awaited once that pattern is
    issued (a stream wait after its kernels: the transfer runs beside them), so that their sent buffers go before
    the later patterns' parts and workspaces come. Beside side streams ``_run_swap`` awaits them at once."""

    def __init__(self) -> None:
        self.swaps: list[_Swapped] = []
        self.issued = False  # a pattern was issued since the swaps

    def turn(self, swap: _Swapped | None) -> None:
        """At each pattern's turn: ``swap`` if the pattern is swapped, else ``None``."""
        if self.swaps and self.issued:
            for travelling in self.swaps:
                travelling.land()
            self.swaps = []
        if swap is not None:
            self.swaps.append(swap)
        self.issued = swap is None and bool(self.swaps)


def _swap_order(count: int, swaps: dict[int, _Swapped], rest: list[int] | None = None) -> list[int]:
    """The positions of ``count`` patterns in the order they are computed: ``rest`` (default: plan order) with the
    swapped ones after ``SWAP_AFTER`` of the others."""
    order = [i for i in (range(count) if rest is None else rest) if i not in swaps]
    order[SWAP_AFTER:SWAP_AFTER] = sorted(swaps)
    return order


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, ring: RingCall,
                  into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``ring_forward``'s ``out`` for ``dout``, from its final ``out`` and ``lse``; ``into``:
    views (a head range of the caller's gradients) to write them to."""
    comm, layout = ring.comm, ring.layout
    own = _block_mask(key_mask, comm.rank // layout.stride if comm is not None else 0, q.shape[1])
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # kernels read the head dim with unit stride
    acc = accum_dtype(q.dtype)
    running, held = None, {}
    sides = _SideStreams(q, ring.causal)
    plans = [p for p in ring.plans if p.chunks]

    def sends(plan: PatternPlan) -> list[torch.Tensor]:
        return [_compact(q, plan), *pack_kv(k, v, plan), *(_compact(x, plan) for x in (out, dout, lse))]

    swaps = _swaps(ring, plans, q, k, key_mask is not None, "backward", sends, sides)
    dense = [_dense_ring(p, key_mask is not None, layout, q, k) for p in plans]
    order = [i for i, d in enumerate(dense) if d is None]
    at = RING_AFTER[ring.causal]
    order[at:at] = [i for i, d in enumerate(dense) if d is not None]
    travelling = _Travelling()
    for i in _swap_order(len(plans), swaps, order):
        plan = plans[i]
        travelling.turn(swaps.get(i))
        if i in swaps:
            _run_swap(swaps[i], _swap_backward, sends, sides)
            continue
        split, pieces, part = _route(ring.kernel, ring.causal, "bwd", plan, q, k, key_mask is not None)
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
            _split_backward(ring.kernel, pieces, q, k, v, out, lse, dout, *running, packed=False, scale=ring.scale,
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
