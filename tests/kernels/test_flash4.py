"""The flash-attn-4 pattern kernel (``kernels/flash4.py``) against the fp64 oracle.

On CPU, FA4's two entry points are replaced by a fake ``flash_attn.cute`` module
(``FakeFA4``): float64 plain torch with FA4's signatures and output layouts
(LSE ``(B', h, M)``, natural log, ``-inf`` for an empty row; backward reads a
``-inf`` LSE as 0, as FA4 does) that also *asserts* FA4's rules, so a layout
FA4 would copy silently fails here: every operand read in place (unit last
stride, 16-byte aligned address and strides), outputs of the declared shapes,
``deterministic=True``. That checks the kernel's calls (one per head-offset
group, zero copy), LSE conversion, GQA, causal, packed ring blocks and error
messages on any layout. With CUDA and flash-attn-4 on a Hopper or Blackwell GPU
the real kernels run in bf16/fp16.
"""

from __future__ import annotations

import sys
import types

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
    plans_for,
    rand,
    seeded,
)

from dilated_attention import dilated_attention
from dilated_attention.kernels import dispatch, flash4
from dilated_attention.kernels.dispatch import select_kernel
from dilated_attention.kernels.flash4 import Flash4Kernel, Flash4Ops
from dilated_attention.kernels.protocol import CallSpec
from dilated_attention.testing.compare import assert_within_rule


def _real_fa4() -> bool:
    if not CUDA:
        return False
    flash4._api.cache_clear()
    return flash4.unavailable_reason(DEVICE) is None


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


def _fa4_writable(x: torch.Tensor) -> bool:
    """FA4's output rule (``cute_dsl_utils.validate_output_layout``): aligned, and no zero stride, not even
    on a dimension of size 1."""
    return _fa4_aligned(x) and 0 not in x.stride()


