"""Compact parts combined in one pass (``merge.combine_results``/``sum_grads``, ``combine_kernel``).

The kernel (Triton's interpreter on CPU, compiled on CUDA) against the torch path it replaces: the
patterns merged one by one into a running result with ``merge_pattern_`` (``merge_two``'s semantics)
and gradients added into an accumulator, computed in float64 from the same inputs. Parts come in
arbitrary strided layouts, with empty rows holding NaN garbage, uncovered heads (grouped mode) and
GQA kv heads; the strategy-level path (``ring.py``) is tested end to end by every library test.
"""

from __future__ import annotations

import os

import pytest
import torch

from dilated_attention import merge as merge_mod
from dilated_attention.kernels.protocol import CallSpec
from dilated_attention.merge import Part, combine_results, sum_grads
from dilated_attention.patterns import plan_patterns
from dilated_attention.testing.compare import as_layout
from dilated_attention.views import chunk_views, compact_view

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
KERNEL = merge_mod.triton is not None and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs Triton and CUDA or TRITON_INTERPRET=1")
NEG = float("-inf")
N, DIM = 32, 24


def _plans(heads, kv_heads, segs, rates, mode="longnet"):
    return plan_patterns(segs, rates, seq_len=N, local_len=N, num_heads=heads, num_kv_heads=kv_heads, mode=mode)


def _rand(gen, *shape, dtype=torch.float32, layout="contiguous"):
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(DEVICE, dtype)
    return as_layout(x, layout, generator=torch.Generator(device=DEVICE).manual_seed(int(gen.initial_seed()) + 1))


def test_head_offsets():
    """Each head's offset, -1 where no chunk covers it, None where a kv head reads two offsets."""
    longnet = _plans(8, 8, [32], [4])[0]
    assert longnet.head_offsets(8) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert longnet.head_offsets(8, kv=True) == (0, 0, 1, 1, 2, 2, 3, 3)
    grouped = _plans(4, 4, [16, 32], [1, 2], mode="grouped")[1]
    assert grouped.head_offsets(4) == (-1, -1, 1, 1)
    shared = _plans(8, 2, [32], [4])[0]  # 4 query heads per kv head, 2 offsets each
    assert shared.head_offsets(8) == (0, 0, 1, 1, 2, 2, 3, 3) and shared.head_offsets(2, kv=True) is None
    aligned = _plans(8, 4, [32], [2])[0]  # offsets change at kv-group boundaries
    assert aligned.head_offsets(4, kv=True) == (0, 0, 1, 1)


def _result_parts(gen, plans, heads, dtype, layout):
    """A part per plan: random out in ``dtype``, lse in fp32, a sixth of the rows empty (``-inf``) with NaN
    out, some rows with an lse far below the others (weight underflow)."""
    parts = []
    for p in plans:
        rows = N // p.dilation
        out = _rand(gen, 2, rows, heads, DIM, dtype=dtype, layout=layout)
        lse = 3 * _rand(gen, 2, rows, heads, 1, layout=layout).squeeze(-1)
        empty = torch.randint(0, 6, lse.shape, generator=gen).to(DEVICE) == 0
        lse.copy_(torch.where(empty, NEG, lse))
        out.copy_(torch.where(empty.unsqueeze(-1), float("nan"), out))
        low = torch.randint(0, 9, lse.shape, generator=gen).to(DEVICE) == 0
        lse.copy_(torch.where(low & ~empty, -90.0, lse))
        parts.append(Part(p, out, lse))
    return parts


def _f64(part: Part) -> Part:
    return Part(part.plan, part.out.double(), None if part.lse is None else part.lse.double(), part.kv)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, segs, rates, mode", [
    (4, 4, [8, 16, 32], [1, 2, 4], "longnet"),
    (6, 2, [16, 32], [2, 4], "longnet"),  # offsets that do not divide the heads evenly
    (5, 5, [8, 16, 32], [1, 2, 4], "grouped"),  # each pattern covers some heads: the rest stay empty
])
@pytest.mark.parametrize("dtype, layout", [(torch.bfloat16, "contiguous"), (torch.float16, "transposed"),
                                           (torch.float32, "strided_head_dim"), (torch.bfloat16, "storage_offset")])
