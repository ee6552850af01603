"""The zero-copy cuDNN pattern kernel (``kernels/cudnn.py``) against the fp64 oracle.

On CPU the aten cuDNN ops are replaced by ``MathOps``, a float64 stand-in with
cuDNN's contract that also *asserts* what the kernel promises cuDNN: every
operand readable in place (unit last stride, 16-byte aligned strides and
address), backward ``out``/``dout`` with exactly ``q``'s strides, ``lse`` packed
``(B', h, M, 1)``. That checks the view logic (chunk grouping, batch merging,
copies only where needed, result placement, accumulation) on any layout. With
CUDA the real ops run in bf16/fp16 on real shapes, judged by the tolerance rule.
"""

from __future__ import annotations

import weakref
import warnings

import pytest
import torch

# first: kernel_checks sets TRITON_INTERPRET on CPU, which must precede triton's import
from kernel_checks import (  # noqa: I001
    CUDA,
    DEVICE,
    LOWP_P,
    REF_P,
    check_api_against_oracle,
    check_fresh_backward,
    check_packed_ring_block,
    check_pattern_local,
    d64,
    judge,
    plans_for,
    rand,
    seeded,
)

from dilated_attention import clear_caches, dilated_attention
from dilated_attention.memory import gathered_bytes
from dilated_attention.ring import routes
from dilated_attention.kernels.cudnn import CudnnDkdvKernel, CudnnKernel
from dilated_attention.views import readable
from dilated_attention.kernels.protocol import CallSpec
from dilated_attention.kernels.auto import AutoKernel
from dilated_attention.kernels.fused import FusedKernel
from dilated_attention.kernels.view_kernel import AttentionOps
from dilated_attention.testing.compare import LAYOUTS, assert_within_rule


class MathOps(AttentionOps):
    """cuDNN's two ops in float64 plain torch, with cuDNN's input rules asserted."""

    name = "math"
    deterministic_backward = True

    def __init__(self, write_into: bool = False, own_strides: bool = False) -> None:
        self.own_strides = own_strides  # like the frontend's ops: out/dout may have strides of their own
        self.calls: list[tuple] = []
        self.outputs: list[torch.Tensor] = []
        self.write_into = write_into  # like the frontend's ops (else like torch's, which allocate)
        self.written_into = 0  # backward calls whose gradients went straight into the compact parts
        self.forward_into = 0  # forward calls whose result went straight into the compact part

    def supports(self, q, k):
        return None

    @staticmethod
    def _scores(q, k, causal, scale):
        g = q.shape[1] // k.shape[1]
        s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * scale
        if causal:
            m, n = s.shape[-2:]
            s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s, g

    def forward(self, q, k, v, *, causal, scale, out=None):
        for x in (q, k, v, *(() if out is None else (out,))):
            assert x.dim() == 4 and readable(x), f"cuDNN would not read {tuple(x.shape)} {x.stride()}"
        self.calls.append(("fwd", tuple(q.shape), tuple(k.shape), [x.untyped_storage().data_ptr() for x in (q, k, v)]))
        s, g = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, -1)
        res = torch.exp(s - lse[..., None]) @ v.double().repeat_interleave(g, 1)
        if out is not None and self.write_into:
            assert out.shape == q.shape, (out.shape, q.shape)
            self.forward_into += 1
        else:
            out = torch.empty_like(q)  # what torch's op allocates (q's strides if q is dense, else contiguous)
        out.copy_(res)
        self.outputs.append(out)
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse4, *, causal, scale, into=None):
        for x in (q, k, v, out, dout, *(into or ())):
            assert x.dim() == 4 and readable(x), f"cuDNN would not read {tuple(x.shape)} {x.stride()}"
        if not self.own_strides:
            assert out.stride() == q.stride() and dout.stride() == q.stride(), (q.stride(), out.stride(), dout.stride())
        assert lse4.is_contiguous() and lse4.shape == (*q.shape[:3], 1) and lse4.dtype == torch.float32
        self.calls.append(("bwd", tuple(q.shape), tuple(k.shape), [x.untyped_storage().data_ptr() for x in (q, k, v)]))
        s, g = self._scores(q, k, causal, scale)
        p = torch.exp(s - lse4.double())
        do = dout.double()
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.double().repeat_interleave(g, 1).transpose(-1, -2)
        ds = p * (dp - (do * out.double()).sum(-1, keepdim=True)) * scale
        dq = ds @ k.double().repeat_interleave(g, 1)
        dk = ds.transpose(-1, -2) @ q.double()
        hk = k.shape[1]
        dk, dv = dk.unflatten(1, (hk, g)).sum(2), dv.unflatten(1, (hk, g)).sum(2)
        if into is not None and self.write_into:
            for target, grad in zip(into, (dq, dk, dv)):
                assert target.shape == grad.shape, (target.shape, grad.shape)
                target.copy_(grad)
            self.written_into += 1
            return into
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def kernel() -> CudnnKernel:
    return CudnnKernel() if CUDA else CudnnKernel(MathOps())