class FakeFA4:
    """``_flash_attn_fwd`` / ``_flash_attn_bwd`` in float64 plain torch, asserting FA4's input rules."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.deterministic = True  # the backward the wrapper must ask for (flash4-nondet: FA4's default)

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

    def _record(self, kind, q, k, v, outputs, **kw):
        self.calls.append(dict(kind=kind, shapes=(tuple(q.shape), tuple(k.shape)),
                               storages=tuple(x.untyped_storage().data_ptr() for x in (q, k, v)),
                               written=tuple(x.untyped_storage().data_ptr() for x in outputs), **kw))

    @staticmethod
    def _check_used(seqused_q, seqused_k, q):
        """The wrapper passes the same lengths for queries and keys (a causal square stays aligned): ``(B',)``
        int32 on q's device, each in ``[1, M]``."""
        assert (seqused_q is None) == (seqused_k is None) and (seqused_q is None or seqused_q is seqused_k)
        if seqused_q is None:
            return None
        assert seqused_q.shape == (q.shape[0],) and seqused_q.dtype == torch.int32 and seqused_q.device == q.device
        used = seqused_q.tolist()
        assert all(1 <= u <= q.shape[1] for u in used), used
        return used

    def fwd(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
            softmax_scale=None, causal=False, window_size_left=None, window_size_right=None, pack_gqa=None,
            return_lse=False, out=None, lse=None):
        self._check_inputs(q, k, v)
        used = self._check_used(seqused_q, seqused_k, q)
        b, m, h, d = q.shape
        assert k.shape[0] == b and k.shape[3] == d and h % k.shape[2] == 0 and v.shape == k.shape
        assert softmax_scale is not None, "the wrapper passes its scale"
        assert out is not None and lse is not None, "the wrapper allocates out and lse"
        assert out.shape == q.shape and out.dtype == q.dtype and _fa4_writable(out), (out.shape, out.stride())
        assert lse.shape == (b, h, m) and lse.dtype == torch.float32 and lse.stride(-1) == 1, (lse.shape, lse.stride())
        self._record("fwd", q, k, v, (out,), causal=causal, used=used)

        def attend(q, k, v):
            s, g = self._scores(q, k, causal, softmax_scale)
            l64 = torch.logsumexp(s, -1)
            p = torch.exp(s - torch.where(torch.isneginf(l64), 0.0, l64)[..., None])
            return torch.einsum("bhmn,bnhd->bmhd", p, v.double().repeat_interleave(g, 2)), l64

        if used is None:
            o64, l64 = attend(q, k, v)
            out.copy_(o64)
            lse.copy_(l64)
        else:  # FA4 leaves the rows past ``used`` unwritten: NaN here, so a wrapper that reads them fails
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            for b, u in enumerate(used):
                out[b:b + 1, :u], lse[b:b + 1, :, :u] = attend(q[b:b + 1, :u], k[b:b + 1, :u], v[b:b + 1, :u])
        return out, lse, None, None, None

    def bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
            window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
            seqused_k=None, deterministic=False, dq=None, dk=None, dv=None):
        self._check_inputs(q, k, v, out, dout)
        used = self._check_used(seqused_q, seqused_k, q)
        assert deterministic is self.deterministic, f"the wrapper asks for deterministic={self.deterministic}"
        b, m, h, d = q.shape
        assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype
        assert lse.shape == (b, h, m) and lse.dtype == torch.float32 and lse.is_contiguous(), (lse.shape, lse.stride())
        for x, like in ((dq, q), (dk, k), (dv, v)):
            assert x is not None and x.shape == like.shape and x.dtype == like.dtype and _fa4_writable(x), x.stride()
        self._record("bwd", q, k, v, (dq, dk, dv), causal=causal, used=used)

        def grads(q, k, v, out, dout, lse):
            s, g = self._scores(q, k, causal, softmax_scale)
            lse_read = torch.where(torch.isneginf(lse), 0.0, lse.double())  # what FA4's preprocess does
            p = torch.exp(s - lse_read[..., None])
            do = dout.double()
            ve, ke = v.double().repeat_interleave(g, 2), k.double().repeat_interleave(g, 2)
            dvh = torch.einsum("bhmn,bmhd->bnhd", p, do)
            dp = torch.einsum("bmhd,bnhd->bhmn", do, ve)
            ds = p * (dp - (do * out.double()).sum(-1).transpose(1, 2)[..., None]) * softmax_scale
            dkh = torch.einsum("bhmn,bmhd->bnhd", ds, q.double())
            hk = k.shape[2]
            return (torch.einsum("bhmn,bnhd->bmhd", ds, ke), dkh.unflatten(2, (hk, g)).sum(3),
                    dvh.unflatten(2, (hk, g)).sum(3))

        if used is None:
            for t, x in zip((dq, dk, dv), grads(q, k, v, out, dout, lse)):
                t.copy_(x)
            return dq, dk, dv
        for t in (dq, dk, dv):  # rows past ``used``: unwritten (NaN here)
            t.fill_(float("nan"))
        for b, u in enumerate(used):
            rows = slice(b, b + 1), slice(0, u)
            for t, x in zip((dq, dk, dv), grads(q[rows], k[rows], v[rows], out[rows], dout[rows],
                                                 lse[b:b + 1, :, :u])):
                t[rows] = x
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


def test_nondeterministic_variant_is_named_and_never_deterministic():
    from dilated_attention.kernels.registry import build_kernel

    det, nondet = build_kernel("flash4"), build_kernel("flash4-nondet")
    assert (det.name, det.deterministic_backward, det.causal_block) == ("flash4", True, flash4.CAUSAL_BLOCK)
    assert (nondet.name, nondet.deterministic_backward, nondet.causal_block) == ("flash4-nondet", False, 0)


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
    _install(monkeypatch, FakeFA4(), bwd=False)
    q = torch.randn(1, 64, 4, 16, dtype=torch.bfloat16)
    reason = Flash4Kernel().supports(q, q)
    assert reason is not None and "_flash_attn_bwd" in reason and "4.0.0b36" in reason


@cpu_only
def test_needs_a_cuda_device(monkeypatch):
    _install(monkeypatch, FakeFA4())
    monkeypatch.setattr(flash4, "_device_arch", DEVICE_ARCH)  # the real check: the fake module alone
    q = torch.randn(1, 64, 4, 16, dtype=torch.bfloat16)
    assert "needs a CUDA device" in Flash4Kernel().supports(q, q)
    assert "needs a CUDA device" in flash4.unavailable_reason(q.device)


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


