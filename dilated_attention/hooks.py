"""The one seam where tools outside the core plug into a call: kernel hooks, registered at run time.

The core imports nothing of ``diagnostics/``: debug mode and the runtime audit register a hook here while
they are on, and ``planning`` shows the kernel it chose for a call to every registered hook, in registration
order (each may return it wrapped, see ``kernels.wrapper.KernelWrapper``). With none registered, the
default, a call runs no hook code and reuses its schedule; with any, each call is planned and shown to them
anew (a hook may record the call).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .kernels.protocol import PatternKernel


@dataclass(frozen=True)
class Call:
    """What a hook is told of the call whose kernel it sees: the arguments as given (``comm`` resolved to a
    backend), ``record`` (the first plan of this call: a compiled backward plans it again with ``False``), and
    ``meta``, a dict the hooks may fill with what the kernel guard names in its errors (step, rank, ...)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    segment_lengths: Sequence[int]
    dilation_rates: Sequence[int]
    comm: Any
    options: dict[str, Any]  # mode, causal, softmax_scale, key_padding_mask, cu_seqlens, ..., strategy, kernel
    record: bool = True
    meta: dict[str, Any] = field(default_factory=dict)


KernelHook = Callable[[PatternKernel, Call], PatternKernel]


class KernelHooks:
    """The registered hooks, in registration order: one registry per process (``HOOKS``), changed only by
    ``add_kernel_hook`` and ``remove_kernel_hook``. Each change replaces the tuple, so a call going through the
    hooks sees one set even if a hook adds or removes one meanwhile."""

    __slots__ = ("hooks",)

    def __init__(self) -> None:
        self.hooks: tuple[KernelHook, ...] = ()


HOOKS = KernelHooks()


def active() -> bool:
    """Is any hook registered? (One attribute read: the call path asks on every call.)"""
    return bool(HOOKS.hooks)


def add_kernel_hook(hook: KernelHook) -> None:
    """Show every call's kernel to ``hook`` from now on (once, however often added)."""
    if hook not in HOOKS.hooks:
        HOOKS.hooks = (*HOOKS.hooks, hook)


def remove_kernel_hook(hook: KernelHook) -> None:
    HOOKS.hooks = tuple(h for h in HOOKS.hooks if h != hook)


@contextlib.contextmanager
def kernel_hook(hook: KernelHook) -> Iterator[None]:
    """``hook`` registered inside a ``with`` block (removed on exit unless it was registered before)."""
    added = hook not in HOOKS.hooks
    add_kernel_hook(hook)
    try:
        yield
    finally:
        if added:
            remove_kernel_hook(hook)


def apply_kernel_hooks(kernel: PatternKernel, call: Call) -> PatternKernel:
    """``kernel`` as every registered hook leaves it, in registration order."""
    for hook in HOOKS.hooks:
        kernel = hook(kernel, call)
    return kernel


__all__ = ["Call", "KernelHook", "active", "add_kernel_hook", "kernel_hook", "remove_kernel_hook"]
