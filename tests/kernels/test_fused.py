"""The fused Triton kernel against the fp64 oracle (ReferenceKernel, driven chunk by chunk by ChunkLoop).

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
below before any kernel is built) on small shapes; with CUDA the same tests run
on real shapes. Inputs are fresh random draws from fixed seeds (the seed is in
every message). Low precision is judged by ``testing/compare.py``'s rule (docs/design.md section 7):
error vs the fp64 oracle at most 2x the error of plain torch in the same
precision, plus a floor. "Plain torch in the same precision" is whichever is
worse of ReferenceKernel run on the low-precision inputs (fp32 inside) and
``LowpTorch`` below, which does every matmul in the low dtype (flash-attention's
``attention_ref(upcast=False)``): the fused kernel feeds bf16/fp16 P and dS to
the tensor cores, which ReferenceKernel alone would not account for.
"""

from __future__ import annotations

import os
import zlib

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first kernel build; fused.py jits lazily at first launch
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from dilated_attention.kernels.fused import (  # noqa: E402
    FusedConfig,
    FusedKernel,
    gpu_config,
    interpreting,
    padded_dim,
    shared_memory_reason,
)
from dilated_attention.kernels.chunk_loop import ChunkLoop  # noqa: E402
from dilated_attention.kernels.reference import ReferenceKernel, _expand_kv  # noqa: E402
from dilated_attention.merge import Part, merge_pattern_, sum_grads  # noqa: E402
from dilated_attention.ring import RingCall, RingLayout, ring_forward  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.testing.compare import as_layout, assert_within_rule, rel_err  # noqa: E402
from dilated_attention.views import chunk_views, compact_view, dilated_view, pack_kv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


