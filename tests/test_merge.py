import math

import torch

import functools

from dilated_attention.merge import merge_two

NEG, POS = float("-inf"), float("inf")


def _partial(rows, d=4, dtype=torch.float64):
    return torch.randn(rows, d, dtype=dtype), torch.randn(rows, dtype=dtype)


def test_merge_equals_softmax_over_concatenated_keys():
    torch.manual_seed(0)
    q = torch.randn(5, 8, dtype=torch.float64)
    keys = [torch.randn(n, 8, dtype=torch.float64) for n in (3, 7, 2)]
    vals = [torch.randn(n, 4, dtype=torch.float64) for n in (3, 7, 2)]
    outs, lses = [], []
    for k, v in zip(keys, vals):
        s = q @ k.T
        outs.append(torch.softmax(s, -1) @ v)
        lses.append(torch.logsumexp(s, -1))
    out, lse = functools.reduce(lambda a, b: merge_two(*a, *b), zip(outs, lses))
    s = q @ torch.cat(keys).T
    torch.testing.assert_close(out, torch.softmax(s, -1) @ torch.cat(vals), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)


def test_empty_rows_never_nan():
    out_a, lse_a = _partial(4)
    out_b, lse_b = _partial(4)
    lse_a[0] = NEG  # empty in a only: b's row
    lse_a[1] = lse_b[1] = NEG  # empty in both: stays empty
    lse_b[2] = NEG  # empty in b only: a's row
    out_b[2] = float("nan")  # whatever an empty row holds must not leak
    out_a[0] = float("nan")
    out, lse = merge_two(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0], out_b[0])
    assert lse[1] == NEG and out[1].eq(0).all()
    torch.testing.assert_close(out[2], out_a[2])
    torch.testing.assert_close(lse[2], lse_a[2])
    w = torch.softmax(torch.stack([lse_a[3], lse_b[3]]), 0)
    torch.testing.assert_close(out[3], w[0] * out_a[3] + w[1] * out_b[3])


