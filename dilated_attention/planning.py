"""Planning: a call's schedule, decided before touching data, and agreed across ranks once per configuration.

``schedule`` validates a call (``validation.py``) and decides everything but the data: the strategy's team size
``A`` (``"ring"`` is ``A = 1``, ``"head"`` is ``A = P``, ``"hybrid"`` in between, ``"auto"`` what
``auto_strategy.py`` measured fastest), how heads are dealt over a team (``head_parallel.HeadSplit``), the pattern
plans (of the rings across teams, or of the whole sequence's batches: ``batching.py``), the kernel, and the
head chunks that bound its memory (``memory.py``). ``prepare`` adds, with ``comm``, the call's number and the
cross-rank agreement (``consistency.agree``); a repeated call reuses its schedule (``schedule_key``) and its
signature's text. What it keeps per backend is ``CallState``.
"""

from __future__ import annotations

import functools
import os
import weakref
import zlib
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

import torch

from . import caches, hooks, memory, misuse
from .batching import Batch, pads, whole_batches
from .caches import typed
from .comm.base import CommBackend
from .consistency import agree, call_signature, signature_text
from .auto_strategy import auto_team_size, pattern_spans
from .head_parallel import HeadSplit, HeadSwap
from .kernels.dispatch import select_kernel
from .kernels.guard import guard_kernel
from .kernels.protocol import PatternKernel
from .memory import HeadRange, head_ranges, own_bytes, scratch_bytes
from .patterns import PatternPlan, hybrid_team_size, padded_length, plan_patterns, zigzag_half
from .ring import routes
from .ring.documents import Documents, plan_documents
from .ring.layout import Padded, RingLayout, padded_shard
from .ring.routes import RingCall, RingPlan, Routes, plan_ring, stand_in
from .validation import check_cu_seqlens, check_flags, check_key_padding_mask, check_scale, check_tensors
from .views import layout_key


@dataclass(frozen=True)
class Schedule:
    """What a call decided before touching data: strategy, plans, kernel and every pattern's route, for forward and
    backward."""

    backend: CommBackend | None
    strategy: str
    team: int  # ranks that swap sequence for heads (1: no swap)
    split: HeadSplit
    batches: tuple[Batch, ...] | None  # the whole sequence on this rank (team == world)
    blocks: tuple[RingPlan, ...] | None  # else this rank's block of rings across teams (per head range)
    docs: tuple[int, ...] | None
    kernel: PatternKernel | None  # None when planned for shapes only (then no routes either)
    causal: bool
    scale: float
    zigzag: bool = False  # the shards are in the zigzag layout (ring.layout.RingLayout), over more than one rank
    heads: tuple[HeadRange, ...] = ()  # the head chunks run one after another (``memory.py``); () = all at once
    padded: Padded | None = None  # rings over shards the segments do not tile: their padded shards
    documents: Documents | None = None  # packed documents on rings: where each document runs
    parts: tuple[Schedule, ...] = ()  # with ``documents``: each group's call (batch rows: its documents)
    alone: bool = False  # a group of whole documents, which this rank runs alone (no backend)

    def rings(self, call: int, batch: Batch | None = None) -> tuple[RingCall, ...]:
        """Per head range: the rank's block of rings across teams, or (a whole-sequence ``batch``) a block whose
        every pattern is local."""
        if batch is not None:
            return tuple(RingCall(r, None, 0) for r in batch.rings)
        return tuple(RingCall(r, self.backend, call) for r in self.blocks)

    def on(self, backend: CommBackend | None) -> Schedule:
        """This schedule with ``backend`` (a kept schedule holds none: no cycle keeps the process group alive)."""
        return replace(self, backend=None if self.alone else backend, parts=tuple(p.on(backend) for p in self.parts))

    def chunk(self, i: int) -> Schedule:
        """Head chunk ``i`` alone, on tensors holding only its heads (a head strategy's chunked swap)."""
        batches = None if self.batches is None else \
            tuple(replace(b, plans=(b.plans[i],), rings=(b.rings[i],)) for b in self.batches)
        blocks = None if self.blocks is None else (self.blocks[i],)
        return replace(self, batches=batches, blocks=blocks, heads=())

    def swap(self, call: int) -> HeadSwap:
        first = self.backend.rank - self.backend.rank % self.team
        return HeadSwap(self.backend, tuple(range(first, first + self.team)), self.split,
                        f"call {call}, strategy {self.strategy!r} (team of {self.team})", call, self.zigzag)


