"""Calls that run but most likely compute something the caller did not mean warn once, at the caller's line:
a segment clamped to a short sequence, a heads-first ``(B, H, N, D)`` input, every rank passing the same ``q``
with ``comm`` (two spawned gloo ranks)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from dilated_attention import clear_caches, dilated_attention
from dilated_attention.misuse import MisuseWarning, data_sample
from dilated_attention.testing.oracle import dense_dilated_attention
from dilated_attention.testing.spawn import spawn_ranks


def _qkv(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)]


def _calls(fn, times: int = 3) -> list[warnings.WarningMessage]:
    """The warnings ``times`` calls of ``fn`` show under Python's default filter (once per message and line)."""
    clear_caches()  # a planned call is cached: plan it anew, as a fresh process would
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(times):
            fn()
    return [w for w in caught if issubclass(w.category, MisuseWarning)]


def test_a_clamped_segment_warns_once_at_the_callers_line():
    q, k, v = _qkv((2, 48, 4, 8))
    pad = torch.zeros(2, 48, dtype=torch.bool)
    pad[1, 40:] = True  # (a key mask: planned on every call, so the filter, not a cache, keeps it to one)
    seen = _calls(lambda: dilated_attention(q, k, v, [16, 64], [1, 2], key_padding_mask=pad))
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert seen[0].filename == __file__
    assert "shorter than segment_lengths' largest, 64 tokens" in str(seen[0].message)
    # what it computes is the clamped pattern: the same rows as segments [16, 48], which do not warn
    with pytest.warns(MisuseWarning):
        out = dilated_attention(q, k, v, [16, 64], [1, 2], key_padding_mask=pad)
    assert not _calls(lambda: dilated_attention(q, k, v, [16, 48], [1, 2], key_padding_mask=pad))
    want = dense_dilated_attention(q, k, v, [16, 48], [1, 2], key_padding_mask=pad)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("length, segments, documents", [
    (1000, [256, 1024], None),   # padded to 1024 internally: nothing is clamped
    (700, [128, 256], [0, 300, 550, 700]),  # short documents clamp their own segments, as meant
    (64, [32, 64], None),
])
def test_no_warning_where_nothing_is_clamped_or_clamping_is_meant(length, segments, documents):
    q, k, v = _qkv((1, length, 4, 8))
    cu = None if documents is None else torch.tensor(documents, dtype=torch.int32)
    assert not _calls(lambda: dilated_attention(q, k, v, segments, [1, 2], cu_seqlens=cu), times=1)


@pytest.mark.parametrize("shape, segments", [
    ((1, 4, 64, 8), [16, 32]),      # every segment clamped to 4 "tokens" of 64 "heads"
    ((1, 8, 16, 8), [4, 16]),       # the longest clamped, more "heads" than "tokens"
    ((1, 16, 2048, 8), [8, 16]),    # nothing clamped, but 2048 "heads": no model has that many
])
def test_heads_first_input_warns_with_the_fix(shape, segments):
    q, k, v = _qkv(shape)
    seen = _calls(lambda: dilated_attention(q, k, v, segments, [1, 2]))
    assert len(seen) == 1 and seen[0].filename == __file__
    assert f"read as (B, N, H, D): {shape[1]} tokens and {shape[2]} heads" in str(seen[0].message)
    assert "q.transpose(1, 2)" in str(seen[0].message)


def test_the_right_layout_with_many_tokens_does_not_warn_of_heads():
    q, k, v = _qkv((1, 64, 16, 8))
    assert not _calls(lambda: dilated_attention(q, k, v, [32, 64], [1, 2]), times=1)


def test_data_sample_reads_values_and_skips_what_it_cannot_read():
    q = torch.randn(2, 40, 3, 8, dtype=torch.bfloat16)
    sample = data_sample(q)
    assert sample[0] == 1 and sample.dtype == torch.int64 and len(sample) == 9
    # the values are q's own, at positions spread over the rows (first and last row included)
    values = sample[1:].view(torch.float64)
    assert values[0] == q[0, 0, 0, 0].double() and values[-1] == q[1, 39, 5 * 7 % 3, 3 * 7 % 8].double()
    assert torch.equal(data_sample(None), torch.zeros(9, dtype=torch.int64))
    assert torch.equal(data_sample(torch.empty(0, 4, 2, 8)), torch.zeros(9, dtype=torch.int64))


def _ranks_worker(rank: int, world: int, same: bool) -> dict:
    g = torch.Generator().manual_seed(0 if same else rank)  # same: every rank holds the same "shard"
    q, k, v = (torch.randn(1, 32, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning raised, not once per line: the check itself runs once
        for _ in range(3):
            out = dilated_attention(q, k, v, [16, 64], [1, 2], comm="collective", strategy="ring")
    mine = [w for w in caught if issubclass(w.category, MisuseWarning)]
    return {"messages": [str(w.message) for w in mine], "files": [os.path.basename(w.filename) for w in mine],
            "finite": bool(torch.isfinite(out).all())}


@pytest.mark.parametrize("same", [True, False])
def test_identical_shards_under_comm_warn_on_every_rank_once(same):
    results = spawn_ranks(_ranks_worker, 2, same)
    for rank, res in enumerate(results):
        assert res["finite"]
        if same:
            assert len(res["messages"]) == 1, (rank, res)
            assert "every one of the 2 ranks passed the same q" in res["messages"][0]
            assert "shard_sequence" in res["messages"][0]
            assert res["files"] == [os.path.basename(__file__)]
        else:
            assert res["messages"] == [], (rank, res)