def test_merge_is_fp32_for_low_precision_and_grads_are_finite():
    out_a, lse_a = _partial(3, dtype=torch.float64)
    out_b, lse_b = _partial(3, dtype=torch.float64)
    out_a, out_b = out_a.bfloat16().requires_grad_(), out_b.bfloat16().requires_grad_()
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse_a[0] = lse_b[0] = NEG
    lse_a.requires_grad_(), lse_b.requires_grad_()
    out, lse = merge_two(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    (out.sum() + lse[1:].sum()).backward()
    for t in (out_a, out_b, lse_a, lse_b):
        assert torch.isfinite(t.grad).all()


def test_merge_weights_are_differentiated_exactly():
    out_a, lse_a = _partial(2)
    out_b, lse_b = _partial(2)
    leaves = [t.clone().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    assert torch.autograd.gradcheck(lambda *a: merge_two(*a)[0], leaves)
    assert math.isfinite(merge_two(*leaves)[1].sum().item())


# ---------------------------------------------------------------------------
# fresh=True, and the fused Triton merge (merge_kernel) against merge_two. Without CUDA the kernel runs in
# Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 before anything imports Triton).

import os  # noqa: E402

import pytest  # noqa: E402

from dilated_attention import merge as merge_mod  # noqa: E402
from dilated_attention.merge import (  # noqa: E402
    add_into_, add_into_triton_, add_reason, merge_into_, merge_into_triton_, merge_pattern_, triton_reason,
)
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.testing.compare import as_layout  # noqa: E402
from dilated_attention.views import region_views  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_skip = pytest.mark.skipif(merge_mod.triton is None or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                           reason="needs Triton and CUDA or TRITON_INTERPRET=1")
_nan_warning = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (interpreter: NaN rows)


def needs_kernel(fn):
    return _skip(_nan_warning(fn))
# A few fp32 ulps: the interpreter's numpy exp/log vs torch's; a GPU's approximate exp/log/div add a few more.
TOL = dict(rtol=1e-5, atol=1e-5) if CUDA else dict(rtol=1e-6, atol=1e-6)


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind a view, flat: a write outside the view shows up there."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def _specials_(out, lse, part_out, part_lse, gen):
    """Special rows, as where(): empty on one side (its out NaN garbage) or both, NaN and +inf lse, NaN out."""
    cat = torch.randint(0, 24, lse.shape, generator=gen).to(lse.device)
    nan = float("nan")

    def put(t, rows, val):
        t.copy_(torch.where(rows.unsqueeze(-1) if t.dim() > rows.dim() else rows, val, t))

    put(lse, cat == 0, NEG)  # running empty, garbage out: b's row
    put(out, cat == 0, nan)
    put(part_lse, cat == 1, NEG)  # partial empty, garbage out: a's row
    put(part_out, cat == 1, nan)
    put(lse, cat == 2, NEG)  # both empty: stays (0, -inf)
    put(part_lse, cat == 2, NEG)
    put(part_out, cat == 2, nan)
    put(part_lse, cat == 3, nan)  # NaN lse: NaN
    put(lse, cat == 4, POS)  # +inf lse: NaN out, +inf lse
    put(part_out, cat == 5, nan)  # NaN in a live row: NaN
    put(lse, cat == 6, NEG)  # +inf partial into an empty row
    put(part_lse, cat == 6, POS)
    put(lse, cat == 7, 30.0)  # one side's weight underflows to 0 next to the other's
    put(part_lse, cat == 7, -80.0)


def _oracle_(out, lse, part_out, part_lse, fresh=False):
    """merge_two, into a cleared result (0, -inf) when ``fresh``."""
    if fresh:
        out.zero_()
        lse.fill_(NEG)
    merged, total = merge_two(out, lse, part_out, part_lse)
    out.copy_(merged)
    lse.copy_(total)


def _assert_same(got, want):
    for name, f in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(f(got), f(want)), f"{name} pattern differs"
    torch.testing.assert_close(got, want, equal_nan=True, **TOL)


def _check(build, seed, fresh=False, specials=True):
    """``build(gen) -> [(out, lse, part_out, part_lse), ...]`` on ``DEVICE``, called twice with one seed:
    the kernel merges one copy, merge_two the other; their whole storages must agree."""
    runs = []
    for merge in (merge_into_triton_, _oracle_):
        gen = torch.Generator().manual_seed(seed)
        cases = build(gen)
        if specials:
            for case in cases:
                _specials_(*case, gen)
        for case in cases:
            merge(*case, fresh=fresh)
        runs.append(cases)
    for got, want in zip(*runs):
        for g, w in zip(got[:2], want[:2]):
            _assert_same(_storage(g), _storage(w))


def _layout_gen(gen):
    """A generator on ``DEVICE`` (what ``as_layout`` draws its padding with), seeded from the CPU one."""
    return torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))


def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(DEVICE, dtype)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, segs, rates, mode, layout, dtype", [
    (8, 8, [32], [2], "longnet", "contiguous", torch.float32),  # one whole-pattern region (affine heads)
    (8, 2, [32], [4], "longnet", "contiguous", torch.bfloat16),
    (6, 2, [32], [4], "longnet", "contiguous", torch.float16),  # chunk by chunk
    (7, 7, [16, 32], [1, 2], "grouped", "contiguous", torch.float32),
    (8, 8, [32], [4], "longnet", "transposed", torch.bfloat16),  # non-contiguous full: chunk by chunk
    (5, 5, [32], [4], "longnet", "strided_head_dim", torch.float32),
])
@pytest.mark.parametrize("fresh", [False, True])
def test_kernel_merges_region_views_like_merge_two(heads, kv_heads, segs, rates, mode, layout, dtype, fresh):
    plan = plan_patterns(segs, rates, seq_len=64, local_len=64, num_heads=heads, num_kv_heads=kv_heads,
                         mode=mode)[-1]
    r, dim = plan.dilation, 16

    def build(gen):
        out = as_layout(_rand(gen, 2, 64, heads, dim), layout, generator=_layout_gen(gen))
        lse = as_layout(_rand(gen, 2, 64, heads, 1), layout, generator=_layout_gen(gen)).squeeze(-1)
        part_out, part_lse = _rand(gen, 2, 64 // r, heads, dim, dtype=dtype), _rand(gen, 2, 64 // r, heads)
        whole = out.is_contiguous() and lse.is_contiguous()
        pairs = zip(region_views(out, part_out, plan, whole), region_views(lse, part_lse, plan, whole))
        cases = [(o, l_, po, pl) for (o, po), (l_, pl) in pairs]
        assert all(c[0].dim() == 6 for c in cases)
        return cases

    _check(build, seed=heads * 100 + r, fresh=fresh)


@needs_kernel
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head_slice", "storage_offset",
                                    "strided_head_dim", "unbind_last", "permuted", "zero_stride"])
