"""The fused Triton kernel against the fp64 oracle (ReferenceKernel, pattern.py's chunk loop).

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
below before any kernel is built) on small shapes; with CUDA the same tests run
on real shapes. Inputs are fresh random draws (the seed is in every message).
Low precision is judged by the rule of DESIGN.md 5: error vs the fp64 oracle at
most 2x the error of plain torch in the same precision, plus a small floor.
"Plain torch in the same precision" is the larger error of ReferenceKernel run
on the low-precision inputs (it computes in fp32 inside) and of ``LowpTorch``
below, which does every matmul in the low dtype (flash-attention's
``attention_ref(upcast=False)``): the fused kernel feeds bf16/fp16 P and dS to
the tensor cores, which ReferenceKernel alone would not account for.
"""

from __future__ import annotations

import os
import random

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first kernel build; fused.py jits lazily at first launch
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from dilated_attention.kernels.fused import (  # noqa: E402
    FusedConfig,
    FusedKernel,
    default_config,
    gpu_config,
    interpreting,
    shared_memory_reason,
)
from dilated_attention.kernels.pattern import compact_view, pattern_backward, pattern_forward  # noqa: E402
from dilated_attention.kernels.reference import ReferenceKernel, _expand_kv  # noqa: E402
from dilated_attention.ring import combine_patterns  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.views import chunk_views, dilated_view, pack_kv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


class LowpTorch:
    """Plain torch attention with every matmul in the input dtype (softmax and sums in fp32)."""

    name = "lowp-torch"

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
FUSED = FusedKernel()
LOW = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]
DTYPES = [torch.float32] + LOW

# sizes by device: (block rows M, key rows, head dim) and pattern setups
BLOCK_SHAPES = [(200, 200, 64), (256, 130, 128), (64, 64, 256)] if CUDA else [(24, 24, 32), (8, 20, 32)]
PAT_N = 1024 if CUDA else 32
PAT_SEGS = [256, 512, 1024] if CUDA else [8, 16, 32]
PAT_RATES = [1, 2, 4] if CUDA else [1, 2, 4]
PAT_DIM = 128 if CUDA else 32


def _seed() -> int:
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    return seed