def team_size(strategy: str, world: int, heads: int, auto: Callable[[], int]) -> int:
    """Ranks that swap sequence for heads (``A``): 1 for ``"ring"``, the world for ``"head"``, ``auto()``
    (``auto_strategy.py``: what the scaling benchmark measured fastest) for ``"auto"``. ``hybrid``: a2a
    inside a node (``LOCAL_WORLD_SIZE`` ranks) and the ring across nodes when that divides the heads,
    else the largest proper divisor of the world that divides the heads.
    """
    if strategy == "ring" or world == 1:
        return 1
    if strategy == "head":
        return world
    if strategy == "auto":
        return auto()
    team = hybrid_team_size(world, heads, local_world())
    if team is None:
        raise ValueError(f'strategy="hybrid" needs a team size that divides both the world size ({world}) and the '
                         f"number of query heads ({heads}); none exists")
    return team


@caches.memoize("planning.gpu_model", 16)  # asked per call with comm; a process sees few devices
def gpu_model(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)


def ring_plans(segment_lengths, dilation_rates, n: int, local: int, heads: int, kv_heads: int, layout: str) -> bool:
    """Whether the patterns tile shards of ``local`` rows so that rings can run them (else only
    head-parallel, which holds the whole sequence, pads and runs documents)."""
    try:
        plan_patterns(segment_lengths, dilation_rates, seq_len=n, local_len=local, num_heads=heads,
                      num_kv_heads=kv_heads, layout=layout)
    except ValueError:
        return False
    return True



class Part(NamedTuple):
    """A group of a packed call's documents, planned as a ring call of its own (``document_rings``): the caller's
    team, and the head ranges the documents run in (``None``: the group's own rule)."""

    team: int
    ranges: tuple[HeadRange, ...] | None = None


class CallOptions(NamedTuple):
    """A call's arguments besides ``q``, ``k``, ``v`` and ``comm``, as ``dilated_attention`` takes them: what travels
    from the API to the op and the plan (a tuple: a schedule's key reads it without a Python call)."""

    segment_lengths: Sequence[int]
    dilation_rates: Sequence[int]
    mode: str = "longnet"
    causal: bool = False
    softmax_scale: float | None = None
    key_padding_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    pad_to_segments: bool = True
    head_offsets: str = "spread"
    strategy: str = "auto"
    kernel: object = "auto"
    layout: str = "contiguous"


