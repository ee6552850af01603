"""Single-device dilated attention against the independent dense oracle (float64, CPU)."""

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.testing.oracle import dense_dilated_attention

LAYOUTS = ("contiguous", "transposed", "head_slice")


def _make(shape, layout, gen, dtype=torch.float64):
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "head_slice":
        wide = torch.randn(*shape[:2], shape[2] + 2, shape[3], generator=gen, dtype=torch.float64).to(dtype)
        wide[:, :, 1:-1] = x
        return wide[:, :, 1:-1]
    return x


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _run(fn, q, k, v, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() if t.is_contiguous() else t.detach().requires_grad_() for t in (q, k, v)]
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
    gen = torch.Generator().manual_seed(hash((mode, causal, n, kernel)) % 2**31)
    layout = LAYOUTS[n % 3]
    q = _make((2, n, heads, 8), layout, gen)
    k, v = (_make((2, n, kv_heads, 8), layout, gen) for _ in range(2))
    dout = torch.randn(2, n, heads, 8, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=segs, dilation_rates=rates, mode=mode, causal=causal, softmax_scale=0.3)
    got = _run(dilated_attention, q, k, v, dout, kernel=kernel, **kw)
    want = _run(dense_dilated_attention, q, k, v, dout, **kw)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(g, w) < 1e-10, name


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
    floor = 1e-6 if dtype == torch.float32 else 2e-3
    for name, o, p, w in zip(("out", "dq", "dk", "dv"), ours, plain, oracle):
        assert o.dtype == dtype
        assert _rel(o, w) <= 2 * _rel(p, w) + floor, name


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
        (((1, 12, 2, 4),) * 3, {"segment_lengths": [8]}, ValueError, ["12", "segment_lengths[0]=8"]),
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
