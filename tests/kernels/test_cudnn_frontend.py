"""cuDNN's deterministic backward through the cuDNN frontend (``kernels/cudnn_frontend.py``).

On CPU the frontend's graph call (``_run``) is replaced by the float64 math of
``MathOps`` writing into the output views it is handed: that checks what the
library adds around cuDNN (splitting a call by batch and by key chunks to bound
the workspace, the causal query offset of a key chunk, summing dQ parts,
output layouts) against one unsplit call and the fp64 oracle. With CUDA and
``nvidia-cudnn-frontend`` installed the real graph runs: oracle checks on the
pattern cases, bitwise reproducibility, split equals unsplit.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

# first: kernel_checks sets TRITON_INTERPRET on CPU, which must precede triton's import
from kernel_checks import CUDA, DEVICE, check_packed_ring_block, check_pattern_local, seeded  # noqa: I001
from test_cudnn import DIM, LOW, MathOps, N

from dilated_attention.kernels.cudnn import CudnnKernel
from dilated_attention.kernels.cudnn_frontend import (
    CudnnFrontendOps,
    _empty_in_layout,
    _frontend,
    split_plan,
    workspace_estimate,
)
from dilated_attention.kernels.dispatch import select_kernel

HAVE_FRONTEND = CUDA and _frontend() is not None


class MathFrontendOps(CudnnFrontendOps):
    """``CudnnFrontendOps`` with the graph call done in float64 torch; records every call's shapes."""

    def __init__(self, workspace_limit: int = 1 << 40, batch_workspace_limit: int = 1 << 40) -> None:
        super().__init__(workspace_limit, batch_workspace_limit)
        self.math = MathOps(write_into=True, own_strides=True)  # the frontend's forward writes where it is told
        self.runs: list[tuple] = []

    def supports(self, q, k):
        return None

    def forward(self, q, k, v, *, causal, scale, out=None):
        return self.math.forward(q, k, v, causal=causal, scale=scale, out=out)

    def _run(self, inputs, grads, causal, scale):
        dout, q, k, v, out, lse4 = inputs
        assert lse4.is_contiguous() and lse4.shape == (*q.shape[:3], 1)
        self.runs.append((tuple(q.shape), tuple(k.shape)))
        for target, grad in zip(grads, self.math.backward(dout, q, k, v, out, lse4, causal=causal, scale=scale)):
            target.copy_(grad)


def frontend_ops(limit: int = 1 << 40) -> CudnnFrontendOps:
    return CudnnFrontendOps(limit, limit) if CUDA else MathFrontendOps(limit, limit)


