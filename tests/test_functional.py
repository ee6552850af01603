"""Single-device dilated attention against the independent dense oracle (float64, CPU)."""

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.testing.compare import LAYOUTS, as_layout, assert_within_rule, rel_err
from dilated_attention.testing.oracle import dense_dilated_attention



def _make(shape, layout, gen, dtype=torch.float64):
    return as_layout(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype), layout, generator=gen)


def _run(fn, q, k, v, dout, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    return [out, *torch.autograd.grad(out, leaves, dout)]


CONFIGS = [
    # (heads, kv_heads, N, segments, rates)
    (4, 4, 32, [8, 16, 32], [1, 2, 4]),
    (6, 2, 48, [12, 48], [3, 4]),
    (3, 1, 32, [4, 1000], [1, 8]),  # MQA; segment above N is clamped; rate above heads
    (8, 2, 64, [16, 32, 64], [1, 2, 2]),
]


@pytest.mark.parametrize("mode", ["longnet", "grouped"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"H{c[0]}kv{c[1]}N{c[2]}")
@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_fp64_matches_dense_oracle(mode, causal, config, kernel):
    heads, kv_heads, n, segs, rates = config
    seed = CONFIGS.index(config) * 8 + 4 * (mode == "grouped") + 2 * causal + (kernel == "sdpa")
    gen = torch.Generator().manual_seed(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    q = _make((2, n, heads, 8), layout, gen)
    k, v = (_make((2, n, kv_heads, 8), layout, gen) for _ in range(2))
    dout = torch.randn(2, n, heads, 8, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=segs, dilation_rates=rates, mode=mode, causal=causal, softmax_scale=0.3)
    got = _run(dilated_attention, q, k, v, dout, kernel=kernel, **kw)
    want = _run(dense_dilated_attention, q, k, v, dout, **kw)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_within_rule(name, g, w, context=f"seed {seed}, layout {layout}")


def test_uncovered_positions_are_zero_in_grouped_mode():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 16, 2, 4, generator=gen, dtype=torch.float64)
    out = dilated_attention(q, q, q, [8, 16], [2, 2], mode="grouped")
    # group 0 (head 0) uses offset 0, group 1 (head 1) offset 1: the other rows are covered by no pattern
    assert out[:, 1::2, 0].eq(0).all() and out[:, 0::2, 1].eq(0).all()
    assert out[:, 0::2, 0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_low_precision_within_twice_plain_torch_error(dtype, kernel):
    gen = torch.Generator().manual_seed(11)
    n, segs, rates = 64, [16, 32, 64], [1, 2, 4]
    q = torch.randn(2, n, 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, n, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, n, 4, 16, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=segs, dilation_rates=rates, causal=True)
    oracle = _run(dense_dilated_attention, q, k, v, dout, **kw)
    plain = _run(dense_dilated_attention, *(t.to(dtype) for t in (q, k, v)), dout.to(dtype), **kw)
    ours = _run(dilated_attention, *(t.to(dtype) for t in (q, k, v)), dout.to(dtype), kernel=kernel, **kw)
    for name, o, p, w in zip(("out", "dq", "dk", "dv"), ours, plain, oracle):
        assert o.dtype == dtype
        assert_within_rule(name, o, w, p)


def test_auto_kernel_matches_reference_fp32():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 32, 4, 8, generator=gen)
    a = dilated_attention(q, q, q, [8, 32], [1, 2], kernel="auto")
    b = dilated_attention(q, q, q, [8, 32], [1, 2], kernel="reference")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        (("q",), {}, TypeError, ["q must be a torch.Tensor"]),
        (((1, 8, 2, 4), (1, 8, 2, 4), (1, 8, 2, 5)), {}, ValueError, ["k and v", "(1, 8, 2, 5)"]),
        (((1, 8, 2, 4), (1, 16, 2, 4), (1, 16, 2, 4)), {}, ValueError, ["batch, sequence length and head dim"]),
        (((1, 8, 3, 4), (1, 8, 2, 4), (1, 8, 2, 4)), {}, ValueError, ["query heads (3)", "kv heads (2)"]),
        (((1, 8, 2),) * 3, {}, ValueError, ["(B, N, H, D)"]),
        (((1, 0, 2, 4),) * 3, {}, ValueError, ["non-empty"]),
        (((1, 8, 2, 4),) * 3, {"softmax_scale": -1.0}, ValueError, ["softmax_scale", "-1.0"]),
        (((1, 8, 2, 4),) * 3, {"softmax_scale": "big"}, TypeError, ["softmax_scale"]),
        (((1, 8, 2, 4),) * 3, {"causal": 1}, TypeError, ["causal"]),
        (((1, 8, 2, 4),) * 3, {"mode": "sparse"}, ValueError, ["mode must be one of", "sparse"]),
        (((1, 8, 2, 4),) * 3, {"kernel": "cuda"}, ValueError, ["kernel must be one of", "cuda"]),
        (((1, 8, 2, 4),) * 3, {"comm": 3}, TypeError, ["comm must be"]),
        (((1, 8, 2, 4),) * 3, {"comm": "mpi"}, ValueError, ["comm must be one of", "mpi"]),
        (((1, 12, 2, 4),) * 3, {"segment_lengths": [8], "pad_to_segments": False}, ValueError,
         ["12", "segment_lengths[0]=8"]),
        (((1, 8, 2, 4),) * 3, {"mode": "grouped", "segment_lengths": [4, 8, 8], "dilation_rates": [1, 1, 2]},
         ValueError, ["num_heads >= number of patterns"]),
    ],
)
def test_invalid_inputs_raise_named_errors(args, kwargs, exc, words):
    tensors = [torch.randn(s) if isinstance(s, tuple) else s for s in args]
    while len(tensors) < 3:
        tensors.append(torch.randn(1, 8, 2, 4))
    call = dict(segment_lengths=[4, 8], dilation_rates=[1, 2])
    call.update(kwargs)
    segs, rates = call.pop("segment_lengths"), call.pop("dilation_rates")
    if len(segs) != len(rates):
        rates = [1] * len(segs)
    with pytest.raises(exc) as info:
        dilated_attention(*tensors, segs, rates, **call)
    for w in words:
        assert w in str(info.value)


