"""Key padding masks, packed documents (cu_seqlens) and internal padding against the fp64 oracle.

Single device (every layout, both modes, causal, GQA) and on gloo ranks (ring with spanning
patterns and a key mask; the head strategy with documents that span ranks and padding).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused kernel (the benchmark smoke) in Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's import, as tests/kernels/kernel_checks.py does

from dilated_attention import dilated_attention
from dilated_attention.testing.compare import LAYOUTS, as_layout, assert_within_rule, rel_err
from dilated_attention.testing.oracle import dense_dilated_attention
from dilated_attention.testing.spawn import spawn_ranks

F64 = torch.float64


def _inputs(seed, b, n, h, hk, d, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(b, n, hk, d, generator=gen, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, n, h, d, generator=gen, dtype=dtype)
    return q, k, v, dout, gen


def _fwd_bwd(fn, q, k, v, dout, *args, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, *args, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return (out.detach(), *grads)


def _assert_same(got, want, tol=1e-10):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["longnet", "grouped"])
@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_key_padding_mask_matches_oracle(causal, mode, kernel):
    q, k, v, dout, gen = _inputs(1, 2, 32, 4, 2, 8)
    mask = torch.rand(2, 32, generator=gen) < 0.3
    mask[1, :20] = True  # long runs of padding: whole segments of some patterns are empty
    kw = dict(mode=mode, causal=causal, key_padding_mask=mask)
    got = _fwd_bwd(dilated_attention, q, k, v, dout, [8, 16, 32], [1, 2, 4], kernel=kernel, **kw)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, [8, 16, 32], [1, 2, 4], **kw)
    _assert_same(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_padding_mask_on_every_layout(layout):
    q, k, v, dout, gen = _inputs(2, 2, 16, 4, 4, 8)
    gen2 = torch.Generator().manual_seed(9)
    q, k, v = (as_layout(t, layout, generator=gen2) for t in (q, k, v))
    mask = (torch.rand(1, 16, generator=gen) < 0.4).expand(2, 16)  # a stride-0 mask too
    got = _fwd_bwd(dilated_attention, q, k, v, dout, [4, 16], [1, 2], key_padding_mask=mask)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, [4, 16], [1, 2], key_padding_mask=mask)
    _assert_same(got, want)


def test_all_keys_masked_gives_zero_rows_and_zero_finite_grads():
    q, k, v, dout, _ = _inputs(3, 2, 16, 2, 2, 8)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0] = True  # batch row 0: nothing to attend to
    got = _fwd_bwd(dilated_attention, q, k, v, dout, [8, 16], [1, 2], key_padding_mask=mask, causal=True)
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))
    for g in got[1:]:
        assert torch.isfinite(g).all()
        assert torch.equal(g[0], torch.zeros_like(g[0]))
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, [8, 16], [1, 2], key_padding_mask=mask, causal=True)
    _assert_same(got, want)


def test_masked_keys_get_no_gradient_and_do_not_change_the_output():
    q, k, v, dout, gen = _inputs(4, 1, 16, 2, 2, 8)
    mask = torch.rand(1, 16, generator=gen) < 0.5
    out, dq, dk, dv = _fwd_bwd(dilated_attention, q, k, v, dout, [8, 16], [1, 2], key_padding_mask=mask)
    assert torch.equal(dk[mask], torch.zeros_like(dk[mask])) and torch.equal(dv[mask], torch.zeros_like(dv[mask]))
    k2, v2 = k.clone(), v.clone()
    k2[mask], v2[mask] = 1e3, -7.0  # whatever the pad keys hold
    out2 = dilated_attention(q, k2, v2, [8, 16], [1, 2], key_padding_mask=mask)
    assert torch.allclose(out, out2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, segs, rates", [(100, [32], [1]), (30, [8, 16, 64], [1, 2, 4]), (12, [1000], [5])])
def test_internal_padding_matches_oracle(causal, n, segs, rates):
    q, k, v, dout, _ = _inputs(5, 2, n, 4, 2, 8)
    got = _fwd_bwd(dilated_attention, q, k, v, dout, segs, rates, causal=causal)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, segs, rates, causal=causal)
    assert got[0].shape == q.shape
    _assert_same(got, want)


def test_internal_padding_equals_explicit_padding_with_a_mask():
    q, k, v, dout, _ = _inputs(6, 1, 20, 2, 2, 8)
    got = _fwd_bwd(dilated_attention, q, k, v, dout, [8], [2])
    grow = lambda x: torch.cat([x, torch.randn(1, 4, *x.shape[2:], dtype=F64)], 1)  # noqa: E731
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[:, 20:] = True
    want = _fwd_bwd(lambda a, b, c: dilated_attention(a, b, c, [8], [2], key_padding_mask=mask)[:, :20],
                    grow(q), grow(k), grow(v), dout)
    _assert_same(got, [want[0], want[1][:, :20], want[2][:, :20], want[3][:, :20]])


def test_pad_to_segments_false_keeps_the_error():
    x = torch.randn(1, 20, 2, 8)
    with pytest.raises(ValueError, match=r"20 must be divisible by segment_lengths\[0\]=8"):
        dilated_attention(x, x, x, [8], [2], pad_to_segments=False)


def _docs(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["longnet", "grouped"])
def test_cu_seqlens_matches_oracle_and_each_document_alone(causal, mode):
    lengths = (16, 5, 0, 32, 9, 16)  # a zero-length document, lengths the segments do not tile
    cu = _docs(*lengths)
    q, k, v, dout, _ = _inputs(7, 1, int(cu[-1]), 4, 2, 8)
    kw = dict(causal=causal, mode=mode)
    segs, rates = [4, 8, 32], [1, 2, 4]
    got = _fwd_bwd(dilated_attention, q, k, v, dout, segs, rates, cu_seqlens=cu, **kw)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, segs, rates, cu_seqlens=cu, **kw)
    _assert_same(got, want)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # the definition: each document on its own
        if b > a:
            alone = _fwd_bwd(dilated_attention, q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], segs, rates, **kw)
            _assert_same([t[:, a:b] for t in got], alone)


def test_cu_seqlens_with_key_padding_mask():
    cu = _docs(12, 20)
    q, k, v, dout, gen = _inputs(8, 1, 32, 2, 1, 8)
    mask = torch.rand(1, 32, generator=gen) < 0.3
    kw = dict(cu_seqlens=cu, key_padding_mask=mask, causal=True)
    got = _fwd_bwd(dilated_attention, q, k, v, dout, [8, 16], [1, 2], **kw)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, [8, 16], [1, 2], **kw)
    _assert_same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_in_low_precision_within_rule(dtype):
    cu = _docs(24, 40)
    q, k, v, dout, gen = _inputs(9, 1, 64, 4, 2, 16)
    mask = torch.rand(1, 64, generator=gen) < 0.2
    kw = dict(cu_seqlens=cu, key_padding_mask=mask, causal=True)
    args = ([16, 32], [1, 2])
    oracle = _fwd_bwd(dense_dilated_attention, q, k, v, dout, *args, **kw)
    low = [t.to(dtype) for t in (q, k, v, dout)]
    plain = _fwd_bwd(dense_dilated_attention, *low, *args, **kw)
    ours = _fwd_bwd(dilated_attention, *low, *args, **kw)
    for name, o, p, w in zip(("out", "dq", "dk", "dv"), ours, plain, oracle):
        assert o.dtype == dtype
        assert_within_rule(name, o, w, p)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"key_padding_mask": torch.zeros(1, 8)}, TypeError, ["key_padding_mask", "bool"]),
        ({"key_padding_mask": torch.zeros(1, 9, dtype=torch.bool)}, ValueError, ["key_padding_mask", "(1, 8)", "(1, 9)"]),
        ({"key_padding_mask": [True] * 8}, TypeError, ["key_padding_mask", "list"]),
        ({"cu_seqlens": torch.tensor([0, 8])}, ValueError, ["cu_seqlens", "int32", "torch.int64"]),
        ({"cu_seqlens": torch.tensor([0, 5, 7], dtype=torch.int32)}, ValueError, ["end at the total length 8", "[0, 5, 7]"]),
        ({"cu_seqlens": torch.tensor([0, 6, 4, 8], dtype=torch.int32)}, ValueError, ["never decrease"]),
        ({"cu_seqlens": [0, 8]}, TypeError, ["cu_seqlens", "list"]),
        ({"pad_to_segments": 1}, TypeError, ["pad_to_segments", "bool"]),
        ({"key_padding_mask": torch.zeros(1, 8, dtype=torch.bool), "kernel": "sdpa"}, ValueError,
         ["kernel='sdpa'", "key mask", "'fused' or 'reference'"]),
    ],
)
def test_invalid_mask_arguments_raise_named_errors(kwargs, exc, words):
    x = torch.randn(1, 8, 2, 8)
    with pytest.raises(exc) as info:
        dilated_attention(x, x, x, [4, 8], [1, 2], **kwargs)
    for w in words:
        assert w in str(info.value)


def test_cu_seqlens_needs_one_batch_row():
    x = torch.randn(2, 8, 2, 8)
    with pytest.raises(ValueError, match="one batch row"):
        dilated_attention(x, x, x, [4], [1], cu_seqlens=_docs(4, 4))


# -- sequence parallel (gloo ranks) ---------------------------------------------------------------


def _rank_case(rank, world, strategy, segs, rates, n, docs, causal, heads, kv_heads, masked, pad_only):
    from dilated_attention.comm import get_backend

    comm = get_backend("collective")
    q, k, v, dout, gen = _inputs(20, 1 if docs else 2, n, heads, kv_heads, 8)
    mask = (torch.rand(q.shape[:2], generator=gen) < 0.3) if masked else None
    cu = torch.tensor(docs, dtype=torch.int32) if docs else None
    kw = dict(causal=causal, key_padding_mask=mask, cu_seqlens=cu)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, segs, rates, **kw)
    rows = slice(rank * n // world, (rank + 1) * n // world)
    kw["key_padding_mask"] = mask[:, rows] if masked else None
    got = _fwd_bwd(dilated_attention, *(t[:, rows] for t in (q, k, v, dout)), segs, rates, comm=comm,
                   strategy=strategy, **kw)
    return {name: rel_err(a, b[:, rows]) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


CASES = {
    # ring with spanning patterns (w > L): the mask of each visiting block is read where it lives
    "ring_mask": ("ring", [4, 16, 32], [1, 2, 4], 32, None, True, 4, 2, True, False),
    "ring_mask_causal": ("ring", [8, 32], [1, 2], 32, None, True, 2, 1, True, False),
    # head strategy: documents that span ranks, lengths the segments do not tile, plus a mask
    "head_docs": ("head", [4, 8, 16], [1, 2, 4], 32, [0, 11, 11, 27, 32], True, 4, 2, True, False),
    # ... and without a key mask: only the padding of short documents is masked (``batching.pads``); the last
    # document (5 rows) and the one before it (11 rows, beside a whole 16-row one) are padded. Not causal: causal
    # rows never see the pad keys after them, so a lost pad mask shows only here
    "head_docs_unmasked": ("head", [4, 8, 16], [1, 2, 4], 32, [0, 16, 27, 32], False, 4, 2, False, False),
    # head strategy pads a global length the segments do not tile (36 = 3 x 12, segment 16)
    "head_pad": ("head", [8, 16], [1, 2], 36, None, False, 3, 3, False, True),
}


def _all_cases(rank, world):
    return {name: _rank_case(rank, world, *case) for name, case in CASES.items()
            if name != "head_pad" or world == 3}


@pytest.fixture(scope="module")
def ranks2():
    return spawn_ranks(_all_cases, 2)


@pytest.fixture(scope="module")
def ranks3():
    return spawn_ranks(_rank_case, 3, *CASES["head_pad"])


@pytest.mark.parametrize("case", [c for c in CASES if c != "head_pad"])
def test_sequence_parallel_masks_match_oracle(ranks2, case):
    for rank, res in enumerate(ranks2):
        for name, err in res[case].items():
            assert err <= 1e-10, (case, rank, name, err)


def test_head_strategy_pads_internally(ranks3):
    for rank, res in enumerate(ranks3):
        for name, err in res.items():
            assert err <= 1e-10, (rank, name, err)


def _ring_rejects_untiled_docs(rank, world):
    from dilated_attention.comm import get_backend

    x = torch.randn(1, 8, 2, 8)
    messages = []
    for docs in ([0, 5, 16], [0, 8, 13, 16]):  # (a 5-row document runs whole on one rank, the others dealt)
        try:
            dilated_attention(x, x, x, [4], [1], comm=get_backend("collective"), strategy="ring",
                              pad_to_segments=False, cu_seqlens=torch.tensor(docs, dtype=torch.int32))
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_ring_refuses_untiled_documents_without_padding_on_every_rank():
    for messages in spawn_ranks(_ring_rejects_untiled_docs, 2):
        for message in messages:  # every rank names the document, whichever rank would run it
            assert "cu_seqlens: a document of 5 rows" in message and "pad_to_segments=True" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke of the benchmark script (Triton's interpreter "
                    "is off on CUDA machines); there the benchmark itself runs")
def test_mask_benchmark_smoke(tmp_path):
    import os
    import sys


    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_masks

    result = bench_masks.main(["--smoke", "--causal", "0", "--out", str(tmp_path)])
    cases = [r["case"].split(" ")[0] for r in result["records"]]
    assert cases[:3] == ["key_padding_mask", "docs_equal", "docs_varlen"]
    for r in result["records"]:
        assert r["kernel"] == "fused" and r["ms"] > 0 and r["baseline_ms"] > 0
        assert r["ratio"] == round(r["ms"] / r["baseline_ms"], 4)
    assert (tmp_path / "masks_smoke.json").exists()


@pytest.mark.parametrize("masked", [False, True])
def test_back_to_back_documents_run_as_a_view_and_match_the_oracle(masked):
    cu = _docs(16, 16, 16, 8)  # three whole 16-row documents in a row: a (3, 16) view, no mask
    q, k, v, dout, gen = _inputs(10, 1, 56, 2, 2, 8)
    mask = (torch.rand(1, 56, generator=gen) < 0.3) if masked else None
    kw = dict(cu_seqlens=cu, key_padding_mask=mask, causal=True)
    got = _fwd_bwd(dilated_attention, q, k, v, dout, [8, 16], [1, 2], **kw)
    want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, [8, 16], [1, 2], **kw)
    _assert_same(got, want)


def test_whole_documents_need_no_mask_so_any_kernel_runs_them():
    """Documents that fill their batch rows exactly run unmasked: a kernel without key masks (``sdpa``) takes them,
    matching the oracle, and ``auto`` keeps its unmasked choice; documents that need padding still ask for a
    kernel that takes masks."""
    q, k, v, dout, _ = _inputs(11, 1, 64, 2, 2, 8, dtype=torch.float32)
    for lengths in ((16, 16, 32), (16, 32, 16)):  # equal documents side by side (a view) or apart (copied)
        kw = dict(cu_seqlens=_docs(*lengths), causal=True)
        got = _fwd_bwd(dilated_attention, q, k, v, dout, [8, 16], [1, 2], kernel="sdpa", **kw)
        want = _fwd_bwd(dense_dilated_attention, q, k, v, dout, [8, 16], [1, 2], **kw)
        _assert_same(got, want, tol=1e-5)
    with pytest.raises(ValueError, match="kernel='sdpa'.*key mask"):
        dilated_attention(q, k, v, [8, 16], [1, 2], kernel="sdpa", cu_seqlens=_docs(16, 12, 36))


def test_debug_mode_records_masks_and_documents_for_the_repro():
    from dilated_attention.diagnostics import debug

    q = torch.randn(1, 24, 2, 8)
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[0, 3:7] = True
    with debug.debug(shadow=0.0, sync=False):
        debug.clear_history()
        dilated_attention(q, q, q, [8, 16], [1, 2], key_padding_mask=mask, pad_to_segments=True,
                          cu_seqlens=torch.tensor([0, 10, 24], dtype=torch.int32))
        meta = debug.last_calls()[-1]
    assert meta["cu_seqlens"] == [0, 10, 24]
    assert meta["key_padding_mask"]["shape"] == [1, 24]
    assert meta["kwargs"]["pad_to_segments"] is True


def test_fuzzer_does_not_replay_after_a_sticky_cuda_fault():
    """A fault that leaves the CUDA context unusable is reported as found (no narrowing replay, which would
    die on the next CUDA call before writing the repro)."""
    from dilated_attention.diagnostics.fuzz import _sticky

    assert _sticky("KernelError: CUDA error: misaligned address in kernel 'fused'.forward_pattern_into")
    assert _sticky("RuntimeError: an illegal memory access was encountered")
    assert not _sticky("ValueError: segment_lengths[0]=3 must divide 16") and not _sticky(None)
