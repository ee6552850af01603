"""The kernel seam is its Protocol: every kernel and wrapper has every member of ``PatternKernel`` (a strategy reads
nothing else), a kernel written with only the required members gets the optional ones at their defaults, wrappers
answer them for the kernel they would run, and the view logic's ops are ``AttentionOps``."""

from __future__ import annotations

import pytest
import torch

# first: kernel_checks sets TRITON_INTERPRET on CPU, which must precede triton's import
from kernel_checks import seeded  # noqa: I001
from test_cudnn import MathOps

from dilated_attention.diagnostics.debug import DebugKernel
from dilated_attention.kernels import protocol
from dilated_attention.kernels.auto import AutoKernel, table_key
from dilated_attention.kernels.chunk_loop import ChunkLoop
from dilated_attention.kernels.cudnn import CudnnKernel, CudnnOps
from dilated_attention.kernels.cudnn_frontend import CudnnFrontendOps
from dilated_attention.kernels.dispatch import select_kernel
from dilated_attention.kernels.flash4 import Flash4Kernel, Flash4Ops
from dilated_attention.kernels.fused import FusedKernel
from dilated_attention.kernels.guard import guard_kernel
from dilated_attention.kernels.protocol import (OPTIONAL_MEMBERS, REQUIRED_MEMBERS, CallSpec, Op, PatternKernel,
                                                causal_block, run, stacks)
from dilated_attention.kernels.reference import ReferenceKernel
from dilated_attention.kernels.registry import KERNELS
from dilated_attention.kernels.view_kernel import AttentionOps, ViewKernel
from dilated_attention.kernels.wrapper import KernelWrapper, WithDefaults
from dilated_attention.patterns import plan_patterns

N, HEADS, DIM = 32, 4, 16
CALL_NAMES = tuple(op.value for op in Op)
DENSE, DILATED = plan_patterns([N, N], [1, 2], seq_len=N, local_len=N, num_heads=HEADS, num_kv_heads=HEADS)


class RequiredOnly:
    """A PatternKernel written with the required members only (the fp64 reference, chunk by chunk, underneath)."""

    name, key_masks, deterministic_backward = "required-only", True, True

    def __init__(self) -> None:
        self.inner = ChunkLoop(ReferenceKernel())

    def supports(self, q, k):
        return None

    def forward_pattern(self, *args, **kwargs):
        return self.inner.forward_pattern(*args, **kwargs)

    def forward_pattern_into(self, *args, **kwargs):
        return self.inner.forward_pattern_into(*args, **kwargs)

    def backward_pattern(self, *args, **kwargs):
        return self.inner.backward_pattern(*args, **kwargs)

    def parts(self, *args, **kwargs):
        return self.inner.parts(*args, **kwargs)

    def backward_pattern_parts(self, *args, **kwargs):
        return self.inner.backward_pattern_parts(*args, **kwargs)


def _kernels() -> dict[str, object]:
    """Every registered kernel, every wrapper (debug mode's too), and the two ways a kernel of its own enters."""
    auto = AutoKernel({"fused": FusedKernel(), "cudnn": CudnnKernel(MathOps())},
                      {table_key("fwd", 1, False, DIM, torch.float32): "cudnn"})
    return {**{name: build() for name, build in KERNELS.items()}, "auto": auto, "guarded": guard_kernel(auto),
            "wrapper": KernelWrapper(FusedKernel()), "with-defaults": WithDefaults(RequiredOnly()),
            "wrapped-required-only": KernelWrapper(RequiredOnly()), "chunk-loop": ChunkLoop(ReferenceKernel()),
            "debug": DebugKernel(FusedKernel())}


def _protocol_members() -> set[str]:
    body = vars(PatternKernel)
    return set(PatternKernel.__annotations__) | {n for n, v in body.items() if callable(v) and not n.startswith("_")}


def test_the_member_lists_are_the_protocols():
    assert set(REQUIRED_MEMBERS) | set(OPTIONAL_MEMBERS) == _protocol_members()
    assert not set(REQUIRED_MEMBERS) & set(OPTIONAL_MEMBERS)


@pytest.mark.parametrize("name", list(_kernels()))
def test_every_kernel_and_wrapper_has_every_member(name):
    kernel = _kernels()[name]
    missing = [m for m in (*REQUIRED_MEMBERS, *OPTIONAL_MEMBERS) if not hasattr(kernel, m)]
    assert not missing, f"{name} lacks {missing}"
    assert isinstance(kernel, PatternKernel)
    for m in ("supports", "split_block", "stacks", *CALL_NAMES):
        assert callable(getattr(kernel, m)), (name, m)
    assert isinstance(kernel.padding_masks, bool) and isinstance(kernel.key_masks, bool), name


