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
from typing import Sequence

import torch

from .comm import CommBackend, resolve_comm
from .consistency import agree, call_signature
from .diagnostics import debug as _debug
from .diagnostics.guard import guard_kernel
from .head_parallel import HeadSplit, HeadsToSequence, SequenceToHeads
from .kernels.base import BlockKernel, PatternKernel
from .kernels.dispatch import select_kernel
from .patterns import hybrid_team_size, plan_patterns
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
    ``head_offsets="torchscale"`` selects torchscale's head-offset rule.
    Returns ``(B, N, H, D)``; differentiable once (double backward raises).
    """
    backend = resolve_comm(comm)
    world = backend.world_size if backend is not None else 1
    error: BaseException | None = None
    try:
        _check_tensors(q, k, v)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
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
        plans = plan_patterns(
            segment_lengths, dilation_rates, seq_len=local * world, local_len=local * team,
            num_heads=split.local_heads, num_kv_heads=split.local_kv_heads, mode=mode, head_offsets=head_offsets,
            head_start=lane * split.local_heads, total_heads=heads,
        )
        if backend is not None:
            for name, t in (("q", q), ("k", k), ("v", v)):
                reason = backend.check_device(name, t)
                if reason is not None:
                    raise ValueError(reason)
        chosen = select_kernel(kernel, q, k)
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
        return RingDilatedAttention.apply(q, k, v, plans, None, RingLayout(), 0, chosen, causal, scale)
    backend.calls += 1
    call = backend.calls
    if backend.check_calls:
        sig = call_signature(q, k, v, segment_lengths, dilation_rates, mode=mode, causal=causal,
                             softmax_scale=softmax_scale, head_offsets=head_offsets, strategy=strategy,
                             kernel=kernel if isinstance(kernel, str) else type(kernel).__name__)
        agree(backend, sig, error, q if isinstance(q, torch.Tensor) else torch.empty(0))
    elif error is not None:
        raise error
    q, k, v = _unit_head_dim(q), _unit_head_dim(k), _unit_head_dim(v)
    if team == 1:
        return RingDilatedAttention.apply(q, k, v, plans, backend, RingLayout(), call, chosen, causal, scale)
    members = tuple(range(backend.rank - lane, backend.rank - lane + team))
    what = f"call {call}, strategy {strategy!r} (team of {team})"
    qh, kh, vh = SequenceToHeads.apply(q, k, v, backend, members, split, what)
    out = RingDilatedAttention.apply(qh, kh, vh, plans, backend, RingLayout(team), call, chosen, causal, scale)
    return HeadsToSequence.apply(out, backend, members, what)
