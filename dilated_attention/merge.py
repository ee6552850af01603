"""fp32 log-sum-exp merging of partial attention results, safe for empty rows: all of it lives here.

``merge_two`` merges two partials (ring steps); ``combine_patterns`` combines every
pattern's partial into the final ``(out, lse)`` in two passes.

A partial is ``(out, lse)`` with ``out`` of shape ``(..., D)`` and ``lse`` of
shape ``(...)`` in natural log. An empty row has ``lse = -inf``. Merging is the
online softmax combination; it never produces NaN from empty rows (two empty
rows stay empty), and NaN/inf inputs give NaN where plain attention gives NaN.
"""

from __future__ import annotations

import torch

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


def combine_patterns(partials, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every pattern's keys: the total LSE first, then one weighted add per region.

    ``partials`` holds ``(plan, out, lse)`` in compact layout (``lse`` as a kernel gave it). Two passes of a few ops
    per pattern (``views.region_views``) beat merging pattern by pattern (a dozen ops
    over the whole fp32 accumulator each time). Rows no pattern covers keep
    ``lse = -inf`` and ``out = 0``.
    """
    bsz, n, heads, dim = like.shape
    acc = accum_dtype(like.dtype)
    total = torch.full((bsz, n, heads), float("-inf"), dtype=acc, device=like.device)
    partials = [(plan, out, normalize_lse(lse)) for plan, out, lse in partials]
    for plan, _, lse in partials:
        for rows, part in region_views(total, lse, plan):
            rows.copy_(torch.logaddexp(rows, part))
    safe = torch.where(torch.isfinite(total), total, torch.zeros((), dtype=acc, device=like.device))
    out = torch.zeros((bsz, n, heads, dim), dtype=acc, device=like.device)
    for plan, part_out, lse in partials:
        weights = [torch.exp(part - rows) for rows, part in region_views(safe, lse, plan)]
        for (rows, part), weight in zip(region_views(out, part_out, plan), weights):
            rows.addcmul_(part, weight.unsqueeze(-1))
    return out.to(like.dtype), total