def test_supports_accepts_half_precision_gqa_and_padding_masks_only(fake):
    for dtype in LOW:
        q = torch.randn(1, 64, 8, 64, device=DEVICE, dtype=dtype)
        assert Flash4Kernel().supports(q, q[:, :, :2]) is None
    kern = select_kernel("flash4", q, q[:, :, :2])
    assert isinstance(kern, Flash4Kernel) and kern.deterministic_backward and not kern.key_masks and kern.padding_masks
    assert select_kernel("flash4", q, q[:, :, :2], masked=True, padding_only=True) is kern
    with pytest.raises(ValueError, match="kernel='flash4' cannot run.*takes no key_padding_mask.*'fused'"):
        select_kernel("flash4", q, q[:, :, :2], masked=True)
    assert select_kernel("auto", q, q, masked=True).key_masks  # a key_padding_mask runs on a kernel that takes masks


# ---------------------------------------------------------------------------
# Patterns


PATTERN_CASES = [
    # mode, heads, kv heads, layout, causal, dtype
    ("longnet", 4, 2, "contiguous", False, torch.bfloat16),
    ("longnet", 6, 2, "transposed", True, torch.float16),
    ("grouped", 4, 2, "head_slice", True, torch.bfloat16),
    ("longnet", 8, 8, "storage_offset", True, torch.bfloat16),
    ("longnet", 4, 1, "strided_head_dim", False, torch.float16),
    ("grouped", 6, 3, "contiguous", False, torch.float16),
]


@pytest.mark.parametrize("case", PATTERN_CASES, ids=lambda c: f"{c[0]}-H{c[1]}-{c[2]}-{c[3]}-{c[4]}-{c[5]}")
def test_pattern_local(fake, case):
    """Compact forward parts, backward added into fp32 accumulators and (where the pattern leaves them)
    compact backward parts, each against the fp64 oracle; heads and rows a pattern does not read untouched."""
    mode, heads, kv_heads, layout, causal, dtype = case
    seed = seeded("flash4-pattern", case)
    check_pattern_local(Flash4Kernel(), mode, heads, kv_heads, layout, causal, dtype, seed, DIM, PAT_N, segs=SEGS)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 8)])
def test_pattern_packed_ring_block(fake, causal, heads, kv_heads):
    """Ring steps on ``views.pack_kv`` halves, with a final ``lse`` of ``-inf`` on rows the block does not cover."""
    seed = seeded("flash4-ring", causal, heads, kv_heads)
    check_packed_ring_block(Flash4Kernel(), "longnet", heads * (2 if REAL else 1), kv_heads, causal, torch.bfloat16,
                            seed, dim=DIM, n=PAT_N)


@cpu_only
def test_one_call_per_head_offset_group_read_in_place(fake):
    """LongNet H=16, r=1..16: every segment of a pattern and every head chunk whose offset and heads step by
    constants go into the batch dim of one FA4 call, read in the caller's storage (forward and backward);
    a one-call pattern's output is FA4's own, a backward part is written by FA4 in place."""
    seeded("flash4-calls")
    heads, n, dim = 16, 512, 16
    kern = Flash4Kernel()
    plans = plans_for("longnet", heads, heads, n, n, [32, 64, 128, 256, 512], [1, 2, 4, 8, 16])
    q, k, v = (torch.randn(1, n, heads, dim, dtype=torch.bfloat16) for _ in range(3))
    storages = tuple(x.untyped_storage().data_ptr() for x in (q, k, v))
    expect_calls = {1: 1, 2: 2, 4: 4, 8: 2, 16: 1}  # r=8: 2 segments x 8 offsets -> 2 calls of 8 chunks
    for p in plans:
        fake.calls.clear()
        out, lse = kern.forward_pattern(q, k, v, p, CallSpec(True, 0.25))
        assert len(fake.calls) == expect_calls[p.dilation], (p.dilation, [c["shapes"] for c in fake.calls])
        assert all(c["storages"] == storages for c in fake.calls), "an input was copied"
        if expect_calls[p.dilation] == 1:  # FA4's result is the part: no copy
            assert out.untyped_storage().data_ptr() == fake.calls[0]["written"][0]
        else:  # FA4 wrote into the part
            assert all(c["written"][0] == out.untyped_storage().data_ptr() for c in fake.calls)
        o64, _ = REF_P.forward_pattern(d64(q), d64(k), d64(v), p, CallSpec(True, 0.25))
        plain, _ = LOWP_P.forward_pattern(q, k, v, p, CallSpec(True, 0.25))
        assert_within_rule(f"r={p.dilation} out", out, o64, plain)
        fin, dout = torch.randn(1, n, heads, dim, dtype=torch.bfloat16), torch.randn(1, n, heads, dim, dtype=torch.bfloat16)
        fake.calls.clear()
        grads = kern.backward_pattern_parts(q, k, v, p, CallSpec(True, 0.25),
                                            (fin, lse.new_zeros(1, n, heads) + 4.0, dout))
        assert len(fake.calls) == expect_calls[p.dilation]
        assert all(c["storages"] == storages for c in fake.calls), "an input was copied in the backward"
        parts = tuple(g.untyped_storage().data_ptr() for g in grads)
        assert all(c["written"] == parts for c in fake.calls), "a gradient part was copied, not written by FA4"