@pytest.mark.parametrize("running", [False, True])
def test_combine_results_matches_merging_one_by_one(heads, kv_heads, segs, rates, mode, dtype, layout, running):
    gen = torch.Generator().manual_seed(hash((heads, tuple(rates), mode, str(dtype), layout, running)) % 2**31)
    plans = _plans(heads, kv_heads, segs, rates, mode)
    parts = _result_parts(gen, plans[1:] if running else plans, heads, dtype, layout)
    like = torch.empty(2, N, heads, DIM, dtype=dtype, device=DEVICE)
    run = None
    if running:  # what patterns merged in place left: some rows empty
        run_lse = 2 * _rand(gen, 2, N, heads, 1).squeeze(-1)
        run_lse[:, ::7] = NEG
        run_out = _rand(gen, 2, N, heads, DIM)
        run_out[:, ::7] = 0.0  # (an empty row of a running result is (0, -inf), as merging leaves it)
        run = (run_out, run_lse)
    assert merge_mod._combine_reason(run, parts, like) is None
    out, lse = combine_results(None if run is None else tuple(t.clone() for t in run), parts, like)
    want_out, want_lse = combine_results(None if run is None else tuple(t.double() for t in run),
                                         [_f64(p) for p in parts], like.double())
    assert out.dtype == dtype and out.shape == like.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "empty rows differ"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN garbage of empty rows leaked"
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~fin], torch.zeros_like(out[~fin])), "an empty row's out must be 0"
    # one rounding to the output dtype (the interpreter truncates, the GPU rounds to nearest)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}[dtype]
    torch.testing.assert_close(out.double(), want_out.to(dtype).double(), rtol=2 * ulp, atol=1e-6)


@needs_kernel
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (interpreter: NaN rows)
def test_combine_results_nan_and_inf_propagate_like_merge_two():
    """A NaN or ``+inf`` lse, and NaN in a live row's out, give NaN where ``merge_two`` does."""
    gen = torch.Generator().manual_seed(7)
    plans = _plans(4, 4, [8, 16], [1, 2])
    parts = _result_parts(gen, plans, 4, torch.float32, "contiguous")
    parts[0].lse[0, 3, 1] = float("nan")
    parts[0].lse[1, 5, 2] = float("inf")
    parts[1].out[0, 4, 0, 3] = float("nan")
    like = torch.empty(2, N, 4, DIM, device=DEVICE)
    out, lse = combine_results(None, parts, like)
    want_out, want_lse = combine_results(None, [_f64(p) for p in parts], like.double())
    assert torch.equal(torch.isnan(out), torch.isnan(want_out)) and torch.isnan(out).any()
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    assert torch.equal(torch.isposinf(lse), torch.isposinf(want_lse))


def _far_apart_lse(gen, shape):
    """An lse of up to ±40 plus, per element, one of 0, ±100, ±150, ±200, an eighth of it empty (``-inf``): two
    parts (or a part and the running result) then differ by 100 to 400 where fp32's ``exp`` of the difference
    overflows unless the combine shifts by the largest."""
    offsets = torch.tensor([0.0, 100.0, -100.0, 150.0, -150.0, 200.0, -200.0])
    lse = 40 * (2 * torch.rand(shape, generator=gen) - 1) + offsets[torch.randint(0, 7, shape, generator=gen)]
    return torch.where(torch.randint(0, 8, shape, generator=gen) == 0, NEG, lse).to(DEVICE)