def test_mixed_dtypes_and_int_inputs_rejected():
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(TypeError, match="share a dtype"):
        dilated_attention(x, x.double(), x, [8], [1])
    with pytest.raises(TypeError, match="floating point"):
        dilated_attention(x.long(), x, x, [8], [1])


def test_forced_kernel_that_cannot_run_says_why():
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="kernel='sdpa-cudnn' cannot run"):
        dilated_attention(x, x, x, [8], [1], kernel="sdpa-cudnn")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_layout_every_kernel(layout, kernel, dtype):
    """Arbitrary strides (head dim with stride != 1, permuted buffers, zero strides, storage offsets)."""
    if kernel == "sdpa" and dtype == torch.float64:
        kernel = "sdpa"  # the CPU flash op takes fp64 too
    seed = LAYOUTS.index(layout)
    gen = torch.Generator().manual_seed(seed)
    q = _make((2, 32, 4, 8), layout, gen, dtype)
    k, v = (_make((2, 32, 2, 8), layout, gen, dtype) for _ in range(2))
    dout = torch.randn(2, 32, 4, 8, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=[8, 32], dilation_rates=[1, 4], causal=True)
    oracle = _run(dense_dilated_attention, q.double(), k.double(), v.double(), dout, **kw)
    plain = None if dtype == torch.float64 else _run(dense_dilated_attention, q, k, v, dout.to(dtype), **kw)
    got = _run(dilated_attention, q, k, v, dout.to(dtype), kernel=kernel, **kw)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_within_rule(name, got[i], oracle[i], None if plain is None else plain[i], context=f"{layout} {kernel}")