@pytest.mark.parametrize("dim", [8, 24])
def test_kernel_takes_any_strides(layout, dim):
    """(B, N, H, D) running result and partial both in ``layout`` (D stride 2 or 3, permuted D, storage
    offsets); a zero-stride running result is refused (``test_kernel_refuses...``), so only the partial is."""
    def build(gen):
        run = "contiguous" if layout == "zero_stride" else layout
        out = as_layout(_rand(gen, 2, 12, 3, dim), run, generator=_layout_gen(gen))
        lse = as_layout(_rand(gen, 2, 12, 3, 1), run, generator=_layout_gen(gen)).squeeze(-1)
        part_out = as_layout(_rand(gen, 2, 12, 3, dim, dtype=torch.bfloat16), layout, generator=_layout_gen(gen))
        part_lse = as_layout(_rand(gen, 2, 12, 3, 1), layout, generator=_layout_gen(gen)).squeeze(-1)
        return [(out, lse, part_out, part_lse)]

    _check(build, seed=dim + len(layout), specials=layout != "zero_stride")  # (specials write the parts)


@needs_kernel
@pytest.mark.parametrize("shape", [(40,), (3, 33), (2, 3, 1, 5, 160), (1, 3, 2, 2, 4, 16)])
@pytest.mark.parametrize("fresh", [False, True])
def test_kernel_any_rank(shape, fresh):
    """Ranks 1 to 6, size-1 dims, D not a power of two, and D = 160 (two column blocks of 128)."""
    def build(gen):
        tail = shape[:-1]
        return [(_rand(gen, *shape), _rand(gen, *tail), _rand(gen, *shape, dtype=torch.float16), _rand(gen, *tail))]

    _check(build, seed=len(shape), fresh=fresh, specials=len(shape) > 1)


@needs_kernel
def test_kernel_int64_indexing(monkeypatch):
    """The int64 index path (taken for huge tensors) on a small one."""
    monkeypatch.setattr(merge_mod, "INT32_LIMIT", 0)

    def build(gen):
        out = as_layout(_rand(gen, 2, 16, 3, 8), "transposed", generator=_layout_gen(gen))
        return [(out, _rand(gen, 2, 16, 3), _rand(gen, 2, 16, 3, 8), _rand(gen, 2, 16, 3))]

    _check(build, seed=7)


@needs_kernel
def test_kernel_is_deterministic_and_reads_nothing_when_fresh():
    gen = torch.Generator().manual_seed(3)
    part = (_rand(gen, 4, 50, 16, dtype=torch.bfloat16), _rand(gen, 4, 50))
    running = (_rand(gen, 4, 50, 16), _rand(gen, 4, 50))
    results = []
    for start in (running, (torch.full_like(running[0], float("nan")), torch.full_like(running[1], POS))):
        out, lse = (t.clone() for t in running)
        merge_into_triton_(out, lse, *part)
        fresh_out, fresh_lse = (t.clone() for t in start)  # garbage: never read
        merge_into_triton_(fresh_out, fresh_lse, *part, fresh=True)
        results.append((out, lse, fresh_out, fresh_lse))
    for a, b in zip(*results):
        assert torch.equal(a, b)  # bit for bit (no NaN here)


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    gen = torch.Generator().manual_seed(4)
    out, lse, part_out, part_lse = _rand(gen, 3, 5, 8), _rand(gen, 3, 5), _rand(gen, 3, 5, 8), _rand(gen, 3, 5)
    assert triton_reason(out, lse, part_out, part_lse) is None
    bad = {
        "fp64": (out.double(), lse.double(), part_out.double(), part_lse.double()),
        "overlap": (out[:1].expand(3, 5, 8), lse, part_out, part_lse),
        "shapes": (out, lse, part_out[:, :4], part_lse[:, :4]),
        "aliasing": (out, lse, out[:, :, :8], part_lse),
        "rank 7": tuple(t.reshape(3, 5, 1, 1, 1, 1, *t.shape[2:]) for t in (out, lse, part_out, part_lse)),
    }
    for name, args in bad.items():
        assert triton_reason(*args) is not None, name
        with pytest.raises(ValueError):
            merge_into_triton_(*args)


@needs_kernel
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head_slice", "storage_offset",
                                    "strided_head_dim", "unbind_last", "permuted", "zero_stride"])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fresh", [False, True])