def test_workspace_estimate_and_split_plan():
    # the measured rule: ceil(keys / 256) fp32 copies of dQ (H200, cuDNN 9.19: 16 x 16 x 2048 x 128 -> 2 GiB)
    assert workspace_estimate(16, 16, 2048, 2048, 128) == 8 * 16 * 16 * 2048 * 128 * 4
    assert workspace_estimate(1, 16, 32768, 300, 128) == 2 * 16 * 32768 * 128 * 4
    whole = workspace_estimate(16, 16, 2048, 2048, 128)
    assert split_plan(16, 16, 2048, 128, whole) == (16, 2048)  # fits: one call
    assert split_plan(16, 16, 2048, 128, whole // 4) == (4, 2048)  # batch split first
    one = workspace_estimate(1, 16, 32768, 32768, 128)
    assert split_plan(1, 16, 32768, 128, one // 8) == (1, 4096)  # then keys, whole key tiles
    assert split_plan(3, 16, 32768, 128, 1) == (1, 256)  # never below one item and one key tile
    # a tighter limit for calls that split only their batch; keys still split under the other one
    assert split_plan(16, 16, 2048, 128, whole, whole // 8) == (2, 2048)
    assert split_plan(16, 16, 2048, 128, whole, 1) == (1, 2048)  # at least one item, all keys
    assert split_plan(1, 16, 32768, 128, one // 8, 1) == (1, 4096)  # key splits ignore the batch limit
    with pytest.raises(ValueError, match="workspace_limit"):
        CudnnFrontendOps(0)
    with pytest.raises(ValueError, match="batch_workspace_limit"):
        CudnnFrontendOps(1 << 30, 0)


def test_empty_in_layout_keeps_dim_order():
    x = torch.randn(2, 64, 4, 16).transpose(1, 2)[:, :, ::2]  # (B, h, M, D) view of (B, M, h, D) rows
    y = _empty_in_layout(x)
    assert y.shape == x.shape
    assert sorted(range(4), key=lambda d: -y.stride(d)) == sorted(range(4), key=lambda d: -x.stride(d))
    assert y.is_contiguous() or y.permute(0, 2, 1, 3).is_contiguous()


def test_kernel_name_and_determinism_come_from_the_ops():
    kern = CudnnKernel(MathFrontendOps())
    assert kern.name == "cudnn-det" and kern.deterministic_backward
    plain = CudnnKernel(MathOps())
    assert plain.name == "math" and plain.deterministic_backward
    real = CudnnKernel()
    assert real.name == "cudnn" and not real.deterministic_backward


def test_supports_names_the_missing_package(monkeypatch):
    import dilated_attention.kernels.cudnn_frontend as cf
    from dilated_attention.kernels.cudnn import CudnnOps

    monkeypatch.setattr(CudnnOps, "supports", lambda self, q, k: None)
    monkeypatch.setattr(cf, "_frontend", lambda: None)
    x = torch.randn(1, 8, 2, 64)
    reason = CudnnFrontendOps().supports(x, x)
    assert reason is not None and "nvidia-cudnn-frontend" in reason
    if not CUDA:
        with pytest.raises(ValueError, match="cudnn-det"):
            select_kernel("cudnn-det", x, x)


def _bwd_inputs(batch, heads, kv_heads, rows, dim, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def view(h):  # (B', h, M, D) views of (B', M, h, D) storage: the library's strided layout
        return torch.randn(batch, rows, h, dim, generator=g).to(device, dtype).transpose(1, 2)

    q, k, v, out, dout = view(heads), view(kv_heads), view(kv_heads), view(heads), view(heads)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # q's strides, as CudnnKernel guarantees
    lse4 = (torch.randn(batch, heads, rows, 1, generator=g) * 0.5 + 3.0).to(device)
    return dout, q, k, v, out, lse4


@pytest.mark.skipif(CUDA and not HAVE_FRONTEND, reason="nvidia-cudnn-frontend not installed")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_split_calls_equal_one_call(causal, heads, kv_heads):
    """Batch split and key chunks (causal: queries from the chunk's first key) give one call's gradients."""
    batch, rows, dim = 3, (512 if CUDA else 48), (64 if CUDA else 8)
    dtype = LOW[0]
    seed = seeded("frontend-split", causal, heads, kv_heads)
    args = _bwd_inputs(batch, heads, kv_heads, rows, dim, dtype, DEVICE, seed)
    whole = frontend_ops().backward(*args, causal=causal, scale=0.3)
    # room for one batch item with 2 key tiles of 256: batch split, then 2 (CPU: 1) key chunks per item
    limit = workspace_estimate(1, heads, rows, 512, dim)
    ops = frontend_ops(limit)
    if not CUDA:
        import dilated_attention.kernels.cudnn_frontend as cf

        cf_tile, cf._KEY_TILE = cf._KEY_TILE, 16  # small key tiles so that CPU-sized rows split
        try:
            limit = workspace_estimate(1, heads, rows, 16, dim)
            ops = frontend_ops(limit)
            split = ops.backward(*args, causal=causal, scale=0.3)
        finally:
            cf._KEY_TILE = cf_tile
        assert len(ops.runs) == batch * (rows // 16)
        # causal key chunk j pairs with queries from its first key on
        want_q = [rows - (j * 16 if causal else 0) for j in range(rows // 16)] * batch
        assert [r[0][2] for r in ops.runs] == want_q and all(r[1][2] == 16 for r in ops.runs)
    else:
        split = ops.backward(*args, causal=causal, scale=0.3)
    for name, a, b in zip(("dq", "dk", "dv"), split, whole):
        assert a.shape == b.shape and a.dtype == b.dtype
        tol = 0 if name != "dq" else (1e-2 if dtype != torch.float32 else 1e-5)  # dq parts are rounded once more
        assert torch.allclose(a.float(), b.float(), atol=tol * b.float().abs().max().item(), rtol=0), name


@pytest.mark.skipif(CUDA and not HAVE_FRONTEND, reason="nvidia-cudnn-frontend not installed")
@pytest.mark.parametrize("case", [("longnet", 4, 2, "transposed", True), ("grouped", 6, 3, "contiguous", False),
                                  ("longnet", 8, 8, "storage_offset", False), ("longnet", 6, 2, "permuted", True)],
                         ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-causal{c[4]}")
def test_pattern_local(case):
    mode, heads, kv_heads, layout, causal = case
    seed = seeded("frontend-pattern", case)
    n = N if CUDA else 32
    check_pattern_local(CudnnKernel(frontend_ops()), mode, heads, kv_heads, layout, causal, LOW[0], seed, DIM, n)


@pytest.mark.skipif(CUDA and not HAVE_FRONTEND, reason="nvidia-cudnn-frontend not installed")
def test_pattern_packed_ring_block():
    n = N if CUDA else 32
    check_packed_ring_block(CudnnKernel(frontend_ops()), "longnet", 4, 2, True, LOW[0], seeded("frontend-ring"),
                            DIM, n)


@pytest.mark.skipif(not HAVE_FRONTEND, reason="needs CUDA and nvidia-cudnn-frontend")
@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_bitwise_reproducible(causal):
    """The reason the implementation exists: torch's cuDNN backward differs run to run, this one must not."""
    seeded("frontend-repro", causal)
    args = _bwd_inputs(4, 8, 8, 2048, 128, torch.bfloat16, DEVICE, 7)
    ops = CudnnFrontendOps()
    first = ops.backward(*args, causal=causal, scale=0.1)
    for _ in range(3):
        again = ops.backward(*args, causal=causal, scale=0.1)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.skipif(not HAVE_FRONTEND, reason="needs CUDA and nvidia-cudnn-frontend")
@pytest.mark.parametrize("causal", [False, True])
def test_through_autograd_matches_fused(causal):
    """``kernel="cudnn-det"`` through ``dilated_attention`` and autograd (inputs that require grad) agrees with
    the fused kernel to bf16 accuracy (both are checked against the fp64 oracle elsewhere), and its gradients
    are bitwise reproducible."""
    from dilated_attention import dilated_attention
    from dilated_attention.testing.compare import rel_err

    seed = seeded("frontend-api", causal)
    n, h, d = 2048, 4, 64
    q, k, v, g = (torch.randn(1, n, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    runs = {}
    for name in ("cudnn-det", "cudnn-det", "fused"):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = dilated_attention(*leaves, [512, 2048], [1, 4], causal=causal, kernel=name)
        runs.setdefault(name, []).append([o.float(), *(x.float() for x in torch.autograd.grad(o, leaves, g))])
    a, b = runs["cudnn-det"]
    assert all(torch.equal(x, y) for x, y in zip(a, b)), f"not reproducible (seed {seed})"
    for what, x, y in zip(("out", "dq", "dk", "dv"), a, runs["fused"][0]):
        assert rel_err(x, y) < 2e-2, f"{what}: {rel_err(x, y):.2e} off the fused kernel (seed {seed})"


@pytest.mark.skipif(not HAVE_FRONTEND, reason="needs CUDA and nvidia-cudnn-frontend")
@pytest.mark.parametrize("causal", [False, True])
def test_raw_pointer_execute_matches_the_mapped_one(monkeypatch, causal):
    """Graphs run with raw pointers in the graph's uid order where the frontend has that call (1.22), else
    through ``graph.execute`` with a node -> tensor map: both must bind every tensor to its own node, so
    forward and backward agree bitwise (swapped operands would not: q, k, v, out, dout differ)."""
    from dilated_attention.kernels import cudnn_frontend

    seeded("frontend-pointers", causal)
    args = _bwd_inputs(2, 4, 4, 512, 64, torch.bfloat16, DEVICE, 11)
    dout, q, k, v = args[:4]
    results = []
    for mapped in (False, True):
        if mapped:
            monkeypatch.setattr(cudnn_frontend, "_pointer_order", lambda graph, nodes: None)
        ops = CudnnFrontendOps()
        out, lse4 = ops.forward(q, k, v, causal=causal, scale=0.1)
        grads = ops.backward(dout, q, k, v, out, lse4, causal=causal, scale=0.1)
        raw = not mapped and callable(getattr(cudnn_frontend._frontend().pygraph, "_execute_with_ptrs", None))
        assert [entry[3] is not None for entry in ops._graphs.values()] == [raw, raw]  # (forward, backward)
        results.append((out, lse4, *grads))
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{what} differs between raw-pointer and mapped execution"


class _CyclicFrontend:
    """A stand-in ``cudnn`` frontend module whose graph build leaves a reference cycle holding the frame it ran
    under, as the frontend's Python layer does: through ``f_back`` the cycle holds every frame up the stack."""

    class data_type:  # noqa: N801 (the frontend's name)
        HALF, BFLOAT16, FLOAT = "half", "bfloat16", "float"

    class heur_mode:  # noqa: N801
        A, FALLBACK = "a", "fallback"

    class _Node:
        def __getattr__(self, name):  # set_output / set_dim / set_stride / set_data_type chain
            return lambda *args: self

    class pygraph:  # noqa: N801
        def __init__(self, **kwargs):
            self.runs = 0

        def tensor_like(self, x):
            return _CyclicFrontend._Node()

        def sdpa(self, **kwargs):
            return _CyclicFrontend._Node(), _CyclicFrontend._Node()

        def build_plans(self):
            cycle = {"frame": sys._getframe()}
            cycle["self"] = cycle

        def validate(self):
            pass

        build_operation_graph = check_support = validate

        def create_execution_plans(self, modes):
            pass

        def get_workspace_size(self):
            return 4096

        def execute(self, tensors, workspace, handle):
            self.runs += 1

    @staticmethod
    def set_stream(handle, stream):
        pass


def test_a_built_graph_leaves_no_cycle_holding_the_callers_tensors(monkeypatch):
    """A graph's build must not keep the tensors of the frames it ran under alive past the call (on an H100 the
    frontend's build held the first call's 512 MiB workspace beside the next calls'): with Python's collector
    off, a tensor the caller dropped is freed once the call returns, whether the call built its graph or not."""
    from dilated_attention.kernels import cudnn_frontend

    monkeypatch.setattr(cudnn_frontend, "_frontend", lambda: _CyclicFrontend)
    monkeypatch.setattr(cudnn_frontend, "current_raw_stream", lambda index: 0)
    ops = CudnnFrontendOps()
    q = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16)
    ops._handles[q.device.index] = "handle"

    def call() -> weakref.ref:
        held = torch.randn(8)  # the caller's, dropped on return
        ops.forward(q, q, q, causal=False, scale=0.25)
        return weakref.ref(held)

    enabled = gc.isenabled()
    gc.disable()
    try:
        for built in (True, False):
            ref = call()
            assert ref() is None, f"a tensor of the calling frame outlived the call (graph built: {built})"
        assert [entry[0].runs for entry in ops._graphs.values()] == [2]
    finally:
        if enabled:
            gc.enable()