LOW = [torch.bfloat16, torch.float16] if CUDA else [torch.float32]
DIM = 128 if CUDA else 16
N = 1024 if CUDA else 32


# ---------------------------------------------------------------------------
# supports()


def test_supports_needs_cuda_and_half_precision():
    q = torch.randn(1, 16, 4, 64)
    reason = CudnnKernel().supports(q, q)
    if not CUDA:
        assert reason is not None and "CUDA" in reason
    else:
        qc = q.to(DEVICE)
        assert "dtype" in CudnnKernel().supports(qc, qc)
        assert CudnnKernel().supports(qc.half(), qc.half()) is None
    fake = CudnnKernel(MathOps())
    for dim, ok in ((64, True), (40, True), (20, False), (264, False)):
        x = torch.randn(1, 16, 4, dim)
        assert (fake.supports(x, x) is None) == ok, dim
    with pytest.raises(ValueError, match="head dim"):
        fake.forward_pattern(*(torch.randn(1, 16, 2, 20),) * 3, plans_for("longnet", 2, 2, 16, 16, [16], [1])[0],
                             CallSpec(False, 0.1))


def test_readable():
    x = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)
    assert readable(x) and readable(x.transpose(1, 2))
    assert not readable(x[..., ::2])  # head dim not unit-stride
    assert not readable(x.flatten()[3:3 + x.numel() // 2].view(2, 2, 16, 64))  # 6-byte offset
    assert not readable(x[:1].expand(2, 4, 16, 64))  # zero stride
    assert not readable(torch.randn(2, 4, 16, 20, dtype=torch.bfloat16))  # 40-byte rows


# ---------------------------------------------------------------------------
# patterns against the oracle


PATTERN_CASES = [
    # mode, heads, kv heads, layout, causal, dtype index
    ("longnet", 4, 2, "contiguous", False),
    ("longnet", 6, 2, "transposed", True),
    ("grouped", 4, 2, "head_slice", True),
    ("grouped", 6, 3, "contiguous", False),
    ("longnet", 8, 2, "storage_offset", True),
    ("longnet", 4, 1, "zero_stride", False),
    ("longnet", 8, 8, "strided_head_dim", True),
    ("longnet", 6, 2, "permuted", False),
    ("longnet", 4, 4, "unbind_last", True),
]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", PATTERN_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-{c[3]}-causal{c[4]}")
def test_pattern_local(case, dtype):
    mode, heads, kv_heads, layout, causal = case
    seed = seeded("cudnn-pattern", case, dtype)
    check_pattern_local(kernel(), mode, heads, kv_heads, layout, causal, dtype, seed, DIM, N)


@pytest.mark.skipif(CUDA, reason="MathOps stand-in (the frontend's backward runs in test_cudnn_frontend.py)")
@pytest.mark.parametrize("case", [("longnet", 8, 8, "contiguous", False), ("longnet", 8, 4, "transposed", True),
                                  ("grouped", 6, 3, "head_slice", False)], ids=str)
def test_backward_parts_written_in_place(case):
    """An op that writes its results where it is told (the frontend's) fills the compact parts itself:
    no copy, same results (``check_pattern_local`` judges the parts when the kernel leaves them)."""
    mode, heads, kv_heads, layout, causal = case
    ops = MathOps(write_into=True)
    kern = CudnnKernel(ops)
    check_pattern_local(kern, mode, heads, kv_heads, layout, causal, LOW[0], seeded("cudnn-into", case), DIM, N)
    assert ops.written_into > 0, "no backward call wrote into the parts"
    if mode == "longnet":  # (grouped mode's patterns here are one call each: cuDNN's own result is the part)
        assert ops.forward_into > 0, "no forward call of a several-call pattern wrote into its part"


RING_CASES = [("longnet", 4, 2, True), ("longnet", 6, 2, False), ("grouped", 4, 2, True), ("longnet", 8, 8, True)]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-causal{c[3]}")
def test_pattern_packed_ring_block(case, dtype):
    mode, heads, kv_heads, causal = case
    check_packed_ring_block(kernel(), mode, heads, kv_heads, causal, dtype, seeded("cudnn-ring", case, dtype), DIM, N)


@pytest.mark.parametrize("dim", [40, 64, 96, 256] if CUDA else [8, 24])
def test_pattern_head_dims(dim):
    dtype = LOW[0]
    seed = seeded("cudnn-dims", dim)
    n = 512 if CUDA else 16
    check_pattern_local(kernel(), "longnet", 8, 4, "transposed", True, dtype, seed, dim, n,
                        segs=[n // 2, n], rates=[1, 4])


# ---------------------------------------------------------------------------
# the promises: few calls, no input copies, no output copy for a one-call pattern


def test_longnet_calls_are_grouped_and_zero_copy():
    """LongNet H=16, w=[..], r=[1..16]: chunks with equal steps share a call; contiguous inputs
    are read in place (forward and backward), and r=1 / one-segment r=16 outputs are cuDNN's own."""
    seeded("cudnn-calls")
    heads, n, dim = 16, 512, 16
    ops = MathOps()
    kern = CudnnKernel(ops)
    plans = plans_for("longnet", heads, heads, n, n, [32, 64, 128, 256, 512], [1, 2, 4, 8, 16])
    q, k, v = (torch.randn(1, n, heads, dim) for _ in range(3))
    storages = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    expect_calls = {1: 1, 2: 2, 4: 4, 8: 2, 16: 1}  # r=8: 2 segments x 8 offsets -> 2 calls of 8
    for p in plans:
        ops.calls.clear()
        ops.outputs.clear()
        out, lse = kern.forward_pattern(q, k, v, p, CallSpec(True, 0.25))
        assert len(ops.calls) == expect_calls[p.dilation], (p.dilation, ops.calls)
        assert all(set(c[3]) <= storages for c in ops.calls), "an input was copied"
        if expect_calls[p.dilation] == 1:
            assert out.untyped_storage().data_ptr() == ops.outputs[0].untyped_storage().data_ptr(), p.dilation
        o64, l64 = REF_P.forward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.25))
        assert_within_rule(f"r={p.dilation} out", out, o64, o64.float())
        ops.calls.clear()
        acc = [torch.zeros(x.shape) for x in (q, k, v)]
        fin, dout = torch.randn(1, n, heads, dim), torch.randn(1, n, heads, dim)
        kern.backward_pattern(q, k, v, p, CallSpec(True, 0.25), (fin, lse.new_zeros(1, n, heads) + 4.0, dout), acc)
        assert len(ops.calls) == expect_calls[p.dilation]
        assert all(set(c[3]) <= storages for c in ops.calls), "an input was copied in the backward"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in's view of the calls; on a GPU the real op runs")
@pytest.mark.parametrize("own_strides", [False, True])
def test_backward_copies_q_out_dout_together(own_strides):
    """out with strides other than q's: q, out and dout all go in compact (MathOps asserts equal strides), unless
    the ops plan every tensor's strides (the frontend's): then each is read in place, and the results agree."""
    seed = seeded("cudnn-joint-copy", own_strides)
    ops = MathOps(own_strides=own_strides)
    kern = CudnnKernel(ops)
    heads, n, dim = 4, 32, 16
    p = plans_for("longnet", heads, 2, n, n, [16, 32], [1, 2])[1]
    q = rand((2, n, heads, dim), torch.float32, "transposed")
    k, v = rand((2, n, 2, dim), torch.float32), rand((2, n, 2, dim), torch.float32)
    out, dout = torch.randn(2, n, heads, dim), torch.randn(2, n, heads, dim)
    lse = torch.randn(2, n, heads) + 3.0
    acc = [torch.zeros(x.shape) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, p, CallSpec(False, 0.25), (out, lse, dout), acc)
    want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, CallSpec(False, 0.25), (d64(out), d64(lse), d64(dout)), want)
    for name, got, w in zip("qkv", acc, want):
        assert_within_rule(f"d{name}", got, w, w.float(), context=f"(seed {seed})")
    read_in_place = q.untyped_storage().data_ptr() in {c[3][0] for c in ops.calls}
    assert read_in_place == own_strides, "q read in place" if read_in_place else "q copied"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_forward(layout):
    """Every arrangement of q/k/v gives the oracle's result (copies where cuDNN cannot read)."""
    seed = seeded("cudnn-layouts", layout)
    dtype = LOW[0]
    heads, n = 6, N
    plans = plans_for("longnet", heads, 2, n, n)
    q, k, v = rand((2, n, heads, DIM), dtype, layout), rand((2, n, 2, DIM), dtype, layout), rand((2, n, 2, DIM), dtype, layout)
    kern = kernel()
    for p in plans:
        out, lse = kern.forward_pattern(q, k, v, p, CallSpec(True, 0.2))
        o64, l64 = REF_P.forward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.2))
        plains = [kk.forward_pattern(q, k, v, p, CallSpec(True, 0.2)) for kk in (REF_P, LOWP_P)]
        judge(f"{layout} r={p.dilation} lse", lse, l64, [x[1] for x in plains], seed)
        judge(f"{layout} r={p.dilation} out", out, o64, [x[0] for x in plains], seed)


