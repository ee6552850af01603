"""Drop-in attention layers.

``MultiheadDilatedAttention`` follows ``nn.MultiheadAttention``'s calling
convention where that costs nothing: ``forward(query, key, value,
key_padding_mask=None, need_weights=None, attn_mask=None, ...)``. Attention
weights are never materialised, so ``need_weights=False`` returns ``(out, None)``
and ``need_weights=True`` raises; arbitrary ``attn_mask`` tensors and attention-weight
dropout are not supported and raise ``ValueError`` saying what to use instead.
"""

from __future__ import annotations

from typing import Sequence

import torch
from einops import rearrange
from torch import nn

from .comm import CommBackend
from .functional import dilated_attention
from .validation import check_call_options


class DilatedAttention(nn.Module):
    """Holds a pattern; ``forward(q, k, v)`` on ``(B, N, H, D)`` tensors (local shards with ``comm``, in the
    order ``layout`` names: ``distributed.shard_sequence(x, comm, layout=...)`` makes them).

    Every argument is ``dilated_attention``'s (see its docstring and docs/design.md); those that do not depend on
    the tensors are checked here, with the call's messages.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "longnet",
        causal: bool = False,
        softmax_scale: float | None = None,
        head_offsets: str = "spread",
        comm: str | CommBackend | None = None,
        strategy: str = "auto",
        kernel: str = "auto",
        layout: str = "contiguous",
    ) -> None:
        super().__init__()
        check_call_options(segment_lengths, dilation_rates, mode=mode, causal=causal, softmax_scale=softmax_scale,
                           head_offsets=head_offsets, comm=comm, strategy=strategy, kernel=kernel, layout=layout)
        self.segment_lengths = list(segment_lengths)
        self.dilation_rates = list(dilation_rates)
        self.mode, self.causal, self.softmax_scale = mode, causal, softmax_scale
        self.head_offsets, self.comm, self.strategy, self.kernel = head_offsets, comm, strategy, kernel
        self.layout = layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``key_padding_mask`` ``(B, N)`` (this rank's shard with ``comm``): ``True`` marks padding keys;
        ``cu_seqlens``: int32 offsets of packed documents in a ``(1, total, H, D)`` batch."""
        return dilated_attention(
            q, k, v, self.segment_lengths, self.dilation_rates, mode=self.mode, causal=self.causal,
            softmax_scale=self.softmax_scale, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
            head_offsets=self.head_offsets, comm=self.comm, strategy=self.strategy, kernel=self.kernel,
            layout=self.layout,
        )

    def extra_repr(self) -> str:
        return (f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
                f"mode={self.mode!r}, causal={self.causal}, head_offsets={self.head_offsets!r}, "
                f"comm={self.comm!r}, strategy={self.strategy!r}, kernel={self.kernel!r}, layout={self.layout!r}")


class MultiheadDilatedAttention(nn.Module):
    """Multi-head attention layer (q/k/v/out projections) with dilated attention inside.

    Input ``(B, N, embed_dim)`` (or ``(N, B, embed_dim)`` with ``batch_first=False``);
    with ``comm`` each rank passes its sequence shard. ``num_kv_heads`` < ``num_heads``
    gives grouped-query attention.

    ``dropout`` exists for ``nn.MultiheadAttention`` compatibility and must be 0:
    the kernels never materialise attention weights, so there is nothing to drop
    (regularise with ``nn.Dropout`` on the layer's output instead).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = True,
        mode: str = "longnet",
        causal: bool = False,
        head_offsets: str = "spread",
        comm: str | CommBackend | None = None,
        strategy: str = "auto",
        kernel: str = "auto",
        layout: str = "contiguous",
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
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"dropout must be a float, got {type(dropout).__name__}")
        if dropout != 0:
            raise ValueError(
                f"dropout={dropout}: attention-weight dropout is not supported (dilated attention never "
                "materialises the attention weights); use dropout=0.0 and nn.Dropout on the output instead")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        self.dropout = 0.0
        kv_dim = self.head_dim * num_kv_heads
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, mode=mode, causal=causal, head_offsets=head_offsets, comm=comm,
            strategy=strategy, kernel=kernel, layout=layout,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool | None = None,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, None]:
        """``nn.MultiheadAttention``'s signature; returns ``out``, or ``(out, None)`` with ``need_weights=False``.

        ``key``/``value`` default to ``query`` (self-attention). ``key_padding_mask``
        ``(B, N)``: ``True`` marks padding. ``need_weights=True`` raises (weights are
        never computed); ``average_attn_weights`` is accepted and has no effect.
        ``attn_mask`` must be ``None`` (the dilated pattern and ``causal`` are the
        mask); ``is_causal=True`` requires a layer built with ``causal=True``. ``cu_seqlens``
        (not in ``nn.MultiheadAttention``): packed documents, as in ``dilated_attention``.
        """
        if need_weights:
            raise ValueError("need_weights=True: dilated attention never materialises attention weights; "
                             "pass need_weights=False (returns (out, None)) or leave it None (returns out)")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported: the dilated pattern (and causal=True at construction) "
                             "is the mask; padding goes in key_padding_mask")
        if is_causal and not self.attention.causal:
            raise ValueError("is_causal=True, but this layer was built with causal=False: build it with causal=True")
        key = query if key is None else key
        value = key if value is None else value
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must have shape (B, N, {self.embed_dim}), got {tuple(query.shape)}")
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        q = rearrange(self.q_proj(query), "b n (h d) -> b n h d", d=self.head_dim)
        k = rearrange(self.k_proj(key), "b n (h d) -> b n h d", d=self.head_dim)
        v = rearrange(self.v_proj(value), "b n (h d) -> b n h d", d=self.head_dim)
        out = self.out_proj(rearrange(self.attention(q, k, v, key_padding_mask, cu_seqlens), "b n h d -> b n (h d)"))
        out = out if self.batch_first else out.transpose(0, 1)
        return out if need_weights is None else (out, None)
