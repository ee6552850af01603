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