@pytest.mark.skipif(not CUDA, reason="needs cuDNN")
def test_cudnn_forward_is_deterministic():
    seeded("cudnn-det")
    kern = CudnnKernel()
    p = plans_for("longnet", 8, 8, 1024, 1024, [512, 1024], [1, 2])[0]
    q, k, v = (torch.randn(1, 1024, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    a = kern.forward_pattern(q, k, v, p, CallSpec(False, 0.1))
    b = kern.forward_pattern(q, k, v, p, CallSpec(False, 0.1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------
# cuDNN forward and dK/dV, the fused kernel's dQ


def dkdv_kernel() -> CudnnDkdvKernel:
    return CudnnDkdvKernel() if CUDA else CudnnDkdvKernel(MathOps())


@pytest.mark.parametrize("case", [("longnet", 4, 2, "transposed", True), ("grouped", 6, 3, "contiguous", False)],
                         ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-{c[3]}-causal{c[4]}")
def test_dkdv_kernel_pattern_local(case):
    mode, heads, kv_heads, layout, causal = case
    dtype = LOW[0]
    seed = seeded("dkdv-pattern", case)
    n, dim = (N, DIM) if CUDA else (16, 16)
    check_pattern_local(dkdv_kernel(), mode, heads, kv_heads, layout, causal, dtype, seed, dim, n,
                        segs=[n // 2, n], rates=[1, 2])


def test_dkdv_kernel_packed_ring_block():
    n, dim = (N, DIM) if CUDA else (16, 16)
    check_packed_ring_block(dkdv_kernel(), "longnet", 4, 2, True, LOW[0], seeded("dkdv-ring"), dim, n)


def test_grads_subset_is_validated():
    with pytest.raises(ValueError, match="grads"):
        CudnnKernel(MathOps(), grads=("dx",))
    with pytest.raises(ValueError, match="grads"):
        CudnnKernel(MathOps(), grads=())


class PickyOps(MathOps):
    """Refuses a batch that interleaves with the rows (chunks stacked by offset), as a cuDNN might."""

    @staticmethod
    def _refuse(q):
        if q.shape[0] > 1 and q.stride(0) < q.stride(2) * q.shape[2]:
            raise RuntimeError("cuDNN Frontend error: no valid engine for these strides (test stand-in)")

    def forward(self, q, k, v, **kw):
        self._refuse(q)
        return super().forward(q, k, v, **kw)

    def backward(self, dout, q, k, v, out, lse4, **kw):
        self._refuse(q)
        return super().backward(dout, q, k, v, out, lse4, **kw)


def test_refused_stacking_runs_chunk_by_chunk():
    """Where cuDNN refuses stacked chunks, the pattern runs chunk by chunk (warned once), same results."""
    seed = seeded("cudnn-refused")
    heads, n, dim = 8, 64, 16
    ops = PickyOps()
    kern = CudnnKernel(ops)
    p = plans_for("longnet", heads, heads, n, n, [64], [8])[0]  # one segment, 8 offsets: one stacked group
    q, k, v, dout = (torch.randn(1, n, heads, dim) for _ in range(4))
    with pytest.warns(UserWarning, match="chunk by chunk"):
        out, lse = kern.forward_pattern(q, k, v, p, CallSpec(True, 0.25))
    assert len(ops.calls) == heads
    o64, l64 = REF_P.forward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.25))
    assert_within_rule("out", out, o64, o64.float(), context=f"(seed {seed})")
    ops.calls.clear()
    fin = torch.randn(1, n, heads, dim)
    lse_full = torch.randn(1, n, heads) + 3.0
    acc = [torch.zeros(x.shape) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, p, CallSpec(True, 0.25), (fin, lse_full, dout), acc)
    assert [c[0] for c in ops.calls] == ["bwd"] * heads  # remembered: no stacked attempt this time
    want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.25), (d64(fin), d64(lse_full), d64(dout)), want)
    for name, got, w in zip("qkv", acc, want):
        assert_within_rule(f"d{name}", got, w, w.float(), context=f"(seed {seed})")
    # a backward that meets the refusal first adds nothing twice
    ops2 = PickyOps()
    acc2 = [torch.zeros(x.shape) for x in (q, k, v)]
    with pytest.warns(UserWarning, match="chunk by chunk"):
        CudnnKernel(ops2).backward_pattern(q, k, v, p, CallSpec(False, 0.25), (fin, lse_full, dout), acc2)
    want2 = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, CallSpec(False, 0.25), (d64(fin), d64(lse_full), d64(dout)),
                           want2)
    for name, got, w in zip("qkv", acc2, want2):
        assert_within_rule(f"d{name} (refused in backward)", got, w, w.float(), context=f"(seed {seed})")


def test_refused_backward_falls_back_in_every_group():
    """A backward whose first stacked group is refused runs that group, and each later one, chunk by chunk."""
    clear_caches()
    seed = seeded("cudnn-refused-groups")
    heads, kv_heads, n, dim = 8, 2, 64, 16
    p = plans_for("longnet", heads, kv_heads, n, n, [64], [8])[0]  # two groups (one per kv head) of four offsets
    q, dout = (torch.randn(1, n, heads, dim) for _ in range(2))
    k, v = (torch.randn(1, n, kv_heads, dim) for _ in range(2))
    fin, lse = torch.randn(1, n, heads, dim), torch.randn(1, n, heads) + 3.0
    acc = [torch.zeros(x.shape) for x in (q, k, v)]
    with pytest.warns(UserWarning, match="chunk by chunk"):
        CudnnKernel(PickyOps()).backward_pattern(q, k, v, p, CallSpec(True, 0.25), (fin, lse, dout), acc)
    want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.25), (d64(fin), d64(lse), d64(dout)), want)
    for name, got, w in zip("qkv", acc, want):
        assert_within_rule(f"d{name}", got, w, w.float(), context=f"(seed {seed})")