@pytest.mark.parametrize("running", [False, True])
def test_combining_far_apart_parts_is_finite_and_exact(running):
    """Parts and a running result whose lse differ by 100-400 either way, and empty rows next to them: the
    combine kernel (``combine_lse_kernel``'s one log-sum-exp, where it runs) and the fp32 torch path (merging
    the parts one by one) are finite and match the float64 combine."""
    gen = torch.Generator().manual_seed(61 + running)
    heads = 4
    plans = _plans(heads, heads, [8, 16, 32], [1, 2, 4])
    parts = []
    for plan in plans[1:] if running else plans:
        lse = _far_apart_lse(gen, (2, N // plan.dilation, heads))
        out = _rand(gen, *lse.shape, DIM).masked_fill_(torch.isneginf(lse).unsqueeze(-1), float("nan"))  # (garbage)
        parts.append(Part(plan, out, lse))
    run = (_rand(gen, 2, N, heads, DIM), _far_apart_lse(gen, (2, N, heads))) if running else None
    if running:
        run[0].masked_fill_(torch.isneginf(run[1]).unsqueeze(-1), 0.0)  # (an empty running row is (0, -inf))
    like = torch.empty(2, N, heads, DIM, device=DEVICE)
    want_out, want_lse = combine_results(None if run is None else tuple(t.double() for t in run),
                                         [_f64(p) for p in parts], like.double())
    fin = torch.isfinite(want_lse)
    assert fin.any() and not fin.all()
    results = {}
    if KERNEL:
        assert merge_mod._combine_reason(run, parts, like) is None
        results["kernel"] = combine_results(None if run is None else tuple(t.clone() for t in run), parts, like)
    out, lse = (run[0].clone(), run[1].clone()) if running else (
        torch.zeros(like.shape, device=DEVICE), torch.full(like.shape[:3], NEG, device=DEVICE))
    for part in parts:  # the torch path of the combine: each part merged in turn (merge_two in fp32 off CUDA)
        merge_mod.merge_pattern_(out, lse, part.plan, part.out, part.lse)
    results["merged one by one"] = (out, lse)
    for name, (out, lse) in results.items():
        assert torch.isfinite(out).all(), f"{name}: NaN or inf in the out"
        assert torch.equal(torch.isneginf(lse), ~fin), f"{name}: empty rows differ"
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=1e-6, atol=1e-5, msg=name)
        torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6, msg=name)


@needs_kernel
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("running", [False, True])
def test_consume_writes_over_the_rate_one_part_bit_for_bit(weighted, running):
    """``consume=True``: the result is written over the rate-1 part (the same storage comes back, so the call
    holds one result-sized tensor less) and equals the combine into a new tensor bit for bit; a part in another
    dtype, a strided one or one sharing memory with another part is not reused."""
    gen = torch.Generator().manual_seed(5 + weighted + 2 * running)
    heads = 4
    plans = _plans(heads, heads, [8, 16, 32], [1, 2, 4])
    assert plans[0].dilation == 1
    like = torch.empty(2, N, heads, DIM, dtype=torch.bfloat16, device=DEVICE)
    parts = (_result_parts(gen, plans, heads, torch.bfloat16, "contiguous") if weighted
             else _grad_parts(gen, plans, heads, False, torch.bfloat16, "contiguous"))
    run = None
    if running:
        run = (_rand(gen, 2, N, heads, DIM), _rand(gen, 2, N, heads, 1).squeeze(-1)) if weighted else \
            _rand(gen, 2, N, heads, DIM)

    def combine(parts, consume):
        held = None if run is None else tuple(t.clone() for t in run) if weighted else run.clone()
        if weighted:
            return combine_results(held, parts, like, consume=consume)[0]
        return sum_grads(held, parts, like, consume=consume)

    want = combine([Part(p.plan, p.out.clone(), p.lse, p.kv) for p in parts], consume=False)
    assert want.data_ptr() != parts[0].out.data_ptr()
    kept = parts[0].out.clone()
    got = combine(parts, consume=True)
    assert got.data_ptr() == parts[0].out.data_ptr(), "the rate-1 part was not reused"
    assert not torch.equal(kept, got), "the part still holds its own values"
    assert torch.equal(got, want)
    assert merge_mod._reused(parts, like) is not None
    strided = Part(parts[0].plan, _rand(gen, 2, N, heads, DIM, dtype=torch.bfloat16, layout="transposed"))
    other_dtype = Part(parts[0].plan, parts[0].out.float())
    shared = [parts[0], Part(parts[1].plan, parts[0].out[:, ::2])]
    assert merge_mod._reused([strided, *parts[1:]], like) is None
    assert merge_mod._reused([other_dtype, *parts[1:]], like) is None
    assert merge_mod._reused(shared, like) is None