def _rand(shape, dtype, layout="contig", extra_heads=2):
    """Fresh random (B, N, H, D)-like tensor with a chosen memory layout (always a view)."""
    if layout == "contig":
        return torch.randn(shape, device=DEVICE, dtype=dtype)
    if layout == "transposed":  # from (B, H, N, ..., D)
        hdim = len(shape) - 2
        big = [shape[0], shape[hdim], *shape[1:hdim], shape[-1]]
        x = torch.randn(big, device=DEVICE, dtype=dtype)
        return x.movedim(1, hdim)
    if layout == "head_sliced":
        hdim = len(shape) - 2
        big = list(shape)
        big[hdim] += extra_heads
        x = torch.randn(big, device=DEVICE, dtype=dtype)
        return x.narrow(hdim, 1, shape[hdim])
    raise ValueError(layout)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def _judge(what, got, oracle, ref_low, dtype, seed, floor=None):
    """Assert the tolerance rule; ``ref_low`` is ReferenceKernel's result in ``dtype``."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values (seed {seed})"
    err = _err(got, oracle)
    mag = max(1.0, oracle.abs().max().item())
    if dtype == torch.float32:
        tol = 2e-5 * mag
    else:
        lows = ref_low if isinstance(ref_low, (list, tuple)) else [ref_low]
        tol = 2 * max(_err(x, oracle) for x in lows) + (floor if floor is not None else 1e-3 * mag)
    assert err <= tol, f"{what}: max error {err:.3e} > tolerance {tol:.3e} ({dtype}, seed {seed})"


def _d(x):
    return x.detach().double().cpu()


# ---------------------------------------------------------------------------
# supports()


def test_supports_accepts_good_inputs():
    q = torch.randn(1, 2, 16, 4, 64, device=DEVICE)
    assert FUSED.supports(q, q[..., :2, :]) is None


@pytest.mark.parametrize(
    "case",
    ["dim48", "dim16", "float64", "stride", "kv_heads", "ndim", "kdim"],
)
def test_supports_rejects_with_reason(case):
    q = torch.randn(1, 2, 16, 4, 64, device=DEVICE)
    k = torch.randn(1, 2, 16, 2, 64, device=DEVICE)
    if case == "dim48":
        q, k = q[..., :48], k[..., :48]
        want = "head dim"
    elif case == "dim16":
        q, k = q[..., :16].contiguous(), k[..., :16].contiguous()
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


def test_shared_memory_reason():
    huge = FusedConfig(256, 256, 8, 4, 256, 256, 256, 256, 8, 4)
    reason = shared_memory_reason(huge, 256, torch.float32, 232448)
    assert reason is not None and "out of resource: shared memory" in reason and "232448" in reason
    for dim in (32, 64, 128):
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            assert shared_memory_reason(default_config(dim, dt), dim, dt, 232448) is None, (dim, dt)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=lambda s: f"M{s[0]}-N{s[1]}-D{s[2]}")
@pytest.mark.parametrize(
    "layout,heads",
    [("contig", (4, 2)), ("transposed", (6, 2)), ("head_sliced", (2, 2))],
    ids=["contig-H4-2", "transposed-H6-2", "head_sliced-H2-2"],
)
def test_block_forward_backward(dtype, causal, heads, shape, layout):
    m, mk, dim = shape
    hq, hk = heads
    if causal and m != mk:  # the seam's rule: a causal block is square; say so, never guess
        q = _rand((1, 1, m, hq, dim), dtype, layout)
        k = _rand((1, 1, mk, hk, dim), dtype, layout)
        with pytest.raises(ValueError, match="causal block needs equal query and key rows"):
            FUSED.forward(q, k, k, causal=True, scale=0.1)
        return
    seed = _seed()
    b, s = 2, 2
    q = _rand((b, s, m, hq, dim), dtype, layout)
    k = _rand((b, s, mk, hk, dim), dtype, layout)
    v = _rand((b, s, mk, hk, dim), dtype, layout)
    scale = dim**-0.5
    out, lse = FUSED.forward(q, k, v, causal=causal, scale=scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:4]
    o64, l64 = REF.forward(_d(q), _d(k), _d(v), causal=causal, scale=scale)
    lows = [kern.forward(q, k, v, causal=causal, scale=scale) for kern in (REF, LOWP)]
    _judge("out", out, o64, [x[0] for x in lows], dtype, seed)
    _judge("lse", lse, l64, [x[1] for x in lows], dtype, seed, floor=1e-4 * max(1.0, l64.abs().max().item()))

    dout = _rand(q.shape, dtype, layout)
    grads = FUSED.backward(q, k, v, out, lse, dout, causal=causal, scale=scale)
    g64 = REF.backward(_d(q), _d(k), _d(v), _d(out), _d(lse), _d(dout), causal=causal, scale=scale)
    glo = [kern.backward(q, k, v, out, lse, dout, causal=causal, scale=scale) for kern in (REF, LOWP)]
    for name, g, want, low, x in zip(("dq", "dk", "dv"), grads, g64, zip(*glo), (q, k, v)):
        assert g.shape == x.shape
        _judge(name, g, want, low, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_block_with_pinned_gpu_tiles(dtype, causal):
    """The pinned D=128 GPU tile sizes on uneven rows (in the interpreter too: the tiling logic)."""
    seed = _seed()
    kern = FusedKernel(gpu_config(128, dtype))
    m = 100 if not CUDA else 1000
    q = _rand((1, 2, m, 4, 128), dtype, "transposed")
    k = _rand((1, 2, m, 2, 128), dtype)
    v = _rand((1, 2, m, 2, 128), dtype, "head_sliced")
    out, lse = kern.forward(q, k, v, causal=causal, scale=0.09)
    o64, l64 = REF.forward(_d(q), _d(k), _d(v), causal=causal, scale=0.09)
    lows = [kk.forward(q, k, v, causal=causal, scale=0.09) for kk in (REF, LOWP)]
    _judge("out", out, o64, [x[0] for x in lows], dtype, seed)
    _judge("lse", lse, l64, [x[1] for x in lows], dtype, seed, floor=1e-3)
    dout = _rand(q.shape, dtype)
    grads = kern.backward(q, k, v, out, lse, dout, causal=causal, scale=0.09)
    g64 = REF.backward(_d(q), _d(k), _d(v), _d(out), _d(lse), _d(dout), causal=causal, scale=0.09)
    glo = [kk.backward(q, k, v, out, lse, dout, causal=causal, scale=0.09) for kk in (REF, LOWP)]
    for name, g, want, low in zip(("dq", "dk", "dv"), grads, g64, zip(*glo)):
        _judge(name, g, want, low, dtype, seed)


def test_block_empty_keys_and_rows():
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


def _plans(mode, heads, kv_heads, local_len, seq_len):
    return plan_patterns(
        PAT_SEGS, PAT_RATES, seq_len=seq_len, local_len=local_len, num_heads=heads, num_kv_heads=kv_heads, mode=mode
    )


def _final_out_lse(q, k, v, plans, causal, scale):
    """Merged (out, lse) of all local plans, the way the library combines them, fp64 kernel."""
    parts = [(p, *pattern_forward(REF, _d(q), _d(k), _d(v), p, packed=False, causal=causal, scale=scale)) for p in plans]
    out, lse = combine_patterns(parts, _d(q))
    return out, lse.float()


def _backward_pattern_all(q, k, v, p, out, lse, dout, packed, causal, scale):
    """backward_pattern of the fused kernel, the fp64 oracle and the two low-precision
    baselines, each adding into copies of the same random fp32 accumulators ``init``."""
    init = [torch.randn(x.shape, device=DEVICE) for x in (q, k, v)]
    kw = dict(packed=packed, causal=causal, scale=scale)
    acc = [x.clone() for x in init]
    FUSED.backward_pattern(q, k, v, p, out, lse, dout, *acc, **kw)
    acc64 = [_d(x) for x in init]
    pattern_backward(REF, _d(q), _d(k), _d(v), p, _d(out), _d(lse), _d(dout), *acc64, **kw)
    acclo = []
    for kern in (REF, LOWP):
        acc_k = [x.clone() for x in init]
        pattern_backward(kern, q, k, v, p, out, lse, dout, *acc_k, **kw)
        acclo.append(acc_k)
    return init, acc, acc64, list(zip(*acclo))


def _chunk_rows(x, plan):
    """Compact rows of the heads in the plan's chunks, stacked (heads outside are unspecified)."""
    return torch.cat([compact_view(x, plan, c.h0, c.h1).flatten(3) for c in plan.chunks], dim=-1)


