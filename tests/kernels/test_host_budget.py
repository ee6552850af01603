"""The host's budget for one LongNet forward+backward: how many torch operations the library dispatches around
its kernels, counted (never timed) on CPU through the cuDNN kernel's view logic with plain-torch stand-in ops and
the merges' Triton kernels in Triton's interpreter (each counted as one launch, as on a GPU); and how many Python
calls the fused kernel's step makes around its launches (replayed after the first call of a geometry).

An eager call is host-bound on a GPU (docs/performance.md): every operation dispatched costs microseconds of
Python and C++ between kernel launches. A change that adds per-call work shows here as a higher count: each bound
is the count measured (the counts are the same in every run), so a single added operation, kernel call or Python
call fails the test. A bound is raised only in a commit that says why the added host work is worth its time, and
lowered with the work. Each count empties the library's caches before its warm-up call: a cache that
earlier tests in the process left near its bound would start over during the warm-up and miss in the counted call.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dilated_attention import caches, dilated_attention, merge, triton_support
from dilated_attention.kernels import fused
from dilated_attention.kernels.cudnn import CudnnKernel
from dilated_attention.testing.compare import assert_within_rule
from dilated_attention.testing.op_count import OpCount
from dilated_attention.testing.oracle import dense_dilated_attention

from test_cudnn import MathOps  # (the cuDNN kernel's plain-torch stand-in ops)

SEGMENTS, RATES = [64, 128, 256, 512], [1, 2, 4, 8]  # LongNet's geometric pattern on 512 rows
# (ops dispatched around the kernels, kernel calls and launches) per forward+backward, as measured (causal: its
# dilated patterns stacked (stacking.py), their rows gathered by one launch per tensor). A bound is the
# measurement: raised only in a commit that explains why.
BUDGET = {False: (159, 17), True: (90, 18)}
# Python calls (functions and builtins) around the launches of a fused-kernel forward+backward, and its launches,
# as measured. A bound is the measurement: raised only in a commit that explains why.
PYTHON_BUDGET = {False: (1270, 21), True: (1270, 21)}


class _UncountedOps(MathOps):
    """The frontend's contract (writes into given views, reads out/dout in their own strides), its arithmetic
    outside the count."""

    mode: OpCount | None = None

    def _quiet(self, fn, *args, **kwargs):
        with self.mode.paused():
            return fn(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self._quiet(super().forward, *args, **kwargs) if self.mode else super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._quiet(super().backward, *args, **kwargs) if self.mode else super().backward(*args, **kwargs)


# The count is made on CPU tensors, with the merges' Triton kernels in the interpreter (on a GPU machine, where
# the interpreter is off, CPU tensors would take the merges' plain-torch fallback and count its ops instead).
needs_triton = pytest.mark.skipif(merge.triton is None or not merge.interpreting(),
                                  reason="counts on CPU: needs Triton's interpreter (TRITON_INTERPRET=1, as without "
                                         "CUDA)")


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_longnet_step_dispatches_no_more_operations_than_its_budget(causal, monkeypatch):
    total, calls, most = count_longnet_step(causal, monkeypatch)
    bound_ops, bound_calls = BUDGET[causal]
    assert total <= bound_ops and calls <= bound_calls, (
        f"one LongNet forward+backward dispatched {total} operations around {calls} kernel calls, over its budget "
        f"of {bound_ops} around {bound_calls}; most: {most}")


def count_longnet_step(causal: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, str]:
    """One LongNet forward+backward on the cuDNN kernel's view logic: (operations dispatched around the kernel
    calls and launches, those calls and launches, the most dispatched operations); checked against the oracle."""
    g = torch.Generator().manual_seed(5401 + causal)
    q, k, v, dout = (torch.randn(1, 512, 8, 16, generator=g) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ops = _UncountedOps(write_into=True, own_strides=True)
    launches = []

    def launch(*args, **kwargs):  # the merges' Triton kernels: one launch each, outside the count
        if ops.mode is None:
            return merge_launch(*args, **kwargs)
        launches.append(args[0])
        return ops._quiet(merge_launch, *args, **kwargs)

    merge_launch = triton_support.launch
    monkeypatch.setattr(triton_support, "launch", launch)  # (every merge, combine and gather launch goes through it)
    kernel = CudnnKernel(ops)
    caches.clear_caches()  # (module doc: a count starts from empty caches)
    # one call first: plans, tables and views of this configuration made and cached (a second changes no count)
    dilated_attention(*leaves, SEGMENTS, RATES, causal=causal, kernel=kernel).backward(dout)
    for x in leaves:
        x.grad = None
    ops.calls.clear()
    with OpCount() as mode:
        ops.mode = mode
        out = dilated_attention(*leaves, SEGMENTS, RATES, causal=causal, kernel=kernel)
        out.backward(dout)
    ops.mode = None
    _assert_oracle(q, k, v, dout, causal, out, leaves)
    return mode.total(), len(ops.calls) + len(launches), mode.most(8)


def _assert_oracle(q, k, v, dout, causal, out, leaves, segments=SEGMENTS, rates=RATES) -> None:
    """The counted step computed the right thing (the oracle: plain torch, float64)."""
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    want = dense_dilated_attention(*ref, segments, rates, causal=causal)
    want.backward(dout.double())
    for name, got, exp in (("out", out, want), *zip(("dq", "dk", "dv"), (x.grad for x in leaves),
                                                     (x.grad for x in ref))):
        assert_within_rule(name, got, exp, exp.float())  # (fp32: plain torch is the float64 oracle rounded)


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_fused_longnet_step_makes_no_more_python_calls_than_its_budget(causal, monkeypatch):
    calls, launches = count_fused_step(causal, monkeypatch)
    bound_calls, bound_launches = PYTHON_BUDGET[causal]
    assert launches <= bound_launches and calls <= bound_calls, (
        f"one fused LongNet forward+backward made {calls} Python calls around {launches} launches, over its "
        f"budget of {bound_calls} around {bound_launches}")


def count_fused_step(causal: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """One fused-kernel LongNet forward+backward: (Python calls around its launches, launches); checked against
    the oracle."""
    g = torch.Generator().manual_seed(5411 + causal)
    segments = [s // 2 for s in SEGMENTS]  # (the same pattern on 256 rows and 4 heads: the interpreter's time)
    q, k, v, dout = (torch.randn(1, 256, 4, 16, generator=g) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    calls, launches = [0], [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    def launch(*args, **kwargs):  # a launch is one call on a GPU: the interpreter's work runs uncounted
        launches[0] += 1
        sys.setprofile(None)
        try:
            return real_launch(*args, **kwargs)
        finally:
            sys.setprofile(count)

    real_launch = triton_support.launch
    for module in (triton_support, fused):  # (Prepared and launch_on launch through triton_support's)
        monkeypatch.setattr(module, "launch", launch)

    def step():
        for x in leaves:
            x.grad = None
        out = dilated_attention(*leaves, segments, RATES, causal=causal, kernel="fused")
        out.backward(dout)
        return out

    caches.clear_caches()  # (module doc: a count starts from empty caches)
    step()  # first: plans, replays and tables of this configuration made and kept (a second changes no count)
    calls[0] = launches[0] = 0
    sys.setprofile(count)  # (CPU: autograd runs the backward on this thread)
    try:
        out = step()
    finally:
        sys.setprofile(None)
    _assert_oracle(q, k, v, dout, causal, out, leaves, segments)
    return calls[0], launches[0]
