"""Drop-in attention layers."""

from __future__ import annotations

from typing import Sequence

import torch
from einops import rearrange
from torch import nn

from .comm import CommBackend
from .functional import dilated_attention


class DilatedAttention(nn.Module):
    """Holds a pattern; ``forward(q, k, v)`` on ``(B, N, H, D)`` tensors (local shards with ``comm``)."""

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "longnet",
        causal: bool = False,
        softmax_scale: float | None = None,
        comm: str | CommBackend | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.segment_lengths = list(segment_lengths)
        self.dilation_rates = list(dilation_rates)
        self.mode, self.causal, self.softmax_scale = mode, causal, softmax_scale
        self.comm, self.kernel = comm, kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dilated_attention(
            q, k, v, self.segment_lengths, self.dilation_rates, mode=self.mode, causal=self.causal,
            softmax_scale=self.softmax_scale, comm=self.comm, kernel=self.kernel,
        )

    def extra_repr(self) -> str:
        return (f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
                f"mode={self.mode!r}, causal={self.causal}, comm={self.comm!r}, kernel={self.kernel!r}")


class MultiheadDilatedAttention(nn.Module):
    """Multi-head attention layer (q/k/v/out projections) with dilated attention inside.

    Input ``(B, N, embed_dim)`` (or ``(N, B, embed_dim)`` with ``batch_first=False``);
    with ``comm`` each rank passes its sequence shard. ``num_kv_heads`` < ``num_heads``
    gives grouped-query attention.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        batch_first: bool = True,
        mode: str = "longnet",
        causal: bool = False,
        comm: str | CommBackend | None = None,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        kv_dim = self.head_dim * num_kv_heads
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, mode=mode, causal=causal, comm=comm, kernel=kernel
        )

    def forward(
        self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None
    ) -> torch.Tensor:
        key = query if key is None else key
        value = key if value is None else value
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must have shape (B, N, {self.embed_dim}), got {tuple(query.shape)}")
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        q = rearrange(self.q_proj(query), "b n (h d) -> b n h d", d=self.head_dim)
        k = rearrange(self.k_proj(key), "b n (h d) -> b n h d", d=self.head_dim)
        v = rearrange(self.v_proj(value), "b n (h d) -> b n h d", d=self.head_dim)
        out = self.out_proj(rearrange(self.attention(q, k, v), "b n h d -> b n (h d)"))
        return out if self.batch_first else out.transpose(0, 1)
