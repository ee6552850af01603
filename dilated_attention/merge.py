"""fp32 log-sum-exp merging of partial attention results, safe for empty rows: all of it lives here.

``merge_two`` merges two partials; ``merge_into_`` and ``merge_pattern_`` merge a partial
(a block's, or a whole pattern's in compact layout) into the running fp32 result in place.

A partial is ``(out, lse)`` with ``out`` of shape ``(..., D)`` and ``lse`` of
shape ``(...)`` in natural log. An empty row has ``lse = -inf``. Merging is the
online softmax combination; it never produces NaN from empty rows (two empty
rows stay empty), and NaN/inf inputs give NaN where plain attention gives NaN.
"""

from __future__ import annotations

import torch

from .patterns import PatternPlan
from .views import region_views


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, except that float64 (the oracle's precision) stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def normalize_lse(lse: torch.Tensor) -> torch.Tensor:
    """LSE in the accumulation dtype. NaN and ``+inf`` are kept: they come from NaN/inf inputs, and
    the result must then be NaN where plain attention's is (no kernel here marks empty rows with them)."""
    return lse.to(accum_dtype(lse.dtype))


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials; returns fp32 ``(out, lse)``. Differentiable, NaN-free for empty rows."""
    lse_a, lse_b = normalize_lse(lse_a), normalize_lse(lse_b)
    top = torch.maximum(lse_a, lse_b)
    # A row empty in both has top = -inf: shift by 0 instead so exp() sees -inf, not NaN.
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = wa + wb
    # log/reciprocal only of a safe total, so empty rows get no 0/0 in the backward either;
    # a NaN total (NaN input) is not empty: it must stay NaN.
    nonempty = ~(total == 0)
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    lse = torch.where(nonempty, shift + torch.log(safe_total), torch.full_like(total, float("-inf")))
    inv = torch.where(nonempty, 1.0 / safe_total, torch.zeros_like(total))
    return _weighted(out_a, wa * inv) + _weighted(out_b, wb * inv), lse


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # A zero weight must silence the row even if an empty row's out holds NaN (a NaN weight stays NaN).
    w = weight.unsqueeze(-1)
    return torch.where(w == 0, torch.zeros((), dtype=w.dtype, device=out.device), out.to(w.dtype) * w)


def merge_into_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Merge a partial into the running ``(out, lse)`` (fp32 views, possibly strided) in place."""
    merged, total = merge_two(out, lse, part_out, part_lse)
    out.copy_(merged)
    lse.copy_(total)


def merge_pattern_(out: torch.Tensor, lse: torch.Tensor, plan: PatternPlan, part_out: torch.Tensor,
                   part_lse: torch.Tensor) -> None:
    """Merge one pattern's partial in compact layout (``kernels/pattern.py``) into the running full-layout
    ``(out, lse)`` in place: the generic ``PatternKernel.forward_pattern_into`` (the fused kernel merges
    in its epilogue instead)."""
    whole = out.is_contiguous() and lse.is_contiguous()  # both views whole, or both chunk by chunk
    lse_regions = region_views(lse, part_lse, plan, whole)
    for (rows, part), (rows_lse, part_l) in zip(region_views(out, part_out, plan, whole), lse_regions):
        merge_into_(rows, rows_lse, part, part_l)
