"""The flash-attn-4 block kernel (``kernels/flash4.py``) against the fp64 oracle.

On CPU, FA4's two entry points are replaced by a fake ``flash_attn.cute`` module
(``FakeFA4``): float64 plain torch with FA4's signatures and output layouts
(LSE ``(B', h, M)``, natural log, ``-inf`` for an empty row; backward reads a
``-inf`` LSE as 0, as FA4 does) that also *asserts* FA4's rules, so a layout
FA4 would copy silently fails here: every operand read in place (unit last
stride, 16-byte aligned address and strides), outputs of the declared shapes,
``deterministic=True``. That checks the wrapper's view handling, LSE
conversion, GQA, per-batch calls and error messages on any layout. With CUDA
and flash-attn-4 on a Hopper or Blackwell GPU the real kernels run in bf16/fp16.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

# first: test_fused sets TRITON_INTERPRET on CPU, which must precede triton's import
from test_fused import (  # noqa: I001
    CUDA,
    DEVICE,
    _check_block,
    check_packed_ring_block,
    check_pattern_local,
    rand5,
    seeded,
)

from dilated_attention import dilated_attention
from dilated_attention.kernels import flash4
from dilated_attention.kernels.dispatch import select_kernel
from dilated_attention.kernels.flash4 import Flash4Kernel, reads_in_place
from dilated_attention.kernels.chunk_loop import ChunkLoop
from dilated_attention.testing.compare import assert_within_rule
from dilated_attention.testing.oracle import dense_dilated_attention


def _real_fa4() -> bool:
    if not CUDA:
        return False
    flash4._api.cache_clear()
    return not isinstance(flash4._api(), str) and not isinstance(flash4._device_arch(DEVICE), str)


DEVICE_ARCH = flash4._device_arch
REAL = _real_fa4()
gpu = pytest.mark.skipif(not REAL, reason="needs CUDA, flash-attn-4 and a Hopper or Blackwell GPU")
cpu_only = pytest.mark.skipif(REAL, reason="the fake FA4 stands in only where the real one is absent")


# ---------------------------------------------------------------------------
# The stand-in


def _fa4_aligned(x: torch.Tensor) -> bool:
    """FA4's own test (``cute_dsl_utils._is_aligned_layout``), written out independently of the wrapper's."""
    unit = 16 // x.element_size()
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s == 0 or s % unit == 0 for s in x.stride()[:-1])


class FakeFA4:
    """``_flash_attn_fwd`` / ``_flash_attn_bwd`` in float64 plain torch, asserting FA4's input rules."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    @staticmethod
    def _check_inputs(*xs):
        for x in xs:
            assert x.dim() == 4, f"FA4 takes (B, M, h, D), got {tuple(x.shape)}"
            assert x.dtype in (torch.float16, torch.bfloat16), x.dtype
            assert _fa4_aligned(x), f"FA4 would copy {tuple(x.shape)} {x.stride()} (address {x.data_ptr() % 16})"

    @staticmethod
    def _scores(q, k, causal, scale):
        g = q.shape[2] // k.shape[2]
        s = torch.einsum("bmhd,bnhd->bhmn", q.double(), k.double().repeat_interleave(g, 2)) * scale
        if causal:
            m, n = s.shape[-2:]
            s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(n - m + 1), float("-inf"))
        return s, g

    def _record(self, kind, q, k, v, **kw):
        self.calls.append(dict(kind=kind, shapes=(tuple(q.shape), tuple(k.shape)),
                               storages=tuple(x.untyped_storage().data_ptr() for x in (q, k, v)), **kw))

    def fwd(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, causal=False,
            window_size_left=None, window_size_right=None, pack_gqa=None, return_lse=False, out=None, lse=None):
        self._check_inputs(q, k, v)
        b, m, h, d = q.shape
        assert k.shape[0] == b and k.shape[3] == d and h % k.shape[2] == 0 and v.shape == k.shape
        assert softmax_scale is not None, "the wrapper passes its scale"
        assert out is not None and lse is not None, "the wrapper allocates out and lse"
        assert out.shape == q.shape and out.dtype == q.dtype and _fa4_aligned(out), (out.shape, out.stride())
        assert lse.shape == (b, h, m) and lse.dtype == torch.float32 and lse.stride(-1) == 1, (lse.shape, lse.stride())
        self._record("fwd", q, k, v, causal=causal)
        s, g = self._scores(q, k, causal, softmax_scale)
        l64 = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isneginf(l64), 0.0, l64)[..., None])
        out.copy_(torch.einsum("bhmn,bnhd->bmhd", p, v.double().repeat_interleave(g, 2)))
        lse.copy_(l64)
        return out, lse, None, None, None

    def bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
            window_size_left=None, window_size_right=None, deterministic=False, dq=None, dk=None, dv=None):
        self._check_inputs(q, k, v, out, dout)
        assert deterministic, "the wrapper asks for the deterministic backward"
        b, m, h, d = q.shape
        assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype
        assert lse.shape == (b, h, m) and lse.dtype == torch.float32 and lse.is_contiguous(), (lse.shape, lse.stride())
        for x, like in ((dq, q), (dk, k), (dv, v)):
            assert x is not None and x.shape == like.shape and x.dtype == like.dtype and _fa4_aligned(x)
        self._record("bwd", q, k, v, causal=causal)
        s, g = self._scores(q, k, causal, softmax_scale)
        lse_read = torch.where(torch.isneginf(lse), 0.0, lse.double())  # what FA4's preprocess does
        p = torch.exp(s - lse_read[..., None])
        do = dout.double()
        ve, ke = v.double().repeat_interleave(g, 2), k.double().repeat_interleave(g, 2)
        dvh = torch.einsum("bhmn,bmhd->bnhd", p, do)
        dp = torch.einsum("bmhd,bnhd->bhmn", do, ve)
        ds = p * (dp - (do * out.double()).sum(-1).transpose(1, 2)[..., None]) * softmax_scale
        dq.copy_(torch.einsum("bhmn,bnhd->bmhd", ds, ke))
        dkh = torch.einsum("bhmn,bmhd->bnhd", ds, q.double())
        hk = k.shape[2]
        dk.copy_(dkh.unflatten(2, (hk, g)).sum(3))
        dv.copy_(dvh.unflatten(2, (hk, g)).sum(3))
        return dq, dk, dv