def test_rows_no_pattern_covers_get_no_gradient(fake):
    """A final ``lse`` of ``-inf`` (no pattern covers the row) gives that row no gradient: the kernel hands FA4 the
    row's lse as ``+inf`` (``Flash4Ops.lse_neginf``, applied as the lse is packed); FA4 would read ``-inf`` as 0 and
    give it one."""
    torch.manual_seed(seeded("flash4-empty-row"))
    b, h, m, d = 2, 2, 64, 64
    q, k, v, dout = (torch.randn(b, h, m, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    ops = Flash4Ops()
    out, lse = ops.forward(q, k, v, causal=False, scale=0.125)
    assert out.shape == q.shape and lse.shape == (b, h, m) and lse.dtype == torch.float32
    s = torch.einsum("bhmd,bhnd->bhmn", q.double(), k.double()) * 0.125
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=2e-2, rtol=0)  # natural log
    out, lse = out.clone(), lse.clone()
    out[:, :, 5] = 0.0
    lse[:, :, 5] = float("-inf")
    packed = lse.unsqueeze(-1).nan_to_num(neginf=ops.lse_neginf)
    dq, dk, dv = ops.backward(dout, q, k, v, out, packed.clone(), causal=False, scale=0.125)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :, 5] == 0).all() and (dq[:, :, 4] != 0).any()
    only = torch.zeros_like(dout)  # row 5's dout alone: no dk/dv either
    only[:, :, 5] = dout[:, :, 5]
    _, dk, dv = ops.backward(only, q, k, v, out, packed.clone(), causal=False, scale=0.125)
    assert (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_fresh_first_pattern_writes_what_merging_into_empty_gives(fake, causal):
    """``fresh=True`` on the first pattern (covering every row and head) ignores the running result and the
    accumulators, here NaN-filled, and gives bit for bit what merging/adding into (0, -inf)/zeros gives."""
    seed = seeded("flash4-fresh", causal)
    heads, kv_heads, n = 4, 2, PAT_N
    plans = plans_for("longnet", heads, kv_heads, n, n, SEGS)
    assert plans[0].covers_all(heads, kv_heads) and not plans[1].covers_all(heads, kv_heads)
    dtype = torch.bfloat16
    q, dout = rand((2, n, heads, DIM), dtype, "transposed"), rand((2, n, heads, DIM), dtype, "transposed")
    k, v = rand((2, n, kv_heads, DIM), dtype), rand((2, n, kv_heads, DIM), dtype)
    kern = Flash4Kernel()
    kw = dict(packed=False, causal=causal, scale=DIM**-0.5)
    out, lse = torch.zeros(q.shape, device=DEVICE), torch.full(q.shape[:3], float("-inf"), device=DEVICE)
    kern.forward_pattern_into(q, k, v, plans[0], CallSpec(**kw), (out, lse))
    out_f, lse_f = torch.full(q.shape, float("nan"), device=DEVICE), torch.full(q.shape[:3], float("nan"), device=DEVICE)
    kern.forward_pattern_into(q, k, v, plans[0], CallSpec(**kw), (out_f, lse_f), fresh=True)
    assert torch.equal(out_f, out) and torch.equal(lse_f, lse), f"fresh forward differs (seed {seed})"
    for p in plans[1:]:
        kern.forward_pattern_into(q, k, v, p, CallSpec(**kw), (out, lse))
    check_fresh_backward(kern, q, k, v, plans[:2], out.to(dtype), lse, dout, seed, **kw)


def test_errors_are_named(fake):
    q = torch.randn(1, 32, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    plan = plans_for("longnet", 2, 2, 32, 32, [16, 32], [1, 2])[1]
    with pytest.raises(ValueError, match="flash4 kernel cannot run.*fp16 or bf16"):
        Flash4Kernel().forward_pattern(q.float(), q.float(), q.float(), plan, CallSpec(False, 0.1))
    with pytest.raises(ValueError, match="do not tile"):
        Flash4Kernel().forward_pattern(q[:, :24], q[:, :24], q[:, :24], plan, CallSpec(False, 0.1))
    with pytest.raises(ValueError, match="lse has shape"):
        Flash4Kernel().backward_pattern(q, q, q, plan, CallSpec(False, 0.1), (q, q[..., 0, 0], q),
                                        (torch.zeros(q.shape),) * 3)


# ---------------------------------------------------------------------------
# The public API


API_CASES = [
    # name, segments, rates, heads, kv heads, causal, layout
    ("dense", None, (1,), 4, 4, False, "contiguous"),
    ("dense-causal-gqa", None, (1,), 4, 2, True, "contiguous"),
    ("longnet", "quarters", (1, 2, 4), 8, 4, False, "contiguous"),
    ("longnet-causal", "quarters", (1, 2, 4), 8, 8, True, "head_slice"),
    ("longnet-causal-gqa-transposed", "quarters", (1, 2, 4), 8, 2, True, "transposed"),
]


@pytest.mark.parametrize("kernel", ["flash4", "flash4-nondet"])
@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", LOW if REAL else [torch.bfloat16], ids=str)
def test_public_api_matches_oracle(fake, case, dtype, kernel):
    """``dilated_attention(..., kernel="flash4")`` forward and backward against the fp64 dense oracle, judged by the
    tolerance rule (plain torch in the same precision); ``flash4-nondet`` asks FA4 for its default backward."""
    name, segs, rates, heads, kv_heads, causal, layout = case
    n, dim = (1024, 128) if REAL else (64, 16)
    segs = [n] if segs is None else [n // 4, n // 2, n]
    seed = seeded("flash4-api", case, dtype, kernel)
    if fake is not None:
        fake.deterministic = kernel == "flash4"
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, n, hh, dim, generator=g, dtype=torch.float64).to(DEVICE) for hh in (heads, kv_heads, kv_heads)]
    dout = torch.randn(1, n, heads, dim, generator=g, dtype=torch.float64).to(DEVICE)
    check_api_against_oracle(base, dout, segs, list(rates[:len(segs)]), dtype, layout,
                             f"{name} {dtype} (seed {seed})", kernel=kernel, causal=causal)
    if not REAL:
        assert {c["kind"] for c in fake.calls} == {"fwd", "bwd"}


DOC_CASES = [
    # name, document lengths as fractions of n (None: one sequence of n - 24 rows, padded internally), heads,
    # kv heads, causal, layout
    ("documents", (0.3, 0.0, 0.45, 0.25), 8, 4, False, "contiguous"),
    ("documents-causal-gqa", (0.3, 0.45, 0.25), 8, 2, True, "transposed"),
    ("documents-causal-one-short", (0.2, 0.8), 4, 4, True, "contiguous"),
    ("padded-causal", None, 8, 8, True, "head_slice"),
    ("padded", None, 4, 2, False, "contiguous"),
    ("whole-documents-causal", (0.25, 0.25, 0.25, 0.25), 8, 4, True, "contiguous"),  # no padding: no mask
    ("whole-documents-apart", (0.25, 0.5, 0.25), 4, 2, False, "transposed"),  # equal ones apart: copied, no mask
]


@pytest.mark.parametrize("kernel", ["flash4", "auto"])
@pytest.mark.parametrize("case", DOC_CASES, ids=lambda c: c[0])
def test_documents_and_internal_padding_match_oracle(fake, case, kernel):
    """Packed documents (``cu_seqlens``) and internal padding run on FA4 with per-call lengths (``seqused_q`` =
    ``seqused_k``): out, dq, dk, dv against the fp64 oracle by the tolerance rule. FA4 leaves the padding rows
    unwritten (the stand-in fills them with NaN): nothing of them may reach the result. ``auto`` runs the
    same calls on its own choices (whole documents: its unmasked ones)."""
    name, fractions, heads, kv_heads, causal, layout = case
    n, dim = (1024, 128) if REAL else (64, 16)
    seed = seeded("flash4-docs", case)
    options: dict = dict(causal=causal)
    rows = n - 24 if fractions is None else n
    if fractions is not None:
        lengths = [round(f * n) for f in fractions[:-1]]
        offsets = [0, *torch.tensor([*lengths, n - sum(lengths)]).cumsum(0).tolist()]
        options["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, rows, hh, dim, generator=g, dtype=torch.float64).to(DEVICE) for hh in (heads, kv_heads, kv_heads)]
    dout = torch.randn(1, rows, heads, dim, generator=g, dtype=torch.float64).to(DEVICE)
    check_api_against_oracle(base, dout, [n // 4, n // 2, n], [1, 2, 4], torch.bfloat16, layout,
                             f"{name} {kernel} (seed {seed})", kernel=kernel, **options)
    if not REAL and kernel == "flash4":  # the padded calls went to FA4 with lengths, forward and backward
        padded = {c["kind"] for c in fake.calls if c["used"] is not None}
        assert padded == (set() if name.startswith("whole") else {"fwd", "bwd"})


def test_key_padding_mask_is_refused_and_auto_keeps_masks_on_a_kernel_taking_any(fake):
    """``kernel="flash4"`` with a ``key_padding_mask`` raises, naming the argument and the kernels that take it;
    ``auto`` runs every masked call, padding too, on a kernel that takes any mask (measured as fast as flash4
    through the API: ``bench_masks.py``)."""
    q = torch.randn(1, 64, 4, 16, device=DEVICE, dtype=torch.bfloat16)
    mask = torch.zeros(1, 64, dtype=torch.bool, device=DEVICE)
    mask[:, 50:] = True
    with pytest.raises(ValueError, match="kernel='flash4' cannot run.*key_padding_mask.*'fused'"):
        dilated_attention(q, q, q, [16, 64], [1, 2], kernel="flash4", key_padding_mask=mask)
    assert select_kernel("auto", q, q, masked=True).key_masks
    assert select_kernel("auto", q, q, masked=True, padding_only=True).key_masks
    with pytest.raises(ValueError, match="local patterns only"):
        plan = plans_for("longnet", 4, 4, 64, 64, [16, 64], [1, 2])[1]  # one segment of 64 rows, r = 2
        Flash4Kernel().forward_pattern(q, q[:, :32], q[:, :32], plan, CallSpec(False, 0.25, packed=True, key_mask=mask))


def test_cudnn_ops_take_no_mask():
    """The same view logic on ops without lengths (cuDNN's) refuses a key mask by name, before any launch."""
    from dilated_attention.kernels.cudnn import CudnnKernel

    kern = CudnnKernel()
    assert not kern.padding_masks and not kern.key_masks
    q = torch.randn(1, 64, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes no key mask.*'fused'"):
        kern._check_mask(torch.zeros(1, 64, dtype=torch.bool), q, False)
    assert kern._check_mask(None, q, False) is None


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
@pytest.mark.parametrize("rates", [(1,), (4,)], ids=["dense", "dilated"])
def test_forward_allocates_only_the_part(rates):
    """One pattern's forward: FA4 reads the dilated views in place and writes the compact part (and its lse);
    nothing else is allocated beyond FA4's own small scratch."""
    torch.manual_seed(seeded("flash4-alloc", rates))
    b, n, h, d = 1, 16384, 8, 128
    x = [torch.randn(b, n, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3)]
    plan = plans_for("longnet", h, h, n, n, [4096], list(rates))[0]
    kern = Flash4Kernel()
    kw = dict(packed=False, causal=True, scale=d**-0.5)
    kern.forward_pattern(*x, plan, CallSpec(**kw))  # compiles and warms up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = kern.forward_pattern(*x, plan, CallSpec(**kw))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    expected = out.numel() * out.element_size() + lse.numel() * 4
    copy = x[0].numel() * 2 // rates[0]  # what one copied operand would add
    assert peak < expected + copy // 4, (peak, expected)


@gpu
def test_dispatch_and_auto_name_flash4_only_where_it_runs():
    q = torch.randn(1, 256, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    assert isinstance(select_kernel("flash4", q, q), Flash4Kernel)
    assert {"flash4", "flash4-nondet"} <= set(dispatch.auto_implementations(q.device))
    nondet = select_kernel("flash4-nondet", q, q)
    assert nondet.name == "flash4-nondet" and not nondet.deterministic_backward and nondet.causal_block == 0
