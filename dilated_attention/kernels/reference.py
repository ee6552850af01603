"""Plain-torch block kernel: any device, any float dtype; in float64 it is the oracle.

Low-precision inputs are computed in fp32 (as torch's math attention does).
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..merge import accum_dtype


def _expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    group = q_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _scores(q, k, causal: bool, scale: float, key_mask: torch.Tensor | None) -> torch.Tensor:
    ct = accum_dtype(q.dtype)
    s = torch.einsum("bsmhd,bsnhd->bshmn", q.to(ct), _expand_kv(k, q.shape[-2]).to(ct)) * scale
    if causal:
        m, n = s.shape[-2:]
        if m != n:
            raise ValueError(f"causal block needs equal query and key rows, got {m} and {n}")
        mask = torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if key_mask is not None:  # (B, S, Mk) -> broadcast over heads and query rows
        s = s.masked_fill(key_mask[:, :, None, None, :], float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Empty rows (lse = -inf) get zero probabilities instead of NaN; +inf/NaN (from inf/NaN inputs)
    # stay, so such rows are NaN exactly as in plain softmax attention.
    safe = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    return torch.exp(s - safe.unsqueeze(-1))


class ReferenceKernel:
    name = "reference"
    key_masks = True
    deterministic_backward = True

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return None

    def forward(self, q, k, v, *, causal: bool, scale: float, key_mask: torch.Tensor | None = None):
        s = _scores(q, k, causal, scale, key_mask)
        lse = torch.logsumexp(s, dim=-1)
        p = _probs(s, lse)
        out = torch.einsum("bshmn,bsnhd->bsmhd", p, _expand_kv(v, q.shape[-2]).to(p.dtype))
        return out.to(q.dtype), rearrange(lse, "b s h m -> b s m h")

    def backward(self, q, k, v, out, lse, dout, *, causal: bool, scale: float, key_mask: torch.Tensor | None = None):
        ct = accum_dtype(q.dtype)
        hq, hk = q.shape[-2], k.shape[-2]
        s = _scores(q, k, causal, scale, key_mask)
        p = _probs(s, rearrange(lse.to(ct), "b s m h -> b s h m"))
        do = dout.to(ct)
        ve = _expand_kv(v, hq).to(ct)
        dv = torch.einsum("bshmn,bsmhd->bsnhd", p, do)
        dp = torch.einsum("bsmhd,bsnhd->bshmn", do, ve)
        delta = rearrange((do * out.to(ct)).sum(-1), "b s m h -> b s h m")
        ds = p * (dp - delta.unsqueeze(-1)) * scale
        dq = torch.einsum("bshmn,bsnhd->bsmhd", ds, _expand_kv(k, hq).to(ct))
        dk = torch.einsum("bshmn,bsmhd->bsnhd", ds, q.to(ct))
        if hq != hk:  # fold the expanded heads back onto their kv head
            dk = dk.unflatten(-2, (hk, hq // hk)).sum(-2)
            dv = dv.unflatten(-2, (hk, hq // hk)).sum(-2)
        return dq, dk, dv