def _install(monkeypatch, fake: FakeFA4, *, fwd=True, bwd=True):
    """Put a fake ``flash_attn.cute`` in ``sys.modules`` and let the kernel run on this device."""
    interface = types.ModuleType("flash_attn.cute.interface")
    if fwd:
        interface._flash_attn_fwd = fake.fwd
    if bwd:
        interface._flash_attn_bwd = fake.bwd
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    for name, mod in (("flash_attn", pkg), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(flash4, "_device_arch", lambda device: 9)
    flash4._api.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_api():
    flash4._api.cache_clear()
    yield
    flash4._api.cache_clear()


@pytest.fixture
def fake(monkeypatch):
    if REAL:
        return None
    f = FakeFA4()
    _install(monkeypatch, f)
    return f


LOW = [torch.bfloat16, torch.float16]
DIM = 128 if REAL else 16
PAT_N = 1024 if REAL else 32
SEGS = [256, 512, 1024] if REAL else [8, 16, 32]


# ---------------------------------------------------------------------------
# Availability and supports()


@cpu_only
def test_absent_package_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ModuleNotFoundError
    q = torch.randn(1, 64, 4, 16, dtype=torch.bfloat16)
    reason = Flash4Kernel().supports(q, q)
    assert reason is not None and "not installed" in reason and 'pip install ".[flash4]"' in reason
    with pytest.raises(ValueError, match=r"kernel='flash4' cannot run.*pip install \"\.\[flash4\]\""):
        select_kernel("flash4", q, q)
    with pytest.raises(ValueError, match=r"pip install \"\.\[flash4\]\""):
        dilated_attention(q, q, q, [16, 64], [1, 2], kernel="flash4")
    assert select_kernel("auto", q, q).name != "flash4"


@cpu_only
def test_a_release_without_the_output_arguments_is_refused(monkeypatch):
    fake = FakeFA4()
    _install(monkeypatch, fake, bwd=False)
    q = torch.randn(1, 64, 4, 16, dtype=torch.bfloat16)
    reason = Flash4Kernel().supports(q, q)
    assert reason is not None and "_flash_attn_bwd" in reason and "4.0.0b36" in reason


@cpu_only
def test_needs_a_cuda_device(monkeypatch):
    _install(monkeypatch, FakeFA4())
    monkeypatch.setattr(flash4, "_device_arch", DEVICE_ARCH)  # the real check: the fake module alone
    q = torch.randn(1, 64, 4, 16, dtype=torch.bfloat16)
    assert "needs a CUDA device" in Flash4Kernel().supports(q, q)


@pytest.mark.parametrize("case", [
    ("fp32", torch.float32, 4, 4, 64, "fp16 or bf16"),
    ("gqa", torch.bfloat16, 6, 4, 64, "multiple of kv heads"),
    ("dim12", torch.bfloat16, 4, 4, 12, "head dim must be"),
    ("dim264", torch.float16, 4, 4, 264, "head dim must be"),
], ids=lambda c: c[0])
def test_supports_refuses_with_reason(fake, case):
    _, dtype, hq, hk, dim, words = case
    q = torch.randn(1, 64, hq, dim, device=DEVICE).to(dtype)
    k = torch.randn(1, 64, hk, dim, device=DEVICE).to(dtype)
    reason = Flash4Kernel().supports(q, k)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match="kernel='flash4' cannot run"):
        select_kernel("flash4", q, k)


