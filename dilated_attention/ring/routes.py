"""How each pattern of a rank's block runs: decided once, when a call is planned (``plan_ring``).

A pattern of a rank's block runs one of five ways (``Way``), in each direction:

* ``MERGED``: locally, or as a ring of K/V blocks (``kv_ring.py``), merged into one fp32 running result (or
  gradient accumulators) of the whole block; a long causal square split into pieces (``split_pieces``);
* ``PART``: locally, leaving a compact part in the inputs' dtype (``PatternKernel.parts``);
* ``STACKED``: locally, with the other dilated patterns of its compact segment length, as one dense call
  (``Stack``; ``stacking.py`` gathers the rows);
* ``COMPACT_RING``: a dilated ring on compact copies of its query rows (``dense_ring``), a compact part;
* ``SWAPPED``: a compact ring whose ranks divide the heads, run head-parallel instead (``swapped.py``).

A call's schedule holds a ``RingPlan`` per block (``plan_ring``); its ``routes`` decide every pattern's ``Route``
and the order they are computed in, per direction, once per block layout (the kernel's choices read the block's
strides and alignment), and keep them: ``block.py``'s forward and backward run them, and the memory estimate
(``memory.py``) reads those of a stand-in block (``stand_in``). The measured choices behind the rules are
``Tuning``'s fields; ``tuned`` changes them for a while (tests, benchmarks); schedules are keyed on them
(``planning.schedule_key``).

                                  local (ring_size 1)          spanning (ring_size G > 1)
    dilated, one offset per head  STACKED / PART / MERGED      SWAPPED / COMPACT_RING
    otherwise (rate 1, masked)    PART / MERGED                MERGED (a ring on the block's rows)
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from .. import caches
from ..comm.base import CommBackend
from ..kernels.protocol import PatternKernel, causal_block, stacks
from ..patterns import HeadChunk, PatternPlan, plan_patterns
from ..views import ALIGN_BYTES
from .layout import RingLayout


class Tuning(NamedTuple):
    """The measured thresholds and orders the routes follow (each field's reason at its comment); a tuple, so that a
    schedule's key hashes it without a Python call."""

    # A causal square of at most this many blocks runs as one call: split, it costs more (more, smaller calls, and
    # fp32 merges in place of compact parts) than the slow long causal kernel it avoids. Measured on an H100, dense
    # causal forward+backward, split / whole: cudnn-det in blocks of 4096 rows 1.00x at 16384 rows, 0.96x at 32768,
    # 0.86x at 65536; flash4 in blocks of 8192 1.13x at 16384, 1.06x at 32768, 0.78x at 65536. LongNet's squares
    # (at most 8192 rows in its usual patterns) ran 1.3-1.7x slower split in blocks of 2048.
    whole_blocks: int = 4
    # Stacks of at least this many patterns run stacked (one pattern alone would gain only its own calls' tails).
    stack_min_patterns: int = 2
    # Which compact rings whose ranks divide the query and kv heads run head-parallel (``SWAPPED``): "causal"
    # (every rank then does the same share of the causal segment), "all" or "none". Measured on 2 x H100 (LongNet,
    # 32768 tokens per GPU, flash-attn-4, alternated in one process), swapped / ring: causal 0.94-0.95x replayed in a
    # CUDA graph (peak 1.69x -> 1.58x own), 0.98-1.10x eagerly (host-bound at this size: it depends on the host);
    # non-causal rings are balanced already: 0.97-1.0x replayed, 1.02-1.10x eagerly, so they stay rings.
    swapped_rings: str = "causal"
    # Where among the call's other patterns a swapped pattern is computed (its first all-to-all is posted before
    # them all; only the order of launches changes, not a bit of the result): second, so that the transfers hide
    # behind the pattern computed first and its buffers meet one pattern's parts, not all of them. Measured on 2 x
    # H200 (LongNet, 32768 tokens per GPU, flash-attn-4, eager steps alternated in one process), second against
    # last: the same time within the noise of eager steps (0.98x in one run, 1.03x in another), peak 1.50x -> 1.42x
    # own (1.39x posted at its turn: ``swapped.run_swap``); replayed in a CUDA graph second was already the faster.
    swap_after: int = 1
    # The backward runs compact rings after this many of its other patterns (by causal flag): their blocks and fp32
    # accumulators then meet fewer local parts, the backward's peak. The parts still sum in plan order and patterns
    # merged in place keep theirs, so no bit depends on it. Non-causal, first: on 2 x H100 (LongNet, 32768 tokens
    # per GPU, alternated runs) after the first against last measured the same time at 1.41x own instead of 1.69x,
    # and on 2 x H200 (flash-attn-4) first against after the first 1.39x instead of 1.41x at 1.00-1.02x the time.
    # Causal rings (those not swapped) stay last: 1.41x instead of 1.69x after the first (flash-attn-4; cuDNN 1.61x
    # -> 1.33x) but 0.99-1.05x the time on an idle host and 1.08-1.09x on a loaded one: issued last, a causal ring's
    # host work hides behind the local patterns queued on side streams. (A count past the others: last.)
    ring_after: tuple[int, int] = (0, 1 << 30)  # (non-causal, causal)
    # Causal rings share their cross blocks (``Share``) where a block has at least this many rows. Measured on 2 x
    # H100 (causal, 16 x 128 heads, bf16, flash-attn-4), shared / unshared time: full attention 0.73x at 32768 rows,
    # 0.98x at 16384, 1.01x at 8192.
    share_min_rows: int = 16384
    # ... and compact rings at least this many compact rows: never. Run eagerly, their extra calls and exchanges cost
    # more than the balance saves; replayed in a CUDA graph it gains at most 3%. LongNet causal at 32768 / 131072
    # tokens per GPU (4096 / 8192 compact rows), shared / unshared: eager 1.20x / 1.12x (cuDNN only: 1.10x /
    # 1.08x), graph 0.99x / 0.985x (cuDNN 0.98x / 0.97x).
    share_min_compact_rows: int = 1 << 30
    # ... and at most this many ranks: the first rank of a ring of G holds G - 1 later ranks' half rows (and their
    # dQ), which grows with the ring; longer causal rings balance with zigzag shards.
    share_max_ranks: int = 4
    # Side streams for causal local patterns (1: none); why, in ``side_streams.SideStreams``.
    causal_part_streams: int = 2

    def swaps_rings(self, causal: bool) -> bool:
        """Whether compact rings of this causal flag run head-parallel (``swapped_rings``)."""
        return self.swapped_rings == "all" or (causal and self.swapped_rings == "causal")


TUNING = Tuning()  # the one in force: replaced only by ``tuned`` (schedules are keyed on it)


@contextmanager
def tuned(**changes) -> Iterator[Tuning]:
    """``Tuning`` with ``changes`` in force inside the block (tests and benchmarks that force a route), the previous
    one after it. Process-wide: every rank of a job must tune alike (the routes decide the exchanges)."""
    global TUNING
    previous = TUNING
    TUNING = previous._replace(**changes)
    try:
        yield TUNING
    finally:
        TUNING = previous


class Way(enum.Enum):
    """How a pattern runs (module doc)."""

    MERGED = "merged into the running result"
    PART = "a compact part"
    STACKED = "stacked with patterns of its compact length"
    COMPACT_RING = "a ring on compact rows"
    SWAPPED = "a compact ring run head-parallel"


@dataclass(frozen=True)
class Piece:
    """One kernel call of a split causal square (``split_pieces``): ``plan`` on views that cut the rows in spans of
    ``span`` dilated rows, each span one batch row of the call. ``rectangle``: the queries of each span's second
    half against the keys of its first half, non-causal; else the spans themselves, causal."""

    span: int
    rectangle: bool
    plan: PatternPlan


@dataclass(frozen=True)
class Stack:
    """Local patterns (``members``: their positions in the block's plans) run as one ``dense`` pattern over a buffer
    holding each member's compact rows at ``spans`` (first row, end row) of its rows dim."""

    members: tuple[int, ...]
    plans: tuple[PatternPlan, ...]
    spans: tuple[tuple[int, int], ...]
    dense: PatternPlan
    rows: int

    def slices(self, results: tuple[torch.Tensor, ...]) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
        """Each member's position and its compact parts of the stack's ``results``: their rows at its span."""
        for i, (a, b) in zip(self.members, self.spans):
            yield i, tuple(x[:, a:b] for x in results)


@dataclass(frozen=True)
class Share:
    """A causal ring on contiguous blocks, balanced (``cross_share.py``): the ring position ``p`` sees ``p`` earlier
    blocks whole, so the last rank would do ``G - 1`` blocks of cross work while the first does none. Here each rank
    computes only its first ``half`` query rows against the earlier blocks; its second half goes to every earlier
    rank of the ring (its ``helpers``), which computes it against its own K/V and sends the result back.
    ``guests``: the later ranks whose second halves this rank computes."""

    half: int
    helpers: tuple[int, ...]
    guests: tuple[int, ...]


@dataclass(frozen=True)
class Route:
    """How the pattern at ``position`` of a block's plans runs in one direction (module doc)."""

    position: int
    plan: PatternPlan
    way: Way
    fresh: bool = False  # MERGED: the first merged, covering every row and head: it writes the running result
    pieces: tuple[Piece, ...] = ()  # MERGED, local: a causal square split into calls
    split: int = 0  # rings: the causal block a ring step's causal call splits into (0: whole)
    dense: PatternPlan | None = None  # COMPACT_RING, SWAPPED: the plan read on compact rows (``dense_view``)
    share: Share | None = None  # MERGED and COMPACT_RING rings: their cross blocks shared
    stack: Stack | None = None  # STACKED
    members: tuple[int, ...] = ()  # rings: the ring's group ranks, ascending
    inner: Route | None = None  # SWAPPED: the segment on its head-layout rows, a local pattern

    @property
    def leaves_part(self) -> bool:
        """Whether its result (gradients) comes as compact parts rather than merged in place."""
        return self.way is not Way.MERGED


@dataclass(frozen=True)
class Routes:
    """One direction's routes of a block's patterns (by position) and the order they are computed in."""

    routes: tuple[Route, ...]
    order: tuple[int, ...]

    def stacks(self) -> tuple[Stack, ...]:
        return tuple({r.stack: None for r in self.routes if r.stack is not None})


ROUTE_LAYOUTS = 16  # block layouts a RingPlan keeps the routes of (a schedule's blocks have one or two)


@dataclass(frozen=True)
class Ranks:
    """What the routes read of a backend: this rank and the group's size."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class RingPlan:
    """Everything a block's attention decides before touching data: its patterns (those some local head uses),
    the kernel and flags, this rank in its group (``None``: one device), and, per block layout, every pattern's
    route in each direction (``routes``). ``masked``: the block runs with a key mask."""

    plans: tuple[PatternPlan, ...]
    kernel: PatternKernel
    layout: RingLayout
    causal: bool
    scale: float
    masked: bool
    ranks: Ranks | None = None
    decided: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    def routes(self, q: torch.Tensor, k: torch.Tensor) -> tuple[Routes, Routes]:
        """The forward's and the backward's routes of a block ``q`` (``(B, rows, heads, D)``), ``k``: decided at its
        layout's first call and kept (what the kernel's choices read besides shapes fixed by the plan)."""
        key = (q.stride(), k.stride(), q.data_ptr() % ALIGN_BYTES, k.data_ptr() % ALIGN_BYTES)
        found = self.decided.get(key)
        if found is None:
            if len(self.decided) >= ROUTE_LAYOUTS:
                self.decided.clear()
            found = self.decided[key] = tuple(_routes(self, d, q, k) for d in ("fwd", "bwd"))
        return found


@dataclass(frozen=True)
class RingCall:
    """One call's attention on this rank's block: its plan, the backend and the call's number (stamps)."""

    plan: RingPlan
    comm: CommBackend | None
    call: int