@needs_kernel
@pytest.mark.parametrize("weighted", [False, True])
def test_a_kept_plan_still_looks_at_each_calls_memory(weighted):
    """A combine's plan is kept per geometry (shapes, strides, dtypes, alignment); what the geometry does not fix is
    looked at on every call: a rate-1 part whose memory another part views is not written over (``consume``), and
    a result given in memory a part is read from takes the torch path. Each call of one geometry equals the
    combine of copies of its parts into new tensors."""
    gen = torch.Generator().manual_seed(17 + weighted)
    heads = 4
    plans = _plans(heads, heads, [8, 16, 32], [1, 2, 4])
    like = torch.empty(2, N, heads, DIM, dtype=torch.bfloat16, device=DEVICE)

    def make():
        return (_result_parts(gen, plans, heads, torch.bfloat16, "contiguous") if weighted
                else _grad_parts(gen, plans, heads, False, torch.bfloat16, "contiguous"))

    def combine(parts, into=None, consume=False):
        if weighted:
            return combine_results(None, parts, like, into=into, consume=consume)[0]
        return sum_grads(None, parts, like, into=None if into is None else into[0], consume=consume)

    def copied(parts):
        return [Part(p.plan, p.out.clone(), p.lse, p.kv) for p in parts]

    def result_like():
        return (torch.empty(like.shape, dtype=like.dtype, device=DEVICE),
                torch.empty(like.shape[:3], dtype=torch.float32, device=DEVICE))

    own = make()
    want = combine(copied(own))
    got = combine(own, consume=True)  # the plan is made here
    assert got.data_ptr() == own[0].out.data_ptr() and torch.equal(got, want)

    # the same geometry, the second part a view of the first one's memory: that memory must not be written over
    shared = make()
    flat = shared[0].out.view(-1)
    shared[1] = Part(shared[1].plan, flat[:shared[1].out.numel()].view(shared[1].out.shape), shared[1].lse)
    want = combine(copied(shared))
    got = combine(shared, consume=True)
    assert got.data_ptr() != shared[0].out.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # (the first part's empty rows: NaN)

    # a result given in new memory (the plan with a result), then in memory that holds the second part's rows
    given = make()
    assert torch.equal(combine(copied(given), into=result_like()), combine(copied(given)))
    buffer = torch.empty(like.numel(), dtype=like.dtype, device=DEVICE)
    second = given[1].out
    buffer[:second.numel()].copy_(second.reshape(-1))
    given[1] = Part(given[1].plan, buffer[:second.numel()].view(second.shape), given[1].lse)
    want = combine(copied(given))
    into = (buffer.view(like.shape), result_like()[1])
    got = combine(given, into=into)
    assert got.data_ptr() == buffer.data_ptr()
    # the torch path: the same sums, rounded to bf16 by torch (Triton's interpreter truncates) and, weighted,
    # merged pair by pair (the kernel in one pass): within one bf16 rounding, where a race would be far off
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7, equal_nan=True)


