"""The kernel seam: nothing runs there by default, a registered hook sees every call's kernel, and a
``KernelWrapper`` states only what it changes."""

from __future__ import annotations

import torch

from dilated_attention import dilated_attention, hooks
from dilated_attention.diagnostics import debug
from dilated_attention.kernels import KernelWrapper, PatternKernel
from dilated_attention.kernels.guard import GuardedKernel
from dilated_attention.kernels.registry import build_kernel


class Counting(KernelWrapper):
    """Counts the computing calls that pass through it."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls: list[str] = []

    def call(self, op, args, kwargs):
        self.calls.append(op)
        return super().call(op, args, kwargs)


def test_no_hook_by_default_and_debug_mode_registers_one_while_on():
    assert not hooks.active()
    with debug.debug():
        assert hooks.active()
        with debug.debug(enabled=False):
            assert not hooks.active()
        assert hooks.active()
    assert not hooks.active()


def test_hooks_run_in_registration_order_each_call_seeing_the_set_it_started_with():
    order: list[str] = []

    def first(kernel, call):
        order.append("first")
        hooks.remove_kernel_hook(first)  # (takes effect from the next call on)
        return kernel

    def second(kernel, call):
        order.append("second")
        return kernel

    q = torch.randn(1, 16, 2, 8)
    with hooks.kernel_hook(first), hooks.kernel_hook(second):
        hooks.add_kernel_hook(second)  # registered once however often added
        dilated_attention(q, q, q, [8, 16], [1, 2])
        dilated_attention(q, q, q, [8, 16], [1, 2])
    assert order == ["first", "second", "second"] and not hooks.active()


def test_a_hook_sees_each_call_and_its_wrapper_runs_every_kernel_call():
    seen: list[hooks.Call] = []
    wrappers: list[Counting] = []

    def hook(kernel, call):
        seen.append(call)
        wrappers.append(Counting(kernel))
        return wrappers[-1]

    q = torch.randn(1, 16, 2, 8, requires_grad=True)
    plain = dilated_attention(q, q, q, [8, 16], [1, 2], causal=True)
    with hooks.kernel_hook(hook):
        for _ in range(2):  # planned anew on each call while a hook is registered
            out = dilated_attention(q, q, q, [8, 16], [1, 2], causal=True)
            out.sum().backward()
    assert not hooks.active() and torch.equal(out, plain)
    assert len(seen) == 2 and seen[0].options["causal"] and list(seen[0].segment_lengths) == [8, 16]
    assert {"forward_pattern", "backward_pattern_parts"} <= set(wrappers[0].calls), wrappers[0].calls


def test_a_wrapper_is_a_pattern_kernel_that_forwards_what_it_does_not_change():
    q = torch.randn(1, 16, 2, 8)
    inner = GuardedKernel(Counting(KernelWrapper(build_kernel("reference"))))
    assert isinstance(inner, PatternKernel) and inner.name == "reference" and inner.key_masks
    assert dilated_attention(q, q, q, [8, 16], [1, 2], kernel=inner).shape == q.shape