def stand_in(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous, aligned tensor of ``like``'s dtype and device with ``shape`` and no memory: a block as a fresh
    allocation lays it out, for the routes of a block that does not exist yet (the memory estimate's)."""
    strides = torch.empty(shape, device="meta").stride()
    return like.new_empty(0).set_(torch.UntypedStorage(0, device=like.device), 0, shape, strides)


def plan_ring(plans, kernel: PatternKernel, *, causal: bool, scale: float, masked: bool = False,
              comm: CommBackend | None = None, layout: RingLayout = RingLayout()) -> RingPlan:
    """A block's plan over ``plans``, on this rank of ``comm`` (``None``: one device, every pattern local)."""
    plans = tuple(p for p in plans if p.chunks)  # (no local head may use a pattern: grouped mode, head-parallel)
    ranks = None if comm is None else Ranks(comm.rank, comm.world_size)
    return RingPlan(plans, kernel, layout, causal, scale, masked, ranks)


def _routes(ring: RingPlan, direction: str, q, k) -> Routes:
    tuning, plans, kernel, causal, masked, comm, layout = (TUNING, ring.plans, ring.kernel, ring.causal, ring.masked,
                                                           ring.ranks, ring.layout)
    stacked = _stacks(kernel, direction, plans, q, k, causal, masked)
    rank = comm.rank if comm is not None else None
    found = []
    for i, plan in enumerate(plans):
        dense = dense_ring(plan, masked, layout, q, k)
        members = () if comm is None or plan.ring_size == 1 else \
            layout.members(comm.rank, plan.ring_size, comm.world_size // layout.stride)
        if _swaps(plan, dense, members, layout, causal, q, k):
            rows, g = q.shape[1] // plan.dilation * len(members), len(members)
            hq, hk = (stand_in(x, (x.shape[0], rows, x.shape[2] // g, x.shape[3])) for x in (q, k))
            inner = local_route(kernel, direction, whole_plan(rows, hq.shape[2], hk.shape[2]), hq, hk, causal, False)
            found.append(Route(i, plan, Way.SWAPPED, dense=dense, members=members,
                               inner=replace(inner, fresh=not inner.leaves_part)))
        elif i in stacked:
            found.append(Route(i, plan, Way.STACKED, stack=stacked[i]))
        elif plan.ring_size == 1:
            found.append(local_route(kernel, direction, plan, q, k, causal, masked, i))
        elif dense is not None:
            qc = stand_in(q, (q.shape[0], q.shape[1] // plan.dilation, *q.shape[2:]))
            split = causal_block(kernel, direction, dense, qc, k) if causal else 0
            found.append(Route(i, plan, Way.COMPACT_RING, split=split, dense=dense, members=members,
                               share=plan_share(dense, layout, causal, members, rank, qc.shape[1], True)))
        else:
            split = causal_block(kernel, direction, plan, q, k) if causal and not masked else 0
            found.append(Route(i, plan, Way.MERGED, split=split, members=members,
                               share=plan_share(plan, layout, causal, members, rank, q.shape[1], False)))
    def where(*ways: Way) -> list[int]:
        return [i for i, r in enumerate(found) if r.way in ways]

    if direction == "fwd":  # plan order
        order = where(Way.MERGED, Way.PART, Way.STACKED, Way.COMPACT_RING)
    else:  # compact rings after ``ring_after`` of the others
        order, at = where(Way.MERGED, Way.PART, Way.STACKED), tuning.ring_after[causal]
        order[at:at] = where(Way.COMPACT_RING)
    order[tuning.swap_after:tuning.swap_after] = where(Way.SWAPPED)
    first = next((i for i in order if found[i].way is Way.MERGED), None)
    if first is not None and plans[first].covers_all(q.shape[2], k.shape[2]):
        found[first] = replace(found[first], fresh=True)
    return Routes(tuple(found), tuple(order))


def local_route(kernel, direction: str, plan: PatternPlan, q, k, causal: bool, masked: bool, position: int = 0
                ) -> Route:
    """A local pattern's route: split into pieces where its kernel splits long causal squares (unmasked causal calls
    only: a key mask's slices stay whole), else a compact part where the kernel leaves one, else merged."""
    split = causal_block(kernel, direction, plan, q, k) if causal and not masked else 0
    pieces = split_pieces(plan, split)
    if not pieces and kernel.parts(direction, plan, q, k, causal=causal, masked=masked):
        return Route(position, plan, Way.PART)
    return Route(position, plan, Way.MERGED, pieces=pieces)


@caches.memoize("routes.whole_plan", 256)  # asked per swapped pattern when a call is planned
def whole_plan(rows: int, heads: int, kv_heads: int) -> PatternPlan:
    """One segment over all of ``rows`` rows, rate 1: a swapped pattern's computation on its head-layout rows."""
    return plan_patterns([rows], [1], seq_len=rows, local_len=rows, num_heads=heads, num_kv_heads=kv_heads)[0]


def split_pieces(plan: PatternPlan, block: int) -> tuple[Piece, ...]:
    """A causal square of ``M = plan.local_segment / r`` rows (every segment of the plan) as kernel calls whose
    causal squares have at most ``block`` rows; ``()`` where it stays one call.

    Why: flash-attn-4's and cuDNN's deterministic causal backwards are slow on long causal squares (full causal
    attention over 65536 rows: FA4 0.77-0.87x of cuDNN's atomic one), while their non-causal backwards and small
    causal blocks are fast; split, FA4 measured 0.91-1.05x. Only squares of more than ``Tuning.whole_blocks`` blocks
    are split. Blocks have ``b = M / 2^j`` rows, the least ``j >= 1`` with ``b <= block`` (``()`` if
    ``M <= whole_blocks * block``, ``block <= 0`` or ``2^j`` does not divide ``M``). Calls, all zero-copy views:

    * the diagonal: every block of ``b`` rows, causal, in one call (blocks folded into the batch dimension;
      ``plan`` read on segments of ``b * r`` rows);
    * per span ``t = M, M / 2, ..., 2b`` (``j`` calls): every span's second half of queries against its first
      half of keys, non-causal, in one call (``plan`` on segments of ``t / 2 * r`` rows).

    A (query, key) pair below the diagonal blocks lies in exactly one rectangle: that of the smallest span
    holding both. Every dilated row stays whole (spans are multiples of ``r`` rows): each view is the kernel's
    usual dilated view of a block, so what it reads in place it still reads in place.
    """
    return _split_pieces(plan, block, TUNING.whole_blocks)


@caches.memoize("routes.pieces", 1024)  # asked per causal pattern when a call is planned
def _split_pieces(plan: PatternPlan, block: int, whole_blocks: int) -> tuple[Piece, ...]:
    m = plan.local_segment // plan.dilation
    if block <= 0 or m <= whole_blocks * block:
        return ()
    levels = 1
    while m >> levels > block:
        levels += 1
    if m % (1 << levels):
        return ()
    b, r = m >> levels, plan.dilation
    diagonal = Piece(b, False, plan.with_local_segment(b * r))
    return (diagonal, *(Piece(m >> j, True, plan.with_local_segment((m >> j) // 2 * r)) for j in range(levels)))


@caches.memoize("routes.dense_view", 256)  # asked per ring pattern when a call is planned
def dense_view(plan: PatternPlan) -> PatternPlan:
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


def dense_ring(plan: PatternPlan, masked: bool, layout: RingLayout, q: torch.Tensor, k: torch.Tensor
               ) -> PatternPlan | None:
    """``dense_view(plan)`` where a ring pattern can run on compact rows, else ``None``: rate above 1, no key mask
    (its rows differ per head offset), each query and kv head in one chunk, the packed heads the kv heads in order
    (so the dK/dV accumulator is the kv part), whole dilated rows per chunk."""
    if plan.ring_size == 1 or plan.dilation == 1 or masked:
        return None
    heads, kv_heads = q.shape[2], k.shape[2]
    if plan.head_offsets(heads) is None or plan.head_offsets(kv_heads, kv=True) is None:
        return None
    if plan.packed_heads != kv_heads or any(c.buffer_head != c.k0 for c in plan.chunks):
        return None
    if q.shape[1] % (plan.dilation * (2 if layout.zigzag else 1)):
        return None
    return dense_view(plan)


def _swaps(plan: PatternPlan, dense: PatternPlan | None, members: tuple[int, ...], layout: RingLayout, causal: bool,
           q, k) -> bool:
    """Whether a ring of ``members`` runs head-parallel (``SWAPPED``): a compact ring of contiguous blocks, read by
    every query head (grouped mode gives a pattern some heads only: a kv head's other query heads would add to its
    gradient), whose ranks divide the query and the kv heads, where ``Tuning.swapped_rings`` says."""
    return (dense is not None and not layout.zigzag and TUNING.swaps_rings(causal) and len(members) >= 2
            and -1 not in plan.head_offsets(q.shape[2]) and not q.shape[2] % len(members)
            and not k.shape[2] % len(members))


def plan_share(reads: PatternPlan, layout: RingLayout, causal: bool, members: tuple[int, ...],
               rank: int | None, rows: int, compact: bool = False) -> Share | None:
    """How the ring of ``members`` on blocks of ``rows`` query rows, read with ``reads`` (a compact ring's dense
    view, else the pattern's plan), shares its cross blocks, seen from group rank ``rank``: causal rings on contiguous blocks of at least ``share_min_rows`` rows (``share_min_compact_rows``
    for ``compact`` ones), whole dilated rows per half, of at most ``share_max_ranks`` ranks; else ``None``."""
    tuning = TUNING
    least = tuning.share_min_compact_rows if compact else tuning.share_min_rows
    if not causal or layout.zigzag or not 2 <= len(members) <= tuning.share_max_ranks or rows < least \
            or rows % (2 * reads.dilation):
        return None
    pos = members.index(rank)
    return Share(rows // 2, members[:pos], members[pos + 1:])


def _joins(plan: PatternPlan, heads: int, kv_heads: int) -> bool:
    """Whether ``plan`` may join a stack: local, dilated, one offset for every query and kv head."""
    if plan.ring_size != 1 or plan.dilation == 1:
        return False
    offsets, kv_offsets = plan.head_offsets(heads), plan.head_offsets(kv_heads, kv=True)
    return offsets is not None and kv_offsets is not None and -1 not in offsets and -1 not in kv_offsets


@caches.memoize("routes.stacks", 256)  # asked per direction when a call is planned
def find_stacks(plans: tuple[PatternPlan, ...], rows: int, heads: int, kv_heads: int) -> tuple[Stack, ...]:
    """Every group of joining patterns with one compact segment length, on blocks of ``rows`` rows."""
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(plans):
        if _joins(p, heads, kv_heads):
            by_length.setdefault(p.local_segment // p.dilation, []).append(i)
    out = []
    for m, members in by_length.items():
        spans, at = [], 0
        for i in members:
            spans.append((at, at + rows // plans[i].dilation))
            at = spans[-1][1]
        first = plans[members[0]]
        dense = PatternPlan(first.index, m, 1, m, 1, (HeadChunk(0, 0, heads, 0, kv_heads, 0),), ((0, 0, heads),))
        out.append(Stack(tuple(members), tuple(plans[i] for i in members), tuple(spans), dense, at))
    return tuple(out)


def _stacks(kernel, direction: str, plans: tuple[PatternPlan, ...], q, k, causal: bool, masked: bool
            ) -> dict[int, Stack]:
    """The stacks of an unmasked causal call's local patterns, by member position (``stacking.py``'s module doc:
    where the kernel would run the stack, ``protocol.stacks``; causal calls only)."""
    if masked or not causal:
        return {}
    found = find_stacks(plans, q.shape[1], q.shape[2], k.shape[2])
    return {i: s for s in found
            if len(s.members) >= TUNING.stack_min_patterns and stacks(kernel, direction, s.dense, causal, q, k)
            for i in s.members}
