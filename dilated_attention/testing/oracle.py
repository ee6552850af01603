"""Independent oracle: dense masked attention straight from docs/design.md section 1.

No views, chunks, kernels or rings: one ``(H, N, N)`` mask per pattern, plain
softmax per pattern, then the log-sum-exp combination. Use float64 on CPU for
the oracle; in a low precision it is "plain torch in the same precision".
"""

from __future__ import annotations

import torch

from ..patterns import head_groups, longnet_offsets, validate_patterns


def _torchscale_offsets(num_heads: int, rate: int) -> list[int]:
    """torchscale's rule re-derived from its code: heads are cut into ``r`` runs of ``ceil(H / r)``."""
    per = -(-num_heads // rate)
    return [min(h // per, rate - 1) for h in range(num_heads)]


def pattern_masks(seq_len: int, num_heads: int, segment_lengths, dilation_rates, mode: str, causal: bool,
                  head_offsets: str = "spread"):
    """``[(H, N, N) bool mask of allowed (query, key) pairs]`` per pattern (queries outside: all False)."""
    pats = validate_patterns(segment_lengths, dilation_rates, seq_len)
    pos = torch.arange(seq_len)
    masks = []
    for i, (w, r) in enumerate(pats):
        if mode == "longnet":
            offsets = longnet_offsets(num_heads, r) if head_offsets == "spread" else _torchscale_offsets(num_heads, r)
            heads = range(num_heads)
        else:
            h0, h1 = head_groups(num_heads, len(pats))[i]
            offsets = {h: i % r for h in range(h0, h1)}
            heads = range(h0, h1)
        mask = torch.zeros(num_heads, seq_len, seq_len, dtype=torch.bool)
        same_seg = (pos[:, None] // w) == (pos[None, :] // w)
        if causal:
            same_seg &= pos[None, :] <= pos[:, None]
        for h in heads:
            inset = (pos % r) == offsets[h]
            mask[h] = same_seg & inset[:, None] & inset[None, :]
        masks.append(mask)
    return masks


def _dense(q, k, v, segment_lengths, dilation_rates, mode, causal, scale, head_offsets, key_padding_mask):
    bsz, n, heads, dim = q.shape
    group = heads // k.shape[2]
    ke, ve = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, ke) * scale
    outs, lses = [], []
    for mask in pattern_masks(n, heads, segment_lengths, dilation_rates, mode, causal, head_offsets):
        mask = mask.to(q.device)[None]
        if key_padding_mask is not None:
            mask = mask & ~key_padding_mask[:, None, None, :]
        sm = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(sm, -1)  # (B, H, N), -inf on uncovered rows
        p = torch.exp(sm - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        outs.append(torch.einsum("bhnm,bmhd->bnhd", p, ve))
        lses.append(lse)
    lse_all = torch.stack(lses)  # (P, B, H, N)
    empty = torch.isneginf(lse_all).all(0)  # rows no pattern covers: out 0 (logsumexp's gradient would be NaN)
    total = torch.logsumexp(lse_all.masked_fill(empty, 0.0), 0)
    weights = torch.exp(lse_all - total).masked_fill(empty, 0.0)  # 0 for patterns not covering a row
    out = sum(o * w.permute(0, 2, 1).unsqueeze(-1) for o, w in zip(outs, weights.unbind(0)))
    return out.to(q.dtype)


def _padded(n: int, segment_lengths, dilation_rates) -> int:
    """Shortest length >= n the patterns tile (searched directly: independent of the library's rule)."""
    length = n
    while True:
        try:
            validate_patterns(segment_lengths, dilation_rates, length)
            return length
        except ValueError:
            length += 1


def dense_dilated_attention(q, k, v, segment_lengths, dilation_rates, *, mode="longnet", causal=False,
                            softmax_scale=None, head_offsets="spread", key_padding_mask=None, cu_seqlens=None,
                            pad_to_segments=True):
    """Differentiable dense reference in the inputs' dtype. ``(B, N, H, D)`` in and out.

    Masks and documents straight from docs/design.md: each document (``cu_seqlens``) alone, padded
    at its end to a length the segments tile with its pad keys masked, the pad rows dropped.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    args = (segment_lengths, dilation_rates, mode, causal, scale, head_offsets)
    kpm = key_padding_mask if key_padding_mask is not None else torch.zeros(q.shape[:2], dtype=torch.bool,
                                                                             device=q.device)
    bounds = [0, q.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        n = b - a
        length = _padded(n, segment_lengths, dilation_rates) if pad_to_segments else n
        grow = length - n
        parts = [torch.cat([x[:, a:b], x.new_zeros((x.shape[0], grow, *x.shape[2:]))], 1) for x in (q, k, v)]
        mask = torch.cat([kpm[:, a:b], kpm.new_ones((kpm.shape[0], grow))], 1)
        pieces.append(_dense(*parts, *args, mask)[:, :n])
    return torch.cat(pieces, 1)


def oracle_rows(q, k, v, dout, rank: int, world: int, segment_lengths, dilation_rates, **options):
    """``[out, dq, dk, dv]`` of the oracle on the whole ``(B, N, H, D)`` inputs, each cut to rank ``rank``'s rows
    of ``world`` contiguous shards: what a sequence-parallel call on that rank's shard must return."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*x, segment_lengths, dilation_rates, **options)
    grads = torch.autograd.grad(out, x, dout)
    rows = q.shape[1] // world
    return [t[:, rank * rows:(rank + 1) * rows].detach() for t in (out, *grads)]