class HeldGrads(MathOps):
    """Counts, at each backward call, the gradients of earlier calls still alive; fails the ``fail_at``-th call."""

    def __init__(self) -> None:
        super().__init__()
        self.returned: list[weakref.ref] = []
        self.held: list[int] = []
        self.fail_at: int | None = None

    def backward(self, *args, **kw):
        self.held.append(sum(ref() is not None for ref in self.returned))
        if self.fail_at is not None and len(self.held) == self.fail_at:
            raise RuntimeError("cuDNN Frontend error: out of engines (test stand-in)")
        grads = super().backward(*args, **kw)
        self.returned += [weakref.ref(g) for g in grads]
        return grads


def _held_grads_case(seed_name: str):
    seed = seeded(seed_name)
    heads, n, dim = 4, 32, 16
    p = plans_for("longnet", heads, heads, n, n, [8, 16, 32], [1, 2, 4])[1]  # rate 2: one group of two offsets
    q, k, v, dout = (rand((2, n, heads, dim), torch.float32, "transposed").cpu() for _ in range(4))  # 2 calls a chunk
    out, lse = torch.randn(q.shape), torch.randn(q.shape[:3]) + 3.0
    return seed, p, (q, k, v, out, lse, dout)


def test_proven_backward_frees_each_calls_gradients_before_the_next():
    """Once a configuration's stacked backward has run whole, each call's gradients are stored as it returns
    and freed before the next call allocates (a group held all its calls' gradients until it ended: on GPUs
    under CUDA-graph capture that was four calls' worth at the step's peak). The first run, which a refusal
    could still redo chunk by chunk, keeps them to the end of the group. Both give the same bits, within the
    rule of the float64 oracle."""
    clear_caches()
    seed, p, (q, k, v, out, lse, dout) = _held_grads_case("cudnn-held-grads")
    ops = HeldGrads()
    kern = CudnnKernel(ops)
    runs = []
    for _ in range(2):
        ops.held.clear()
        acc = [torch.zeros(x.shape) for x in (q, k, v)]
        kern.backward_pattern(q, k, v, p, CallSpec(True, 0.25), (out, lse, dout), acc)
        runs.append((acc, list(ops.held)))
    (first, held_first), (second, held_second) = runs
    assert len(held_first) == len(held_second) > 1
    assert held_first[-1] == 3 * (len(held_first) - 1), held_first  # kept to the end of the group
    assert held_second == [0] * len(held_second), held_second  # each call's freed before the next
    want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.25), (d64(out), d64(lse), d64(dout)), want)
    for name, a, b, w in zip("qkv", first, second, want):
        assert torch.equal(a, b), f"d{name}: storing as each call returns changed bits"
        assert_within_rule(f"d{name}", b, w, w.float(), context=f"(seed {seed})")


