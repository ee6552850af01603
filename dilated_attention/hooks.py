"""The one seam where tools outside the core plug into a call: kernel hooks, registered at run time.

The core imports nothing of ``diagnostics/``: debug mode and the runtime audit register a hook here while
they are on, and ``functional`` hands each kernel a call planned to every registered hook, in registration
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
_HOOKS: tuple[KernelHook, ...] = ()


def active() -> bool:
    """Is any hook registered? (One global read: the call path asks on every call.)"""
    return bool(_HOOKS)


def add_kernel_hook(hook: KernelHook) -> None:
    """Show every call's kernel to ``hook`` from now on (once, however often added)."""
    global _HOOKS
    if hook not in _HOOKS:
        _HOOKS = (*_HOOKS, hook)


def remove_kernel_hook(hook: KernelHook) -> None:
    global _HOOKS
    _HOOKS = tuple(h for h in _HOOKS if h != hook)


@contextlib.contextmanager
def kernel_hook(hook: KernelHook) -> Iterator[None]:
    """``hook`` registered inside a ``with`` block (removed on exit unless it was registered before)."""
    added = hook not in _HOOKS
    add_kernel_hook(hook)
    try:
        yield
    finally:
        if added:
            remove_kernel_hook(hook)


def apply_kernel_hooks(kernel: PatternKernel, call: Call) -> PatternKernel:
    """``kernel`` as every registered hook leaves it, in registration order."""
    for hook in _HOOKS:
        kernel = hook(kernel, call)
    return kernel


__all__ = ["Call", "KernelHook", "active", "add_kernel_hook", "kernel_hook", "remove_kernel_hook"]
