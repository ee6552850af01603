"""``KernelWrapper``: a ``PatternKernel`` that forwards every member to another one, ``inner``.

A kernel that changes another one states only what it changes:

* ``target(direction, plan, causal, q, k, masked)``: which kernel a call goes to (``inner``; a router
  such as ``AutoKernel`` picks one per pattern and direction, the guard its fallback);
* ``call(op, args, kwargs)``: every computing call passes here (``op`` names the ``PatternKernel``
  method, ``args`` are its positional arguments, ``protocol.CALL_ARGUMENTS[op]``): override it to act
  around each call (the guard, the runtime audit);
* or the methods themselves, where each needs its own handling (debug mode's checks, ``ChunkLoop``).

``name``, ``key_masks``, ``padding_masks`` and ``deterministic_backward`` are ``inner``'s unless set otherwise, and
``split_block`` answers ``protocol.causal_block`` for a wrapper that sets no ``causal_block`` of its own with its
target's: what a strategy asks of a kernel, it asks the wrapper, which never needs unwrapping.
"""

from __future__ import annotations

from typing import Any

import torch

from ..patterns import PatternPlan
from .protocol import DIRECTION, PatternKernel, causal_block, takes_padding_masks


class KernelWrapper:
    """A ``PatternKernel`` forwarding to ``inner`` (see the module doc)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.key_masks = inner.key_masks
        self.padding_masks = takes_padding_masks(inner)
        self.deterministic_backward = inner.deterministic_backward

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return self.inner.supports(q, k)

    def target(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor,
               masked: bool) -> PatternKernel:
        """The kernel that runs this pattern in ``direction`` (``"fwd"``/``"bwd"``): ``inner``."""
        return self.inner

    def split_block(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor) -> int:
        """``protocol.causal_block`` of a wrapper without a ``causal_block`` of its own: its target's."""
        return causal_block(self.target(direction, plan, True, q, k, False), direction, plan, q, k)

    def call(self, op: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run ``op`` on ``target``: ``args`` are the method's positional arguments (q, k, v, plan, ...)."""
        kernel = self.target(DIRECTION[op], args[3], kwargs["causal"], args[0], args[1], "key_mask" in kwargs)
        return getattr(kernel, op)(*args, **kwargs)

    def forward_pattern(self, q, k, v, plan: PatternPlan, **kwargs):
        return self.call("forward_pattern", (q, k, v, plan), kwargs)

    def forward_pattern_into(self, q, k, v, plan: PatternPlan, out, lse, **kwargs) -> None:
        return self.call("forward_pattern_into", (q, k, v, plan, out, lse), kwargs)

    def backward_pattern(self, q, k, v, plan: PatternPlan, out, lse, dout, dq, dk, dv, **kwargs) -> None:
        return self.call("backward_pattern", (q, k, v, plan, out, lse, dout, dq, dk, dv), kwargs)

    def backward_pattern_parts(self, q, k, v, plan: PatternPlan, out, lse, dout, **kwargs):
        return self.call("backward_pattern_parts", (q, k, v, plan, out, lse, dout), kwargs)

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        return self.target(direction, plan, causal, q, k, masked).parts(direction, plan, q, k, causal=causal,
                                                                        masked=masked)


__all__ = ["KernelWrapper"]
