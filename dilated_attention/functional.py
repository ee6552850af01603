"""``dilated_attention(...)``: the front door. It checks what only it sees and dispatches.

One call goes down once: ``planning.prepare`` validates and plans it (no data) and, with ``comm``, numbers it
and agrees on it across ranks; ``execution.Attention`` computes it under autograd (``execution.forward`` /
``backward``). Under ``torch.compile`` the call is one custom op (``custom_ops.py``) running the same two steps.
Strategies (``comm`` given, ``P`` ranks, docs/design.md section 2) are one code path with a team size ``A``: an
all-to-all inside teams of ``A`` consecutive ranks swaps sequence for heads (``head_parallel.py``), then every
pattern runs locally or as a ring across teams (``ring/``), then a second all-to-all swaps back.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import custom_ops as _ops
from .comm import CommBackend, resolve_comm
from .execution import Attention
from .kernels.protocol import BlockKernel, PatternKernel
from .planning import CallOptions, prepare


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
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    pad_to_segments: bool = True,
    head_offsets: str = "spread",
    comm: str | CommBackend | None = None,
    strategy: str = "auto",
    kernel: str | BlockKernel | PatternKernel = "auto",
    layout: str = "contiguous",
) -> torch.Tensor:
    """Dilated attention over ``(B, N, H, D)`` inputs (docs/design.md sections 1-2).

    With ``comm`` (a backend name or object), ``q, k, v`` are this rank's shard
    of the sequence (rank ``j`` holds rows ``[jL, (j+1)L)``) and the result is
    this rank's rows of the single-device result; every rank must make the same
    calls, forward and backward, in the same order. ``strategy`` picks how the
    ranks share the work (``"ring"``, ``"head"``, ``"hybrid"`` or ``"auto"``);
    all give the same rows. ``k``/``v`` may have fewer heads than ``q`` (GQA).

    ``key_padding_mask``: bool ``(B, N)`` (this rank's rows), ``True`` = padding key,
    excluded from every pattern; a row with no visible key gets 0. ``cu_seqlens``:
    int32 document offsets of a packed ``(1, total, H, D)`` batch (the global
    sequence with ``comm``, the same on every rank; needs the whole sequence per
    rank, i.e. the ``"head"`` strategy): each document runs alone. A length the
    segments do not tile is padded internally (masked pad keys) unless
    ``pad_to_segments=False`` (with ``comm`` a ring runs on padded shards the segments tile).
    ``head_offsets="torchscale"`` selects torchscale's head-offset rule.
    ``layout="zigzag"`` (with ``comm``): the shards are in zigzag order (``distributed.shard_indices``: rank
    ``j`` of ``K`` holds chunks ``j`` and ``2K - 1 - j`` of ``2K``), which balances causal rings; the
    result rows and gradients are this rank's rows in the same order. Every strategy; not under
    ``torch.compile``.
    Returns ``(B, N, H, D)``; differentiable once (double backward raises). Under
    ``torch.compile`` the call is one custom op (``custom_ops.py``); ``torch.func.grad``/``vjp``
    work, ``vmap`` works without ``comm``, forward-mode AD (``jvp``) raises.
    """
    options = CallOptions(segment_lengths, dilation_rates, mode, causal, softmax_scale, key_padding_mask, cu_seqlens,
                          pad_to_segments, head_offsets, strategy, kernel, layout)
    if torch.compiler.is_compiling() and _ops.AVAILABLE:
        # One opaque op: no graph break, and what talks to other ranks runs inside it, never in the graph.
        return _ops.attend(q, k, v, comm, options)
    backend = resolve_comm(comm)
    spec, call = prepare(q, k, v, backend, None, options)
    return Attention.apply(q, k, v, key_padding_mask, spec, call)[0]
