"""The one seam between the ring and the local-block kernels.

A kernel computes softmax attention of one block: ``(q, k, v) -> (out, lse)``.

* ``q``: ``(B, S, M, Hq, D)``; ``k``, ``v``: ``(B, S, Mk, Hk, D)`` with ``Hq % Hk == 0``
  (query head ``i`` reads kv head ``i // (Hq // Hk)``). They are usually strided
  views (dilated rows, head slices) of larger tensors: a kernel either reads them
  through their strides or copies them itself.
* ``causal``: key ``j`` visible to query ``i`` iff ``j <= i`` (needs ``M == Mk``).
* ``out``: ``(B, S, M, Hq, D)`` in ``q.dtype``; ``lse``: ``(B, S, M, Hq)`` fp32,
  natural log, ``-inf`` for a row with no visible key (``out`` is 0 there).
* ``backward`` gets the *final* merged ``out`` and ``lse`` of the whole dilated
  attention (not this block's), so ``delta = rowsum(dout * out)`` and
  ``P = exp(s - lse)`` make each block's gradient exact for the merged result.
  It returns ``dq``, ``dk``, ``dv`` (fp32 or input dtype) shaped like q, k, v.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockKernel(Protocol):
    name: str

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """``None`` if this kernel can run on these inputs, else the reason it cannot."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
