"""The head swap's layouts (head_parallel.py): where received rows are read in place, and the inverses."""

import pytest
import torch

from dilated_attention.comm.stamps import block_tail
from dilated_attention.head_parallel import (HeadSplit, _by_member_heads, _by_member_rows, _kv_by_member,
                                             _merge_heads, _packed, member_rows)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("team", [2, 3])
def test_rows_follow_member_blocks_as_views_at_batch_1(team):
    """The team's rows at batch 1: sending them and reading them back copies nothing (as DeepSpeed Ulysses)."""
    rows = _x(1, team * 6, 2, 4)
    blocks = _by_member_rows(rows, team)
    assert blocks.data_ptr() == rows.data_ptr() and blocks.is_contiguous()
    back = member_rows(blocks)
    assert back.data_ptr() == blocks.data_ptr() and torch.equal(back, rows)


@pytest.mark.parametrize("bsz, team", [(2, 2), (3, 4)])
def test_rows_above_batch_1_round_trip(bsz, team):
    rows = _x(bsz, team * 4, 2, 4, seed=1)
    blocks = _by_member_rows(rows, team)
    assert blocks.shape == (team, bsz, 4, 2, 4) and torch.equal(blocks[1], rows[:, 4:8])
    assert torch.equal(member_rows(blocks), rows)


@pytest.mark.parametrize("zigzag_team", [2, 3])
def test_zigzag_rows_round_trip(zigzag_team):
    """Member m holds chunks m and 2A-1-m of the team's rows; both directions invert each other."""
    a = zigzag_team
    rows = _x(2, a * 8, 1, 2, seed=2)
    blocks = _by_member_rows(rows, a, zigzag=True)
    for m in range(a):
        assert torch.equal(blocks[m, :, :4], rows[:, m * 4:(m + 1) * 4])
        assert torch.equal(blocks[m, :, 4:], rows[:, (2 * a - 1 - m) * 4:(2 * a - m) * 4])
    assert torch.equal(member_rows(blocks, zigzag=True), rows)


def test_heads_by_member_and_merge_invert():
    x = _x(2, 5, 6, 4, seed=3)  # 6 heads over a team of 3
    blocks = _by_member_heads(x, 3)
    assert torch.equal(blocks[2], x[:, :, 4:6])
    assert torch.equal(_merge_heads(blocks), x)


@pytest.mark.parametrize("heads, kv_heads, team", [(8, 4, 2), (8, 2, 4), (6, 2, 3)])
def test_kv_heads_each_member_reads(heads, kv_heads, team):
    split = HeadSplit(heads, kv_heads, team)
    k = _x(1, 3, kv_heads, 4, seed=4)
    blocks = _kv_by_member(k, split)
    assert blocks.shape[3] == split.local_kv_heads
    for m in range(team):
        assert torch.equal(blocks[m], k[:, :, split.kv_sources(m)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz", [1, 2])
def test_packed_rows_hold_each_tensor_and_the_stamp_apart(dtype, bsz):
    """q, k, v packed side by side in each row: each view holds its tensor, the stamp's room (the last 16 bytes of
    each member block) touches none of them, every start is 16-byte aligned, and at batch 1 the member-order rows
    are a view with one row stride."""
    team, rows = 3, 5
    shapes = [(team, bsz, rows, 4, 6), (team, bsz, rows, 1, 6), (team, bsz, rows, 1, 6)]  # GQA, odd head dim
    sources = [_x(*s, seed=10 + i).to(dtype) for i, s in enumerate(shapes)]
    buffer, views = _packed(shapes, sources[0])
    for view, x in zip(views, sources):
        view.copy_(x)
    block_tail(buffer).copy_(torch.arange(4 * team, dtype=torch.int32).view(team, 4))
    for view, x in zip(views, sources):
        assert view.data_ptr() % 16 == 0 and view.stride(2) % (16 // dtype.itemsize) == 0
        assert torch.equal(view, x), "the stamp's room overlaps a tensor"
    assert block_tail(buffer).tolist() == torch.arange(4 * team).view(team, 4).tolist()
    again = _packed(shapes, buffer, buffer)[1]  # the receiver's views of the same layout
    assert all(torch.equal(a, x) for a, x in zip(again, sources))
    team_rows = member_rows(again[0])
    assert torch.equal(team_rows, torch.cat(list(sources[0].unbind(0)), dim=1))
    if bsz == 1:
        assert team_rows.data_ptr() == buffer.data_ptr(), "batch 1: read in place"