def schedule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: CommBackend | None, options: CallOptions,
             *, shapes_only: bool = False, record: bool = True, part: Part | None = None) -> Schedule:
    """Validate a call and decide everything but the data: raises ``ValueError``/``TypeError``.

    ``shapes_only``: what output shapes need, from shapes alone (no ``cu_seqlens`` values, no kernel):
    a custom op's fake implementation. ``record``: kernel hooks may record the call (once per call, not
    again when a compiled backward plans it anew). ``part``: a packed call's group of documents
    (``document_rings``), planned with its caller's team and head ranges.
    """
    (segment_lengths, dilation_rates, mode, causal, softmax_scale, key_padding_mask, cu_seqlens, pad_to_segments,
     head_offsets, strategy, kernel, layout) = options
    world = backend.world_size if backend is not None else 1
    check_tensors(q, k, v)
    check_flags(causal, pad_to_segments, strategy, layout)
    scale = check_scale(softmax_scale, q.shape[-1], q.dtype)
    bsz, local, heads, _ = q.shape
    zigzag = layout == "zigzag" and world > 1  # on one rank the zigzag order is the natural one
    if zigzag:
        zigzag_half(local)
    if part is None:  # (a group of documents: its caller's shapes were checked)
        misuse.check_shape(q.shape, local * world, segment_lengths, dilation_rates, pad=pad_to_segments,
                           documents=cu_seqlens is not None)

    def auto() -> int:
        spans, dense = pattern_spans(segment_lengths, dilation_rates, local * world, local)
        whole = not ring_plans(segment_lengths, dilation_rates, local * world, local, heads, k.shape[2], layout)
        return auto_team_size(world, heads, k.shape[2], causal=causal, spans=spans, dense=dense,
                              local_world=local_world(), layout=layout, whole_sequence=whole,
                              gpu=gpu_model(q.device.index) if q.is_cuda else None)

    team = team_size(strategy, world, heads, auto) if part is None else part.team
    split = HeadSplit(heads, k.shape[2], team)
    reason = split.check()
    if reason is not None:
        raise ValueError(f"strategy={strategy!r}: {reason}")
    lane = backend.rank % team if backend is not None else 0
    key_mask = check_key_padding_mask(key_padding_mask, q)
    docs = check_cu_seqlens(cu_seqlens, q, local * world, read=not shapes_only)

    def plan(length: int, local_len: int | None = None, shards: str = "contiguous", part: HeadRange | None = None
             ) -> tuple[PatternPlan, ...]:
        """The plans of this rank's local heads, or of the head range ``part`` of them."""
        part = part or HeadRange(0, split.local_heads, 0, split.local_kv_heads)
        return plan_patterns(
            segment_lengths, dilation_rates, seq_len=length, local_len=local_len or length,
            num_heads=part.h1 - part.h0, num_kv_heads=part.k1 - part.k0, mode=mode, head_offsets=head_offsets,
            head_start=lane * split.local_heads + part.h0, total_heads=heads, layout=shards,
        )

    batches = plans = padded = None
    shard = local  # rows of this rank's shard that the rings see
    if team == world:  # the whole sequence on this rank: padding and documents are local matters
        batches = whole_batches(segment_lengths, dilation_rates, local * world, docs, pad_to_segments, plan)
    elif cu_seqlens is not None:  # packed documents on rings: each dealt over the ranks (``ring/documents.py``)
        if shapes_only:
            raise ValueError("cu_seqlens on a ring is not supported under torch.compile (where the offsets are data "
                             "and the documents' layout depends on them): call it eagerly, or use strategy='head'")
        documents, parts = document_rings(q, k, v, backend, options, team, docs, record)
        return Schedule(backend, strategy, team, split, None, None, docs, None, causal, scale,
                        documents=documents, parts=parts)
    else:  # rings across teams; a team's rows are in the shards' layout (head_parallel.member_rows)
        if pad_to_segments and not zigzag:  # shards the segments do not tile run padded (``ring.layout.Padded``)
            least = padded_length(segment_lengths, dilation_rates, local * world)

            def fits(rows: int) -> bool:
                return rows * world >= least and ring_plans(segment_lengths, dilation_rates, rows * world,
                                                            rows * team, heads, k.shape[2], layout)

            if not fits(local):
                shard = padded_shard(fits, local, world, least, segment_lengths, dilation_rates) or local
        if shard != local:
            padded = Padded(local * world, local, shard, world)
        try:
            plans = (plan(shard * world, shard * team, layout),)
        except ValueError as exc:  # in the numbers the caller passed: shards, not the sequence they make
            fix = "" if pad_to_segments else "; pad_to_segments=True runs them on padded shards"
            raise ValueError(f"{exc}: with comm the sequence is the {world} ranks' shards of {local} rows each "
                             f"({local * world} rows){fix}") from None
    if backend is not None:
        for name, t in (("q", q), ("k", k), ("v", v), ("key_padding_mask", key_mask)):
            reason = backend.check_device(name, t) if t is not None else None
            if reason is not None:
                raise ValueError(reason)
    chosen, ranges, blocks = None, (), None
    if not shapes_only:
        masked = key_mask is not None or padded is not None or \
            (batches is not None and any(pads(b, local * world) for b in batches))
        # without a key_padding_mask, the only masks are the padding ``_run_mask`` adds
        chosen = select_kernel(kernel, q, k, masked, padding_only=key_mask is None)
        meta = {}
        if hooks.active():  # none by default (debug mode, the runtime audit): one module-global check
            named = options._asdict()
            del named["segment_lengths"], named["dilation_rates"]
            call = hooks.Call(q, k, v, segment_lengths, dilation_rates, backend, named, record, meta)
            chosen = hooks.apply_kernel_hooks(chosen, call)
        chosen = guard_kernel(chosen, meta)  # CUDA faults re-raised with the call's shapes; resource errors fall back

        def routed(plans: tuple[PatternPlan, ...], batch: Batch | None) -> RingPlan:
            """The plan of a block of ``plans``: a whole-sequence ``batch``, else this rank's block of rings."""
            return plan_ring(plans, chosen, causal=causal, scale=scale,
                             masked=key_mask is not None or padded is not None
                             or (batch is not None and pads(batch, local * world)),
                             comm=None if batch is not None else backend,
                             layout=RingLayout() if batch is not None else RingLayout(team, zigzag))

        def estimated(ring: RingPlan, rows: int, count: int) -> Routes:
            """The backward's routes of a block of ``rows`` rows on whole heads, laid out as a fresh tensor."""
            qs, ks = (stand_in(x, (count, rows, h, x.shape[-1])) for x, h in ((q, split.local_heads),
                                                                             (k, split.local_kv_heads)))
            return ring.routes(qs, ks)[1]

        if batches is not None:
            batches = tuple(replace(b, rings=(routed(b.plans[0], b),)) for b in batches)
            largest = max(batches, key=lambda b: b.length * b.count)  # documents of one length run as batch rows
            ranges = part.ranges if part is not None and part.ranges is not None else \
                head_chunks(q, split, largest.length * largest.count * bsz, causal,
                            lambda: estimated(largest.rings[0], largest.length, bsz * largest.count))
        else:
            blocks = (routed(plans[0], None),)
            ranges = part.ranges if part is not None and part.ranges is not None else \
                head_chunks(q, split, shard * team * bsz, causal, lambda: estimated(blocks[0], shard * team, bsz))
        if ranges:  # re-planned per head range
            if batches is not None:
                batches = tuple(replace(b, plans=ps, rings=tuple(routed(p, b) for p in ps))
                                for b in batches for ps in (tuple(plan(b.length, part=r) for r in ranges),))
            else:
                blocks = tuple(routed(plan(shard * world, shard * team, layout, r), None) for r in ranges)
    return Schedule(backend, strategy, team, split, batches, blocks, docs, chosen, causal, scale, zigzag, ranges,
                    padded)


