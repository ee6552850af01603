"""The head swap's layouts (head_parallel.py): where received rows are read in place, the inverses, and which kv
heads each member receives (against GQA's rule written out here: query head ``h`` reads kv head ``h // group``)."""

import pytest
import torch

from dilated_attention.head_parallel import (HeadSplit, _by_member_heads, _by_member_rows, _kv_by_member,
                                             _merge_heads, member_rows)


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


@pytest.mark.parametrize("heads, kv_heads, team", [(8, 4, 2), (8, 2, 4), (6, 2, 3), (12, 3, 2), (6, 3, 3), (4, 1, 2)])
def test_each_members_query_heads_get_the_kv_heads_gqa_assigns_them(heads, kv_heads, team):
    """Member ``m`` computes query heads ``[m H / A, (m + 1) H / A)``; its local query head ``j`` reads local kv head
    ``j // (local heads / local kv heads)``, which must hold global kv head ``(m H / A + j) // (H / Hkv)``."""
    split = HeadSplit(heads, kv_heads, team)
    k = _x(2, 3, kv_heads, 4, seed=5)
    blocks = _kv_by_member(k, split)
    local, local_kv = heads // team, split.local_kv_heads
    assert local % local_kv == 0
    for m in range(team):
        for j in range(local):
            want = (m * local + j) // (heads // kv_heads)
            assert torch.equal(blocks[m][:, :, j // (local // local_kv)], k[:, :, want]), (m, j)