@pytest.mark.parametrize("kernel", ["auto", "sdpa", "fused"])
@pytest.mark.parametrize("causal", [False, True])
def test_misaligned_views_on_the_device(kernel, causal):
    """Views starting at an odd element (not 16-byte aligned), on the GPU when there is one: a CUDA attention
    op fed such a view faults "misaligned address" (the fuzzer's finding: kernel 'sdpa', fp16, offset 7)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(31 + causal)

    def view(heads, offset):
        flat = torch.randn(offset + 2 * 32 * heads * 8, generator=gen).to(device, dtype)
        return flat[offset:].view(2, 32, heads, 8)

    q, k, v = view(4, 7), view(2, 3), view(2, 5)
    dout = torch.randn(2, 32, 4, 8, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=[8, 32], dilation_rates=[1, 4], causal=causal)
    oracle = _run(dense_dilated_attention, *(t.double().cpu() for t in (q, k, v)), dout, **kw)
    plain = _run(dense_dilated_attention, *(t.cpu() for t in (q, k, v)), dout.to(dtype), **kw)
    got = [t.cpu() for t in _run(dilated_attention, q, k, v, dout.to(device, dtype), kernel=kernel, **kw)]
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_within_rule(name, got[i], oracle[i], plain[i], context=f"{kernel} causal={causal} {device}")


def test_issue_unbind_and_permuted_inputs_are_right():
    """The reported silent-wrong cases: ``randn(..., 3).unbind(-1)`` and a (B, D, N, H) buffer permuted."""
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(1, 64, 4, 8, 3, generator=gen)
    q, k, v = qkv.unbind(-1)
    got = dilated_attention(q, k, v, [16, 64], [1, 4], kernel="sdpa")
    want = dense_dilated_attention(q.double(), k.double(), v.double(), [16, 64], [1, 4])
    assert rel_err(got, want) < 1e-5
    buf = torch.randn(1, 8, 64, 4, generator=gen)
    x = buf.permute(0, 2, 3, 1)
    got = dilated_attention(x, x, x, [16, 64], [1, 4])
    assert rel_err(got, dense_dilated_attention(x.double(), x.double(), x.double(), [16, 64], [1, 4])) < 1e-5


def test_double_backward_is_refused():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = dilated_attention(q, k, v, [8, 16], [1, 2])
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    (gq,) = torch.autograd.grad(out.sum(), q)  # plain backward still works
    assert torch.isfinite(gq).all() and gq.abs().sum() > 0


@pytest.mark.parametrize("rule", ["spread", "torchscale"])
def test_head_offset_rules_match_oracle(rule):
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 48, 6, 4, generator=gen, dtype=torch.float64)  # rates 4 and 3 do not divide... 6 % 4 != 0
    k, v = (torch.randn(1, 48, 6, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    kw = dict(segment_lengths=[12, 48], dilation_rates=[4, 3], head_offsets=rule)
    got = _run(dilated_attention, q, k, v, dout, **kw)
    want = _run(dense_dilated_attention, q, k, v, dout, **kw)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_within_rule(name, g, w)


def test_torchscale_rule_differs_where_rates_do_not_divide_heads():
    from dilated_attention.patterns import longnet_offsets

    assert longnet_offsets(6, 4, "spread") == [0, 0, 1, 2, 2, 3]
    assert longnet_offsets(6, 4, "torchscale") == [0, 0, 1, 1, 2, 2]  # h // ceil(6 / 4)
    assert longnet_offsets(8, 4, "spread") == longnet_offsets(8, 4, "torchscale")


def test_scale_outside_compute_range_is_refused():
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="softmax_scale=1e\\+300 is outside the range"):
        dilated_attention(x, x, x, [8], [1], softmax_scale=1e300)
    out = dilated_attention(x.double(), x.double(), x.double(), [8], [1], softmax_scale=1e300)
    assert out.dtype == torch.float64  # fp64 computes in fp64: accepted


@pytest.mark.parametrize("kernel, dtype", [("auto", torch.float64), ("fused", torch.float32)])
def test_inf_and_nan_inputs_behave_like_plain_attention(kernel, dtype):
    """fp64 runs the reference kernel; fused (fp32) merges patterns in its epilogue, which must keep NaN."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k[0, 5, 0, 1] = float("inf")
    v[0, 9, 1, 2] = float("nan")
    kw = dict(segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True)
    device = "cuda" if kernel == "fused" and torch.cuda.is_available() else "cpu"
    got = dilated_attention(*(t.to(device, dtype) for t in (q, k, v)), kernel=kernel, **kw).cpu().double()
    # Plain softmax attention over each row's keys: a +inf score (q . k_inf > 0) makes the whole row NaN,
    # a -inf score just drops that key; a NaN value makes that value dim NaN in every row that sees it.
    # (Rows that share a block with the bad key but mask it may be NaN too, as with any dense kernel: 0 * NaN.)
    from dilated_attention.testing.oracle import pattern_masks

    sees = torch.stack(pattern_masks(16, 2, kw["segment_lengths"], kw["dilation_rates"], "longnet", True)).any(0)
    want_nan = torch.zeros(1, 16, 2, 8, dtype=torch.bool)
    want_nan[0, :, 0, :] = (sees[0, :, 5] & (q[0, :, 0, 1] > 0)).unsqueeze(-1)
    want_nan[0, :, 1, 2] = sees[1, :, 9]
    assert want_nan.any() and not (want_nan & ~torch.isnan(got)).any()
    assert not torch.isnan(got[0, sees[0, :, 5] & (q[0, :, 0, 1] < 0), 0]).any()  # a -inf score only drops the key
    clean = dense_dilated_attention(q, k.nan_to_num(posinf=0.0), v.nan_to_num(), **kw)
    apart = torch.tensor([0, 2, 4, 6])  # head 1 rows in no block with key 9; head 0 rows 8.. in none with key 5
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    assert torch.allclose(got[0, apart, 1], clean[0, apart, 1], **tol)
    assert torch.allclose(got[0, 8:, 0], clean[0, 8:, 0], **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_magnitude_scores_stay_finite(dtype):
    gen = torch.Generator().manual_seed(6)
    q = (torch.randn(1, 32, 2, 16, generator=gen) * 40).to(dtype)  # scores ~ 1e4
    out = dilated_attention(q, q, q, [8, 32], [1, 2])
    assert torch.isfinite(out).all()


def test_clamped_segment_is_named_as_clamped():
    x = torch.randn(1, 12, 2, 4)
    with pytest.raises(ValueError, match=r"segment_lengths\[0\]=12 \(clamped from 1000 to the sequence length\)"):
        dilated_attention(x, x, x, [1000], [5], pad_to_segments=False)


def test_a_schedule_is_reused_only_for_the_same_call(monkeypatch):
    """Repeated single-device calls reuse their validated plan (``planning.prepare`` is host time on every step), but
    only where everything the checks read is the same: a valid call planned first must not let an invalid
    one through (``True`` equals ``1``, a misaligned view has the shape of an aligned one)."""
    import dilated_attention.planning as fn

    monkeypatch.setattr(fn, "SCHEDULES", {})
    monkeypatch.delenv("DILATED_ATTENTION_NONDETERMINISTIC", raising=False)
    planned = []
    real = fn.schedule
    monkeypatch.setattr(fn, "schedule", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=gen) for _ in range(3))
    first = dilated_attention(q, k, v, [4, 8], [1, 2])
    again = dilated_attention(q.clone(), k.clone(), v.clone(), [4, 8], [1, 2])  # new tensors, same properties
    assert len(planned) == 1 and torch.equal(first, again)
    with pytest.raises(TypeError, match=r"segment_lengths\[0\] must be an int"):
        dilated_attention(q, k, v, [4.0, 8], [1, 2])
    with pytest.raises(TypeError, match=r"dilation_rates\[0\] must be an int, got bool"):
        dilated_attention(q, k, v, [4, 8], [True, 2])
    with pytest.raises(TypeError, match="causal must be a bool"):
        dilated_attention(q, k, v, [4, 8], [1, 2], causal=0)
    dilated_attention(q, k, v, [4, 8], [1, 2], causal=True)  # another option: planned anew
    dilated_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, [4, 8], [1, 2])  # other strides
    assert len(planned) == 6
    monkeypatch.setenv("DILATED_ATTENTION_NONDETERMINISTIC", "1")  # the kernel choice reads it: planned anew
    dilated_attention(q, k, v, [4, 8], [1, 2])
    assert len(planned) == 7
    monkeypatch.delenv("DILATED_ATTENTION_NONDETERMINISTIC")
    mask = torch.zeros(1, 8, dtype=torch.bool)
    for _ in range(2):  # a key mask's values are checked on every call
        dilated_attention(q, k, v, [4, 8], [1, 2], key_padding_mask=mask)
    assert len(planned) == 9


