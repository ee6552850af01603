"""``dilated_attention(...)``: validation, cross-rank agreement, strategy, then the computation.

Strategies (``comm`` given, ``P`` ranks, DESIGN.md section 2) are one code path with a team
size ``A``: an all-to-all inside teams of ``A`` consecutive ranks swaps sequence for heads
(``head_parallel.py``), then every pattern runs locally or as a ring across teams
(``ring.py``), then a second all-to-all swaps back. ``"ring"`` is ``A = 1``, ``"head"``
is ``A = P`` (no ring at all), ``"hybrid"`` is in between.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .comm import CommBackend, resolve_comm
from .consistency import agree, call_signature
from .diagnostics import debug as _debug
from .diagnostics.guard import guard_kernel
from .head_parallel import HeadSplit, HeadsToSequence, SequenceToHeads
from .kernels.base import BlockKernel, PatternKernel
from .kernels.dispatch import select_kernel
from .patterns import PatternPlan, hybrid_team_size, padded_length, plan_patterns
from .ring import RingDilatedAttention, RingLayout

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


def _check_scale(softmax_scale, dim: int, dtype: torch.dtype) -> float:
    if softmax_scale is None:
        return dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
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


def _team_size(strategy: str, world: int, heads: int) -> int:
    """Ranks that swap sequence for heads (``A``); the documented choice for ``"auto"``/``"hybrid"``.

    ``auto``: head-parallel whenever the heads split evenly over the ranks (perfect balance,
    causal included, traffic independent of the patterns: 4 all-to-alls of ``(P-1)/P`` of
    q, k, v, out per direction), else hybrid, else the ring. ``hybrid``: a2a inside a node
    (``LOCAL_WORLD_SIZE`` ranks) and the ring across nodes when that divides the heads,
    else the largest proper divisor of the world that divides the heads.
    """
    if strategy == "ring" or world == 1:
        return 1
    if strategy == "head" or (strategy == "auto" and heads % world == 0):
        return world
    team = hybrid_team_size(world, heads, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
    if team is None and strategy == "hybrid":
        raise ValueError(f'strategy="hybrid" needs a team size that divides both the world size ({world}) and the '
                         f"number of query heads ({heads}); none exists")
    return team or 1


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


def _check_cu_seqlens(cu_seqlens, q: torch.Tensor, total: int) -> tuple[int, ...] | None:
    """Document offsets as host ints (read once: the schedule depends on them)."""
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
    plans: tuple[PatternPlan, ...]


def _whole_batches(segment_lengths, dilation_rates, n: int, docs, pad: bool, plan) -> tuple[_Batch, ...]:
    """The schedule on a whole sequence of ``n`` rows; ``plan(length)`` makes the pattern plans."""
    if docs is None:
        length = padded_length(segment_lengths, dilation_rates, n) if pad else n
        return (_Batch(length, None, plan(length)),)
    groups: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(docs, docs[1:]):
        if end > start:
            length = padded_length(segment_lengths, dilation_rates, end - start) if pad else end - start
            groups.setdefault(length, []).append((start, end))
    return tuple(_Batch(length, tuple(spans), plan(length)) for length, spans in sorted(groups.items()))


def _attend_whole(q, k, v, key_mask, batches: tuple[_Batch, ...], kernel, causal: bool, scale: float):
    """Single-device semantics on a whole sequence, with internal padding and packed documents.

    Padded rows are zero queries and keys; their keys are masked and their outputs dropped, so
    results and gradients equal the unpadded ones. Each document runs alone (its segments start
    at its first row; nothing crosses documents); documents of equal padded length share a launch.
    """
    def run(qb, kb, vb, mask, batch):
        return RingDilatedAttention.apply(qb, kb, vb, mask, batch.plans, None, RingLayout(), 0, kernel, causal, scale)

    n = q.shape[1]
    if batches[0].spans is None:
        batch = batches[0]
        if batch.length == n:
            return run(q, k, v, key_mask, batch)
        grow = batch.length - n
        mask = key_mask if key_mask is not None else torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
        pad = [F.pad(x, (0, 0, 0, 0, 0, grow)) for x in (q, k, v)]
        return run(*pad, F.pad(mask, (0, grow), value=True), batch)[:, :n]
    pieces = {}
    for batch in batches:
        def rows(x, fill=0.0):
            return torch.cat([F.pad(x[:, a:b], (0, 0) * (x.dim() - 2) + (0, batch.length - (b - a)), value=fill)
                              for a, b in batch.spans])
        mask = key_mask if key_mask is not None else torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
        out = run(rows(q), rows(k), rows(v), rows(mask, True), batch)
        for i, (a, b) in enumerate(batch.spans):
            pieces[a] = out[i : i + 1, : b - a]
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=1)


def _gather_mask(backend: CommBackend, mask: torch.Tensor | None, call: int) -> torch.Tensor | None:
    """Every rank's key mask rows, as one ``(B, N)`` mask of the whole sequence."""
    if mask is None:
        return None
    parts = backend.all_gather(mask.to(torch.uint8), f"call {call}: key_padding_mask all-gather",
                               host=backend.host_waits)
    return parts.permute(1, 0, 2).flatten(1).bool()


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
) -> torch.Tensor:
    """Dilated attention over ``(B, N, H, D)`` inputs (DESIGN.md sections 1-2).

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
    Returns ``(B, N, H, D)``; differentiable once (double backward raises).
    """
    backend = resolve_comm(comm)
    world = backend.world_size if backend is not None else 1
    error: BaseException | None = None
    docs = None
    try:
        _check_tensors(q, k, v)
        for name, flag in (("causal", causal), ("pad_to_segments", pad_to_segments)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        scale = _check_scale(softmax_scale, q.shape[-1], q.dtype)
        bsz, local, heads, _ = q.shape
        team = _team_size(strategy, world, heads)
        split = HeadSplit(heads, k.shape[2], team)
        reason = split.check()
        if reason is not None:
            raise ValueError(f"strategy={strategy!r}: {reason}")
        lane = backend.rank % team if backend is not None else 0
        key_mask = _check_key_padding_mask(key_padding_mask, q)
        docs = _check_cu_seqlens(cu_seqlens, q, local * world)

        def plan(length: int, local_len: int | None = None) -> tuple[PatternPlan, ...]:
            return plan_patterns(
                segment_lengths, dilation_rates, seq_len=length, local_len=local_len or length,
                num_heads=split.local_heads, num_kv_heads=split.local_kv_heads, mode=mode,
                head_offsets=head_offsets, head_start=lane * split.local_heads, total_heads=heads,
            )

        batches = None
        if team == world:  # the whole sequence on this rank: padding and documents are local matters
            batches = _whole_batches(segment_lengths, dilation_rates, local * world, docs, pad_to_segments, plan)
        elif docs is not None:
            raise ValueError(f"cu_seqlens with comm needs each rank to hold whole documents: strategy='head' (or "
                             f"'auto' with the {heads} heads divisible by the {world} ranks); got "
                             f"strategy={strategy!r} with a ring over {world // team} shards")
        else:
            plans = plan(local * world, local * team)
        if backend is not None:
            for name, t in (("q", q), ("k", k), ("v", v), ("key_padding_mask", key_mask)):
                reason = backend.check_device(name, t) if t is not None else None
                if reason is not None:
                    raise ValueError(reason)
        masked = key_mask is not None or (batches is not None and (
            batches[0].spans is not None or batches[0].length != local * world))
        chosen = select_kernel(kernel, q, k, masked)
        meta = {}
        if _debug.enabled():  # off by default: one module-global check
            meta = _debug.call_meta(q, k, v, segment_lengths, dilation_rates, mode=mode, causal=causal,
                                    softmax_scale=softmax_scale, kernel=kernel, comm=backend, strategy=strategy)
            _debug.record_call(meta, {"q": q, "k": k, "v": v})
            chosen = _debug.wrap_kernel(chosen, meta)
        chosen = guard_kernel(chosen, meta)  # CUDA faults re-raised with the call's shapes; resource errors fall back
    except (ValueError, TypeError) as exc:
        if backend is None:
            raise
        error = exc
    if backend is None:
        q, k, v = _unit_head_dim(q), _unit_head_dim(k), _unit_head_dim(v)
        return _attend_whole(q, k, v, key_mask, batches, chosen, causal, scale)
    backend.calls += 1
    call = backend.calls
    if backend.check_calls:
        sig = call_signature(q, k, v, segment_lengths, dilation_rates, mode=mode, causal=causal,
                             softmax_scale=softmax_scale, head_offsets=head_offsets, strategy=strategy,
                             kernel=kernel if isinstance(kernel, str) else type(kernel).__name__,
                             key_padding_mask=key_padding_mask is not None, pad_to_segments=pad_to_segments,
                             cu_seqlens=None if docs is None else
                             f"{len(docs) - 1} documents, crc32 {zlib.crc32(str(docs).encode())}")
        agree(backend, sig, error, q if isinstance(q, torch.Tensor) else torch.empty(0))
    elif error is not None:
        raise error
    q, k, v = _unit_head_dim(q), _unit_head_dim(k), _unit_head_dim(v)
    key_mask = _gather_mask(backend, key_mask, call)
    if world == 1:  # a group of one: the single-device computation
        return _attend_whole(q, k, v, key_mask, batches, chosen, causal, scale)
    if team == 1:
        return RingDilatedAttention.apply(q, k, v, key_mask, plans, backend, RingLayout(), call, chosen, causal, scale)
    members = tuple(range(backend.rank - lane, backend.rank - lane + team))
    what = f"call {call}, strategy {strategy!r} (team of {team})"
    qh, kh, vh = SequenceToHeads.apply(q, k, v, backend, members, split, what)
    if batches is not None:
        out = _attend_whole(qh, kh, vh, key_mask, batches, chosen, causal, scale)
    else:
        out = RingDilatedAttention.apply(qh, kh, vh, key_mask, plans, backend, RingLayout(team), call, chosen,
                                         causal, scale)
    return HeadsToSequence.apply(out, backend, members, what)
