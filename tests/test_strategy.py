"""strategy="auto": the team size the scaling benchmark measured fastest (dilated_attention/strategy.py)."""

import pytest

from dilated_attention.strategy import MEASURED, MEASURED_ON, auto_team_size, pattern_spans

LONGNET = ([2048, 8192, 32768, 65536], [1, 2, 4, 8])  # N = 65536 on 2 ranks of 32768
FULL = ([65536], [1])


def _team(patterns, causal, world=2, heads=16, **kw):
    spans, dense = pattern_spans(*patterns, 32768 * world, 32768)
    return auto_team_size(world, heads, kw.pop("kv_heads", heads), causal=causal, spans=spans, dense=dense, **kw)


def test_pattern_spans():
    assert pattern_spans(*LONGNET, 65536, 32768) == (True, False)  # only (65536, 8) spans
    assert pattern_spans(*FULL, 65536, 32768) == (True, True)
    assert pattern_spans([2048, 8192], [1, 2], 65536, 32768) == (False, False)
    assert pattern_spans([10**9], [1], 4096, 4096) == (False, False)  # clamped to the sequence


@pytest.mark.parametrize("patterns, causal, layout, team", [
    (LONGNET, False, "contiguous", 1),  # ring 16.2 ms, head 17.4
    (LONGNET, True, "contiguous", 2),  # ring 16.6, head 13.7
    (FULL, False, "contiguous", 1),  # ring 145.3, head 141.1: within 3%, the simpler ring
    (FULL, True, "contiguous", 2),  # ring 108.8 (unbalanced), head 70.3
    (LONGNET, False, "zigzag", 2),  # ring 19.7, head 18.2
    (LONGNET, True, "zigzag", 2),  # ring 20.2, head 14.6
    (FULL, False, "zigzag", 1),  # ring 144.8, head 141.9: within 3%
    (FULL, True, "zigzag", 1),  # ring 72.5 (balanced), head 71.4: within 3%
])
def test_two_gpu_measurements(patterns, causal, layout, team):
    assert _team(patterns, causal, layout=layout) == team


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("patterns, causal, layout, team", [
    (LONGNET, False, "contiguous", 1),  # ring 15.7 ms, head 16.9
    (LONGNET, True, "contiguous", 1),  # ring 11.8, head 12.4
    (FULL, False, "contiguous", 1),  # ring 108.0, head 105.1: within 3%
    (FULL, True, "contiguous", 2),  # ring 61.7, head 58.1
    (LONGNET, False, "zigzag", 2),  # ring 26.3, head 17.9
    (LONGNET, True, "zigzag", 2),  # ring 17.5, head 13.9
    (FULL, False, "zigzag", 1),  # ring 109.2, head 107.1: within 3%
    (FULL, True, "zigzag", 1),  # ring 59.3 (balanced), head 59.1: within 3%
])
def test_two_h100_measurements(patterns, causal, layout, team):
    """On an H100 its own measured choices apply; any other model (or none: CPU) takes the H200 table."""
    assert _team(patterns, causal, layout=layout, gpu=H100) == team
    assert _team(patterns, causal, layout=layout, gpu="Some Other GPU") == _team(patterns, causal, layout=layout)


def test_every_gpu_table_covers_every_case():
    for gpu, table in MEASURED_ON.items():
        assert set(table) == set(MEASURED), gpu
        assert set(table.values()) <= {"ring", "head"}, gpu


def test_local_patterns_need_no_exchange():
    assert auto_team_size(4, 16, 16, causal=True, spans=False, dense=False) == 1
    assert auto_team_size(1, 16, 16, causal=True, spans=True, dense=True) == 1


def test_head_preferred_but_impossible_or_across_nodes():
    # 4 ranks, 6 heads: no head split; a team of 2 divides both
    assert _team(FULL, True, world=4, heads=6) == 2
    assert _team(FULL, True, world=3, heads=4) == 1  # no team at all: the ring
    # 16 ranks on nodes of 8: the all-to-all stays inside a node, the ring crosses nodes
    assert _team(FULL, True, world=16, heads=16, local_world=8) == 8
    assert _team(FULL, True, world=8, heads=16, local_world=8) == 8  # one node: head


def test_whole_sequence_calls_take_head():
    assert _team(LONGNET, False, whole_sequence=True) == 2
    assert _team(LONGNET, False, world=3, heads=4, whole_sequence=True) == 1


def test_layout_hook_and_table():
    assert set(MEASURED) == {(d, c, lay) for d in (False, True) for c in (False, True)
                             for lay in ("contiguous", "zigzag")}
    assert set(MEASURED.values()) <= {"ring", "head"}
    assert _team(FULL, True, layout="zigzag") in (1, 2)
    with pytest.raises(ValueError, match="layout"):
        _team(FULL, True, layout="striped")


def test_kv_heads():
    assert _team(FULL, True, kv_heads=4) == 2  # grouped-query heads: the same choice
    with pytest.raises(ValueError, match="kv heads"):
        _team(FULL, True, kv_heads=3)