def document_rings(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: CommBackend, options: CallOptions,
                   team: int, docs: tuple[int, ...], record: bool) -> tuple[Documents, tuple[Schedule, ...]]:
    """Packed documents on rings across teams of ``team``: where each document runs (``ring.documents``) and
    each group's ring call, planned as a call of its own on a batch row per document.

    A document runs on the fewest rows per rank, at least its padded length in all, that the patterns tile
    (without ``pad_to_segments``, exactly its rows); causal calls deal documents in zigzag halves, which gives
    every rank the same share of each document's causal work."""
    world = backend.world_size
    shard = document_shard(options.segment_lengths, options.dilation_rates, options.pad_to_segments, world, team,
                           q.shape[2], k.shape[2], options.causal)
    documents = plan_documents(docs, q.shape[1], backend.rank, world, options.layout == "zigzag", shard,
                               document_alone(options.segment_lengths, options.dilation_rates, options.pad_to_segments))

    def plan_parts(ranges: tuple[HeadRange, ...] | None) -> tuple[Schedule, ...]:
        parts = []
        for i, g in enumerate(documents.groups):
            rows = (len(g.spans), g.shard)
            masked = g.pads or options.key_padding_mask is not None
            mask = torch.empty(rows, dtype=torch.bool, device=q.device) if masked else None
            group = options._replace(key_padding_mask=mask, cu_seqlens=None, pad_to_segments=False,
                                     layout="zigzag" if g.zigzag else "contiguous")
            try:
                planned = schedule(*(stand_in(x, (*rows, *x.shape[2:])) for x in (q, k, v)),
                                   None if g.alone else backend, group, record=record and i == 0,
                                   part=Part(1 if g.alone else team, ranges))
            except ValueError as exc:  # (named by the documents the caller passed)
                raise ValueError(f"cu_seqlens: documents of {sorted({b - a for a, b in g.spans})} rows: {exc}"
                                 ) from None
            parts.append(replace(planned, alone=True) if g.alone else planned)
        return tuple(parts)

    # Memory: a call whose own bytes reach the head-chunk rule's floor moves a group at a time, in as many head
    # chunks as bring the largest group's moved copies within ``memory.DOCUMENT_SHARE`` of its own bytes (the
    # hybrid's groups whole: its head swap splits the heads already); smaller calls move everything at once.
    shape = (q.shape[2], k.shape[2], q.shape[3], q.element_size())
    own = own_bytes(q.shape[1], *shape)
    if own >= memory.BOUND.floor:
        ranges = ()
        if team == 1:
            # (the same on every rank: their exchanges must match) a dealt group, or the most whole documents' rows
            moved = own_bytes(max([g.rows for g in documents.groups if not g.alone] + [documents.widest]), *shape)
            ranges = head_ranges(moved, own, q.shape[2], k.shape[2], share=memory.DOCUMENT_SHARE)
        documents = replace(documents, units=tuple((i, i + 1) for i in range(documents.buckets_count)),
                            heads=ranges if len(ranges) > 1 else ())
    return documents, plan_parts(documents.heads or None)


