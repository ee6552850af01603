"""Where a ring's rows are: which ranks hold which chunks, which kernel calls one ring step makes, and the
compact rows a dilated ring pattern runs on.

``RingLayout`` deals the sequence's chunks to ranks (consecutive blocks, or zigzag halves); ``step_calls``
compares a step's query chunks with the visiting key chunks by global chunk id and answers with the kernel calls
(``StepCall``) that cover what is visible. ``RingCall`` is what one call's rings need besides tensors.
``dense_ring`` says where a ring pattern runs on compact copies of its query rows (``compact``), read with
``dense_view``: rate 1, the layout of the packed K/V blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from . import caches
from .comm.base import CommBackend
from .kernels.protocol import PatternKernel
from .patterns import PatternPlan
from .views import region_views


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


@caches.memoize("ring_steps.step_calls", 4096)  # asked per pattern and ring step; a model has few configurations
def step_calls(plan: PatternPlan, layout: RingLayout, own: int, src: int, blocks: int, rows: int, causal: bool,
                shared: bool = False) -> tuple[StepCall, ...]:
    """The kernel calls of a ring step on block ``own`` (``rows`` rows) with block ``src``'s K/V.

    Each (query chunk, key chunk) pair is compared by global chunk id. Where the pairs see each other as the
    block's own rows do (all visible, or causal by local row: rows are in global order in both layouts), one
    call covers the block; else one call per visible pair on half-block views (zigzag). For a segment
    spanning the whole sequence that is, causal, on every rank: its own block (one causal call), then per
    step either both query halves against the first key half or the second query half against both key
    halves: half a block's work each step, whatever the rank. ``shared`` (``causal_share.Share``): an earlier block
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


@caches.memoize("ring_steps.half_calls", 1024)  # asked per shared ring step; a model has few configurations
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
class RingCall:
    """What one call's attention on this rank's block needs besides tensors (forward and backward)."""

    plans: tuple[PatternPlan, ...]
    comm: CommBackend | None
    layout: RingLayout
    call: int
    kernel: PatternKernel
    causal: bool
    scale: float


@caches.memoize("ring_steps.dense_view", 256)  # asked per ring pattern and call; a model has few configurations
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
    """``dense_view(plan)`` where a ring pattern can run on compact rows (``ring.py``'s module doc), else ``None``: rate
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
    return dense_view(plan)


def compact(x: torch.Tensor, plan: PatternPlan) -> torch.Tensor:
    """A new compact ``(B, L / r, H, ...)`` copy of the rows and heads ``plan`` reads of ``x``."""
    out = x.new_empty((x.shape[0], x.shape[1] // plan.dilation, *x.shape[2:]))
    for rows, part in region_views(x, out, plan):
        part.copy_(rows)
    return out