class LowpTorch:
    """Plain torch attention with every matmul in the input dtype (softmax and sums in fp32)."""

    name = "lowp-torch"
    key_masks = False
    deterministic_backward = True

    def supports(self, q, k):
        return None

    @staticmethod
    def _s(q, k, causal, scale):
        s = torch.einsum("bsmhd,bsnhd->bshmn", q, _expand_kv(k, q.shape[-2])).float() * scale
        if causal:
            m, n = s.shape[-2:]
            s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, *, causal, scale):
        s = self._s(q, k, causal, scale)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).to(q.dtype)
        out = torch.einsum("bshmn,bsnhd->bsmhd", p, _expand_kv(v, q.shape[-2]))
        return out, lse.permute(0, 1, 3, 2).float()

    def backward(self, q, k, v, out, lse, dout, *, causal, scale):
        dt, hq, hk = q.dtype, q.shape[-2], k.shape[-2]
        s = self._s(q, k, causal, scale)
        p = torch.exp(s - lse.permute(0, 1, 3, 2).float().unsqueeze(-1))
        do = dout.to(dt)
        dv = torch.einsum("bshmn,bsmhd->bsnhd", p.to(dt), do).float()
        dp = torch.einsum("bsmhd,bsnhd->bshmn", do, _expand_kv(v, hq)).float()
        delta = (dout.float() * out.float()).sum(-1).permute(0, 1, 3, 2)
        ds = (p * (dp - delta.unsqueeze(-1)) * scale).to(dt)
        dq = torch.einsum("bshmn,bsnhd->bsmhd", ds, _expand_kv(k, hq)).float()
        dk = torch.einsum("bshmn,bsmhd->bsnhd", ds, q).float()
        if hq != hk:
            dk = dk.unflatten(-2, (hk, hq // hk)).sum(-2)
            dv = dv.unflatten(-2, (hk, hq // hk)).sum(-2)
        return dq, dk, dv


REF = ReferenceKernel()
LOWP = LowpTorch()
REF_P = ChunkLoop(REF)
LOWP_P = ChunkLoop(LOWP)
FUSED = FusedKernel()
LOW = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]
DTYPES = [torch.float32] + LOW

# sizes by device: (block rows M, key rows, head dim) and pattern setups
BLOCK_SHAPES = [(200, 200, 64), (256, 130, 128), (64, 64, 256)] if CUDA else [(24, 24, 32), (8, 20, 32)]
PAT_N = 1024 if CUDA else 32
PAT_SEGS = [256, 512, 1024] if CUDA else [8, 16, 32]
PAT_RATES = [1, 2, 4]
PAT_DIM = 128 if CUDA else 32
# head dims that are not powers of two (padded inside the kernel): interpreter on small shapes, GPU on real ones
ODD_DIMS = [40, 80, 96, 112] + ([8, 200] if CUDA else [])


def seeded(*parts) -> int:
    """A fixed seed per test case (crc32 of its parameters), set before its random draws."""
    seed = zlib.crc32(repr(parts).encode())
    torch.manual_seed(seed)
    return seed


def rand(shape, dtype, layout="contiguous"):
    """Random ``(B, N, H, D)`` values in a chosen memory layout (``testing.compare.as_layout``)."""
    return as_layout(torch.randn(shape, device=DEVICE, dtype=dtype), layout)


def rand5(shape, dtype, layout="contiguous"):
    """A ``(B, S, M, H, D)`` block view: a 4D layout with its sequence dim split."""
    b, s, m, h, d = shape
    return rand((b, s * m, h, d), dtype, layout).unflatten(1, (s, m))


def d64(x):
    return x.detach().double().cpu()


def judge(what, got, oracle, plains, seed):
    """The tolerance rule against the fp64 ``oracle``; ``plains`` are plain-torch results in got's dtype."""
    plains = plains if isinstance(plains, (list, tuple)) else [plains]
    worst = max(plains, key=lambda p: rel_err(p, oracle))
    assert_within_rule(what, got, oracle, worst, context=f"(seed {seed})")


# ---------------------------------------------------------------------------
# supports()


def test_supports_accepts_good_inputs():
    q = torch.randn(1, 2, 16, 4, 64, device=DEVICE)
    assert FUSED.supports(q, q[..., :2, :]) is None
    for dim in (8, 40, 96, 200, 256):
        q = torch.randn(1, 2, 16, 4, dim, device=DEVICE)
        assert FUSED.supports(q, q) is None, dim


@pytest.mark.parametrize("case", ["dim20", "dim264", "float64", "stride", "kv_heads", "ndim", "kdim"])
def test_supports_rejects_with_reason(case):
    q = torch.randn(1, 2, 16, 4, 64, device=DEVICE)
    k = torch.randn(1, 2, 16, 2, 64, device=DEVICE)
    if case == "dim20":
        q, k = q[..., :20], k[..., :20]
        want = "head dim"
    elif case == "dim264":
        q, k = torch.randn(1, 2, 16, 4, 264, device=DEVICE), torch.randn(1, 2, 16, 2, 264, device=DEVICE)
        want = "head dim"
    elif case == "float64":
        q, k = q.double(), k.double()
        want = "dtype"
    elif case == "stride":
        q = torch.randn(1, 2, 16, 4, 128, device=DEVICE)[..., ::2]
        want = "unit stride"
    elif case == "kv_heads":
        k = torch.randn(1, 2, 16, 3, 64, device=DEVICE)
        want = "multiple of kv heads"
    elif case == "ndim":
        q, k = q[0, 0], k[0, 0]
        want = "expects"
    else:
        k = torch.randn(1, 2, 16, 2, 32, device=DEVICE)
        want = "head dim"
    reason = FUSED.supports(q, k)
    assert reason is not None and want in reason, reason
    with pytest.raises(ValueError, match="fused kernel cannot run"):
        FUSED.forward(q, k, k, causal=False, scale=0.1)


def test_supports_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 16, 2, 64)
    reason = FUSED.supports(q, q)
    assert reason is not None and "CUDA" in reason


def test_padded_dim():
    assert [padded_dim(d) for d in (8, 16, 24, 40, 64, 72, 96, 128, 136, 256)] == [16, 16, 32, 64, 64, 128, 128, 128, 256, 256]


def test_shared_memory_reason():
    huge = FusedConfig(256, 256, 8, 4, 256, 256, 8, 4, 256, 256, 8, 4)
    reason = shared_memory_reason(huge, 256, torch.float32, 232448)
    assert reason is not None and "out of resource: shared memory" in reason and "232448" in reason
    for dim in (32, 40, 64, 96, 128, 200):
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            assert shared_memory_reason(gpu_config(dim, dt), dim, dt, 232448) is None, (dim, dt)
    if CUDA:
        limit = torch.cuda.get_device_properties(DEVICE).shared_memory_per_block_optin
        bad = FusedKernel(huge)
        q = torch.randn(1, 1, 64, 2, 256, device=DEVICE)
        reason = bad.supports(q, q)
        assert reason is not None and str(limit) in reason
        with pytest.raises(ValueError, match="shared memory"):
            bad.forward(q, q, q, causal=False, scale=0.1)


def test_interpreter_mode_is_read():
    assert interpreting() == (not CUDA)


# ---------------------------------------------------------------------------
# the block seam: forward / backward on strided 5D views


def _check_block(kern, q, k, v, dout, causal, scale, seed, tag=""):
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:4]
    o64, l64 = REF.forward(d64(q), d64(k), d64(v), causal=causal, scale=scale)
    lows = [kk.forward(q, k, v, causal=causal, scale=scale) for kk in (REF, LOWP)]
    judge(f"{tag}out", out, o64, [x[0] for x in lows], seed)
    judge(f"{tag}lse", lse, l64, [x[1] for x in lows], seed)
    grads = kern.backward(q, k, v, out, lse, dout, causal=causal, scale=scale)
    g64 = REF.backward(d64(q), d64(k), d64(v), d64(out), d64(lse), d64(dout), causal=causal, scale=scale)
    glo = [kk.backward(q, k, v, out, lse, dout, causal=causal, scale=scale) for kk in (REF, LOWP)]
    for name, g, want, low, x in zip(("dq", "dk", "dv"), grads, g64, zip(*glo), (q, k, v)):
        assert g.shape == x.shape
        judge(f"{tag}{name}", g, want, low, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=lambda s: f"M{s[0]}-N{s[1]}-D{s[2]}")
@pytest.mark.parametrize(
    "layout,heads",
    [("contiguous", (4, 2)), ("transposed", (6, 2)), ("head_slice", (2, 2))],
    ids=["contiguous-H4-2", "transposed-H6-2", "head_slice-H2-2"],
)
def test_block_forward_backward(dtype, causal, heads, shape, layout):
    m, mk, dim = shape
    hq, hk = heads
    if causal and m != mk:  # the seam's rule: a causal block is square; say so, never guess
        q = rand5((1, 1, m, hq, dim), dtype, layout)
        k = rand5((1, 1, mk, hk, dim), dtype, layout)
        with pytest.raises(ValueError, match="causal block needs equal query and key rows"):
            FUSED.forward(q, k, k, causal=True, scale=0.1)
        return
    seed = seeded("block", dtype, causal, heads, shape, layout)
    b, s = 2, 2
    q = rand5((b, s, m, hq, dim), dtype, layout)
    k = rand5((b, s, mk, hk, dim), dtype, layout)
    v = rand5((b, s, mk, hk, dim), dtype, layout)
    dout = rand5((b, s, m, hq, dim), dtype, layout)
    _check_block(FUSED, q, k, v, dout, causal, dim**-0.5, seed)


@pytest.mark.parametrize("layout", ["strided_head_dim", "unbind_last", "permuted", "zero_stride"])
def test_block_odd_layouts_of_v_and_dout(layout):
    """v and dout (never shown to supports()) may come in any layout: the kernel copies what it must
    (q starts at an odd storage offset, k is transposed)."""
    seed = seeded("odd-v", layout)
    dtype = torch.float32
    q = rand5((2, 1, 20, 4, 32), dtype, "storage_offset")
    k = rand5((2, 1, 20, 2, 32), dtype, "transposed")
    v = rand5((2, 1, 20, 2, 32), dtype, layout)
    dout = rand5((2, 1, 20, 4, 32), dtype, layout)
    _check_block(FUSED, q, k, v, dout, True, 0.2, seed)


@pytest.mark.parametrize("dim", ODD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_block_head_dims_padded(dim, causal):
    """Head dims that are multiples of 8 but not powers of two: masked columns of a padded tile."""
    dtypes = [torch.float32] if not CUDA else [torch.bfloat16] + ([torch.float16, torch.float32] if dim == 40 else [])
    m = 12 if not CUDA else 300
    for dtype in dtypes:
        seed = seeded("dims", dim, causal, dtype)
        q = rand5((1, 2, m, 4, dim), dtype, "transposed")
        k = rand5((1, 2, m, 2, dim), dtype)
        v = rand5((1, 2, m, 2, dim), dtype, "head_slice")
        dout = rand5((1, 2, m, 4, dim), dtype)
        _check_block(FUSED, q, k, v, dout, causal, dim**-0.5, seed, tag=f"D{dim} {dtype} ")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_block_with_pinned_gpu_tiles(dtype, causal):
    """The pinned D=128 GPU tile sizes on uneven rows (in the interpreter too: the tiling logic)."""
    seed = seeded("pinned", dtype, causal)
    kern = FusedKernel(gpu_config(128, dtype))
    m = 100 if not CUDA else 1000
    q = rand5((1, 2, m, 4, 128), dtype, "transposed")
    k = rand5((1, 2, m, 2, 128), dtype)
    v = rand5((1, 2, m, 2, 128), dtype, "head_slice")
    dout = rand5((1, 2, m, 4, 128), dtype)
    _check_block(kern, q, k, v, dout, causal, 0.09, seed)


def test_block_empty_keys_and_rows():
    seeded("empty")
    q = torch.randn(1, 2, 8, 2, 32, device=DEVICE)
    k = torch.randn(1, 2, 0, 2, 32, device=DEVICE)
    out, lse = FUSED.forward(q, k, k, causal=False, scale=0.2)
    assert (out == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = FUSED.backward(q, k, k, out, lse, torch.randn_like(q), causal=False, scale=0.2)
    assert (dq == 0).all() and dk.numel() == 0
    q0 = torch.randn(1, 2, 0, 2, 32, device=DEVICE)
    out, lse = FUSED.forward(q0, q0, q0, causal=True, scale=0.2)
    assert out.shape == q0.shape and lse.shape == (1, 2, 0, 2)


def test_causal_needs_square_block():
    q = torch.randn(1, 1, 16, 2, 32, device=DEVICE)
    k = torch.randn(1, 1, 32, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="equal query and key rows"):
        FUSED.forward(q, k, k, causal=True, scale=0.2)


# ---------------------------------------------------------------------------
# whole patterns in one launch (forward_pattern / backward_pattern)


def plans_for(mode, heads, kv_heads, local_len, seq_len, segs=None, rates=None):
    return plan_patterns(segs or PAT_SEGS, rates or PAT_RATES, seq_len=seq_len, local_len=local_len,
                         num_heads=heads, num_kv_heads=kv_heads, mode=mode)


def final_out_lse(q, k, v, plans, causal, scale):
    """Merged (out, lse) of all local plans, the way the library combines them, fp64 kernel."""
    out, lse = ring_forward(d64(q), d64(k), d64(v), None, RingCall(tuple(plans), None, RingLayout(), 0, REF_P,
                                                                   causal, scale))
    return out, lse.float()


def backward_pattern_all(kern, q, k, v, p, out, lse, dout, packed, causal, scale):
    """``kern.backward_pattern``, the fp64 oracle and the two low-precision baselines, each
    adding into copies of the same random fp32 accumulators ``init``."""
    init = [torch.randn(x.shape, device=DEVICE) for x in (q, k, v)]
    kw = dict(packed=packed, causal=causal, scale=scale)
    acc = [x.clone() for x in init]
    kern.backward_pattern(q, k, v, p, out, lse, dout, *acc, **kw)
    acc64 = [d64(x) for x in init]
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, d64(out), d64(lse), d64(dout), *acc64, **kw)
    acclo = []
    for kk in (REF_P, LOWP_P):
        acc_k = [x.clone() for x in init]
        kk.backward_pattern(q, k, v, p, out, lse, dout, *acc_k, **kw)
        acclo.append(acc_k)
    return init, acc, acc64, list(zip(*acclo))


def chunk_rows(x, plan):
    """Compact rows of the heads in the plan's chunks, stacked (heads outside are unspecified)."""
    return torch.cat([compact_view(x, plan, c.h0, c.h1).flatten(3) for c in plan.chunks], dim=-1)


def check_pattern_forward(kern, q, k, v, p, packed, causal, scale, seed, what):
    o, s = kern.forward_pattern(q, k, v, p, packed=packed, causal=causal, scale=scale)
    o64, s64 = REF_P.forward_pattern(d64(q), d64(k), d64(v), p, packed=packed, causal=causal, scale=scale)
    lows = [kk.forward_pattern(q, k, v, p, packed=packed, causal=causal, scale=scale) for kk in (REF_P, LOWP_P)]
    judge(f"{what} out", chunk_rows(o, p), chunk_rows(o64, p), [chunk_rows(x[0], p) for x in lows], seed)
    judge(f"{what} lse", chunk_rows(s, p), chunk_rows(s64, p), [chunk_rows(x[1], p) for x in lows], seed)
    check_pattern_merge(kern, q, k, v, p, packed, causal, scale, seed, what)
    return o, s


def check_pattern_merge(kern, q, k, v, p, packed, causal, scale, seed, what):
    """``forward_pattern_into`` merges into a running fp32 result that already holds random values (every
    fifth row empty), read through head-sliced strides, against merging the fp64 oracle's partial; rows
    the pattern does not cover stay bit-for-bit unchanged."""
    g = torch.Generator().manual_seed(seed)
    bsz, n, heads, dim = q.shape
    out0 = torch.randn((bsz, n, heads + 1, dim), generator=g)[:, :, 1:]
    lse0 = (3 * torch.randn((bsz, n, heads + 2), generator=g))[:, :, 2:]
    out0[:, ::5], lse0[:, ::5] = 0.0, float("-inf")
    kw = dict(packed=packed, causal=causal, scale=scale)

    def head_sliced(x):  # a fresh copy that is a head slice of a wider tensor, like out0/lse0
        wide = torch.empty((*x.shape[:2], x.shape[2] + 1, *x.shape[3:]), device=DEVICE)
        wide[:, :, 1:].copy_(x)
        return wide[:, :, 1:]

    def merged(kernel):
        out, lse = head_sliced(out0), head_sliced(lse0)
        kernel.forward_pattern_into(q, k, v, p, out, lse, **kw)
        return out, lse

    got_o, got_l = merged(kern)
    want_o, want_l = d64(out0), d64(lse0)
    merge_pattern_(want_o, want_l, p, *REF_P.forward_pattern(d64(q), d64(k), d64(v), p, **kw))
    lows = [merged(kk) for kk in (REF_P, LOWP_P)]
    fin = torch.isfinite(want_l)
    assert torch.equal(torch.isfinite(got_l.cpu()), fin), f"{what} merged lse: empty rows differ"
    judge(f"{what} merged out", got_o, want_o, [o for o, _ in lows], seed)
    judge(f"{what} merged lse", got_l.cpu()[fin], want_l[fin], [s.cpu()[fin] for _, s in lows], seed)
    covered = torch.zeros(lse0.shape, dtype=torch.bool)
    for c in p.chunks:
        dilated_view(covered, p.local_segment, p.dilation, c.offset, c.h0, c.h1).fill_(True)
    assert torch.equal(got_o.cpu()[~covered], out0[~covered]), f"{what} merged out: uncovered rows changed"


def check_pattern_local(kern, mode, heads, kv_heads, layout, causal, dtype, seed, dim, n, segs=None, rates=None,
                        subset=None):
    """Local plans (packed=False): compact forward, in-place backward accumulation, untouched heads."""
    b = 2 if not CUDA else 1
    plans = plans_for(mode, heads, kv_heads, n, n, segs, rates)
    q = rand((b, n, heads, dim), dtype, layout)
    k = rand((b, n, kv_heads, dim), dtype, layout)
    v = rand((b, n, kv_heads, dim), dtype, layout)
    scale = dim**-0.5
    fin_o, fin_l = final_out_lse(q, k, v, plans, causal, scale)
    out_low = fin_o.to(DEVICE, dtype)
    lse_dev = fin_l.to(DEVICE)
    dout = rand((b, n, heads, dim), dtype, layout)
    for p in plans if subset is None else subset(plans):
        what = f"plan {p.index} (w={p.segment}, r={p.dilation})"
        check_pattern_forward(kern, q, k, v, p, False, causal, scale, seed, what)
        # backward adds into fp32 accumulators that already hold random values
        init, acc, acc64, acclo = backward_pattern_all(kern, q, k, v, p, out_low, lse_dev, dout, False, causal, scale)
        read = [torch.zeros(x.shape, dtype=torch.bool) for x in (q, k, v)]
        for c in p.chunks:
            chunk_views(read[0], p, c).fill_(True)
            chunk_views(read[1], p, c, kv=True).fill_(True)
            chunk_views(read[2], p, c, kv=True).fill_(True)
        for name, got, want, low, x0, touched in zip(("dq", "dk", "dv"), acc, acc64, acclo, init, read):
            judge(f"{what} {name}", got, want, low, seed)
            # rows/heads the plan does not read must be bit-for-bit untouched
            assert torch.equal(got.cpu()[~touched], x0.cpu()[~touched]), f"{what} {name}: untouched entries changed"
        if mode == "grouped":
            covered = {h for c in p.chunks for h in range(c.h0, c.h1)}
            other = [h for h in range(heads) if h not in covered]
            assert torch.equal(acc[0][:, :, other], init[0][:, :, other]), f"{what}: dq of heads {other} touched"
        if kern.parts("bwd", p, q, k, causal=causal, masked=False):
            check_pattern_parts(kern, q, k, v, p, out_low, lse_dev, dout, causal, scale, seed, what)


def check_pattern_parts(kern, q, k, v, p, out, lse, dout, causal, scale, seed, what):
    """``backward_pattern_parts``: compact gradients in the inputs' dtype, placed in full layout (the slots a
    combine reads; ``merge.sum_grads``), against the fp64 oracle's and the plain-torch ones placed alike."""
    def placed(kernel, *xs):
        grads = kernel.backward_pattern_parts(*xs[:3], p, *xs[3:], causal=causal, scale=scale)
        for g, x in zip(grads, xs[:3]):
            assert g.dtype == x.dtype and g.shape == (x.shape[0], x.shape[1] // p.dilation, *x.shape[2:]), what
        return [sum_grads(None, [Part(p, g, kv=kv)], x) for g, x, kv in zip(grads, xs[:3], (False, True, True))]

    xs = (q, k, v, out, lse, dout)
    got, want = placed(kern, *xs), placed(REF_P, *(d64(x) for x in xs))
    lows = list(zip(*(placed(kk, *xs) for kk in (REF_P, LOWP_P))))
    for name, g, w, low in zip(("dq", "dk", "dv"), got, want, lows):
        judge(f"{what} {name} (part)", g, w, low, seed)


PATTERN_CASES = [
    # mode, heads, kv heads, layout, causal, dtype
    ("longnet", 4, 2, "contiguous", False, torch.float32),
    ("longnet", 6, 2, "transposed", True, torch.float16),
    ("grouped", 4, 2, "head_slice", True, torch.float32),
    ("grouped", 6, 3, "contiguous", False, torch.float16),
    ("longnet", 6, 2, "storage_offset", False, torch.float32),
    ("longnet", 4, 1, "contiguous", True, torch.float32),
]
if CUDA:
    PATTERN_CASES += [
        ("longnet", 8, 2, "transposed", True, torch.bfloat16),
        ("longnet", 6, 2, "contiguous", False, torch.bfloat16),
        ("grouped", 8, 8, "head_slice", True, torch.bfloat16),
        ("longnet", 16, 16, "contiguous", True, torch.float16),
    ]


@pytest.mark.parametrize("case", PATTERN_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-{c[3]}-{c[4]}-{c[5]}")
def test_pattern_local(case):
    mode, heads, kv_heads, layout, causal, dtype = case
    seed = seeded("pattern", case)
    # the interpreter is slow: a subset of the longnet plans on CPU
    subset = None if CUDA or mode != "longnet" else (lambda plans: plans[1:])
    check_pattern_local(FUSED, mode, heads, kv_heads, layout, causal, dtype, seed, PAT_DIM, PAT_N, subset=subset)


@pytest.mark.parametrize("dim", [40, 96])
def test_pattern_local_padded_head_dim(dim):
    seed = seeded("pattern-dim", dim)
    dtype = torch.float16 if not CUDA else torch.bfloat16
    check_pattern_local(FUSED, "longnet", 4, 2, "transposed", True, dtype, seed, dim, 16 if not CUDA else 512,
                        segs=[8, 16] if not CUDA else [256, 512], rates=[1, 2])


RING_CASES = [
    ("longnet", 4, 2, True, torch.float32),
    ("longnet", 6, 2, False, torch.float16),
    ("grouped", 4, 2, True, torch.float16),
]
if CUDA:
    RING_CASES += [("longnet", 8, 2, True, torch.bfloat16), ("longnet", 8, 4, False, torch.bfloat16)]


def check_packed_ring_block(kern, mode, heads, kv_heads, causal, dtype, seed, dim=PAT_DIM, n=PAT_N):
    """Ring steps: k/v are halves of a packed buffer (causal only for the own block)."""
    b = 1
    local = n // 2
    plans = [p for p in plans_for(mode, heads, kv_heads, local, n) if p.ring_size > 1]
    assert plans, "no spanning pattern in this setup"
    q = rand((b, local, heads, dim), dtype, "transposed")
    k = rand((b, local, kv_heads, dim), dtype)
    v = rand((b, local, kv_heads, dim), dtype)
    scale = dim**-0.5
    for p in plans:
        buf = pack_kv(k, v, p)
        kp, vp = buf[0], buf[1]
        what = f"ring plan {p.index} (w={p.segment}, r={p.dilation})"
        o, s = check_pattern_forward(kern, q, kp, vp, p, True, causal, scale, seed, what)
        # final out/lse: this block merged with an arbitrary other partial (lse shifted up)
        out_full = torch.randn(b, local, heads, dim, device=DEVICE, dtype=dtype)
        lse_full = torch.full((b, local, heads), float("-inf"), device=DEVICE)
        for c in p.chunks:
            part = compact_view(s, p, c.h0, c.h1)
            dilated_view(lse_full, p.local_segment, p.dilation, c.offset, c.h0, c.h1).copy_(
                part + torch.rand(part.shape, device=DEVICE)
            )
        dout = torch.randn(b, local, heads, dim, device=DEVICE, dtype=dtype)
        init, acc, acc64, acclo = backward_pattern_all(kern, q, kp, vp, p, out_full, lse_full, dout, True, causal, scale)
        for name, got, want, low in zip(("dq", "dk", "dv"), acc, acc64, acclo):
            judge(f"{what} {name}", got, want, low, seed)


@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-causal{c[3]}-{c[4]}")
def test_pattern_packed_ring_block(case):
    mode, heads, kv_heads, causal, dtype = case
    check_packed_ring_block(FUSED, mode, heads, kv_heads, causal, dtype, seeded("ring", case))


def test_pattern_fills_exactly_the_chunks():
    """forward_pattern fills exactly the rows/heads of the chunks (a poisoned output shows a gap)."""
    seed = seeded("fills")
    heads, kv_heads, n, d = 6, 2, PAT_N, PAT_DIM
    plans = plans_for("grouped", heads, kv_heads, n, n)
    q = rand((1, n, heads, d), torch.float32)
    k = rand((1, n, kv_heads, d), torch.float32)
    p = plans[-1]
    o, s = FUSED.forward_pattern(q, k, k, p, packed=False, causal=False, scale=0.1)
    rows = chunk_rows(s, p)
    assert torch.isfinite(rows).all(), f"unwritten lse rows (seed {seed})"
    o64, s64 = REF_P.forward_pattern(d64(q), d64(k), d64(k), p, packed=False, causal=False, scale=0.1)
    assert rel_err(rows, chunk_rows(s64, p)) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kern", [FUSED, REF_P], ids=["fused", "reference"])
def test_fresh_first_pattern_writes_what_merging_into_empty_gives(kern, causal):
    """``fresh=True`` (the first pattern, covering every row and head) ignores the running result and the
    accumulators, here NaN-filled, and gives bit for bit what merging/adding into (0, -inf)/zeros gives,
    with a key mask whose first key tile is all padding (the dK/dV kernel's early exit must write zeros).
    A pattern that does not cover every head or row is refused."""
    seed = seeded("fresh", kern.name, causal)
    heads, kv_heads, n, d = 4, 2, PAT_N, 40 if not CUDA else 96
    dtype = torch.float16
    plans = plans_for("longnet", heads, kv_heads, n, n)
    p = plans[0]
    assert p.dilation == 1 and p.covers_all(heads, kv_heads)
    q, k, v, dout = (rand((2, n, h, d), dtype, "transposed") for h in (heads, kv_heads, kv_heads, heads))
    mask = torch.rand(2, n, device=DEVICE) < 0.3
    mask[0, :64] = True  # at least one whole key tile of padding (64 keys on a GPU, 16 interpreted)
    kw = dict(packed=False, causal=causal, scale=d**-0.5, key_mask=mask)

    def nan(shape):
        return torch.full(shape, float("nan"), device=DEVICE)

    out, lse = torch.zeros(q.shape, device=DEVICE), torch.full(q.shape[:3], float("-inf"), device=DEVICE)
    kern.forward_pattern_into(q, k, v, p, out, lse, **kw)
    out_f, lse_f = nan(q.shape), nan(q.shape[:3])
    kern.forward_pattern_into(q, k, v, p, out_f, lse_f, **kw, fresh=True)
    assert torch.equal(out_f, out) and torch.equal(lse_f, lse), f"fresh forward differs (seed {seed})"
    o = out.to(dtype)
    grads = [torch.zeros(x.shape, device=DEVICE) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, p, o, lse, dout, *grads, **kw)
    fresh = [nan(x.shape) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, p, o, lse, dout, *fresh, **kw, fresh=True)
    for name, got, want in zip(("dq", "dk", "dv"), fresh, grads):
        assert torch.equal(got, want), f"fresh {name} differs (seed {seed})"
    if kern is FUSED:  # writing fresh where the pattern does not reach would leave garbage: refused
        with pytest.raises(ValueError, match="covers every row and head"):
            kern.forward_pattern_into(q, k, v, plans[1], out_f, lse_f, **kw, fresh=True)
        some_heads = plans_for("grouped", heads, kv_heads, n, n)[0]  # r = 1, but only its head group
        assert some_heads.dilation == 1 and not some_heads.covers_all(heads, kv_heads)
        with pytest.raises(ValueError, match="covers every row and head"):
            kern.backward_pattern(q, k, v, some_heads, o, lse, dout, *fresh, **kw, fresh=True)


# ---------------------------------------------------------------------------
# through the library: ring of 2 gloo ranks, fused vs reference kernel


RING_CASES = [  # (mode, causal, heads, kv_heads, layout, dtype)
    ("longnet", True, 4, 2, "transposed", "float32"),
    ("longnet", False, 6, 2, "contiguous", "float32"),
    ("grouped", True, 4, 4, "contiguous", "float16"),
]


def _ring_fused_vs_reference(rank: int, world_size: int) -> list[dict]:
    """On each gloo rank: the library with kernel="fused" vs kernel="reference" on a ring, forward and
    backward (an autograd ``.sum()`` too, whose gradient reaches the kernel with zero strides)."""
    from dilated_attention import dilated_attention

    local, dim, batch = 32, 32, 1
    n = local * world_size
    segs, rates = (8, 16, n), (1, 2, 4)
    results = []
    for mode, causal, heads, kv_heads, layout, dtype_name in RING_CASES:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(1000 + len(results))
        full = [torch.randn(batch, n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
        dout = torch.randn(batch, n, heads, dim, generator=g)
        rows = slice(rank * local, (rank + 1) * local)
        got = {}
        for kern in ("fused", "reference"):
            xs = [as_layout(t[:, rows].to(dtype), layout).requires_grad_() for t in full]
            out = dilated_attention(*xs, segs, rates, mode=mode, causal=causal, comm="collective", kernel=kern)
            grads = torch.autograd.grad(out, xs, dout[:, rows].to(dtype))
            out2 = dilated_attention(*xs, segs, rates, mode=mode, causal=causal, comm="collective", kernel=kern)
            gsum = torch.autograd.grad(out2.float().sum(), xs)
            got[kern] = [t.detach().float() for t in (out, *grads, *gsum)]
        errs = [rel_err(a, b) for a, b in zip(got["fused"], got["reference"])]
        finite = all(torch.isfinite(t).all().item() for t in got["fused"])
        results.append({"case": f"{mode}-causal{causal}-H{heads}-{kv_heads}-{layout}-{dtype_name}",
                        "rank": rank, "errors": errs, "finite": finite})
    return results


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
@pytest.mark.skipif(CUDA, reason="CPU gloo ranks + interpreter; on GPUs the NCCL harness covers the fused ring")
def test_library_ring_fused_matches_reference():
    from dilated_attention.testing.spawn import spawn_ranks

    results = [res for part in spawn_ranks(_ring_fused_vs_reference, 2) for res in part]
    assert len(results) == 6, results
    for res in results:
        tol = 1e-5 if res["case"].endswith("float32") else 5e-3
        assert res["finite"], res
        assert max(res["errors"]) <= tol, res