def document_alone(segments: Sequence[int], rates: Sequence[int], pad: bool
                   ) -> tuple[Callable[[int], int], Callable[[int], float]]:
    """How a document runs whole on one rank (``ring.documents.place_whole``): its rows there (padded as one device
    pads), and the work of that many rows (per head, each pattern's queries times the keys each sees)."""
    def padded(rows: int) -> int:  # (asked of every document on every rank: a refusal is every rank's)
        if pad:
            return padded_length(segments, rates, rows)
        if padded_length(segments, rates, rows) != rows:
            raise ValueError(f"cu_seqlens: a document of {rows} rows is not a length the patterns tile "
                             f"(segment_lengths={list(segments)}, dilation_rates={list(rates)}), and "
                             "pad_to_segments=False; pad_to_segments=True pads it")
        return rows

    def cost(rows: int) -> float:
        return sum(rows * min(w, rows) / r ** 2 for w, r in zip(segments, rates))

    return padded, cost


def document_shard(segments: Sequence[int], rates: Sequence[int], pad: bool, world: int, team: int, heads: int,
                   kv_heads: int, causal: bool) -> Callable[[int], tuple[int, bool]]:
    """How a document of ``rows`` rows runs on a ring (``ring.documents``): the rows per rank, the fewest, at least
    its padded length in all, that the patterns tile (without ``pad``, exactly its rows), and whether it is dealt in
    zigzag halves (causal calls, where the patterns tile the halves at little cost; else consecutive blocks)."""

    def fits(rows: int, zigzag: bool) -> bool:  # (zigzag: each rank's rows are two halves)
        return (not zigzag or rows % 2 == 0) and ring_plans(segments, rates, rows * world, rows * team, heads,
                                                             kv_heads, "zigzag" if zigzag else "contiguous")

    def fewest(rows: int, least: int, zigzag: bool) -> int | None:
        if not pad:
            return rows // world if rows % world == 0 and fits(rows // world, zigzag) else None
        return padded_shard(lambda s: s * world >= least and fits(s, zigzag), -(-least // world), world, least,
                            segments, rates)

    @functools.cache
    def shard(rows: int) -> tuple[int, bool]:
        least = padded_length(segments, rates, rows) if pad else rows
        blocks = fewest(rows, least, False)
        halves = fewest(rows, least, True) if causal and world > 1 else None
        # zigzag where it costs at most an eighth more rows (the balance it buys is worth more than that)
        if halves is not None and (blocks is None or 8 * halves <= 9 * blocks):
            return halves, True
        if blocks is not None:
            return blocks, False
        if not pad:
            raise ValueError(f"cu_seqlens: a document of {rows} rows is not {world} shards (the ranks) that the "
                             "patterns tile, and pad_to_segments=False; pad_to_segments=True pads it")
        raise ValueError(f"cu_seqlens: no shard the patterns tile holds a document of {rows} rows over {world} "
                         f"ranks (segment_lengths={list(segments)}, dilation_rates={list(rates)})")

    return shard


def head_chunks(q, split: HeadSplit, rows: int, causal: bool, routes: Callable[[], Routes]
                ) -> tuple[HeadRange, ...]:
    """The head ranges a call runs in (``memory.py``'s rule), from the backward ``routes()`` of its largest block on
    whole heads, of ``rows`` rows in all (every batch row); () for all at once."""
    shape = (split.local_heads, split.local_kv_heads, q.shape[-1], q.element_size())
    own = own_bytes(rows, *shape)

    def scratch() -> int:  # (asked only of calls long enough to chunk: it asks the kernel about every pattern)
        # the head strategy's swaps: the head-layout q, k, v, out, dout and gradients, own bytes' worth
        return scratch_bytes(routes(), rows, *shape, causal=causal) + (own if split.team > 1 else 0)

    ranges = head_ranges(scratch, own, split.local_heads, split.local_kv_heads)
    return ranges if len(ranges) > 1 else ()


SCHEDULES = caches.table("planning.schedules", 256)
# packed calls' schedules: a batch's layers share one, the next batch brings other documents (and each holds index
# tensors of its rows' moves on the device): a few kept
DOCUMENT_SCHEDULES = caches.table("planning.document_schedules", 2)
# environment the kernel choice reads (auto's nondeterministic entries; the fused kernel on CPU tensors)
KERNEL_CHOICE_ENV = ("DILATED_ATTENTION_NONDETERMINISTIC", "TRITON_INTERPRET")


SCHEDULES_KEPT = 256  # configurations a backend's calls remember (a table that fills up starts over)


class CallState:
    """What the call layer keeps per backend: the calls made through it (their numbers name them in stamps and
    timeout messages), the call signatures every rank has agreed on (``consistency.agree``) and the calls'
    ``(schedule, signature text)`` (``prepare``). Held here, not by the backend, which only moves bytes; keyed by
    the backend's identity and dropped with it (``call_state``), so that nothing keeps its process group alive."""

    __slots__ = ("calls", "agreed", "schedules", "documents")

    def __init__(self) -> None:
        self.calls = 0
        self.agreed: set[str] = set()
        self.schedules = caches.Table(SCHEDULES_KEPT)
        self.documents = caches.Table(DOCUMENT_SCHEDULES.kept)  # packed calls (``DOCUMENT_SCHEDULES``)


_STATES: dict[int, CallState] = {}  # by id(backend); an entry goes with its backend (weakref.finalize)


def call_state(backend: CommBackend) -> CallState:
    """``backend``'s call state, made at its first call."""
    state = _STATES.get(id(backend))
    if state is None:
        state = _STATES[id(backend)] = CallState()
        weakref.finalize(backend, _STATES.pop, id(backend), None)
    return state


def _fullest_schedules() -> int:
    return max((len(state.schedules) for state in list(_STATES.values())), default=0)


def _clear_schedules() -> None:
    for state in list(_STATES.values()):
        state.schedules.clear()
        state.documents.clear()


caches.register("planning.backend_schedules", _fullest_schedules, SCHEDULES_KEPT, _clear_schedules)


def schedule_key(q, k, v, options: CallOptions) -> tuple | None:
    """Everything a call's ``schedule`` reads, as a key, or ``None`` where it reads more (a key mask: its values; a
    kernel hook: it may record each call). Validating and planning a call costs about 0.2 ms of host time (0.6 ms
    with ``comm``, and 0.2 more for the signature; packed documents on a ring several ms), and a LongNet forward is
    host-bound: a training loop's repeated calls reuse the schedule (``prepare`` adds what a call with ``comm`` reads
    besides). Values carry their types (``True == 1`` must not pass for a valid segment length), tensors every
    property the checks and the kernel choice read (type, shape, strides, dtype, device, address alignment),
    document offsets their values, and the environment variables the kernel choice reads, the head-chunk rule's
    settings (``memory.py``) and the routes' (``ring.routes.Tuning``)."""
    if options.key_padding_mask is not None or hooks.active():
        return None
    # (tensor subclasses and torch.func's wrapped tensors, which have no storage: planned every time)
    if not all(type(t) is torch.Tensor for t in (q, k, v)) or torch._C._are_functorch_transforms_active():
        return None
    docs = options.cu_seqlens
    if docs is not None:  # (read on the host by the call's checks anyway)
        if type(docs) is not torch.Tensor or docs.dtype != torch.int32 or docs.dim() != 1:
            return None
        options = options._replace(cu_seqlens=(layout_key(docs), tuple(docs.tolist())))
    try:
        key = (*map(layout_key, (q, k, v)), *map(typed, options),
               *(os.environ.get(name) for name in KERNEL_CHOICE_ENV), memory.BOUND.key, routes.TUNING)
        hash(key)
    except TypeError:  # not iterable, or an unhashable kernel object: plan it every time
        return None
    return key


def prepare(q, k, v, backend: CommBackend | None, requires_grad: list[bool] | None, options: CallOptions
            ) -> tuple[Schedule, int]:
    """Plan the call and, with ``comm``, count it and agree on it across ranks: ``(schedule, call number)``.

    With ``comm`` a rank's own invalid inputs are raised in the agreement, so every rank raises together.
    ``requires_grad``: what the caller's inputs had (a compiled graph's op sees detached tensors).
    A repeated call reuses its schedule and, with ``comm``, its signature's text (``schedule_key``).
    """
    key = schedule_key(q, k, v, options)
    if backend is None:
        kept = SCHEDULES if options.cu_seqlens is None else DOCUMENT_SCHEDULES
        spec = kept.get(key) if key is not None else None
        if spec is None:
            spec = schedule(q, k, v, None, options)
            if key is not None:
                kept[key] = spec
        return spec, 0
    if key is not None:  # the signature also reads whether a backward follows (the table is the backend's)
        grads = tuple(requires_grad) if requires_grad is not None else tuple(t.requires_grad for t in (q, k, v))
        key = (*key, torch.is_grad_enabled(), grads)
    state = call_state(backend)
    kept = state.schedules if options.cu_seqlens is None else state.documents
    cached = kept.get(key) if key is not None else None
    spec = text = error = None
    if cached is not None:
        spec, text = cached[0].on(backend), cached[1]
    else:
        try:
            spec = schedule(q, k, v, backend, options)
        except (ValueError, TypeError) as exc:
            error = exc
    state.calls += 1
    if backend.check_calls:
        if text is None:  # (an entry made with check_calls=False has none yet)
            text = signature_text_of(q, k, v, spec, options, requires_grad)
        agree(backend, state, text, error, q if isinstance(q, torch.Tensor) else torch.empty(0))
    elif error is not None:
        raise error
    if key is not None and error is None and (cached is None or cached[1] is not text):
        kept[key] = (spec.on(None), text)
    return spec, state.calls


def signature_text_of(q, k, v, spec: Schedule | None, options: CallOptions,
                      requires_grad: list[bool] | None) -> str:
    """What every rank must agree on for this call (``consistency.call_signature``), as the text compared."""
    kernel, docs = options.kernel, spec.docs if spec is not None else None
    same = {name: getattr(options, name) for name in ("mode", "causal", "softmax_scale", "head_offsets", "strategy",
                                                      "pad_to_segments", "layout")}
    sig = call_signature(q, k, v, options.segment_lengths, options.dilation_rates, **same,
                         kernel=kernel if isinstance(kernel, str) else type(kernel).__name__,
                         key_padding_mask=options.key_padding_mask is not None,
                         cu_seqlens=None if docs is None else
                         f"{len(docs) - 1} documents, crc32 {zlib.crc32(str(docs).encode())}")
    if requires_grad is not None:
        sig["requires_grad"] = dict(zip("qkv", requires_grad))
    # the resolved strategy: "auto" reads the GPU model, which may differ between ranks (auto_strategy.py)
    sig["strategy's team (1: ring, the world: head)"] = spec.team if spec is not None else None
    sig["head chunks (set_memory_bound)"] = max(1, len(spec.heads)) if spec is not None else None
    return signature_text(sig)
