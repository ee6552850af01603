"""The fused Triton kernel against the fp64 oracle (ReferenceKernel, driven chunk by chunk by ChunkLoop), with
the shared checks of ``kernel_checks.py`` (inputs, plain-torch references, the tolerance rule; it sets
Triton's interpreter up on CPU, so it is imported first)."""

from __future__ import annotations

from kernel_checks import (  # noqa: I001
    CUDA, DEVICE, DTYPES, LOWP, PAT_DIM, PAT_N, REF, REF_P, SMALL_TILES, check_packed_ring_block, check_pattern_local,
    chunk_rows, d64, judge, plans_for, rand, rand5, seeded,
)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from dilated_attention.kernels.fused import FusedKernel, interpreting  # noqa: E402
from dilated_attention.kernels.fused_config import FusedConfig, gpu_config, padded_dim, shared_memory_reason  # noqa: E402
from dilated_attention.kernels.protocol import CallSpec  # noqa: E402
from dilated_attention.testing.compare import as_layout, rel_err  # noqa: E402

FUSED = FusedKernel(SMALL_TILES)
# sizes by device: (block rows M, key rows, head dim)
BLOCK_SHAPES = [(200, 200, 64), (256, 130, 128), (64, 64, 256)] if CUDA else [(24, 24, 32), (8, 20, 32)]
# head dims that are not powers of two (padded inside the kernel): interpreter on small shapes, GPU on real ones
ODD_DIMS = [40, 80, 96, 112] + ([8, 200] if CUDA else [])


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
    from dilated_attention import triton_support

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    triton_support.interpreting.cache_clear()  # (read once per process; this test switches the mode)
    try:
        q = torch.randn(1, 1, 16, 2, 64)
        reason = FUSED.supports(q, q)
        assert reason is not None and "CUDA" in reason
    finally:
        monkeypatch.undo()
        triton_support.interpreting.cache_clear()


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
    o, s = FUSED.forward_pattern(q, k, k, p, CallSpec(False, 0.1))
    rows = chunk_rows(s, p)
    assert torch.isfinite(rows).all(), f"unwritten lse rows (seed {seed})"
    o64, s64 = REF_P.forward_pattern(d64(q), d64(k), d64(k), p, CallSpec(False, 0.1))
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
    kern.forward_pattern_into(q, k, v, p, CallSpec(**kw), (out, lse))
    out_f, lse_f = nan(q.shape), nan(q.shape[:3])
    kern.forward_pattern_into(q, k, v, p, CallSpec(**kw), (out_f, lse_f), fresh=True)
    assert torch.equal(out_f, out) and torch.equal(lse_f, lse), f"fresh forward differs (seed {seed})"
    o = out.to(dtype)
    grads = [torch.zeros(x.shape, device=DEVICE) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, p, CallSpec(**kw), (o, lse, dout), grads)
    fresh = [nan(x.shape) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, p, CallSpec(**kw), (o, lse, dout), fresh, fresh=True)
    for name, got, want in zip(("dq", "dk", "dv"), fresh, grads):
        assert torch.equal(got, want), f"fresh {name} differs (seed {seed})"
    if kern is FUSED:  # writing fresh where the pattern does not reach would leave garbage: refused
        with pytest.raises(ValueError, match="covers every row and head"):
            kern.forward_pattern_into(q, k, v, plans[1], CallSpec(**kw), (out_f, lse_f), fresh=True)
        some_heads = plans_for("grouped", heads, kv_heads, n, n)[0]  # r = 1, but only its head group
        assert some_heads.dilation == 1 and not some_heads.covers_all(heads, kv_heads)
        with pytest.raises(ValueError, match="covers every row and head"):
            kern.backward_pattern(q, k, v, some_heads, CallSpec(**kw), (o, lse, dout), fresh, fresh=True)


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
