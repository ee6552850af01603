"""What a call's arguments must be: each check raises ``ValueError``/``TypeError`` naming the argument and a fix.

Planning (``planning.py``) runs them on every call it plans; under ``torch.compile`` the custom ops run the type
checks that the op schema would blur (``custom_ops.py``). The layers (``modules.py``) run
``check_call_options`` at construction: what can be checked before a tensor is seen fails on the line that
built the layer, with the message the call would give.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .comm import check_comm
from .kernels.registry import KERNEL_NAMES
from .patterns import HEAD_OFFSET_RULES, MODES, check_layout, check_pattern_lists

STRATEGIES = ("auto", "ring", "head", "hybrid")


def check_tensors(q, k, v) -> None:
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


def check_scale_type(softmax_scale) -> None:
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")


def check_scale(softmax_scale, dim: int, dtype: torch.dtype) -> float:
    check_scale_type(softmax_scale)
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




def check_key_padding_mask(mask, q: torch.Tensor) -> torch.Tensor | None:
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


def check_cu_seqlens(cu_seqlens, q: torch.Tensor, total: int, read: bool = True) -> tuple[int, ...] | None:
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


def check_flags(causal, pad_to_segments, strategy, layout="contiguous") -> None:
    for name, flag in (("causal", causal), ("pad_to_segments", pad_to_segments)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_layout(layout)


def check_call_options(segment_lengths, dilation_rates, *, mode="longnet", causal=False, softmax_scale=None,
                       head_offsets="spread", comm=None, strategy="auto", kernel="auto", layout="contiguous") -> None:
    """Every argument of ``dilated_attention`` that does not depend on the tensors, with the call's messages
    (the sequence-dependent pattern rules, a kernel object and the backend's process group wait for the call)."""
    check_pattern_lists(segment_lengths, dilation_rates)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if head_offsets not in HEAD_OFFSET_RULES:
        raise ValueError(f"head_offsets must be one of {HEAD_OFFSET_RULES}, got {head_offsets!r}")
    check_scale_type(softmax_scale)
    check_flags(causal, True, strategy, layout)
    check_comm(comm)
    if isinstance(kernel, str) and kernel not in KERNEL_NAMES:
        raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {kernel!r}")
