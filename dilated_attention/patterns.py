"""Pattern validation, head offsets, head groups and ring plans (docs/design.md sections 1-2).

A *plan* says, for one (segment, dilation) pattern, which heads read which
offset, which kv heads they need, and whether the pattern runs locally on each
rank or as a ring over the ranks holding a segment's chunks.

Shard layouts (``SHARD_LAYOUTS``): ``"contiguous"``: rank ``j`` of ``K`` holds chunk ``j`` of ``K``;
``"zigzag"``: the sequence is cut in ``2K`` chunks and rank ``j`` holds chunk ``j`` followed by chunk
``2K - 1 - j`` (``distributed.shard_indices``), which balances causal rings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from . import caches
from .caches import remember, typed

MODES = ("longnet", "grouped")
HEAD_OFFSET_RULES = ("spread", "torchscale")
SHARD_LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """Raise ``ValueError`` unless ``layout`` names a shard layout."""
    if not isinstance(layout, str) or layout not in SHARD_LAYOUTS:
        raise ValueError(f"layout must be one of {SHARD_LAYOUTS}, got {layout!r}")


def zigzag_half(local_len: int) -> int:
    """Rows of one zigzag chunk (half a rank's ``local_len`` rows); ``ValueError`` if they do not halve."""
    if local_len % 2:
        raise ValueError(f"layout='zigzag' cuts each rank's rows into two chunks, so the local shard length must "
                         f"be even, got {local_len}; use layout='contiguous' or an even shard length")
    return local_len // 2


@dataclass(frozen=True)
class HeadChunk:
    """Query heads ``[h0, h1)`` reading dilation offset ``offset`` of kv heads ``[k0, k1)``.

    Either the chunk is aligned to kv groups (``h0 == k0 * g``, ``h1 == k1 * g``)
    or it lies inside one kv group (``k1 == k0 + 1``); in both cases local query
    head ``i`` reads local kv head ``i // ((h1 - h0) // (k1 - k0))``.
    ``buffer_head`` is where the chunk's kv heads start in the ring's packed buffer.
    """

    offset: int
    h0: int
    h1: int
    k0: int
    k1: int
    buffer_head: int


@dataclass(frozen=True)
class PatternPlan:
    index: int
    segment: int  # effective global segment w' = min(w, N)
    dilation: int
    local_segment: int  # rows of one segment inside a rank's shard: min(w', L)
    # G: 1 = computed locally; > 1 = the segment spans G chunks (contiguous: shards, a ring of G consecutive
    # ranks; zigzag: half shards, a ring of the ranks holding them, ring.RingLayout.members)
    ring_size: int
    chunks: tuple[HeadChunk, ...]
    head_runs: tuple[tuple[int, int, int], ...]  # (offset, h0, h1): consecutive heads sharing an offset

    def __hash__(self) -> int:
        """The fields' hash, computed once: plans key the kernels' caches on every call."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.index, self.segment, self.dilation, self.local_segment, self.ring_size, self.chunks,
                           self.head_runs))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def packed_heads(self) -> int:
        return sum(c.k1 - c.k0 for c in self.chunks)

    def covers_all(self, num_heads: int, num_kv_heads: int) -> bool:
        """Whether this pattern, run locally, reads every row of every query and kv head (``r = 1``, its
        chunks span all heads): then it may write a fresh result instead of merging into one."""
        if self.ring_size != 1 or self.dilation != 1:
            return False
        heads = {h for c in self.chunks for h in range(c.h0, c.h1)}
        kv_heads = {h for c in self.chunks for h in range(c.k0, c.k1)}
        return heads == set(range(num_heads)) and kv_heads == set(range(num_kv_heads))

    def head_offsets(self, num_heads: int, kv: bool = False) -> tuple[int, ...] | None:
        """The dilation offset each of ``num_heads`` query (or, with ``kv``, kv) heads reads, ``-1`` for a head
        no chunk covers; ``None`` when a head reads two chunks (a kv head shared by query heads of different
        offsets). Where it is a tuple, the pattern's compact ``(B, L // r, heads, ...)`` layout holds each
        (row, head) of the full layout at most once: what combining compact parts relies on."""
        return _head_offsets(self, num_heads, kv)

    def with_local_segment(self, rows: int) -> "PatternPlan":
        """This plan read on ``rows``-row blocks (a zigzag ring step's half-shard calls); the same object for
        the same ``rows``, so the kernels' per-plan caches keep hitting."""
        return _with_local_segment(self, rows)

    def leaves_parts(self, direction: str, num_kv_heads: int) -> bool:
        """Whether this pattern's results can be compact parts (``PatternKernel.parts``) in ``direction``
        (``"fwd"``/``"bwd"``): it runs locally and, for gradients, each kv head reads one offset."""
        return self.ring_size == 1 and (direction == "fwd" or self.head_offsets(num_kv_heads, kv=True) is not None)


@caches.memoize("patterns.head_offsets", 1024)  # asked per pattern and step on the hot path; plans are few
def _head_offsets(plan: PatternPlan, num_heads: int, kv: bool) -> tuple[int, ...] | None:
    offsets = [-1] * num_heads
    for c in plan.chunks:
        for h in range(c.k0, c.k1) if kv else range(c.h0, c.h1):
            if offsets[h] != -1:
                return None
            offsets[h] = c.offset
    return tuple(offsets)


@caches.memoize("patterns.resegmented", 256)
def _with_local_segment(plan: PatternPlan, rows: int) -> PatternPlan:
    return PatternPlan(plan.index, plan.segment, plan.dilation, rows, plan.ring_size, plan.chunks, plan.head_runs)


def _check_int_list(name: str, values: Sequence[int]) -> list[int]:
    """``values`` as a list of ints; a ``torch.SymInt`` is specialized to its value.

    Under ``torch.compile`` a length taken from a tensor's shape (``[16, q.shape[1]]``) reaches the custom op's
    fake implementation as a symbol once the shape is dynamic. Plans need concrete lengths, so ``int()``
    specializes it: torch guards the compiled graph on that value and recompiles for another one.
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for i, x in enumerate(values):
        if isinstance(x, torch.SymInt):
            x = int(x)  # a guard on the symbol's value (torch.compile recompiles when it changes)
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}] must be an int, got {type(x).__name__} ({x!r})")
        out.append(int(x))
    return out


# The ring's shard rules bind only where a segment spans ranks; the head strategy keeps whole sequences.
_HEAD_HINT = ("; strategy='head' (each rank runs the whole sequence for a share of the heads, padding it "
              "internally) avoids this, or pick segment lengths that tile the shard")


def check_pattern_lists(segment_lengths, dilation_rates) -> tuple[list[int], list[int]]:
    """The rules ``segment_lengths`` and ``dilation_rates`` obey whatever the sequence (ints, as many of one as of
    the other, at least one pattern, positive): the lists, or ``ValueError``/``TypeError`` naming the rule."""
    segs = _check_int_list("segment_lengths", segment_lengths)
    rates = _check_int_list("dilation_rates", dilation_rates)
    if len(segs) != len(rates):
        raise ValueError(
            f"segment_lengths and dilation_rates must have equal lengths, got {len(segs)} and {len(rates)}"
        )
    if not segs:
        raise ValueError("segment_lengths must hold at least one pattern, got []")
    for name, vals in (("segment_lengths", segs), ("dilation_rates", rates)):
        if any(x <= 0 for x in vals):
            raise ValueError(f"{name} must all be positive, got {vals}")
    return segs, rates


def validate_patterns(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], seq_len: int
) -> list[tuple[int, int]]:
    """Return ``[(w', r), ...]`` or raise ``ValueError``/``TypeError`` naming the rule broken."""
    segs, rates = check_pattern_lists(segment_lengths, dilation_rates)
    out = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        we = min(w, seq_len)
        if seq_len % we:
            raise ValueError(
                f"sequence length {seq_len} must be divisible by segment_lengths[{i}]={we}"
                + (f" (clamped from {w} to the sequence length)" if we != w else "")
            )
        if we % r:
            raise ValueError(
                f"segment_lengths[{i}]={we}" + (f" (clamped from {w} to the sequence length)" if we != w else "")
                + f" must be divisible by dilation_rates[{i}]={r}"
            )
        out.append((we, r))
    return out


def padded_length(segment_lengths: Sequence[int], dilation_rates: Sequence[int], seq_len: int) -> int:
    """The shortest length ``>= seq_len`` that the patterns tile (docs/design.md section 1: internal padding).

    At length ``P`` a segment ``w <= P`` must divide ``P``, and a longer one is clamped to ``P``,
    so ``P`` must then be a multiple of its dilation. Each round moves ``P`` up to the next
    multiple of what the segments at ``P`` need; ``P`` only grows, so this ends.
    """
    segs = _check_int_list("segment_lengths", segment_lengths)
    rates = _check_int_list("dilation_rates", dilation_rates)
    if len(segs) != len(rates) or not segs or min(segs + rates) <= 0:
        validate_patterns(segs, rates, max(seq_len, 1))  # raises the precise error
    length = max(seq_len, 1)
    while True:
        need = math.lcm(*(w if w <= length else r for w, r in zip(segs, rates)))
        if length % need == 0:
            validate_patterns(segs, rates, length)  # a segment its dilation does not divide fits no length
            return length
        length = -(-length // need) * need


def longnet_offsets(num_heads: int, rate: int, rule: str = "spread") -> list[int]:
    """Offset of each head in a pattern of dilation ``rate``.

    ``"spread"``: ``(h * r) // H`` (this library's default); ``"torchscale"``: ``h // ceil(H / r)``
    (Microsoft's torchscale, for LongNet checkpoints trained there). They agree when ``r`` divides ``H``.
    """
    if rule == "spread":
        return [(h * rate) // num_heads for h in range(num_heads)]
    if rule == "torchscale":
        per_offset = -(-num_heads // rate)
        return [h // per_offset for h in range(num_heads)]
    raise ValueError(f"head_offsets must be one of {HEAD_OFFSET_RULES}, got {rule!r}")


def hybrid_team_size(world: int, heads: int, local_world: int = 0) -> int | None:
    """Ranks per all-to-all team of the hybrid strategy: a node (``local_world`` ranks) when the
    job spans nodes and a node divides the heads, else the largest proper divisor of ``world``
    that divides the heads; ``None`` when there is none."""
    if 1 < local_world < world and world % local_world == 0 and heads % local_world == 0:
        return local_world
    return next((a for a in range(world - 1, 1, -1) if world % a == 0 and heads % a == 0), None)


def head_groups(num_heads: int, num_patterns: int) -> list[tuple[int, int]]:
    """Contiguous head groups for ``mode="grouped"``, sizes differ by <= 1, larger first."""
    if num_heads < num_patterns:
        raise ValueError(
            f'mode="grouped" needs num_heads >= number of patterns, got {num_heads} heads '
            f"and {num_patterns} patterns"
        )
    base, extra = divmod(num_heads, num_patterns)
    groups, start = [], 0
    for i in range(num_patterns):
        size = base + (1 if i < extra else 0)
        groups.append((start, start + size))
        start += size
    return groups


def _split_by_kv_group(h0: int, h1: int, group: int) -> list[tuple[int, int]]:
    """Cut ``[h0, h1)`` so each piece is kv-group aligned or inside one kv group."""
    pieces = []
    first_full = -(-h0 // group) * group
    last_full = (h1 // group) * group
    if first_full >= last_full:  # no whole group inside: at most two partial pieces
        cut = min(first_full, h1)
        pieces = [(h0, cut), (cut, h1)] if h0 < cut < h1 else [(h0, h1)]
        return pieces
    if h0 < first_full:
        pieces.append((h0, first_full))
    pieces.append((first_full, last_full))
    if last_full < h1:
        pieces.append((last_full, h1))
    return pieces


def _chunks(head_offsets: list[tuple[int, int, int]], group: int) -> tuple[HeadChunk, ...]:
    chunks, buffer_head = [], 0
    for offset, a, b in head_offsets:
        for h0, h1 in _split_by_kv_group(a, b, group):
            k0, k1 = h0 // group, (h1 - 1) // group + 1
            chunks.append(HeadChunk(offset, h0, h1, k0, k1, buffer_head))
            buffer_head += k1 - k0
    return tuple(chunks)


def _offset_runs(offsets: list[int], h_start: int = 0) -> list[tuple[int, int, int]]:
    """Group consecutive heads with equal offset: ``[(offset, h0, h1), ...]``."""
    runs: list[tuple[int, int, int]] = []
    for i, o in enumerate(offsets):
        h = h_start + i
        if runs and runs[-1][0] == o:
            runs[-1] = (o, runs[-1][1], h + 1)
        else:
            runs.append((o, h, h + 1))
    return runs


def plan_patterns(
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    seq_len: int,
    local_len: int,
    num_heads: int,
    num_kv_heads: int,
    mode: str = "longnet",
    head_offsets: str = "spread",
    head_start: int = 0,
    total_heads: int | None = None,
    layout: str = "contiguous",
) -> tuple[PatternPlan, ...]:
    """Validate the patterns for a global length ``seq_len`` split in shards of ``local_len``.

    ``layout="zigzag"``: each shard is two half-shard chunks (module doc); a segment no longer than a
    half is local (it must tile the half), a longer one spans whole halves.

    ``num_heads``/``num_kv_heads`` are the heads present locally; with a head-parallel
    strategy they are heads ``[head_start, head_start + num_heads)`` of ``total_heads``,
    and offsets and head groups follow the global head index.

    Planned once per configuration: a model asks every call, and the same plan objects keep the
    kernels' per-plan caches on their fast path (hash computed once, lookups by identity).
    """
    total_heads = num_heads if total_heads is None else total_heads
    args = (segment_lengths, dilation_rates, seq_len, local_len, num_heads, num_kv_heads, mode, head_offsets,
            head_start, total_heads, layout)
    try:  # keyed with each value's type: 2048.0 must still be refused where 2048 was planned
        key = tuple(typed(a) for a in args)
        hash(key)
    except TypeError:  # unhashable: planning raises the clear error
        return _plan_patterns(*args)
    hit = _PLANS.get(key)
    return hit if hit is not None else remember(_PLANS, key, _plan_patterns(*args))


_PLANS = caches.table("patterns.plans", 256)


def _plan_patterns(segment_lengths, dilation_rates, seq_len, local_len, num_heads, num_kv_heads, mode,
                   head_offsets, head_start, total_heads, layout) -> tuple[PatternPlan, ...]:
    check_layout(layout)
    # a chunk: what a local pattern must tile and a spanning one spans whole (a shard, or half of one)
    chunk = zigzag_half(local_len) if layout == "zigzag" else local_len
    zigzag = layout == "zigzag"
    what = f"half the local shard ({chunk} of {local_len} rows, layout='zigzag')" if zigzag else \
        f"the local shard of {local_len} rows"
    length = f"the zigzag half-shard length {chunk}" if zigzag else f"the local shard length {local_len}"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if head_offsets not in HEAD_OFFSET_RULES:
        raise ValueError(f"head_offsets must be one of {HEAD_OFFSET_RULES}, got {head_offsets!r}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"number of query heads ({num_heads}) must be divisible by number of kv heads ({num_kv_heads})"
        )
    pats = validate_patterns(segment_lengths, dilation_rates, seq_len)
    group = num_heads // num_kv_heads
    groups = head_groups(total_heads, len(pats)) if mode == "grouped" else None
    local_end = head_start + num_heads
    plans = []
    for i, (w, r) in enumerate(pats):
        if w <= chunk:
            if chunk % w:
                raise ValueError(
                    f"segment_lengths[{i}]={w} does not tile {what} "
                    f"(sequence {seq_len} split over {seq_len // local_len} ranks)" + _HEAD_HINT
                )
            local_segment, ring = w, 1
        else:
            if w % chunk:
                raise ValueError(
                    f"segment_lengths[{i}]={w} spans ranks but is not a multiple of {length}" + _HEAD_HINT
                )
            if chunk % r:
                raise ValueError(
                    f"segment_lengths[{i}]={w} spans ranks, so {length} "
                    f"must be divisible by dilation_rates[{i}]={r}" + _HEAD_HINT
                )
            local_segment, ring = local_len, w // chunk
        if groups is None:
            offsets = longnet_offsets(total_heads, r, head_offsets)[head_start:local_end]
            runs = _offset_runs(offsets)
        else:
            h0, h1 = max(groups[i][0], head_start), min(groups[i][1], local_end)
            runs = [(i % r, h0 - head_start, h1 - head_start)] if h0 < h1 else []
        plans.append(PatternPlan(i, w, r, local_segment, ring, _chunks(runs, group), tuple(runs)))
    return tuple(plans)
