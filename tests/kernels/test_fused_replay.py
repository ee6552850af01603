"""The fused kernel's replays (``replays.py``): a pattern's launches recorded at the first call of a geometry
and replayed after give the same bits as launches worked out anew, on fresh inputs; a new geometry, a key mask,
or one tensor under two names is not replayed from another call's record. Values are checked against the fp64
oracle too (flash-attention's rule), so a replay that launched on the wrong tensor could not pass. Runs in
Triton's interpreter on CPU (``kernel_checks`` sets it up, so it is imported first) and on a GPU as it is."""

from __future__ import annotations

from kernel_checks import DEVICE, seeded  # noqa: I001

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import dilated_attention.kernels.fused as fused  # noqa: E402
from dilated_attention import replays  # noqa: E402
from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.testing.compare import assert_within_rule  # noqa: E402
from dilated_attention.testing.oracle import dense_dilated_attention  # noqa: E402

N, H, HK, D = 64, 4, 2, 16
SEGMENTS, RATES = [16, 32, 64], [1, 2, 4]


@pytest.fixture()
def replayed(monkeypatch):
    """Counts replayed pattern calls; starts with no recipes."""
    replays.RECIPES.clear()
    count = [0]
    real = replays.replay

    def counting(recipe, env, device):
        count[0] += 1
        return real(recipe, env, device)

    monkeypatch.setattr(replays, "replay", counting)
    return count


def _inputs(seed: int, *, dtype=torch.float32, kv_heads: int = HK, layout: str = "contiguous"):
    g = torch.Generator().manual_seed(seeded("replay", seed, dtype, kv_heads, layout))
    shapes = [(1, N, H, D), (1, N, kv_heads, D), (1, N, kv_heads, D), (1, N, H, D)]
    xs = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).to(DEVICE) for s in shapes]
    if layout == "heads-major":  # same values, other strides: (B, H, N, D) storage
        xs = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs]
    return xs


def _step(q, k, v, dout, causal: bool, kernel, **options):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = dilated_attention(*leaves, SEGMENTS, RATES, causal=causal, kernel=kernel, **options)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def _dense(q, k, v, dout, causal: bool, dtype, **options):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = dense_dilated_attention(*leaves, SEGMENTS, RATES, causal=causal, **options)
    out.backward(dout.to(dtype))
    return [out.detach()] + [x.grad for x in leaves]


def _judge(what: str, got, q, k, v, dout, causal: bool, **options) -> None:
    """``got`` (out, dq, dk, dv) within the rule against the fp64 oracle, plain torch in fp32 beside it."""
    oracle = _dense(q, k, v, dout, causal, torch.float64, **options)
    plain = _dense(q, k, v, dout, causal, torch.float32, **options)
    for name, a, o, p in zip(("out", "dq", "dk", "dv"), got, oracle, plain):
        assert_within_rule(f"{what} {name} (causal={causal})", a, o, p)


@pytest.mark.parametrize("causal", [False, True])
def test_replay_is_bitwise_the_first_call(replayed, causal):
    kernel = fused.FusedKernel()
    _step(*_inputs(1), causal, kernel)  # records every pattern's forward and backward
    assert len(replays.RECIPES) > 0 and replayed[0] == 0
    fresh = _inputs(2)
    got = _step(*fresh, causal, kernel)  # replays them
    assert replayed[0] >= 2 * len(SEGMENTS) - 1
    replays.RECIPES.clear()
    want = _step(*fresh, causal, fused.FusedKernel())  # worked out anew
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: the replay differs from launches worked out anew"
    _judge("replayed", got, *fresh, causal)


def test_new_geometry_is_recorded_not_replayed(replayed):
    kernel = fused.FusedKernel()
    _step(*_inputs(3), True, kernel)
    kept = len(replays.RECIPES)
    other = _inputs(4, layout="heads-major")  # other strides: every pattern call is a new geometry
    got = _step(*other, True, kernel)
    assert replayed[0] == 0 and len(replays.RECIPES) > kept
    _judge("new layout", got, *other, True)


def test_masked_calls_are_not_replayed(replayed):
    kernel = fused.FusedKernel()
    q, k, v, dout = _inputs(5)
    mask = torch.zeros(1, N, dtype=torch.bool, device=DEVICE)
    mask[:, -9:] = True
    for seed in (5, 6):
        q, k, v, dout = _inputs(seed)
        got = _step(q, k, v, dout, False, kernel, key_padding_mask=mask)
    assert replayed[0] == 0
    _judge("masked", got, q, k, v, dout, False, key_padding_mask=mask)


def test_one_tensor_under_two_names_is_not_kept(replayed):
    """Recorded with k and v the same tensor, a replay would hand a later call's k to both operands."""
    kernel = fused.FusedKernel()
    q, k, _, dout = _inputs(7, kv_heads=H)
    with torch.no_grad():
        dilated_attention(q, k, k, SEGMENTS, RATES, kernel=kernel)
    assert len(replays.RECIPES) == 0
    q, k, v, dout = _inputs(8, kv_heads=H)
    with torch.no_grad():
        got = dilated_attention(q, k, v, SEGMENTS, RATES, kernel=kernel)
    assert replayed[0] == 0
    with torch.no_grad():
        want, plain = (dense_dilated_attention(q.to(t), k.to(t), v.to(t), SEGMENTS, RATES)
                       for t in (torch.float64, torch.float32))
    assert_within_rule("out after an aliased call", got, want, plain)