def _grad_parts(gen, plans, heads, kv, dtype, layout):
    return [Part(p, _rand(gen, 2, N // p.dilation, heads, DIM, dtype=dtype, layout=layout), kv=kv)
            for p in plans if p.head_offsets(heads, kv) is not None]


@needs_kernel
@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head_slice", "strided_head_dim"])
@pytest.mark.parametrize("running", [False, True])
def test_sum_grads_is_the_fp32_sum_bit_for_bit(kv, layout, running):
    """fp32 parts: the kernel's sum is bitwise the sequential fp32 sum (the accumulator, then each part in
    order); bf16 parts: one rounding of that sum (bitwise torch's cast on CUDA)."""
    gen = torch.Generator().manual_seed(11 + kv + 2 * running + len(layout))
    heads, kv_heads = 8, 4
    plans = _plans(heads, kv_heads, [8, 16, 32], [1, 2, 2])
    h = kv_heads if kv else heads
    for dtype in (torch.float32, torch.bfloat16):
        parts = _grad_parts(gen, plans, h, kv, dtype, layout)
        assert len(parts) == 3
        acc = _rand(gen, 2, N, h, DIM) if running else None
        like = torch.empty(2, N, h, DIM, dtype=dtype, device=DEVICE)
        got = sum_grads(None if acc is None else acc.clone(), parts, like)
        want = acc.clone() if running else torch.zeros(like.shape, device=DEVICE)
        for part in parts:  # the torch path's order: part by part, chunk by chunk
            for c in part.plan.chunks:
                a, b = (c.k0, c.k1) if kv else (c.h0, c.h1)
                chunk_views(want, part.plan, c, kv=kv).add_(compact_view(part.out, part.plan, a, b))
        if dtype == torch.float32 or CUDA:
            assert torch.equal(got, want.to(dtype)), f"{dtype}: not the sequential fp32 sum"
        else:  # the interpreter truncates fp32 -> bf16
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0)


def test_torch_path_without_the_kernel_is_the_same_function(monkeypatch):
    """Where the kernel cannot run (fp64 here) the torch path gives the combine's result."""
    gen = torch.Generator().manual_seed(3)
    plans = _plans(4, 4, [8, 16, 32], [1, 2, 4])
    parts = [_f64(p) for p in _result_parts(gen, plans, 4, torch.float32, "contiguous")]
    like = torch.empty(2, N, 4, DIM, dtype=torch.float64, device=DEVICE)
    assert merge_mod._combine_reason(None, parts, like) is not None
    out, lse = combine_results(None, parts, like)
    s = torch.zeros(like.shape, dtype=torch.float64, device=DEVICE)
    m = torch.full(like.shape[:3], NEG, dtype=torch.float64, device=DEVICE)
    for p in parts:
        merge_mod.merge_pattern_(s, m, p.plan, p.out, p.lse)
    assert torch.equal(out, s) and torch.equal(lse, m)


def test_bad_parts_are_refused_with_the_pattern_named():
    gen = torch.Generator().manual_seed(5)
    plans = _plans(8, 2, [16, 32], [1, 4])
    like = torch.empty(2, N, 8, DIM, device=DEVICE)
    good = _result_parts(gen, plans, 8, torch.float32, "contiguous")
    with pytest.raises(ValueError, match="pattern 1: part has shape"):
        combine_results(None, [good[0], Part(plans[1], good[1].out[:, :-1], good[1].lse[:, :-1])], like)
    with pytest.raises(ValueError, match="pattern 0: part has shape .* expected .*bfloat16"):
        combine_results(None, [good[0]], like.bfloat16())
    with pytest.raises(ValueError, match="pattern 0: a result part needs lse"):
        combine_results(None, [Part(plans[0], good[0].out)], like)
    kv_like = torch.empty(2, N, 2, DIM, device=DEVICE)
    with pytest.raises(ValueError, match="pattern 1 cannot leave a compact part"):  # kv heads read at 2 offsets
        sum_grads(None, [Part(plans[1], torch.zeros(2, N // 4, 2, DIM, device=DEVICE), kv=True)], kv_like)
    ring = plan_patterns([64], [2], seq_len=64, local_len=N, num_heads=8, num_kv_heads=8)[0]
    untiled = torch.empty(2, N + N // 2, 8, DIM, device=DEVICE)  # the ring block's rows do not tile it
    with pytest.raises(ValueError, match="pattern 0 cannot leave a compact part"):
        sum_grads(None, [Part(ring, torch.zeros(2, untiled.shape[1] // 2, 8, DIM, device=DEVICE))], untiled)


def test_a_ring_patterns_part_adds_like_its_chunks():
    """A ring pattern's compact part (``ring.py`` runs such patterns on compact rows) sums like a local one's."""
    gen = torch.Generator().manual_seed(6)
    ring = plan_patterns([64], [2], seq_len=64, local_len=N, num_heads=8, num_kv_heads=8)[0]
    assert ring.ring_size == 2
    like = torch.empty(2, N, 8, DIM, device=DEVICE)
    grad = torch.randn(2, N // 2, 8, DIM, generator=gen).to(DEVICE)
    want = torch.zeros(like.shape, device=DEVICE)
    for c in ring.chunks:
        chunk_views(want, ring, c).add_(compact_view(grad, ring, c.h0, c.h1))
    torch.testing.assert_close(sum_grads(None, [Part(ring, grad)], like), want, rtol=0, atol=0)


@needs_kernel
def test_a_batch_past_the_launch_grid_takes_the_torch_path(monkeypatch):
    """More batch rows than a grid's third dimension holds (packed documents become batch rows): the torch
    path, same result."""
    gen = torch.Generator().manual_seed(9)
    plans = _plans(4, 4, [8, 16], [1, 2])
    parts = _result_parts(gen, plans, 4, torch.float32, "contiguous")
    like = torch.empty(2, N, 4, DIM, device=DEVICE)
    kernel_out, kernel_lse = combine_results(None, parts, like)
    monkeypatch.setattr(merge_mod, "MAX_GRID_Z", 1)
    assert "launch grid" in merge_mod._combine_reason(None, parts, like)
    out, lse = combine_results(None, parts, like)
    torch.testing.assert_close(out, kernel_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(kernel_lse))


def test_a_part_lse_not_in_fp32_takes_the_torch_path():
    """The kernel reads lse as fp32: a kernel returning bf16 lse gets the torch path (same result)."""
    gen = torch.Generator().manual_seed(4)
    plans = _plans(4, 4, [8, 16], [1, 2])
    parts = _result_parts(gen, plans, 4, torch.float32, "contiguous")
    low = [Part(p.plan, p.out, p.lse.bfloat16()) for p in parts]
    like = torch.empty(2, N, 4, DIM, device=DEVICE)
    assert "lse dtypes" in merge_mod._combine_reason(None, low, like)
    out, lse = combine_results(None, low, like)
    want, want_lse = combine_results(None, [Part(p.plan, p.out.double(), p.lse.double()) for p in low], like.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double()[torch.isfinite(want_lse)], want_lse[torch.isfinite(want_lse)])


def test_sum_grads_without_parts_is_the_accumulator_cast():
    acc = torch.randn(2, N, 4, DIM, device=DEVICE)
    assert sum_grads(acc, [], acc) is acc  # fp32: no copy
    assert torch.equal(sum_grads(acc, [], acc.bfloat16()), acc.bfloat16())


def test_a_pattern_kernel_without_parts_is_told_what_it_lacks():
    """A PatternKernel written before parts existed: a TypeError naming the two new methods."""
    from dilated_attention.kernels.dispatch import select_kernel

    class Old:
        name, key_masks, deterministic_backward = "old", False, True

        def supports(self, q, k):
            return None

        def forward_pattern(self, *args, **kwargs): ...

        def forward_pattern_into(self, *args, **kwargs): ...

        def backward_pattern(self, *args, **kwargs): ...

    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(TypeError, match=r"lacks \['parts', 'backward_pattern_parts'\]"):
        select_kernel(Old(), q, q)


# ---------------------------------------------------------------------------
# the strategy level: parts and in-place patterns mixed, masked backward parts


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
def test_ring_mixing_parts_and_a_fresh_in_place_pattern_matches_the_oracle(causal):
    """A dilated pattern leaves a part first; the dense pattern after it runs in place and, covering every
    row and head, writes the running result and accumulators fresh; the combine takes both. Against the
    differentiable fp64 oracle, forward and backward."""
    from dilated_attention.kernels.auto import AutoKernel, table_key
    from dilated_attention.kernels.fused import FusedKernel
    from dilated_attention.kernels.chunk_loop import ChunkLoop
    from dilated_attention.kernels.reference import ReferenceKernel
    from dilated_attention.ring.block import block_backward, block_forward
    from dilated_attention.ring.routes import RingCall, plan_ring
    from dilated_attention.testing.oracle import dense_dilated_attention

    segs, rates, heads, dim = [16, 8], [2, 1], 4, 16
    plans = _plans(heads, heads, segs, rates)
    in_place = FusedKernel(epilogue_merge=True)
    kern = AutoKernel({"fused": in_place, "parts": ChunkLoop(ReferenceKernel())},
                      {table_key(d, 2, causal, dim, torch.float32): "parts" for d in ("fwd", "bwd")})
    assert kern.parts("fwd", plans[0], *(torch.empty(1, N, heads, dim),) * 2, causal=causal, masked=False)
    assert not kern.parts("bwd", plans[1], *(torch.empty(1, N, heads, dim),) * 2, causal=causal, masked=False)
    assert plans[1].covers_all(heads, heads)
    gen = torch.Generator().manual_seed(21 + causal)
    q, k, v, dout = (torch.randn(2, N, heads, dim, generator=gen).to(DEVICE) for _ in range(4))
    ring = RingCall(plan_ring(plans, kern, causal=causal, scale=dim ** -0.5), None, 0)
    out, lse = block_forward(q, k, v, None, ring)
    grads = block_backward(q, k, v, None, (out, lse, dout), ring)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    want = dense_dilated_attention(*leaves, segs, rates, causal=causal)
    want_grads = torch.autograd.grad(want, leaves, dout.double().cpu())
    torch.testing.assert_close(out.double().cpu(), want.detach(), rtol=1e-4, atol=1e-4)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.double().cpu(), ref, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_fused_backward_parts_with_a_key_mask_equal_the_in_place_backward():
    """Masked keys (padding): the fused kernel's compact parts, placed, equal what it adds in place."""
    from dilated_attention.kernels.fused import FusedKernel

    heads, dim = 4, 16
    plan = _plans(heads, heads, [16], [2])[0]
    gen = torch.Generator().manual_seed(5)
    q, k, v, out, dout = (torch.randn(2, N, heads, dim, generator=gen).to(DEVICE) for _ in range(5))
    lse = torch.randn(2, N, heads, generator=gen).to(DEVICE) + 3.0
    key_mask = (torch.rand(2, N, generator=gen) < 0.3).to(DEVICE)
    key_mask[1, :16] = True  # a whole segment of padding: its keys' dK/dV are zero
    kern = FusedKernel()
    kw = dict(causal=False, scale=0.25, key_mask=key_mask)
    parts = kern.backward_pattern_parts(q, k, v, plan, CallSpec(**kw), (out, lse, dout))
    acc = [torch.zeros_like(x) for x in (q, k, v)]
    kern.backward_pattern(q, k, v, plan, CallSpec(**kw), (out, lse, dout), acc)
    for part, whole, kv in zip(parts, acc, (False, True, True)):
        placed = sum_grads(None, [Part(plan, part, kv=kv)], whole)
        torch.testing.assert_close(placed, whole, rtol=1e-5, atol=1e-6)


def test_row_divider_divides_every_int32_row():
    """The combine kernels divide a row by a part's dilation with a multiply and a shift: exact for every
    ``0 <= n < 2**31`` (edges, random rows) and any dilation (powers of two, odd ones, large ones)."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.cat([torch.arange(0, 70_000), torch.randint(0, 2**31, (50_000,), generator=gen),
                      torch.arange(2**31 - 70_000, 2**31)]).to(torch.int64)
    for dilation in [1, 2, 3, 4, 5, 7, 8, 12, 16, 31, 64, 1000, 4096, 65_537, 2**20 + 1, 2**30, 2**31 - 1]:
        multiplier, shift = merge_mod.row_divider(dilation)
        assert 0 < multiplier < 2**32, "the kernel's int64 product needs a 32-bit multiplier"
        got = (rows * multiplier) >> shift
        wrong = rows[got != rows // dilation]
        assert wrong.numel() == 0, f"dilation {dilation}: wrong from row {wrong[:1].tolist()}"


@needs_kernel
def test_combine_tables_are_kept_by_content(monkeypatch):
    """A step whose parts sit where the last step's did reuses its device table; parts elsewhere or in other
    layouts get their own (the table is keyed by every value in it, so a reused one is never stale)."""
    monkeypatch.setattr(merge_mod, "_TABLES", {})
    gen = torch.Generator().manual_seed(23)
    plans = _plans(4, 4, [8, 16, 32], [1, 2, 4])
    like = torch.empty(2, N, 4, DIM, dtype=torch.bfloat16, device=DEVICE)
    first = _result_parts(gen, plans, 4, torch.bfloat16, "contiguous")
    out, lse = combine_results(None, first, like)
    assert len(merge_mod._TABLES) == 1
    again, again_lse = combine_results(None, first, like)
    assert len(merge_mod._TABLES) == 1 and torch.equal(again, out) and torch.equal(again_lse, lse)
    other = _result_parts(gen, plans, 4, torch.bfloat16, "transposed")
    got, got_lse = combine_results(None, other, like)
    assert len(merge_mod._TABLES) == 2
    want, want_lse = combine_results(None, [_f64(p) for p in other], like.double())
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[fin].double(), want_lse[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), rtol=2 * 2**-7, atol=1e-6)