def test_add_kernel_equals_torch_bit_for_bit(layout, src_dtype, fresh):
    """``add_into_triton_``: ``dst += src`` (``dst = src`` fresh) through any strides (5D gradient views of a
    strided accumulator, as the cuDNN kernel adds them), bit for bit what torch's ``add_``/``copy_`` give;
    the rest of the destination's storage is untouched, and a fresh destination is never read (NaN)."""
    gen = torch.Generator().manual_seed(len(layout) * 7 + int(fresh))
    run = "contiguous" if layout == "zero_stride" else layout  # (a zero-stride destination is refused)
    dst = as_layout(_rand(gen, 2, 24, 4, 40), run, generator=_layout_gen(gen))
    src = as_layout(_rand(gen, 2, 24, 4, 40, dtype=src_dtype), layout, generator=_layout_gen(gen))

    def view(t):  # (B, S, h, M, D), as the cuDNN kernel's gradient targets
        return t.unflatten(1, (3, 8)).transpose(2, 3)

    if fresh:
        dst.fill_(float("nan"))
    want = _storage(dst).clone()
    want_view = want.as_strided(dst.shape, dst.stride(), dst.storage_offset())
    (view(want_view).copy_ if fresh else view(want_view).add_)(view(src))
    add_into_triton_(view(dst), view(src), fresh=fresh)
    assert torch.equal(_storage(dst).nan_to_num(7.0), want.nan_to_num(7.0))
    assert not dst.isnan().any()


@needs_kernel
def test_add_kernel_refuses_what_it_cannot_take():
    gen = torch.Generator().manual_seed(5)
    dst, src = _rand(gen, 3, 5, 8), _rand(gen, 3, 5, 8, dtype=torch.bfloat16)
    assert add_reason(dst, src) is None
    bad = {
        "fp64 destination": (dst.double(), src),
        "int source": (dst, src.to(torch.int32)),
        "overlap": (dst[:1].expand(3, 5, 8), src),
        "shapes": (dst, src[:, :4]),
        "aliasing": (dst, dst.view_as(dst)),
        "rank 7": (dst.reshape(3, 5, 1, 1, 1, 1, 8), src.reshape(3, 5, 1, 1, 1, 1, 8)),
    }
    for name, (d, s) in bad.items():
        assert add_reason(d, s) is not None, name
        with pytest.raises(ValueError, match="add kernel cannot run"):
            add_into_triton_(d, s)
    for name in ("fp64 destination", "int source", "rank 7"):  # the public function: torch's add_ instead
        d, s = bad[name]
        got, want = d.clone(), d.clone()
        add_into_(got, s)
        want.add_(s)
        assert torch.equal(got, want), name


def test_fresh_torch_path_equals_merging_into_a_cleared_result():
    """``fresh`` is merge_two against (0, -inf), not a copy: empty rows get out 0 whatever the partial holds,
    +inf/NaN lse rows get NaN out. merge_into_ on CPU is the torch path; also through merge_pattern_."""
    gen = torch.Generator().manual_seed(5)
    for dtype, part_dtype in ((torch.float32, torch.bfloat16), (torch.float64, torch.float64)):
        part_out = torch.randn(2, 16, 4, 8, generator=gen, dtype=torch.float64).to(part_dtype)
        part_lse = torch.randn(2, 16, 4, generator=gen, dtype=dtype)
        running = (torch.randn(2, 16, 4, 8, generator=gen, dtype=dtype), torch.randn(2, 16, 4, generator=gen,
                                                                                     dtype=dtype))
        _specials_(*running, part_out, part_lse, gen)
        got, want = [t.clone() for t in running], [t.clone() for t in running]
        merge_into_(*got, part_out, part_lse, fresh=True)
        _oracle_(*want, part_out, part_lse, fresh=True)
        for g, w in zip(got, want):
            assert g.dtype == dtype and torch.equal(g.isnan(), w.isnan())
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    # merge_pattern_ (a covering pattern), on the fp64 tensors of the last round
    (plan,) = plan_patterns([16], [1], seq_len=16, local_len=16, num_heads=4, num_kv_heads=4)
    got, want = [t.clone() for t in running], [t.clone() for t in running]
    merge_pattern_(*got, plan, part_out, part_lse, fresh=True)
    want[0].zero_(), want[1].fill_(NEG)
    merge_pattern_(*want, plan, part_out, part_lse)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------