def test_proven_backward_failing_mid_group_raises_instead_of_adding_twice():
    """A proven configuration has stored a call's gradients before a later call fails, so it cannot be redone
    chunk by chunk: the error propagates (an unproven one falls back, warned, as above)."""
    clear_caches()
    _, p, (q, k, v, out, lse, dout) = _held_grads_case("cudnn-held-grads-fail")
    ops = HeldGrads()
    kern = CudnnKernel(ops)
    kern.backward_pattern(q, k, v, p, CallSpec(True, 0.25), (out, lse, dout),
                          tuple(torch.zeros(x.shape) for x in (q, k, v)))
    ops.held.clear()
    ops.fail_at = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match="out of engines"):
            kern.backward_pattern(q, k, v, p, CallSpec(True, 0.25), (out, lse, dout),
                                  tuple(torch.zeros(x.shape) for x in (q, k, v)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["cudnn", "cudnn-dkdv"])
def test_fresh_backward_writes_what_adding_into_zeros_gives(which, causal):
    """``fresh=True`` on a pattern covering every row and head writes cuDNN's gradients into the accumulators
    (here NaN-filled: nothing may be read or left) and gives bit for bit what adding into zeros gives; on a
    pattern that does not cover them it fills and adds (NaN would survive otherwise)."""
    seed = seeded("cudnn-fresh", which, causal)
    heads, kv_heads, n = 4, 2, N
    plans = plans_for("longnet", heads, kv_heads, n, n)
    assert plans[0].covers_all(heads, kv_heads) and not plans[1].covers_all(heads, kv_heads)
    dtype = LOW[0]
    q, dout = rand((2, n, heads, DIM), dtype, "transposed"), rand((2, n, heads, DIM), dtype, "transposed")
    k, v = rand((2, n, kv_heads, DIM), dtype), rand((2, n, kv_heads, DIM), dtype)
    kern = kernel() if which == "cudnn" else dkdv_kernel()
    if which == "cudnn" and CUDA:  # torch's cuDNN backward is not reproducible: compare the deterministic one
        from dilated_attention.kernels.cudnn_frontend import CudnnFrontendOps, _frontend

        if _frontend() is None:
            pytest.skip("nvidia-cudnn-frontend not installed")
        kern = CudnnKernel(CudnnFrontendOps())
    out, lse = torch.zeros(q.shape, device=DEVICE), torch.full(q.shape[:3], float("-inf"), device=DEVICE)
    for i, p in enumerate(plans):
        kern.forward_pattern_into(q, k, v, p, CallSpec(causal, 0.2), (out, lse), fresh=i == 0)
    fresh = plans[:2] if which == "cudnn" else plans[:1]  # the fused dQ refuses a fresh non-covering pattern
    check_fresh_backward(kern, q, k, v, fresh, out.to(dtype), lse, dout, seed, packed=False, causal=causal, scale=0.2)


def test_fresh_backward_adds_where_two_groups_share_a_kv_head():
    """A covering pattern split into two head chunks on one kv head: the first group writes dK/dV, the second
    adds (written twice, the first group's gradients would be lost)."""
    import dataclasses

    from dilated_attention.patterns import HeadChunk

    seed = seeded("cudnn-fresh-shared-kv")
    heads, n, dim = 4, 32, 16
    base = plans_for("longnet", heads, 1, n, n, [n], [1])[0]
    # the second chunk starts at the same kv head (step 0): never stacked with the first, so two groups
    plan = dataclasses.replace(base, chunks=(HeadChunk(0, 0, 2, 0, 1, 0), HeadChunk(0, 2, 4, 0, 1, 0)))
    assert plan.covers_all(heads, 1)
    kern = CudnnKernel(MathOps())
    q, dout = torch.randn(1, n, heads, dim), torch.randn(1, n, heads, dim)
    k, v = torch.randn(1, n, 1, dim), torch.randn(1, n, 1, dim)
    out, lse = torch.randn(1, n, heads, dim), torch.randn(1, n, heads) + 3.0
    spec = CallSpec(True, 0.25)
    want = [torch.zeros(x.shape) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, plan, spec, (out, lse, dout), want)
    got = [torch.full(x.shape, float("nan")) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, plan, spec, (out, lse, dout), got, fresh=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), f"fresh {name} differs (seed {seed})"


@pytest.mark.parametrize("neginf", [None, float("inf")])
def test_backward_packs_lse_as_the_ops_read_it(neginf):
    """Each backward call reads a packed copy of its rows' lse: an uncovered row's ``-inf`` becomes the ops'
    ``lse_neginf`` in the same pass (flash-attn-4 reads ``+inf`` as no gradient), NaN and ``+inf`` stay; ops
    without one get the values as they are. The caller's lse is not touched."""
    seeded("cudnn-lse-packing")
    heads, n, dim = 4, 32, 16
    seen = []

    class Recording(MathOps):
        lse_neginf = neginf

        def backward(self, dout, q, k, v, out, lse4, **kw):
            seen.append(lse4.clone())
            return super().backward(dout, q, k, v, out, lse4.nan_to_num(neginf=0.0), **kw)

    kern = CudnnKernel(Recording())
    p = plans_for("longnet", heads, heads, n, n, [16, 32], [1, 2])[0]  # r=1: every row and head in one call
    q, k, v, fin, dout = (torch.randn(1, n, heads, dim, dtype=torch.float16) for _ in range(5))
    lse = torch.randn(1, n, heads)
    lse[0, 3, :], lse[0, 5, 1], lse[0, 7, 2] = float("-inf"), float("nan"), float("inf")
    before = lse.clone()
    kern.backward_pattern_parts(q, k, v, p, CallSpec(False, 0.25), (fin, lse, dout))
    assert torch.equal(lse.nan_to_num(), before.nan_to_num()) and lse.isnan().sum() == 1
    want = lse if neginf is None else lse.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=neginf)
    got = torch.cat([x.flatten() for x in seen])
    assert got.numel() == want.numel()
    torch.testing.assert_close(got.sort().values, want.flatten().sort().values, equal_nan=True, atol=0, rtol=0)


