"""fp32 log-sum-exp merge of partial attention results, safe for empty rows.

A partial is ``(out, lse)`` with ``out`` of shape ``(..., D)`` and ``lse`` of
shape ``(...)`` in natural log. An empty row has ``lse = -inf`` (kernels may mark
a fully masked row with ``+inf``; it is read as ``-inf``). Merging is the online
softmax combination; it never produces NaN, and two empty rows stay empty.
"""

from __future__ import annotations

import torch


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, except that float64 (the oracle's precision) stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def normalize_lse(lse: torch.Tensor) -> torch.Tensor:
    """LSE (fp32, or fp64) with a ``+inf``/NaN empty-row marker mapped to ``-inf``."""
    lse = lse.to(accum_dtype(lse.dtype))
    return torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)


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
    # log/reciprocal only of a safe total, so empty rows get no 0/0 in the backward either.
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    lse = torch.where(nonempty, shift + torch.log(safe_total), torch.full_like(total, float("-inf")))
    inv = torch.where(nonempty, 1.0 / safe_total, torch.zeros_like(total))
    return _weighted(out_a, wa * inv) + _weighted(out_b, wb * inv), lse


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # A zero weight must silence the row even if an empty row's out holds NaN.
    w = weight.unsqueeze(-1)
    return torch.where(w > 0, out.to(w.dtype) * w, torch.zeros((), dtype=w.dtype, device=out.device))


def merge_all(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partials (softmax over the concatenation of their keys)."""
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_all needs equal, non-zero numbers of outs and lses, got {len(outs)} and {len(lses)}")
    out, lse = outs[0].to(accum_dtype(outs[0].dtype)), normalize_lse(lses[0])
    for o, s in zip(outs[1:], lses[1:]):
        out, lse = merge_two(out, lse, o, s)
    return out, lse
