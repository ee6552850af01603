"""Where a ring's rows are: which ranks hold which chunks, which kernel calls one ring step makes, and the padded
shards of a sequence the segments do not tile (``Padded``).

``RingLayout`` deals the sequence's chunks to ranks (consecutive blocks, or zigzag halves); ``step_calls``
compares a step's query chunks with the visiting key chunks by global chunk id and answers with the kernel calls
(``StepCall``) that cover what is visible.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import caches
from ..patterns import PatternPlan


class Visibility(enum.Enum):
    """How a query chunk sees a key chunk on a ring."""

    FULL = "full"        # every key visible (non-causal, or an earlier chunk of the segment)
    CAUSAL = "causal"    # the same chunk: keys up to the query's position
    HIDDEN = "hidden"    # a later chunk under causal masking, or another segment: skipped (still forwarded)


def visibility(causal: bool, key: int, query: int, span: int) -> Visibility:
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
class StepCall:
    """One kernel call of a ring step: local query rows ``rows`` against the visiting block's packed rows
    ``keys``, whose key mask is ``mask`` of the whole-sequence mask (block order), with ``plan``."""

    rows: slice
    keys: slice
    mask: slice
    plan: PatternPlan
    causal: bool


@caches.memoize("layout.step_calls", 4096)  # asked per pattern and ring step; a model has few configurations
def step_calls(plan: PatternPlan, layout: RingLayout, own: int, src: int, blocks: int, rows: int, causal: bool,
                shared: bool = False) -> tuple[StepCall, ...]:
    """The kernel calls of a ring step on block ``own`` (``rows`` rows) with block ``src``'s K/V.

    Each (query chunk, key chunk) pair is compared by global chunk id. Where the pairs see each other as the
    block's own rows do (all visible, or causal by local row: rows are in global order in both layouts), one
    call covers the block; else one call per visible pair on half-block views (zigzag). For a segment
    spanning the whole sequence that is, causal, on every rank: its own block (one causal call), then per
    step either both query halves against the first key half or the second query half against both key
    halves: half a block's work each step, whatever the rank. ``shared`` (``routes.Share``): an earlier block
    is seen by the first half of the rows only, the other half being a helper's.
    """
    queries, keys = layout.chunks(own, blocks), layout.chunks(src, blocks)
    seen = [[visibility(causal, kc, qc, plan.ring_size) for kc in keys] for qc in queries]
    pairs = [(i, j) for i in range(len(queries)) for j in range(len(keys))]
    if all(seen[i][j] is Visibility.HIDDEN for i, j in pairs):
        return ()
    if shared and src != own:
        return half_calls(plan, src, rows)
    for whole in (False, True):  # the block's own rows: full, or causal by row
        if all(seen[i][j] is visibility(whole, j, i, len(keys)) for i, j in pairs):
            return (StepCall(slice(0, rows), slice(0, rows // plan.dilation), slice(src * rows, (src + 1) * rows),
                          plan, whole),)
    size = rows // len(queries)
    packed = size // plan.dilation  # a chunk's rows in the packed K/V block
    half = plan.with_local_segment(size)
    return tuple(StepCall(slice(i * size, (i + 1) * size), slice(j * packed, (j + 1) * packed),
                       slice(src * rows + j * size, src * rows + (j + 1) * size), half, seen[i][j] is Visibility.CAUSAL)
                 for i, j in pairs if seen[i][j] is not Visibility.HIDDEN)


@caches.memoize("layout.half_calls", 1024)  # asked per shared ring step; a model has few configurations
def half_calls(plan: PatternPlan, src: int, rows: int) -> tuple[StepCall, StepCall]:
    """Half of a block's ``rows`` query rows against both halves of block ``src``'s packed K/V, non-causal:
    two calls of half blocks (a kernel call's queries and keys have equally many rows per segment)."""
    size = rows // 2
    packed, half = size // plan.dilation, plan.with_local_segment(size)
    return tuple(StepCall(slice(0, size), slice(j * packed, (j + 1) * packed),
                       slice(src * rows + j * size, src * rows + (j + 1) * size), half, False) for j in range(2))


def describe(call: int, direction: str, plan: PatternPlan, step: int, size: int, exchange: str) -> str:
    return (f"call {call}, {direction}, pattern {plan.index} (w={plan.segment}, r={plan.dilation}), "
            f"ring step {step + 1}/{size}, {exchange}")


def block_mask(key_mask: torch.Tensor | None, block: int, length: int) -> dict:
    """Kernel keyword for sequence block ``block`` (``length`` rows) of a whole-sequence key mask."""
    return {} if key_mask is None else {"key_mask": key_mask[:, block * length:(block + 1) * length]}


def call_mask(key_mask: torch.Tensor | None, call: StepCall) -> dict:
    return {} if key_mask is None else {"key_mask": key_mask[:, call.mask]}


@dataclass(frozen=True)
class Padded:
    """A ring over shards the segments do not tile: the sequence of ``rows`` rows (``world`` shards of ``local``
    rows, as the caller holds them) padded at its end to ``world * shard`` rows, re-cut into shards of ``shard``
    rows that the patterns tile (``padded_shard``). The pad rows' keys are masked and their rows dropped, so results
    and gradients are those of the unpadded rows, as the single-device call pads (docs/design.md section 2)."""

    rows: int
    local: int
    shard: int
    world: int

    def moves(self, rank: int, to_padded: bool) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int]]]:
        """This rank's row moves: ``(sends, receives)``, sends ``(peer, first, end, at)`` (this rank's rows
        ``[first, end)`` to the peer's rows from ``at``), receives ``(peer, first, end)`` (this rank's rows from
        the peer), peers ascending. ``to_padded``: from the caller's shards to the padded ones, else back."""
        mine, theirs = (self.local, self.shard) if to_padded else (self.shard, self.local)
        sends, receives = [], []
        for peer in range(self.world):
            a, b = max(rank * mine, peer * theirs), min((rank + 1) * mine, (peer + 1) * theirs, self.rows)
            if a < b:
                sends.append((peer, a - rank * mine, b - rank * mine, a - peer * theirs))
            a, b = max(peer * mine, rank * theirs), min((peer + 1) * mine, (rank + 1) * theirs, self.rows)
            if a < b:
                receives.append((peer, a - rank * theirs, b - rank * theirs))
        return sends, receives


def padded_shard(fits, local: int, world: int, least: int, segments: Sequence[int], rates: Sequence[int] = (1,)
                 ) -> int | None:
    """The fewest rows ``>= local`` per shard, ``world`` shards holding at least ``least`` rows, for which
    ``fits(shard)`` (the patterns tile such shards) among the candidates below; ``None`` if none fits.

    A pattern local to a shard must tile it (a multiple of the shortest segment it holds) and a spanning one must be
    whole shards: so the candidates are the multiples of the shortest segment and its divisors, and, where every
    segment is clamped to a sequence shorter than the shortest, the multiples of the dilations' least common
    multiple (any such length is tiled then); last, the first multiple of every segment (every pattern local)."""
    first, w = max(local, -(-least // world)), min(segments)
    step, every = math.lcm(*rates), math.lcm(*segments)
    clamped = range(-(-first // step) * step, min(-(-w // world), first + 8 * step), step)
    candidates = sorted({d for d in range(1, w + 1) if w % d == 0 and d >= first} | set(clamped)
                        | set(range(-(-first // w) * w, 4 * max(first, w) + 1, w)) | {-(-first // every) * every})
    return next((shard for shard in candidates if fits(shard)), None)
