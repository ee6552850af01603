"""``dilated_attention(...)``: validation, plan, then the ring (or local) function."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .comm import CommBackend, resolve_comm
from .comm.base import float_bits, stable_hash
from .kernels.base import BlockKernel
from .kernels.dispatch import select_kernel
from .patterns import plan_patterns
from .ring import RingDilatedAttention


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


def _check_scale(softmax_scale, dim: int) -> float:
    if softmax_scale is None:
        return dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    return float(softmax_scale)


def _prepare(q, k, v, segment_lengths, dilation_rates, mode, causal, softmax_scale, world_size):
    _check_tensors(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = _check_scale(softmax_scale, q.shape[-1])
    local = q.shape[1]
    plans = plan_patterns(
        segment_lengths, dilation_rates, seq_len=local * world_size, local_len=local,
        num_heads=q.shape[2], num_kv_heads=k.shape[2], mode=mode,
    )
    return plans, scale


def _signature(q, k, segment_lengths, dilation_rates, mode, causal, softmax_scale) -> dict[str, int]:
    """What every rank must agree on; unreadable parts become -1 (that rank failed anyway)."""
    def safe(f):
        try:
            return int(f())
        except Exception:
            return -1
    return {
        "batch": safe(lambda: q.shape[0]), "local_seq_len": safe(lambda: q.shape[1]),
        "heads": safe(lambda: q.shape[2]), "kv_heads": safe(lambda: k.shape[2]),
        "head_dim": safe(lambda: q.shape[3]), "dtype": safe(lambda: stable_hash(q.dtype)),
        "patterns": safe(lambda: stable_hash((list(segment_lengths), list(dilation_rates)))),
        "mode": stable_hash(mode), "causal": safe(lambda: bool(causal)),
        "softmax_scale": safe(lambda: float_bits(softmax_scale) if softmax_scale is not None else 0),
        "needs_grad": int(torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k))),
    }


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
    comm: str | CommBackend | None = None,
    kernel: str | BlockKernel = "auto",
) -> torch.Tensor:
    """Dilated attention over ``(B, N, H, D)`` inputs (DESIGN.md sections 1-2).

    With ``comm`` (a backend name or object), ``q, k, v`` are this rank's shard
    of the sequence (rank ``j`` holds rows ``[jL, (j+1)L)``) and the result is
    this rank's rows of the single-device result; every rank must call it.
    ``k``/``v`` may have fewer heads than ``q`` (GQA). Returns ``(B, N, H, D)``.
    """
    backend = resolve_comm(comm)
    world = backend.world_size if backend is not None else 1
    error: BaseException | None = None
    try:
        plans, scale = _prepare(q, k, v, segment_lengths, dilation_rates, mode, causal, softmax_scale, world)
        chosen = select_kernel(kernel, q, k)
    except (ValueError, TypeError) as exc:
        if backend is None:
            raise
        error = exc
    if backend is not None and backend.check_calls:
        like = q if isinstance(q, torch.Tensor) else torch.empty(0)
        backend.check_consistent(
            _signature(q, k, segment_lengths, dilation_rates, mode, causal, softmax_scale), error, like
        )
    elif error is not None:
        raise error
    return RingDilatedAttention.apply(q, k, v, plans, backend, chosen, causal, scale)