PATTERN_CASES = [
    # mode, heads, kv heads, layout, causal, dtype
    ("longnet", 4, 2, "contig", False, torch.float32),
    ("longnet", 6, 2, "transposed", True, torch.float16),
    ("grouped", 4, 2, "head_sliced", True, torch.float32),
    ("grouped", 6, 3, "contig", False, torch.float16),
    ("longnet", 6, 2, "head_sliced", False, torch.float32),
    ("longnet", 4, 1, "contig", True, torch.float32),
]
if CUDA:
    PATTERN_CASES += [
        ("longnet", 8, 2, "transposed", True, torch.bfloat16),
        ("longnet", 6, 2, "contig", False, torch.bfloat16),
        ("grouped", 8, 8, "head_sliced", True, torch.bfloat16),
        ("longnet", 16, 16, "contig", True, torch.float16),
    ]


@pytest.mark.parametrize("case", PATTERN_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-{c[3]}-{c[4]}-{c[5]}")
def test_pattern_local(case):
    """Local plans (packed=False): compact forward, in-place backward accumulation, untouched heads."""
    mode, heads, kv_heads, layout, causal, dtype = case
    seed = _seed()
    b, n, d = 2 if not CUDA else 1, PAT_N, PAT_DIM
    plans = _plans(mode, heads, kv_heads, n, n)
    q = _rand((b, n, heads, d), dtype, layout)
    k = _rand((b, n, kv_heads, d), dtype, layout)
    v = _rand((b, n, kv_heads, d), dtype, layout)
    scale = d**-0.5
    fin_o, fin_l = _final_out_lse(q, k, v, plans, causal, scale)
    out_low = fin_o.to(DEVICE, dtype)
    lse_dev = fin_l.to(DEVICE)
    dout = _rand((b, n, heads, d), dtype, layout)
    if not CUDA:  # the interpreter is slow: a subset of the plans
        plans = plans[1:] if mode == "longnet" else plans
    for p in plans:
        o, s = FUSED.forward_pattern(q, k, v, p, packed=False, causal=causal, scale=scale)
        o64, s64 = pattern_forward(REF, _d(q), _d(k), _d(v), p, packed=False, causal=causal, scale=scale)
        lows = [pattern_forward(kern, q, k, v, p, packed=False, causal=causal, scale=scale) for kern in (REF, LOWP)]
        olo = [_chunk_rows(x[0], p) for x in lows]
        slo = [_chunk_rows(x[1], p) for x in lows]
        what = f"plan {p.index} (w={p.segment}, r={p.dilation})"
        _judge(f"{what} out", _chunk_rows(o, p), _chunk_rows(o64, p), olo, dtype, seed)
        _judge(f"{what} lse", _chunk_rows(s, p), _chunk_rows(s64, p), slo, dtype, seed, floor=1e-4 * 10)

        # backward adds into fp32 accumulators that already hold random values
        init, acc, acc64, acclo = _backward_pattern_all(q, k, v, p, out_low, lse_dev, dout, False, causal, scale)
        read = [torch.zeros(x.shape, dtype=torch.bool) for x in (q, k, v)]
        for c in p.chunks:
            chunk_views(read[0], p, c).fill_(True)
            chunk_views(read[1], p, c, kv=True).fill_(True)
            chunk_views(read[2], p, c, kv=True).fill_(True)
        for name, got, want, low, x0, touched in zip(("dq", "dk", "dv"), acc, acc64, acclo, init, read):
            _judge(f"{what} {name}", got, want, low, dtype, seed)
            # rows/heads the plan does not read must be bit-for-bit untouched
            assert torch.equal(got.cpu()[~touched], x0.cpu()[~touched]), f"{what} {name}: untouched entries changed"
        if mode == "grouped":
            covered = {h for c in p.chunks for h in range(c.h0, c.h1)}
            other = [h for h in range(heads) if h not in covered]
            assert torch.equal(acc[0][:, :, other], init[0][:, :, other]), f"{what}: dq of heads {other} touched"


RING_CASES = [
    ("longnet", 4, 2, True, torch.float32),
    ("longnet", 6, 2, False, torch.float16),
    ("grouped", 4, 2, True, torch.float16),
]
if CUDA:
    RING_CASES += [("longnet", 8, 2, True, torch.bfloat16), ("longnet", 8, 4, False, torch.bfloat16)]


@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-causal{c[3]}-{c[4]}")
def test_pattern_packed_ring_block(case):
    """Ring steps: k/v are halves of a packed buffer (causal only for the own block)."""
    mode, heads, kv_heads, causal, dtype = case
    seed = _seed()
    b, d = 1, PAT_DIM
    n = PAT_N
    local = n // 2
    plans = [p for p in _plans(mode, heads, kv_heads, local, n) if p.ring_size > 1]
    assert plans, "no spanning pattern in this setup"
    q = _rand((b, local, heads, d), dtype, "transposed")
    k = _rand((b, local, kv_heads, d), dtype)
    v = _rand((b, local, kv_heads, d), dtype)
    scale = d**-0.5
    for p in plans:
        buf = pack_kv(k, v, p)
        kp, vp = buf[0], buf[1]
        o, s = FUSED.forward_pattern(q, kp, vp, p, packed=True, causal=causal, scale=scale)
        o64, s64 = pattern_forward(REF, _d(q), _d(kp), _d(vp), p, packed=True, causal=causal, scale=scale)
        lows = [pattern_forward(kern, q, kp, vp, p, packed=True, causal=causal, scale=scale) for kern in (REF, LOWP)]
        olo = [_chunk_rows(x[0], p) for x in lows]
        slo = [_chunk_rows(x[1], p) for x in lows]
        what = f"ring plan {p.index} (w={p.segment}, r={p.dilation})"
        _judge(f"{what} out", _chunk_rows(o, p), _chunk_rows(o64, p), olo, dtype, seed)
        _judge(f"{what} lse", _chunk_rows(s, p), _chunk_rows(s64, p), slo, dtype, seed, floor=1e-3)

        # final out/lse: this block merged with an arbitrary other partial (lse shifted up)
        out_full = torch.randn(b, local, heads, d, device=DEVICE, dtype=dtype)
        lse_full = torch.full((b, local, heads), float("-inf"), device=DEVICE)
        for c in p.chunks:
            dilated_view(lse_full, p.local_segment, p.dilation, c.offset, c.h0, c.h1).copy_(
                compact_view(s, p, c.h0, c.h1) + torch.rand(compact_view(s, p, c.h0, c.h1).shape, device=DEVICE)
            )
        dout = torch.randn(b, local, heads, d, device=DEVICE, dtype=dtype)
        init, acc, acc64, acclo = _backward_pattern_all(q, kp, vp, p, out_full, lse_full, dout, True, causal, scale)
        for name, got, want, low in zip(("dq", "dk", "dv"), acc, acc64, acclo):
            _judge(f"{what} {name}", got, want, low, dtype, seed)


def test_pattern_matches_chunk_loop_exactly_in_structure():
    """forward_pattern fills exactly the rows/heads of the chunks (a poisoned output shows a gap)."""
    seed = _seed()
    heads, kv_heads, n, d = 6, 2, PAT_N, PAT_DIM
    plans = _plans("grouped", heads, kv_heads, n, n)
    q = _rand((1, n, heads, d), torch.float32)
    k = _rand((1, n, kv_heads, d), torch.float32)
    p = plans[-1]
    o, s = FUSED.forward_pattern(q, k, k, p, packed=False, causal=False, scale=0.1)
    rows = _chunk_rows(s, p)
    assert torch.isfinite(rows).all(), f"unwritten lse rows (seed {seed})"
    o64, s64 = pattern_forward(REF, _d(q), _d(k), _d(k), p, packed=False, causal=False, scale=0.1)
    assert _err(rows, _chunk_rows(s64, p)) < 1e-4, f"seed {seed}"


# ---------------------------------------------------------------------------
# through the library: ring of 2 gloo ranks, fused vs reference kernel


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
@pytest.mark.skipif(CUDA, reason="CPU gloo ranks + interpreter; on GPUs the NCCL harness covers the fused ring")
def test_library_ring_fused_matches_reference():
    import json as _json

    from dilated_attention.kernels._fused_selfcheck import ring_worker
    from dilated_attention.testing.harness import run_spawned

    out_dir = run_spawned(ring_worker, 2)
    results = []
    for r in range(2):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results += _json.load(f)
    assert len(results) == 6, results
    for res in results:
        tol = 1e-5 if res["case"].endswith("float32") else 5e-3
        assert res["finite"], res
        assert max(res["errors"]) <= tol, res