def test_a_kernel_named_by_string_is_one_instance():
    """Kernels keep per-geometry caches (``cudnn-det``'s cuDNN graphs take about 0.5 s to build): a name must
    give the same instance on every call, not a fresh one with empty caches."""
    from dilated_attention.kernels.dispatch import select_kernel

    x = torch.randn(1, 8, 2, 4)
    for name in ("reference", "sdpa"):
        assert select_kernel(name, x, x) is select_kernel(name, x, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams are CUDA streams")
@pytest.mark.parametrize("kernel", ["auto", "fused"])
def test_causal_side_streams_change_no_bit(monkeypatch, kernel):
    """Causal local patterns run on side streams (``ring/side_streams.py``): each writes tensors of its own, so
    forward and gradients must equal the one-stream run bitwise, run after run, also when the caller's
    stream is not the default one and allocates right after the call; the caller's stream is current after it."""
    from dilated_attention.ring import routes, side_streams

    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, g = (torch.randn(2, 4096, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(4))
    segs, rates = [512, 1024, 2048, 4096], [1, 2, 4, 8]
    runs = []
    for streams in (1, 2, 1, 2):
        monkeypatch.setattr(side_streams, "_STREAM_POOLS", {})
        caller = torch.cuda.Stream()
        caller.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(caller), routes.tuned(causal_part_streams=streams):
            got = _run(lambda *a: dilated_attention(*a, segs, rates, causal=True, kernel=kernel), q, k, v, g)
            assert torch.cuda.current_stream() == caller, "a call must leave the caller's stream current"
            junk = [torch.full_like(x, float("nan")) for x in got]  # reuses freed memory on the caller's stream
        torch.cuda.current_stream().wait_stream(caller)
        runs.append([x.clone() for x in got])
        del junk
    for other in runs[1:]:
        for what, a, b in zip(("out", "dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{what} differs with side streams"