def test_a_kernel_with_only_the_required_members_gets_the_defaults():
    """select_kernel and a wrapper give it the optional members at their defaults: no causal split, no stacking,
    padding masks as its key masks; its calls run as its own."""
    seeded("protocol-defaults")
    q = torch.randn(1, N, HEADS, DIM)
    chosen = select_kernel(RequiredOnly(), q, q, masked=True, padding_only=True)
    assert isinstance(chosen, WithDefaults) and isinstance(chosen, PatternKernel)
    for kern in (chosen, guard_kernel(RequiredOnly()), KernelWrapper(RequiredOnly())):
        assert causal_block(kern, "bwd", DENSE, q, q) == 0
        assert not stacks(kern, "fwd", DENSE, True, q, q)
        assert kern.padding_masks and protocol.takes_padding_masks(kern)
        out, lse = kern.forward_pattern(q, q, q, DILATED, CallSpec(False, DIM ** -0.5))
        want, want_lse = ChunkLoop(ReferenceKernel()).forward_pattern(q, q, q, DILATED, CallSpec(False, DIM ** -0.5))
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("setting", ["causal_block", "padding_masks"])
def test_a_kernel_that_sets_an_optional_value_without_the_base_is_told_the_fix(setting):
    """Only ``PatternKernelBase``'s members read ``causal_block``/``padding_masks``: a kernel of the required members
    that sets one would lose it, so select_kernel refuses it, naming the base."""
    kernel = RequiredOnly()
    setattr(kernel, setting, 8 if setting == "causal_block" else True)
    q = torch.randn(1, N, HEADS, DIM)
    with pytest.raises(TypeError, match=rf"sets \['{setting}'\].*PatternKernelBase"):
        select_kernel(kernel, q, q)


def test_wrappers_answer_the_optional_members_for_their_target():
    """``AutoKernel`` routes the dense forward to a cuDNN kernel with a causal block (which stacks) and the rest to
    fused (which does neither); a guard around it answers the same; a wrapper's own causal block wins."""
    seeded("protocol-targets")
    q = torch.randn(1, N, HEADS, DIM)
    cudnn = CudnnKernel(MathOps(), causal_block=8)
    keys = {table_key("fwd", 1, True, DIM, torch.float32): "cudnn"}
    for kern in (AutoKernel({"fused": FusedKernel(), "cudnn": cudnn}, keys),
                 guard_kernel(AutoKernel({"fused": FusedKernel(), "cudnn": cudnn}, keys))):
        assert causal_block(kern, "fwd", DENSE, q, q) == 8 and causal_block(kern, "bwd", DENSE, q, q) == 0
        assert stacks(kern, "fwd", DENSE, True, q, q) and not stacks(kern, "bwd", DENSE, True, q, q)
    own = KernelWrapper(cudnn)
    own.causal_block = 3
    assert causal_block(own, "fwd", DENSE, q, q) == 3 and causal_block(KernelWrapper(cudnn), "fwd", DENSE, q, q) == 8


def test_run_calls_the_declared_method_of_each_op():
    class Named:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (name, args, kwargs)

    for op in Op:
        assert op == op.value and f"{op}" == op.value  # (a wrapper's ``call`` reads op as the method's name)
        assert protocol.CALL_ARGUMENTS[op.value] == protocol.CALL_ARGUMENTS[op]
        assert run(op, Named(), (1, 2), {"causal": True}) == (op.value, (1, 2), {"causal": True})
    with pytest.raises(ValueError, match="op must be one of"):
        run("forward", Named(), (), {})


def test_the_view_kernels_share_a_base_on_declared_ops():
    """cuDNN's and flash-attn-4's kernels are siblings on ``ViewKernel``; every ops class is an ``AttentionOps``
    (defaults for what it does not set); other ops are refused with the contract's name."""
    assert issubclass(Flash4Kernel, ViewKernel) and issubclass(CudnnKernel, ViewKernel)
    assert not issubclass(Flash4Kernel, CudnnKernel)
    for ops in (CudnnOps(), CudnnFrontendOps(), Flash4Ops(), Flash4Ops(deterministic=False), MathOps()):
        assert isinstance(ops, AttentionOps), type(ops).__name__
    assert (MathOps.padding_masks, MathOps.stacks_patterns, MathOps.lse_neginf) == (False, True, None)
    assert (Flash4Ops.padding_masks, Flash4Ops.lse_neginf) == (True, float("inf"))
    assert not CudnnFrontendOps.stacks_patterns
    with pytest.raises(TypeError, match="ops must be an AttentionOps"):
        CudnnKernel(object())
