"""The test vocabulary, written once: layouts, relative error, the tolerance rule.

Every battery (pytest files, the multi-rank harness, diagnostics, fuzzing) uses
these so that "non-contiguous" and "close enough" mean one thing everywhere.

Tolerance rule (docs/design.md section 7, flash-attention's): a low-precision result
is within the rule when its error against the float64 oracle is at most
``FACTOR`` times the error of plain torch in the same precision, plus a small
floor for that dtype. float64 results must match the oracle to ``FLOOR[float64]``.
"""

from __future__ import annotations

import torch

FACTOR = 2.0
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 2e-3, torch.float16: 5e-4}

# Arrangements of the same values that every fast path must read correctly.
LAYOUTS = (
    "contiguous",
    "transposed",       # a (B, H, N, D) buffer seen as (B, N, H, D)
    "head_slice",       # heads [1, H+1) of a wider buffer
    "storage_offset",   # a view starting inside its storage
    "zero_stride",      # batch expanded from one row (stride 0)
    "strided_head_dim", # every other element of a 2x wider last dim (stride 2)
    "unbind_last",      # one of (..., D, 3).unbind(-1): last-dim stride 3
    "permuted",         # a (B, D, N, H) buffer permuted to (B, N, H, D)
)


def as_layout(x: torch.Tensor, layout: str, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """The values of ``x`` (B, N, H, D) in the arrangement ``layout`` (a view of a fresh buffer).

    Padding around the values is random, never zeros, so a kernel that reads the
    wrong elements gives a wrong answer instead of a lucky one. ``zero_stride``
    keeps only batch row 0 of ``x`` (expanded), so compare against ``as_layout``'s
    result, not ``x``.
    """
    def noise(*shape):
        return torch.randn(*shape, dtype=x.dtype, device=x.device, generator=generator)

    b, n, h, d = x.shape
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "head_slice":
        wide = noise(b, n, h + 2, d)
        wide[:, :, 1:-1] = x
        return wide[:, :, 1:-1]
    if layout == "storage_offset":
        flat = noise(x.numel() + 7)
        view = flat[7:].view(b, n, h, d)
        view.copy_(x)
        return view
    if layout == "zero_stride":
        return x[:1].expand(b, n, h, d)
    if layout == "strided_head_dim":
        wide = noise(b, n, h, 2 * d)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "unbind_last":
        wide = noise(b, n, h, d, 3)
        wide[..., 1] = x
        return wide.unbind(-1)[1]
    if layout == "permuted":
        buf = x.permute(0, 3, 1, 2).contiguous()  # (B, D, N, H)
        return buf.permute(0, 2, 3, 1)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def rel_err(got: torch.Tensor, want: torch.Tensor, *, floor: float = 1e-30) -> float:
    """Max absolute error relative to the largest magnitude of ``want``, or ``floor`` if that is smaller
    (computed in float64; a floor of 1 judges a result that is near zero in absolute terms)."""
    want = want.detach().double()
    diff = (got.detach().double().to(want.device) - want).abs().max()
    return (diff / want.abs().max().clamp_min(floor)).item()


def tolerance(dtype: torch.dtype, plain_err: float | None) -> float:
    """The rule's bound for a result in ``dtype``; ``plain_err`` is plain torch's error in ``dtype``."""
    if dtype == torch.float64 or plain_err is None:
        return FLOOR[torch.float64] if dtype == torch.float64 else FLOOR[dtype]
    return FACTOR * plain_err + FLOOR[dtype]


def assert_within_rule(name: str, got: torch.Tensor, oracle: torch.Tensor, plain: torch.Tensor | None = None,
                       *, context: str = "") -> float:
    """Assert ``got`` (any dtype) is within the rule against the float64 ``oracle``; returns the error.

    ``plain`` is the plain-torch result in ``got``'s dtype (required below float64).
    """
    if got.dtype != torch.float64 and plain is None:
        raise ValueError(f"{name}: a {got.dtype} result needs the plain-torch result in {got.dtype} to be judged")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values {context}")
    err = rel_err(got, oracle)
    bound = tolerance(got.dtype, None if plain is None else rel_err(plain, oracle))
    if not err <= bound:
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {bound:.3e} ({got.dtype}) {context}")
    return err
