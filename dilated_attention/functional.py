"""``dilated_attention(...)``: validation, cross-rank agreement, strategy, then the computation.

Strategies (``comm`` given, ``P`` ranks, docs/design.md section 2) are one code path with a team
size ``A``: an all-to-all inside teams of ``A`` consecutive ranks swaps sequence for heads
(``head_parallel.py``), then every pattern runs locally or as a ring across teams
(``ring.py``), then a second all-to-all swaps back. ``"ring"`` is ``A = 1``, ``"head"``
is ``A = P`` (no ring at all), ``"hybrid"`` is in between.

One code path, one autograd boundary: ``_schedule`` validates and plans (no data), ``_prepare``
adds the cross-rank agreement, ``_forward`` computes and returns what ``_backward`` needs.
Eager calls wrap the pair in ``_Attention`` (an ``autograd.Function`` that ``torch.func``
transforms); under ``torch.compile`` the same pair runs inside ``custom_ops.py``'s ops.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch._functorch.utils import unwrap_dead_wrappers

from . import caches, hooks, memory, misuse
from . import custom_ops as _ops
from .caches import typed
from .comm import CommBackend, resolve_comm
from .consistency import agree, call_signature, settle, signature_text
from .head_parallel import (HeadSplit, HeadSwap, heads_to_sequence, heads_to_sequence_backward, member_rows,
                            sequence_to_heads, sequence_to_heads_backward)
from .kernels.dispatch import select_kernel
from .kernels.guard import guard_kernel
from .kernels.protocol import BlockKernel, PatternKernel
from .memory import HeadRange, head_ranges, own_bytes, scratch_bytes
from .merge import accum_dtype
from .patterns import PatternPlan, check_layout, hybrid_team_size, padded_length, plan_patterns, zigzag_half
from .ring import RingCall, RingLayout, leaves_part, ring_backward, ring_forward
from .strategy import auto_team_size, pattern_spans
from .views import layout_key

STRATEGIES = ("auto", "ring", "head", "hybrid")


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, N, H, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor, got {t.dtype}")
        if 0 in t.shape:
            raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, sequence length and head dim"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")


def _check_scale_type(softmax_scale) -> None:
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")


def _check_scale(softmax_scale, dim: int, dtype: torch.dtype) -> float:
    _check_scale_type(softmax_scale)
    if softmax_scale is None:
        return dim**-0.5
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    # Scores are computed in fp32 below float64: a scale that is inf or 0 there would give NaN or
    # uniform attention silently.
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    info = torch.finfo(compute)
    if not info.tiny <= softmax_scale <= info.max:
        raise ValueError(f"softmax_scale={softmax_scale} is outside the range of the {compute} scores the kernels "
                         f"compute for {dtype} inputs ([{info.tiny:.3g}, {info.max:.3g}])")
    return float(softmax_scale)


def _unit_head_dim(x: torch.Tensor) -> torch.Tensor:
    """Kernels and private SDPA ops read the head dim with unit stride: copy the rare input that has not."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _team_size(strategy: str, world: int, heads: int, auto: Callable[[], int]) -> int:
    """Ranks that swap sequence for heads (``A``): 1 for ``"ring"``, the world for ``"head"``, ``auto()``
    (``strategy.py``: what the scaling benchmark measured fastest) for ``"auto"``. ``hybrid``: a2a
    inside a node (``LOCAL_WORLD_SIZE`` ranks) and the ring across nodes when that divides the heads,
    else the largest proper divisor of the world that divides the heads.
    """
    if strategy == "ring" or world == 1:
        return 1
    if strategy == "head":
        return world
    if strategy == "auto":
        return auto()
    team = hybrid_team_size(world, heads, _local_world())
    if team is None:
        raise ValueError(f'strategy="hybrid" needs a team size that divides both the world size ({world}) and the '
                         f"number of query heads ({heads}); none exists")
    return team


@caches.memoize("functional.gpu_model", 16)  # asked per call with comm; a process sees few devices
def _gpu_model(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)


def _ring_plans(segment_lengths, dilation_rates, n: int, local: int, heads: int, kv_heads: int, layout: str) -> bool:
    """Whether the patterns tile shards of ``local`` rows so that rings can run them (else only
    head-parallel, which holds the whole sequence, pads and runs documents)."""
    try:
        plan_patterns(segment_lengths, dilation_rates, seq_len=n, local_len=local, num_heads=heads,
                      num_kv_heads=kv_heads, layout=layout)
    except ValueError:
        return False
    return True