def test_call_plans_replay_per_geometry():
    """Views are planned once per geometry (shapes, strides, dtype, address alignment) and replayed:
    a second call on new tensors of the same geometry gives bit for bit what planning afresh gives, and
    a geometry that differs only in its alignment (a 2-byte offset: not readable in place) gets its own
    plan, which copies where the aligned one read in place."""
    from dilated_attention.kernels import cudnn_calls

    seeded("cudnn-plans")
    heads, n, dim = 8, 64, 16
    ops = MathOps()
    kern = CudnnKernel(ops)
    p = plans_for("longnet", heads, heads, n, n, [16, 32, 64], [1, 2, 4])[1]  # r=2: several calls

    def inputs(offset):
        xs = []
        for _ in range(5):
            flat = torch.randn(offset + n * heads * dim, dtype=torch.float16)
            xs.append(flat[offset:].view(1, n, heads, dim))
        return xs

    def run(xs, fresh_plans):
        if fresh_plans:
            cudnn_calls._FORWARD_CALLS.clear()
            cudnn_calls._BACKWARD_CALLS.clear()
        q, k, v, fin, dout = xs
        out, lse = kern.forward_pattern(q, k, v, p, CallSpec(True, 0.25))
        acc = [torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) for x in (q, k, v)]
        kern.backward_pattern(q, k, v, p, CallSpec(True, 0.25), (fin, lse.new_zeros(1, n, heads) + 3.0, dout), acc)
        return [out, lse, *acc]

    first = inputs(0)
    run(first, True)
    planned = (len(cudnn_calls._FORWARD_CALLS), len(cudnn_calls._BACKWARD_CALLS))
    assert planned[0] >= 1 and planned[1] >= 1
    second = inputs(0)
    replayed = run(second, False)
    assert (len(cudnn_calls._FORWARD_CALLS), len(cudnn_calls._BACKWARD_CALLS)) == planned, "same geometry re-planned"
    for got, want in zip(replayed, run(second, True)):
        assert torch.equal(got, want)
    ops.calls.clear()
    shifted = inputs(1)  # same shapes and strides, 2 bytes off 16-byte alignment
    storages = {x.untyped_storage().data_ptr() for x in shifted[:3]}
    got = run(shifted, False)
    assert len(cudnn_calls._FORWARD_CALLS) == planned[0] + 1, "the misaligned geometry reused the aligned plan"
    assert not any(set(c[3]) <= storages for c in ops.calls), "misaligned inputs were read in place"
    for g, want in zip(got, run(shifted, True)):
        assert torch.equal(g, want)


