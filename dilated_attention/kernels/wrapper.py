"""``KernelWrapper``: a ``PatternKernel`` that forwards every member to another one, ``inner``.

A kernel that changes another one states only what it changes:

* ``target(direction, plan, causal, q, k, masked)``: which kernel a call goes to (``inner``; a router
  such as ``AutoKernel`` picks one per pattern and direction, the guard its fallback);
* ``call(op, args, kwargs)``: every computing call passes here (``op``, a ``protocol.Op``, names the
  ``PatternKernel`` method, ``args`` are its positional arguments, ``protocol.CALL_ARGUMENTS[op]``, ``kwargs`` its
  ``fresh`` where given; ``protocol.run`` passes it on): override it to act around each call (the guard, the
  runtime audit);
* or the methods themselves, where each needs its own handling (debug mode's checks).

``name``, ``key_masks``, ``padding_masks`` and ``deterministic_backward`` are ``inner``'s unless set otherwise;
``split_block`` and ``stacks`` answer for the target (``split_block``: a wrapper's own ``causal_block`` where it
sets one): what a strategy asks of a kernel, it asks the wrapper, which never needs unwrapping.

``declared(kernel)``: a kernel that implements only ``PatternKernel``'s required members (written on its own,
without ``PatternKernelBase``) as one with every member, the optional ones at their defaults (``WithDefaults``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..patterns import PatternPlan
from .protocol import DIRECTION, CallSpec, Grads, Op, PatternKernel, PatternKernelBase, Result, Saved, run


class KernelWrapper(PatternKernelBase):
    """A ``PatternKernel`` forwarding to ``inner`` (see the module doc)."""

    causal_block: int | None = None  # a wrapper's own causal block; None: its target's (``split_block``)

    def __init__(self, inner: PatternKernel) -> None:
        # (the nominal check first: a wrapper is built per call, and a Protocol check costs 20 us)
        self.inner = inner if isinstance(inner, PatternKernelBase) else declared(inner)
        self.name = inner.name
        self.key_masks = inner.key_masks
        self.padding_masks = self.inner.padding_masks
        self.deterministic_backward = inner.deterministic_backward

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return self.inner.supports(q, k)

    def target(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor,
               masked: bool) -> PatternKernel:
        """The kernel that runs this pattern in ``direction`` (``"fwd"``/``"bwd"``): ``inner``."""
        return self.inner

    def split_block(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor) -> int:
        """This wrapper's own ``causal_block`` where it sets one, else its target's for this pattern's causal calls."""
        if self.causal_block is not None:
            return self.causal_block
        return self.target(direction, plan, True, q, k, False).split_block(direction, plan, q, k)

    def stacks(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Its target's answer for ``plan``."""
        return self.target(direction, plan, causal, q, k, False).stacks(direction, plan, causal, q, k)

    def call(self, op: Op, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run ``op`` on ``target``: ``args`` are the method's positional arguments (q, k, v, plan, spec, ...)."""
        spec = args[4]
        kernel = self.target(DIRECTION[op], args[3], spec.causal, args[0], args[1], spec.key_mask is not None)
        return run(op, kernel, args, kwargs)

    def forward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                        spec: CallSpec) -> Result:
        return self.call(Op.FORWARD, (q, k, v, plan, spec), {})

    def forward_pattern_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                             spec: CallSpec, running: Result, **kwargs: bool) -> None:
        return self.call(Op.FORWARD_INTO, (q, k, v, plan, spec, running), kwargs)

    def backward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, saved: Saved, grads: Grads, **kwargs: bool) -> None:
        return self.call(Op.BACKWARD, (q, k, v, plan, spec, saved, grads), kwargs)

    def backward_pattern_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                               spec: CallSpec, saved: Saved) -> Grads:
        return self.call(Op.BACKWARD_PARTS, (q, k, v, plan, spec, saved), {})

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        return self.target(direction, plan, causal, q, k, masked).parts(direction, plan, q, k, causal=causal,
                                                                        masked=masked)


class WithDefaults(KernelWrapper):
    """A kernel of ``PatternKernel``'s required members only, with the optional ones at ``PatternKernelBase``'s
    defaults (padding masks where it takes key masks, as any kernel with ``key_masks``)."""

    causal_block = 0

    def __init__(self, inner) -> None:  # (not KernelWrapper's: ``inner`` has no optional member to forward)
        self.inner = inner
        self.name = inner.name
        self.key_masks = inner.key_masks
        self.padding_masks = inner.key_masks
        self.deterministic_backward = inner.deterministic_backward

    def stacks(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
        return False


def declared(kernel) -> PatternKernel:
    """``kernel`` where it has every ``PatternKernel`` member, else (required ones only) ``WithDefaults(kernel)``."""
    if isinstance(kernel, PatternKernelBase) or isinstance(kernel, PatternKernel):
        return kernel
    return WithDefaults(kernel)