def _check_key_padding_mask(mask, q: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {mask.dtype}")
    if tuple(mask.shape) != tuple(q.shape[:2]):
        raise ValueError(f"key_padding_mask must have shape (B, N) = {tuple(q.shape[:2])} (this rank's rows), "
                         f"got {tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"key_padding_mask must be on q's device {q.device}, got {mask.device}")
    return mask


def _brief(values: Sequence[int]) -> str:
    return str(list(values)) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"


def _check_cu_seqlens(cu_seqlens, q: torch.Tensor, total: int, read: bool = True) -> tuple[int, ...] | None:
    """Document offsets as host ints (read once: the schedule depends on them); ``read=False`` checks
    only what shapes say (planning for shapes under ``torch.compile``: the values are data there)."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor of at least 2 document offsets (flash-attention's "
                         f"convention), got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the packed documents as one batch row (1, total, H, D), got batch "
                         f"size {q.shape[0]}")
    if not read:
        return None
    offsets = tuple(int(x) for x in cu_seqlens.tolist())
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the total length {total}, got "
                         f"{_brief(offsets)}")
    return offsets


@dataclass(frozen=True)
class _Batch:
    """Rows that run as one batch on a whole sequence: padded to ``length`` rows.

    ``spans``: ``None`` for the caller's batch as it is, else one ``(start, end)`` row range of
    the packed sequence per batch row (documents of equal padded length).
    """

    length: int
    spans: tuple[tuple[int, int], ...] | None
    plans: tuple[tuple[PatternPlan, ...], ...]  # per head range (``_Schedule.heads``)


def _whole_batches(segment_lengths, dilation_rates, n: int, docs, pad: bool, plan) -> tuple[_Batch, ...]:
    """The schedule on a whole sequence of ``n`` rows; ``plan(length)`` makes the pattern plans."""
    if docs is None:
        length = padded_length(segment_lengths, dilation_rates, n) if pad else n
        return (_Batch(length, None, (plan(length),)),)
    groups: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(docs, docs[1:]):
        if end > start:
            length = padded_length(segment_lengths, dilation_rates, end - start) if pad else end - start
            groups.setdefault(length, []).append((start, end))
    return tuple(_Batch(length, tuple(spans), (plan(length),)) for length, spans in sorted(groups.items()))


def _back_to_back(batch: _Batch) -> bool:
    """Documents (batch size 1) that need no padding and follow each other: rows are a view, no mask."""
    spans = batch.spans
    return all(b - a == batch.length for a, b in spans) and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def _rows(x: torch.Tensor, batch: _Batch, fill: float = 0.0) -> torch.Tensor:
    """``x`` ``(B, N, ...)`` laid out as ``batch`` runs: padded to its length, and with documents one
    batch row group per span (span-major: span ``i`` is rows ``[i B, (i + 1) B)``)."""
    pad = (0, 0) * (x.dim() - 2)
    if batch.spans is None:
        grow = batch.length - x.shape[1]
        return x if grow == 0 else F.pad(x, pad + (0, grow), value=fill)
    if _back_to_back(batch):  # documents of exactly the batch length, one after another: a view
        return x[0, batch.spans[0][0]:batch.spans[-1][1]].unflatten(0, (len(batch.spans), batch.length))
    return torch.cat([F.pad(x[:, a:b], pad + (0, batch.length - (b - a)), value=fill) for a, b in batch.spans])


def _unrows(parts: list[torch.Tensor], batches: tuple[_Batch, ...], n: int, bsz: int,
            copy: bool = False) -> torch.Tensor:
    """The inverse of ``_rows`` over every batch: the caller's ``(B, n, ...)`` rows (pad rows dropped).

    ``copy``: a new tensor, never a view (the output: a view made inside an autograd.Function may not
    be modified in place).
    """
    if batches[0].spans is None:
        if parts[0].shape[1] == n:
            return parts[0]
        return parts[0][:, :n].clone(memory_format=torch.contiguous_format) if copy else parts[0][:, :n]
    pieces = {}
    for part, batch in zip(parts, batches):
        for i, (a, b) in enumerate(batch.spans):
            pieces[a] = part[i * bsz:(i + 1) * bsz, :b - a]
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=1)


def _pads(batch: _Batch, n: int) -> bool:
    """Whether ``batch`` runs with padding rows (so with a padding mask): a sequence of ``n`` rows padded, or a
    document shorter than its batch rows (whole documents need no mask: separate batch rows keep them apart)."""
    return batch.length != n if batch.spans is None else any(b - a != batch.length for a, b in batch.spans)


def _run_mask(key_mask: torch.Tensor | None, batch: _Batch, q: torch.Tensor) -> torch.Tensor | None:
    if batch.spans is None and batch.length == q.shape[1]:
        return key_mask
    if key_mask is None and not _pads(batch, q.shape[1]):
        return None
    mask = key_mask if key_mask is not None else torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
    return _rows(mask, batch, True)  # pad keys are masked


@dataclass(frozen=True)
class _Schedule:
    """What a call decided before touching data: strategy, plans and kernel, for forward and backward."""

    backend: CommBackend | None
    strategy: str
    team: int  # ranks that swap sequence for heads (1: no swap)
    split: HeadSplit
    batches: tuple[_Batch, ...] | None  # the whole sequence on this rank (team == world)
    plans: tuple[tuple[PatternPlan, ...], ...] | None  # else this rank's block of rings across teams (per head range)
    docs: tuple[int, ...] | None
    kernel: PatternKernel | None  # None when planned for shapes only
    causal: bool
    scale: float
    zigzag: bool = False  # the shards are in the zigzag layout (ring.RingLayout), over more than one rank
    heads: tuple[HeadRange, ...] = ()  # the head chunks run one after another (``memory.py``); () = all at once

    def rings(self, call: int, batch: _Batch | None = None) -> tuple[RingCall, ...]:
        """Per head range: rings across teams, or (a whole-sequence ``batch``) every pattern local."""
        if batch is not None:
            return tuple(RingCall(p, None, RingLayout(), 0, self.kernel, self.causal, self.scale)
                         for p in batch.plans)
        return tuple(RingCall(p, self.backend, RingLayout(self.team, self.zigzag), call, self.kernel, self.causal,
                              self.scale) for p in self.plans)

    def chunk(self, i: int) -> _Schedule:
        """Head chunk ``i`` alone, on tensors holding only its heads (a head strategy's chunked swap)."""
        batches = None if self.batches is None else tuple(replace(b, plans=(b.plans[i],)) for b in self.batches)
        plans = None if self.plans is None else (self.plans[i],)
        return replace(self, batches=batches, plans=plans, heads=())

    def swap(self, call: int) -> HeadSwap:
        first = self.backend.rank - self.backend.rank % self.team
        return HeadSwap(self.backend, tuple(range(first, first + self.team)), self.split,
                        f"call {call}, strategy {self.strategy!r} (team of {self.team})", call, self.zigzag)


def _attend(spec: _Schedule, call: int, q, k, v, key_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the sequence this rank attends over: its block of rings across teams, or the
    whole sequence with internal padding and packed documents.

    Padded rows are zero queries and keys; their keys are masked and their outputs dropped, so
    results and gradients equal the unpadded ones. Each document runs alone (its segments start
    at its first row; nothing crosses documents); documents of equal padded length share a launch.
    """
    if spec.batches is None:
        return _forward_by_heads(spec.heads, spec.rings(call), q, k, v, key_mask)
    runs = [_forward_by_heads(spec.heads, spec.rings(call, b), _rows(q, b), _rows(k, b), _rows(v, b),
                              _run_mask(key_mask, b, q)) for b in spec.batches]
    bsz, n = q.shape[:2]
    return (_unrows([o for o, _ in runs], spec.batches, n, bsz, copy=True),
            _unrows([lse for _, lse in runs], spec.batches, n, bsz))


def _attend_backward(spec: _Schedule, call: int, q, k, v, key_mask, out, lse, dout):
    """The gradient of ``_attend``. Pad rows' outputs were dropped, so ``(0, -inf)`` (an uncovered row)
    stands in for them: their ``dout`` is 0, so they add nothing either way."""
    if spec.batches is None:
        return _backward_by_heads(spec.heads, spec.rings(call), q, k, v, key_mask, out, lse, dout)
    grads = [_backward_by_heads(spec.heads, spec.rings(call, b), _rows(q, b), _rows(k, b), _rows(v, b),
                                _run_mask(key_mask, b, q), _rows(out, b), _rows(lse, b, float("-inf")), _rows(dout, b))
             for b in spec.batches]
    bsz, n = q.shape[:2]
    return tuple(_unrows([g[i] for g in grads], spec.batches, n, bsz) for i in range(3))


def _forward_by_heads(heads: tuple[HeadRange, ...], rings: tuple[RingCall, ...], q, k, v, key_mask
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_forward`` over every head range in turn, each writing its heads of one ``(out, lse)``."""
    if not heads:
        return ring_forward(q, k, v, key_mask, rings[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device)
    for r, ring in zip(heads, rings):
        ring_forward(r.query(q), r.kv(k), r.kv(v), key_mask, ring, into=(r.query(out), r.query(lse)))
    return out, lse


def _backward_by_heads(heads: tuple[HeadRange, ...], rings: tuple[RingCall, ...], q, k, v, key_mask, out, lse, dout
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ring_backward`` over every head range in turn, each writing its heads of ``(dq, dk, dv)`` (a kv head's
    query heads are all in its range, so each gradient element is written once)."""
    if not heads:
        return ring_backward(q, k, v, key_mask, out, lse, dout, rings[0])
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    for r, ring in zip(heads, rings):
        ring_backward(r.query(q), r.kv(k), r.kv(v), key_mask, r.query(out), r.query(lse), r.query(dout), ring,
                      into=(r.query(grads[0]), r.kv(grads[1]), r.kv(grads[2])))
    return grads


def _gather_mask(backend: CommBackend, mask: torch.Tensor | None, call: int, team: int, zigzag: bool
                 ) -> torch.Tensor | None:
    """Every rank's key mask rows, as one ``(B, N)`` mask of the whole sequence in block order: each team's
    rows as its all-to-all lays them out (``member_rows``), teams in order. That is the natural order, except
    for zigzag rings, where block ``b`` holds its two chunks (ring steps read a block's, or a chunk's, mask
    rows as a slice)."""
    if mask is None:
        return None
    parts = backend.all_gather(mask.to(torch.uint8), f"call {call}: key_padding_mask all-gather",
                               host=backend.host_waits, stamp=backend.stamp(call, "forward"))
    teams = parts.unflatten(0, (-1, team)).unbind(0)
    return torch.cat([member_rows(rows, zigzag) for rows in teams], dim=1).bool()


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "longnet",
    causal: bool = False,
    softmax_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    pad_to_segments: bool = True,
    head_offsets: str = "spread",
    comm: str | CommBackend | None = None,
    strategy: str = "auto",
    kernel: str | BlockKernel | PatternKernel = "auto",
    layout: str = "contiguous",
) -> torch.Tensor:
    """Dilated attention over ``(B, N, H, D)`` inputs (docs/design.md sections 1-2).

    With ``comm`` (a backend name or object), ``q, k, v`` are this rank's shard
    of the sequence (rank ``j`` holds rows ``[jL, (j+1)L)``) and the result is
    this rank's rows of the single-device result; every rank must make the same
    calls, forward and backward, in the same order. ``strategy`` picks how the
    ranks share the work (``"ring"``, ``"head"``, ``"hybrid"`` or ``"auto"``);
    all give the same rows. ``k``/``v`` may have fewer heads than ``q`` (GQA).

    ``key_padding_mask``: bool ``(B, N)`` (this rank's rows), ``True`` = padding key,
    excluded from every pattern; a row with no visible key gets 0. ``cu_seqlens``:
    int32 document offsets of a packed ``(1, total, H, D)`` batch (the global
    sequence with ``comm``, the same on every rank; needs the whole sequence per
    rank, i.e. the ``"head"`` strategy): each document runs alone. A length the
    segments do not tile is padded internally (masked pad keys) unless
    ``pad_to_segments=False``; with ``comm`` only the ``"head"`` strategy pads.
    ``head_offsets="torchscale"`` selects torchscale's head-offset rule.
    ``layout="zigzag"`` (with ``comm``): the shards are in zigzag order (``distributed.shard_indices``: rank
    ``j`` of ``K`` holds chunks ``j`` and ``2K - 1 - j`` of ``2K``), which balances causal rings; the
    result rows and gradients are this rank's rows in the same order. Every strategy; not under
    ``torch.compile``.
    Returns ``(B, N, H, D)``; differentiable once (double backward raises). Under
    ``torch.compile`` the call is one custom op (``custom_ops.py``); ``torch.func.grad``/``vjp``
    work, ``vmap`` works without ``comm``, forward-mode AD (``jvp``) raises.
    """
    options = dict(mode=mode, causal=causal, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
                   cu_seqlens=cu_seqlens, pad_to_segments=pad_to_segments, head_offsets=head_offsets,
                   strategy=strategy, kernel=kernel, layout=layout)
    if torch.compiler.is_compiling() and _ops.AVAILABLE:
        # One opaque op: no graph break, and what talks to other ranks runs inside it, never in the graph.
        return _ops.attend(q, k, v, segment_lengths, dilation_rates, comm=comm, **options)
    backend = resolve_comm(comm)
    spec, call = _prepare(q, k, v, segment_lengths, dilation_rates, backend, None, **options)
    return _Attention.apply(q, k, v, key_padding_mask, spec, call)[0]


def _check_flags(causal, pad_to_segments, strategy, layout="contiguous") -> None:
    for name, flag in (("causal", causal), ("pad_to_segments", pad_to_segments)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_layout(layout)


def _schedule(q, k, v, segment_lengths, dilation_rates, *, backend: CommBackend | None, mode, causal,
              softmax_scale, key_padding_mask, cu_seqlens, pad_to_segments, head_offsets, strategy, kernel,
              layout: str = "contiguous", shapes_only: bool = False, record: bool = True) -> _Schedule:
    """Validate a call and decide everything but the data: raises ``ValueError``/``TypeError``.

    ``shapes_only``: what output shapes need, from shapes alone (no ``cu_seqlens`` values, no kernel):
    a custom op's fake implementation. ``record``: kernel hooks may record the call (once per call, not
    again when a compiled backward plans it anew).
    """
    world = backend.world_size if backend is not None else 1
    _check_tensors(q, k, v)
    _check_flags(causal, pad_to_segments, strategy, layout)
    scale = _check_scale(softmax_scale, q.shape[-1], q.dtype)
    bsz, local, heads, _ = q.shape
    zigzag = layout == "zigzag" and world > 1  # on one rank the zigzag order is the natural one
    if zigzag:
        zigzag_half(local)
    misuse.check_shape(q.shape, local * world, segment_lengths, dilation_rates, pad=pad_to_segments,
                       documents=cu_seqlens is not None)
    def auto() -> int:
        spans, dense = pattern_spans(segment_lengths, dilation_rates, local * world, local)
        whole = cu_seqlens is not None or not _ring_plans(segment_lengths, dilation_rates, local * world, local,
                                                          heads, k.shape[2], layout)
        return auto_team_size(world, heads, k.shape[2], causal=causal, spans=spans, dense=dense,
                              local_world=_local_world(), layout=layout, whole_sequence=whole,
                              gpu=_gpu_model(q.device.index) if q.is_cuda else None)

    team = _team_size(strategy, world, heads, auto)
    split = HeadSplit(heads, k.shape[2], team)
    reason = split.check()
    if reason is not None:
        raise ValueError(f"strategy={strategy!r}: {reason}")
    lane = backend.rank % team if backend is not None else 0
    key_mask = _check_key_padding_mask(key_padding_mask, q)
    docs = _check_cu_seqlens(cu_seqlens, q, local * world, read=not shapes_only)

    def plan(length: int, local_len: int | None = None, shards: str = "contiguous", part: HeadRange | None = None
             ) -> tuple[PatternPlan, ...]:
        """The plans of this rank's local heads, or of the head range ``part`` of them."""
        part = part or HeadRange(0, split.local_heads, 0, split.local_kv_heads)
        return plan_patterns(
            segment_lengths, dilation_rates, seq_len=length, local_len=local_len or length,
            num_heads=part.h1 - part.h0, num_kv_heads=part.k1 - part.k0, mode=mode, head_offsets=head_offsets,
            head_start=lane * split.local_heads + part.h0, total_heads=heads, layout=shards,
        )

    batches = plans = None
    if team == world:  # the whole sequence on this rank: padding and documents are local matters
        batches = _whole_batches(segment_lengths, dilation_rates, local * world, docs, pad_to_segments, plan)
    elif cu_seqlens is not None:
        raise ValueError(f"cu_seqlens with comm needs each rank to hold whole documents: strategy='head' (or "
                         f"'auto' with the {heads} heads divisible by the {world} ranks); got "
                         f"strategy={strategy!r} with a ring over {world // team} shards")
    else:  # rings across teams; a team's rows are in the shards' layout (head_parallel.member_rows)
        plans = (plan(local * world, local * team, layout),)
    if backend is not None:
        for name, t in (("q", q), ("k", k), ("v", v), ("key_padding_mask", key_mask)):
            reason = backend.check_device(name, t) if t is not None else None
            if reason is not None:
                raise ValueError(reason)
    chosen, ranges = None, ()
    if not shapes_only:
        masked = key_mask is not None or (batches is not None and any(_pads(b, local * world) for b in batches))
        # without a key_padding_mask, the only masks are the padding ``_run_mask`` adds
        chosen = select_kernel(kernel, q, k, masked, padding_only=key_mask is None)
        meta = {}
        if hooks.active():  # none by default (debug mode, the runtime audit): one module-global check
            options = dict(mode=mode, causal=causal, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
                           cu_seqlens=cu_seqlens, pad_to_segments=pad_to_segments, head_offsets=head_offsets,
                           strategy=strategy, kernel=kernel, layout=layout)
            call = hooks.Call(q, k, v, segment_lengths, dilation_rates, backend, options, record, meta)
            chosen = hooks.apply_kernel_hooks(chosen, call)
        chosen = guard_kernel(chosen, meta)  # CUDA faults re-raised with the call's shapes; resource errors fall back
        ranges = _head_chunks(chosen, q, k, split, batches, plans, local * team, causal, masked)
        if ranges:  # re-planned per head range
            if batches is not None:
                batches = tuple(replace(b, plans=tuple(plan(b.length, part=r) for r in ranges)) for b in batches)
            else:
                plans = tuple(plan(local * world, local * team, layout, r) for r in ranges)
    return _Schedule(backend, strategy, team, split, batches, plans, docs, chosen, causal, scale, zigzag, ranges)


def _head_chunks(kernel: PatternKernel, q, k, split: HeadSplit, batches, plans, rows: int, causal: bool,
                 masked: bool) -> tuple[HeadRange, ...]:
    """The head ranges a call runs in (``memory.py``'s rule, from its whole-heads plans); () for all at once."""
    length = rows
    if batches is not None:  # the largest batch: documents of one padded length run as batch rows
        batch = max(batches, key=lambda b: b.length * (len(b.spans) if b.spans else 1))
        plans, length, rows = batch.plans[0], batch.length, batch.length * (len(batch.spans) if batch.spans else 1)
    else:
        plans = plans[0]
    rows *= q.shape[0]
    shape = (split.local_heads, split.local_kv_heads, q.shape[-1], q.element_size())
    own = own_bytes(rows, *shape)
    # stand-ins for the tensors the attention reads (the head layout where a team swaps): their shapes, dtype, device
    q, k = (x.new_empty(()).expand(1, length, heads, x.shape[-1]) for x, heads in ((q, shape[0]), (k, shape[1])))

    def scratch() -> int:  # (asked only of calls long enough to chunk: it asks the kernel about every pattern)
        attend = scratch_bytes(plans, lambda p: leaves_part(kernel, causal, "bwd", p, q, k, masked), rows, *shape,
                               causal=causal)
        # the head strategy's swaps: the head-layout q, k, v, out, dout and gradients, own bytes' worth
        return attend + (own if split.team > 1 else 0)

    ranges = head_ranges(scratch, own, split.local_heads, split.local_kv_heads)
    return ranges if len(ranges) > 1 else ()


_SCHEDULES = caches.table("functional.schedules", 256)
# environment the kernel choice reads (auto's nondeterministic entries; the fused kernel on CPU tensors)
_KERNEL_CHOICE_ENV = ("DILATED_ATTENTION_NONDETERMINISTIC", "TRITON_INTERPRET")


def _schedule_key(q, k, v, segment_lengths, dilation_rates, options: dict) -> tuple | None:
    """Everything a single-device call's ``_schedule`` reads, as a key, or ``None`` where it reads more (a key
    mask or documents: their values; a kernel hook: it may record each call). Validating and planning a call costs
    about 0.2 ms of host time (0.6 ms with ``comm``, and 0.2 more for the signature), and a LongNet forward is
    host-bound: a training loop's repeated calls reuse the schedule (``_prepare`` adds what a call with ``comm``
    reads besides). Values carry their types (``True == 1`` must not pass for a valid segment length), tensors every
    property the checks and the kernel choice read (type, shape, strides, dtype, device, address alignment), and
    the environment variables the kernel choice reads, and the head-chunk rule's settings (``memory.py``)."""
    if options["key_padding_mask"] is not None or options["cu_seqlens"] is not None or hooks.active():
        return None
    # (tensor subclasses and torch.func's wrapped tensors, which have no storage: planned every time)
    if not all(type(t) is torch.Tensor for t in (q, k, v)) or torch._C._are_functorch_transforms_active():
        return None
    try:
        key = (typed(segment_lengths), typed(dilation_rates), *map(layout_key, (q, k, v)),
               *((name, typed(value)) for name, value in options.items()),
               *(os.environ.get(name) for name in _KERNEL_CHOICE_ENV), memory.SCRATCH_SHARE, memory.SCRATCH_FLOOR)
        hash(key)
    except TypeError:  # not iterable, or an unhashable kernel object: plan it every time
        return None
    return key


def _prepare(q, k, v, segment_lengths, dilation_rates, backend: CommBackend | None,
             requires_grad: list[bool] | None, **options) -> tuple[_Schedule, int]:
    """Plan the call and, with ``comm``, count it and agree on it across ranks: ``(schedule, call number)``.

    With ``comm`` a rank's own invalid inputs are raised in the agreement, so every rank raises together.
    ``requires_grad``: what the caller's inputs had (a compiled graph's op sees detached tensors).
    A repeated call reuses its schedule and, with ``comm``, its signature's text (``_schedule_key``).
    """
    key = _schedule_key(q, k, v, segment_lengths, dilation_rates, options)
    if backend is None:
        spec = _SCHEDULES.get(key) if key is not None else None
        if spec is None:
            spec = _schedule(q, k, v, segment_lengths, dilation_rates, backend=None, **options)
            if key is not None:
                _SCHEDULES[key] = spec
        return spec, 0
    if key is not None:  # the signature also reads whether a backward follows (the table is the backend's)
        grads = tuple(requires_grad) if requires_grad is not None else tuple(t.requires_grad for t in (q, k, v))
        key = (*key, torch.is_grad_enabled(), grads)
    cached = backend.schedules.get(key) if key is not None else None
    spec = text = error = None
    if cached is not None:
        spec, text = replace(cached[0], backend=backend), cached[1]
    else:
        try:
            spec = _schedule(q, k, v, segment_lengths, dilation_rates, backend=backend, **options)
        except (ValueError, TypeError) as exc:
            error = exc
    backend.calls += 1
    if backend.check_calls:
        if text is None:  # (an entry made with check_calls=False has none yet)
            text = _signature_text(q, k, v, segment_lengths, dilation_rates, spec, options, requires_grad)
        agree(backend, text, error, q if isinstance(q, torch.Tensor) else torch.empty(0))
    elif error is not None:
        raise error
    if key is not None and error is None and (cached is None or cached[1] is not text):
        backend.schedules[key] = (replace(spec, backend=None), text)  # (no cycle holding the process group)
    return spec, backend.calls


def _signature_text(q, k, v, segment_lengths, dilation_rates, spec: _Schedule | None, options: dict,
                    requires_grad: list[bool] | None) -> str:
    """What every rank must agree on for this call (``consistency.call_signature``), as the text compared."""
    kernel, docs = options["kernel"], spec.docs if spec is not None else None
    same = {name: options[name] for name in ("mode", "causal", "softmax_scale", "head_offsets", "strategy",
                                             "pad_to_segments", "layout")}
    sig = call_signature(q, k, v, segment_lengths, dilation_rates, **same,
                         kernel=kernel if isinstance(kernel, str) else type(kernel).__name__,
                         key_padding_mask=options["key_padding_mask"] is not None,
                         cu_seqlens=None if docs is None else
                         f"{len(docs) - 1} documents, crc32 {zlib.crc32(str(docs).encode())}")
    if requires_grad is not None:
        sig["requires_grad"] = dict(zip("qkv", requires_grad))
    # the resolved strategy: "auto" reads the GPU model, which may differ between ranks (strategy.py)
    sig["strategy's team (1: ring, the world: head)"] = spec.team if spec is not None else None
    sig["head chunks (set_memory_bound)"] = max(1, len(spec.heads)) if spec is not None else None
    return signature_text(sig)


def _forward(spec: _Schedule, call: int, q, k, v, key_padding_mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The computation: ``(out, saved)``, ``saved`` being the tensors it made that ``_backward`` needs
    (the q/k/v/mask/out/lse the attention saw, where they are not the caller's)."""
    q, k, v = _unit_head_dim(q), _unit_head_dim(k), _unit_head_dim(v)
    saved, mask = [], key_padding_mask
    if spec.backend is not None and mask is not None:
        mask = _gather_mask(spec.backend, mask, call, spec.team, spec.zigzag)
        saved.append(mask)
    if spec.team == 1:
        out, lse = _attend(spec, call, q, k, v, mask)
        settle(spec.backend)  # a peer in another call or configuration raises here (stamps)
        return out, saved + [lse]
    swap = spec.swap(call)
    if spec.heads:  # one chunk's heads at a time; the backward swaps them again (head_parallel.py)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = q.new_empty((q.shape[0], q.shape[1] * spec.team, spec.split.local_heads), dtype=accum_dtype(q.dtype))
        for i, part in enumerate(spec.heads):
            out_h, part_lse = _attend(spec.chunk(i), call, *sequence_to_heads(q, k, v, swap, part), mask)
            part.query(lse).copy_(part_lse)
            heads_to_sequence(out_h, swap, part, into=out)
        settle(spec.backend)
        return out, saved + [lse]
    qh, kh, vh = sequence_to_heads(q, k, v, swap)
    out_h, lse = _attend(spec, call, qh, kh, vh, mask)
    out = heads_to_sequence(out_h, swap)
    settle(spec.backend)
    return out, saved + [qh, kh, vh, out_h, lse]


def _backward(spec: _Schedule, call: int, q, k, v, key_padding_mask, out, saved: list[torch.Tensor], dout
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``_forward``'s ``out`` for ``dout`` (exact: the kernels' backward on the final out/lse)."""
    saved = list(saved)
    mask = saved.pop(0) if spec.backend is not None and key_padding_mask is not None else key_padding_mask
    if spec.team == 1:
        (lse,) = saved
        q, k, v = _unit_head_dim(q), _unit_head_dim(k), _unit_head_dim(v)
        grads = _attend_backward(spec, call, q, k, v, mask, out, lse, dout)
        settle(spec.backend)
        return grads
    swap = spec.swap(call)
    if spec.heads:  # one chunk's heads at a time, swapped again (``_forward``)
        (lse,) = saved
        adds = spec.split.kv_heads % spec.team != 0  # a kv head several members read: its chunks add
        into = (q.new_empty(q.shape), *((k.new_zeros if adds else k.new_empty)(k.shape) for _ in "kv"))
        for i, part in enumerate(spec.heads):
            qh, kh, vh, out_h, dout_h = sequence_to_heads(q, k, v, swap, part, (out, dout), "backward")
            grads = list(_attend_backward(spec.chunk(i), call, qh, kh, vh, mask, out_h, part.query(lse), dout_h))
            del qh, kh, vh, out_h, dout_h
            sequence_to_heads_backward(grads, swap, k.shape, part, into)
        settle(spec.backend)
        return into
    qh, kh, vh, out_h, lse = saved
    grads = list(_attend_backward(spec, call, qh, kh, vh, mask, out_h, lse, heads_to_sequence_backward(dout, swap)))
    grads = sequence_to_heads_backward(grads, swap, k.shape)  # (frees the head-layout gradients as it goes)
    settle(spec.backend)
    return grads


def _saved_like(spec: _Schedule, q, k, key_padding_mask) -> list[torch.Tensor]:
    """Empty tensors shaped as ``_forward``'s ``saved`` (for a custom op's fake implementation)."""
    bsz, local, heads, dim = q.shape
    acc = accum_dtype(q.dtype)
    saved = []
    if spec.backend is not None and key_padding_mask is not None:
        saved.append(key_padding_mask.new_empty((bsz, local * spec.backend.world_size)))
    if spec.team == 1:
        return saved + [q.new_empty((bsz, local, heads), dtype=acc)]
    n, hl, hk = local * spec.team, spec.split.local_heads, spec.split.local_kv_heads
    if spec.heads:
        return saved + [q.new_empty((bsz, n, hl), dtype=acc)]
    return saved + [q.new_empty((bsz, n, hl, dim)), k.new_empty((bsz, n, hk, dim)), k.new_empty((bsz, n, hk, dim)),
                    q.new_empty((bsz, n, hl, dim)), q.new_empty((bsz, n, hl), dtype=acc)]


def _double_backward_error() -> RuntimeError:
    return RuntimeError(
        "dilated_attention does not support double backward (backward with create_graph=True, e.g. "
        "gradient penalties or torch.autograd.grad(..., create_graph=True)): its backward is hand-written "
        "and not itself differentiable"
    )


def _vmap_folded(apply, info, in_dims, spec: _Schedule, *args):
    """A vmap rule: rows of a batch are independent, so the vmapped dim folds into the batch dim
    (one call, no loop); tensors not vmapped are repeated."""
    if spec.backend is not None:
        raise RuntimeError("torch.func.vmap over dilated_attention with comm is not supported (every rank must "
                           "exchange whole calls): vmap single-device calls, or fold the vmapped dim into the "
                           "batch dim yourself")
    size = info.batch_size

    def fold(x, dim):
        if not isinstance(x, torch.Tensor):
            return x
        x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
        return x.flatten(0, 1)

    outs = apply(*(fold(x, d) for x, d in zip(args, in_dims)))
    return tuple(t.unflatten(0, (size, -1)) for t in outs), (0,) * len(outs)


class _Attention(torch.autograd.Function):
    """The one autograd boundary of an eager call: ``_forward``, and ``_backward`` as its gradient.

    ``forward`` + ``setup_context`` (what ``torch.func`` needs): the tensors ``_forward`` makes for the
    backward are outputs, marked non-differentiable.
    """

    @classmethod
    def apply(cls, *args):
        # Function.apply re-binds arguments with inspect.signature on every call of a setup_context
        # Function (~30 us); forward has no defaults to bind, so outside torch.func go straight to C++.
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    @staticmethod
    def forward(q, k, v, key_padding_mask, spec: _Schedule, call: int):
        out, saved = _forward(spec, call, q, k, v, key_padding_mask)
        return (out, *saved)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, key_padding_mask, spec, call = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zero "gradients" for the saved outputs: only out's is used
        ctx.save_for_backward(q, k, v, key_padding_mask, *output)
        # torch.func transforms run every backward with grad mode on: remember whether one is active
        ctx.spec, ctx.call, ctx.under_torch_func = spec, call, torch._C._are_functorch_transforms_active()

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, key_padding_mask, out, *saved = ctx.saved_tensors
        if ctx.under_torch_func:  # a Function, so vmap batches it; differentiating it raises
            grads = _AttentionBackward.apply(dout, q, k, v, key_padding_mask, out, ctx.spec, ctx.call, *saved)
        elif torch.is_grad_enabled():  # plain autograd: only create_graph=True runs a backward with grad mode on
            raise _double_backward_error()
        else:
            grads = _backward(ctx.spec, ctx.call, q, k, v, key_padding_mask, out, saved, dout)
        return (*grads, None, None, None)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            "dilated_attention does not support forward-mode AD (torch.func.jvp, torch.autograd.forward_ad): "
            "its derivative is a hand-written backward; use reverse mode (backward, torch.func.grad / vjp)"
        )

    @staticmethod
    def vmap(info, in_dims, q, k, v, key_padding_mask, spec: _Schedule, call: int):
        return _vmap_folded(_Attention.apply, info, in_dims, spec, q, k, v, key_padding_mask, spec, call)


class _AttentionBackward(torch.autograd.Function):
    """``_backward`` as a Function of its own under ``torch.func`` (which runs every backward with grad
    mode on): ``vmap`` batches it too (per-sample gradients), and differentiating it raises."""

    @staticmethod
    def forward(dout, q, k, v, key_padding_mask, out, spec: _Schedule, call: int, *saved):
        return _backward(spec, call, q, k, v, key_padding_mask, out, saved, dout)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise _double_backward_error()

    @staticmethod
    def vmap(info, in_dims, dout, q, k, v, key_padding_mask, out, spec: _Schedule, call: int, *saved):
        return _vmap_folded(_AttentionBackward.apply, info, in_dims, spec, dout, q, k, v, key_padding_mask, out,
                            spec, call, *saved)


_ops.bind(check_flags=_check_flags, check_scale_type=_check_scale_type, prepare=_prepare, forward=_forward,
          backward=_backward, schedule=_schedule, saved_like=_saved_like)