def test_head_dim_rule_per_architecture():
    assert flash4._dim_reason(192, 9) is None and flash4._dim_reason(256, 9) is None
    assert flash4._dim_reason(192, 10) is not None and flash4._dim_reason(256, 10) is None
    assert flash4._dim_reason(40, 9) is None and flash4._dim_reason(44, 9) is not None


def test_supports_accepts_half_precision_gqa(fake):
    for dtype in LOW:
        q = torch.randn(1, 64, 8, 64, device=DEVICE, dtype=dtype)
        assert Flash4Kernel().supports(q, q[:, :, :2]) is None
    kern = select_kernel("flash4", q, q[:, :, :2])
    assert kern.name == "flash4" and kern.deterministic_backward and not kern.key_masks


def test_reads_in_place():
    x = torch.randn(2, 64, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    assert reads_in_place(x) and reads_in_place(x[:, :, 1:3]) and reads_in_place(x.transpose(1, 2))
    assert not reads_in_place(x[..., 1:17])  # address off by 2 bytes
    assert not reads_in_place(x[..., ::2])  # head dim not unit-stride
    assert not reads_in_place(torch.randn(4, 64, 3, 12, dtype=torch.bfloat16)[..., :8])  # head stride 24 bytes
    assert reads_in_place(x[:1].expand(3, -1, -1, -1))  # stride 0: FA4 broadcasts it


# ---------------------------------------------------------------------------
# Blocks


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout,heads", [("contiguous", (4, 2)), ("transposed", (6, 2)), ("head_slice", (2, 2))],
                         ids=["contiguous-H4-2", "transposed-H6-2", "head_slice-H2-2"])