# Partials whose lse are far apart: in fp32, exp() of a difference past ~88 overflows, so the merge must shift by
# the larger lse (and by 0 only where both rows are empty). Checked against float64 weights computed here.

GAPS = (100.0, 130.0, 160.0, 200.0)


def _far_apart(gen, rows=64, dim=8):
    """fp32 partials ``(out_a, lse_a, out_b, lse_b)``: per row, ``lse_b - lse_a`` is one of ``±GAPS`` around an
    lse of up to ±60, or one side is empty (``-inf``) next to a finite lse of ±100..200, or both are empty."""
    base = 60 * (2 * torch.rand(rows, generator=gen, dtype=torch.float64) - 1)
    gap = torch.tensor(GAPS, dtype=torch.float64)[torch.randint(0, len(GAPS), (rows,), generator=gen)]
    sign = torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0).double()
    lse_a, lse_b = base.clone(), base + sign * gap
    far = sign * (100 + 100 * torch.rand(rows, generator=gen, dtype=torch.float64))
    kind = torch.arange(rows) % 8  # 0: a empty, 1: b empty, 2: both, else a gap
    lse_a = torch.where(kind == 0, NEG, torch.where(kind == 1, far, lse_a))
    lse_b = torch.where(kind == 1, NEG, torch.where(kind == 0, far, lse_b))
    lse_a[kind == 2], lse_b[kind == 2] = NEG, NEG
    out_a, out_b = (torch.randn(rows, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    return out_a.float(), lse_a.float(), out_b.float(), lse_b.float()


def _merged_f64(out_a, lse_a, out_b, lse_b):
    """The merge in float64 from its definition: each side weighted by its share of ``exp(lse)``."""
    out_a, lse_a, out_b, lse_b = (t.double() for t in (out_a, lse_a, out_b, lse_b))
    lse = torch.logaddexp(lse_a, lse_b)
    live = torch.isfinite(lse)
    w_a = torch.where(live, torch.exp(lse_a - torch.where(live, lse, 0.0)), 0.0)
    w_b = torch.where(live, torch.exp(lse_b - torch.where(live, lse, 0.0)), 0.0)
    return w_a[:, None] * out_a + w_b[:, None] * out_b, lse


def _assert_far_apart_merged(out, lse, want_out, want_lse):
    assert torch.isfinite(out).all(), "NaN or inf in a merged out"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "empty rows differ"
    live = torch.isfinite(want_lse)
    assert torch.isfinite(lse[live]).all(), "a live row's merged lse is not finite"
    torch.testing.assert_close(lse[live].double(), want_lse[live], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    assert out[~live].eq(0).all()


def test_merge_two_of_far_apart_partials_is_finite_and_exact():
    """The torch path in fp32: gaps of 100-200 both ways, and empty rows next to an lse of ±100..200."""
    out_a, lse_a, out_b, lse_b = _far_apart(torch.Generator().manual_seed(41))
    out, lse = merge_two(out_a, lse_a, out_b, lse_b)
    assert out.dtype == lse.dtype == torch.float32
    _assert_far_apart_merged(out, lse, *_merged_f64(out_a, lse_a, out_b, lse_b))
    swapped, swapped_lse = merge_two(out_b, lse_b, out_a, lse_a)  # the larger lse on either side
    _assert_far_apart_merged(swapped, swapped_lse, *_merged_f64(out_a, lse_a, out_b, lse_b))


@needs_kernel
@pytest.mark.parametrize("swap", [False, True], ids=["running_first", "partial_first"])
def test_kernel_merge_of_far_apart_partials_is_finite_and_exact(swap):
    """``merge_kernel``'s weights (``merge._triton.merge_weights``) on the same partials, the running result
    either side of each gap."""
    out_a, lse_a, out_b, lse_b = _far_apart(torch.Generator().manual_seed(43))
    if swap:
        out_a, lse_a, out_b, lse_b = out_b, lse_b, out_a, lse_a
    want_out, want_lse = _merged_f64(out_a, lse_a, out_b, lse_b)
    out, lse = out_a.clone().to(DEVICE), lse_a.clone().to(DEVICE)
    merge_into_triton_(out, lse, out_b.to(DEVICE), lse_b.to(DEVICE))
    _assert_far_apart_merged(out.cpu(), lse.cpu(), want_out, want_lse)