# ---------------------------------------------------------------------------
# Stacked local patterns (``ring/stacking.py``) through the API

STACK_SEGS, STACK_RATES = [N // 8, N // 4, N // 2, N], [1, 2, 4, 8]  # every dilated pattern N // 8 compact rows


def _api_case(name, *extra):
    seed = seeded("cudnn-stacked", name, *extra)
    base = [torch.randn(2, N, h, DIM, dtype=torch.float64, device=DEVICE) for h in (4, 4, 4)]
    return seed, base, torch.randn(2, N, 4, DIM, dtype=torch.float64, device=DEVICE)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head_slice"])
def test_stacked_patterns_match_the_oracle(kv_heads, layout):
    """Causal LongNet with every dilated pattern of one compact length: one stacked call per direction where each
    kv head reads one offset (4 kv heads), none where grouped heads of two offsets share one (2 kv heads: only
    r = 2 joins, alone), against the oracle either way."""
    assert layout in LAYOUTS
    seed, base, dout = _api_case("oracle", kv_heads, layout)
    base[1:] = [x[:, :, :kv_heads] for x in base[1:]]
    ops = MathOps()
    check_api_against_oracle(base, dout, STACK_SEGS, STACK_RATES, LOW[0], layout, f"(seed {seed})",
                             kernel=CudnnKernel(ops) if not CUDA else CudnnKernel(), causal=True)
    if not CUDA:
        stacked_rows = 2 * (N // 2 + N // 4 + N // 8)  # (B x rows) of the stack: the three dilated patterns
        stacked = [c[0] for c in ops.calls if c[1][0] * c[1][2] == stacked_rows]
        assert stacked == (["fwd", "bwd"] if kv_heads == 4 else []), ops.calls


@pytest.mark.skipif(CUDA, reason="counts the stand-in's calls")
def test_auto_stacks_where_its_table_names_a_stacking_kernel():
    """``auto`` whose table runs the stack's dense pattern on cuDNN both ways (the dilated patterns on fused):
    one stacked call per direction, against the oracle."""
    seed, base, dout = _api_case("auto")
    ops = MathOps()
    keys = [f"{d}/dense/causal/D{DIM}/float32/short" for d in ("fwd", "bwd")]
    kern = AutoKernel({"fused": FusedKernel(), "cudnn": CudnnKernel(ops)}, dict.fromkeys(keys, "cudnn"))
    check_api_against_oracle(base, dout, STACK_SEGS, STACK_RATES, LOW[0], "contiguous", f"(seed {seed})",
                             kernel=kern, causal=True)
    stacked_rows = 2 * (N // 2 + N // 4 + N // 8)
    assert [c[0] for c in ops.calls if c[1][0] * c[1][2] == stacked_rows] == ["fwd", "bwd"], ops.calls


@pytest.mark.skipif(CUDA, reason="counts the stand-in's calls")
class UnstackedOps(MathOps):
    stacks_patterns = False  # as the frontend's (cudnn-det)


@pytest.mark.parametrize("case", ["non-causal", "auto", "fused", "ops that do not stack", "one pattern"])
def test_patterns_stack_only_where_they_should(case, monkeypatch):
    """Non-causal calls, kernels that do not stack (fused, cuDNN's on ops that say so, auto in a direction its
    table runs on fused) and a stack of one pattern run pattern by pattern: the stand-in sees no call over the
    stacked rows, except auto's forward, which its table runs on cuDNN (masked calls: ``gathered_bytes``' test)."""
    seed, base, dout = _api_case("where", case)
    ops = UnstackedOps() if case == "ops that do not stack" else MathOps()
    kern = CudnnKernel(ops)
    if case in ("auto", "fused"):
        fused = FusedKernel()
        kern = AutoKernel({"fused": fused, "cudnn": kern}, {f"fwd/dense/causal/D{DIM}/float32/short": "cudnn",
                                                              f"fwd/dilated/causal/D{DIM}/float32/short": "cudnn"})
        if case == "fused":
            kern = fused
    q, k, v = (x.float().requires_grad_() for x in base)
    with routes.tuned(stack_min_patterns=4 if case == "one pattern" else routes.TUNING.stack_min_patterns):
        out = dilated_attention(q, k, v, STACK_SEGS, STACK_RATES, causal=case != "non-causal", kernel=kern)
        out.backward(dout.float())
    stacked_rows = 2 * (N // 2 + N // 4 + N // 8)
    stacked = [c[0] for c in ops.calls if c[1][0] * c[1][2] == stacked_rows]
    assert stacked == (["fwd"] if case == "auto" else []), (case, seed, ops.calls)


def test_gathered_bytes_are_the_largest_stacks_inputs():
    """The memory estimate's share for a stacked backward: q, out, dout, k, v and lse of the stacked rows; none
    for a kernel that does not stack or a masked call."""
    from dilated_attention.patterns import plan_patterns
    plans = plan_patterns(STACK_SEGS, STACK_RATES, seq_len=N, local_len=N, num_heads=4, num_kv_heads=4,
                          mode="longnet")
    q = torch.empty(1, N, 4, DIM)
    rows = N // 2 + N // 4 + N // 8

    def gathered(kernel, masked: bool) -> int:
        ring = routes.plan_ring(plans, kernel, causal=True, scale=1.0, masked=masked)
        return gathered_bytes(ring.routes(q, q)[1], N, 4, 4, DIM, 2)

    assert gathered(CudnnKernel(MathOps()), False) == rows * ((3 * 4 + 2 * 4) * DIM * 2 + 16)
    assert gathered(FusedKernel(), False) == 0
    assert gathered(CudnnKernel(MathOps()), True) == 0