def test_block_forward_backward(fake, dtype, causal, layout, heads):
    m, mk = (256, 256) if causal else (256, 384)
    if not REAL:
        m, mk = (24, 24) if causal else (24, 40)
    seed = seeded("flash4-block", dtype, causal, heads, layout)
    b, s = 2, 2
    q = rand5((b, s, m, heads[0], DIM), dtype, layout)
    k = rand5((b, s, mk, heads[1], DIM), dtype, layout)
    v = rand5((b, s, mk, heads[1], DIM), dtype, layout)
    dout = rand5((b, s, m, heads[0], DIM), dtype, layout)
    _check_block(Flash4Kernel(), q, k, v, dout, causal, DIM**-0.5, seed)


@cpu_only
def test_dilated_views_are_read_in_place_in_one_call(fake):
    """A LongNet chunk ``x.view(B, S, M, r, H, D)[:, :, :, o, h0:h1]`` goes to FA4 as one ``(B * S, M, h, D)``
    view of the caller's storage, forward and backward."""
    torch.manual_seed(seeded("flash4-views"))
    b, n, h, d, w, r = 2, 64, 8, 16, 16, 4
    x = [torch.randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(3)]
    views = [t.view(b, n // w, w // r, r, h, d)[:, :, :, 1, 2:4] for t in x]
    out, lse = Flash4Kernel().forward(*views, causal=True, scale=0.25)
    assert out.shape == views[0].shape and lse.shape == views[0].shape[:4] and lse.dtype == torch.float32
    dout = torch.randn(out.shape, dtype=out.dtype)
    Flash4Kernel().backward(*views, out, lse, dout, causal=True, scale=0.25)
    assert [c["kind"] for c in fake.calls] == ["fwd", "bwd"]
    for call in fake.calls:
        assert call["shapes"] == ((b * n // w, w // r, 2, d), (b * n // w, w // r, 2, d))
        assert call["storages"] == tuple(t.untyped_storage().data_ptr() for t in x), "an operand was copied"


@cpu_only
def test_batch_rows_that_do_not_merge_run_one_call_each(fake):
    """A ``(B, H, N, D)`` buffer seen as ``(B, N, H, D)``: ``B`` and ``S`` share no stride, so one call per batch row,
    still without copies."""
    seed = seeded("flash4-batches")
    b, s, m, h, d = 3, 2, 8, 4, 16
    q, k, v, dout = (rand5((b, s, m, h, d), torch.bfloat16, "transposed") for _ in range(4))
    _check_block(Flash4Kernel(), q, k, v, dout, False, d**-0.5, seed)
    kinds = [c["kind"] for c in fake.calls]
    assert kinds == ["fwd"] * b + ["bwd"] * b
    assert all(c["shapes"][0] == (s, m, h, d) for c in fake.calls)
    assert all(c["storages"][0] == q.untyped_storage().data_ptr() for c in fake.calls), "q was copied"


@cpu_only
@pytest.mark.parametrize("layout", ["strided_head_dim", "unbind_last", "permuted", "zero_stride", "storage_offset"])
def test_layouts_fa4_would_copy_are_copied_here(fake, layout):
    """Operands FA4 cannot read in place reach it as compact copies (the fake asserts it never sees one it
    would copy); the others still go in place."""
    seed = seeded("flash4-layout", layout)
    b, s, m, h, d = 2, 2, 16, 4, 16
    q, k, v, dout = (rand5((b, s, m, h, d), torch.float16, layout) for _ in range(4))
    _check_block(Flash4Kernel(), q, k, v, dout, True, d**-0.5, seed)
    copied = not reads_in_place(q.flatten(0, 1) if q.stride(0) == s * q.stride(1) else q[0])
    fwd = fake.calls[0]
    assert (fwd["storages"][0] != q.untyped_storage().data_ptr()) == copied, layout


def test_lse_is_natural_log_in_the_seam_layout(fake):
    """FA4's ``(B', h, M)`` LSE comes back as a ``(B, S, M, h)`` view, natural log: exp(lse) is the row sum."""
    torch.manual_seed(seeded("flash4-lse"))
    q, k, v = (torch.randn(1, 2, 64, 4, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    _, lse = Flash4Kernel().forward(q, k, v, causal=False, scale=0.125)
    s = torch.einsum("bsmhd,bsnhd->bsmhn", q.double(), k.double()) * 0.125
    want = torch.logsumexp(s, -1)
    assert lse.shape == (1, 2, 64, 4)
    assert torch.allclose(lse.double(), want, atol=2e-2, rtol=0), (lse.double() - want).abs().max()


def test_rows_no_pattern_covers_get_no_gradient(fake):
    """A final ``lse`` of ``-inf`` (no pattern covers the row) gives that row no gradient; FA4 alone would read it
    as 0 and give it one."""
    torch.manual_seed(seeded("flash4-empty-row"))
    b, s, m, h, d = 1, 1, 64, 2, 64
    q, k, v, dout = (torch.randn(b, s, m, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    out, lse = Flash4Kernel().forward(q, k, v, causal=False, scale=0.125)
    out, lse = out.clone(), lse.clone()
    out[:, :, 5] = 0.0
    lse[:, :, 5] = float("-inf")
    dq, dk, dv = Flash4Kernel().backward(q, k, v, out, lse, dout, causal=False, scale=0.125)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :, 5] == 0).all() and (dq[:, :, 4] != 0).any()
    only = torch.zeros_like(dout)  # row 5's dout alone: no dk/dv either
    only[:, :, 5] = dout[:, :, 5]
    _, dk, dv = Flash4Kernel().backward(q, k, v, out, lse, only, causal=False, scale=0.125)
    assert (dk == 0).all() and (dv == 0).all()


def test_errors_are_named(fake):
    q = torch.randn(1, 1, 32, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 48, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="causal block needs equal query and key rows"):
        Flash4Kernel().forward(q, k, k, causal=True, scale=0.1)
    with pytest.raises(ValueError, match="no key mask"):
        Flash4Kernel().forward(q, k, k, causal=False, scale=0.1, key_mask=torch.zeros(1, 1, 48, dtype=torch.bool))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        Flash4Kernel().forward(q.float(), k.float(), k.float(), causal=False, scale=0.1)


# ---------------------------------------------------------------------------
# Patterns (ChunkLoop over the block kernel) and the public API


PATTERN_CASES = [
    # mode, heads, kv heads, layout, causal, dtype
    ("longnet", 4, 2, "contiguous", False, torch.bfloat16),
    ("longnet", 6, 2, "transposed", True, torch.float16),
    ("grouped", 4, 2, "head_slice", True, torch.bfloat16),
    ("longnet", 8, 8, "storage_offset", True, torch.bfloat16),
    ("longnet", 4, 1, "strided_head_dim", False, torch.float16),
]


@pytest.mark.parametrize("case", PATTERN_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-{c[3]}-{c[4]}-{c[5]}")
def test_pattern_local(fake, case):
    mode, heads, kv_heads, layout, causal, dtype = case
    seed = seeded("flash4-pattern", case)
    check_pattern_local(ChunkLoop(Flash4Kernel()), mode, heads, kv_heads, layout, causal, dtype, seed, DIM, PAT_N,
                        segs=SEGS)


@pytest.mark.parametrize("causal", [False, True])
def test_pattern_packed_ring_block(fake, causal):
    seed = seeded("flash4-ring", causal)
    check_packed_ring_block(ChunkLoop(Flash4Kernel()), "longnet", 8 if REAL else 4, 2, causal, torch.bfloat16, seed,
                            dim=DIM, n=PAT_N)


API_CASES = [
    # name, segments, rates, heads, kv heads, causal, layout
    ("dense", None, (1,), 4, 4, False, "contiguous"),
    ("dense-causal-gqa", None, (1,), 4, 2, True, "contiguous"),
    ("longnet", "quarters", (1, 2, 4), 8, 4, False, "contiguous"),
    ("longnet-causal", "quarters", (1, 2, 4), 8, 8, True, "head_slice"),
    ("longnet-causal-gqa-transposed", "quarters", (1, 2, 4), 8, 2, True, "transposed"),
]


@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", LOW if REAL else [torch.bfloat16], ids=str)
def test_public_api_matches_oracle(fake, case, dtype):
    """``dilated_attention(..., kernel="flash4")`` forward and backward against the fp64 dense oracle, judged by the
    tolerance rule (plain torch in the same precision)."""
    from dilated_attention.testing.compare import as_layout

    name, segs, rates, heads, kv_heads, causal, layout = case
    n, dim = (1024, 128) if REAL else (64, 16)
    segs = [n] if segs is None else [n // 4, n // 2, n]
    seed = seeded("flash4-api", case, dtype)
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, n, hh, dim, generator=g, dtype=torch.float64).to(DEVICE) for hh in (heads, kv_heads, kv_heads)]
    dout = torch.randn(1, n, heads, dim, generator=g, dtype=torch.float64).to(DEVICE)
    kw = dict(causal=causal)

    def run(fn, xs, do, **extra):
        xs = [x.detach().requires_grad_(True) for x in xs]
        out = fn(*xs, segs, list(rates[:len(segs)]), **kw, **extra)
        out.backward(do)
        return [out.detach(), *(x.grad for x in xs)]

    oracle = run(dense_dilated_attention, base, dout)
    plain = run(dense_dilated_attention, [x.to(dtype) for x in base], dout.to(dtype))
    got = run(dilated_attention, [as_layout(x.to(dtype), layout) for x in base], dout.to(dtype), kernel="flash4")
    for what, gt, w, p in zip(("out", "dq", "dk", "dv"), got, oracle, plain):
        assert gt.dtype == dtype
        assert_within_rule(what, gt, w, p, context=f"{name} {dtype} (seed {seed})")
    if not REAL:
        assert {c["kind"] for c in fake.calls} == {"fwd", "bwd"}


# ---------------------------------------------------------------------------
# GPU only: determinism and allocations


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_bitwise_reproducible(causal):
    torch.manual_seed(seeded("flash4-det", causal))
    n, heads, kv_heads, dim = 8192, 8, 2, 128
    x = [torch.randn(1, n, hh, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
         for hh in (heads, kv_heads, kv_heads)]
    dout = torch.randn(1, n, heads, dim, device=DEVICE, dtype=torch.bfloat16)

    def grads():
        for t in x:
            t.grad = None
        dilated_attention(*x, [2048, 4096, 8192], [1, 2, 4], causal=causal, kernel="flash4").backward(dout)
        return [t.grad.clone() for t in x]

    first = grads()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


@gpu
@pytest.mark.parametrize("layout", ["dense", "dilated"])
def test_forward_allocates_only_out_and_lse(layout):
    torch.manual_seed(seeded("flash4-alloc", layout))
    b, n, h, d = 1, 16384, 8, 128
    x = [torch.randn(b, n, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3)]
    w, r, o = (n, 1, 0) if layout == "dense" else (4096, 4, 1)
    views = [t.view(b, n // w, w // r, r, h, d)[:, :, :, o, 2:6] for t in x]
    kern = Flash4Kernel()
    kern.forward(*views, causal=True, scale=d**-0.5)  # compiles and warms up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = kern.forward(*views, causal=True, scale=d**-0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    expected = out.numel() * out.element_size() + lse.numel() * 4
    copy = views[0].numel() * 2  # what one copied operand would add
    assert torch.cuda.memory_allocated() - before == _rounded(out) + _rounded(lse)
    assert peak < expected + copy // 4, (peak, expected)


def _rounded(t: torch.Tensor) -> int:
    """Bytes the caching allocator takes for ``t`` (blocks of 512 bytes)."""
    size = t.numel() * t.element_size()
    return -(-size // 512) * 512
