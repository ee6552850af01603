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


H100 = "NVIDIA H100 80GB HBM3"


# forward+backward ms at K=2 (scaling_h200_x2.json; scaling_h100_x2.json): both GPU models chose the same
@pytest.mark.parametrize("patterns, causal, layout, team", [
    (LONGNET, False, "contiguous", 1),  # ring 14.0, head 15.6; H100 ring 16.7, head 17.6
    (LONGNET, True, "contiguous", 1),  # ring 11.9, head 12.4; H100 15.0, 14.7: within 3%
    (FULL, False, "contiguous", 1),  # ring 106.1, head 104.1: within 3%, the simpler ring; H100 108.0, 106.8
    (FULL, True, "contiguous", 2),  # ring 59.1, head 57.2; H100 62.5, 59.0
    (LONGNET, False, "zigzag", 2),  # ring 22.5, head 17.2; H100 23.6, 18.1
    (LONGNET, True, "zigzag", 2),  # ring 20.3, head 13.3; H100 28.3, 17.3
    (FULL, False, "zigzag", 1),  # ring 106.2, head 104.9: within 3%; H100 108.8, 107.8
    (FULL, True, "zigzag", 1),  # ring 58.7 (balanced), head 58.1: within 3%; H100 60.8, 60.4
])
def test_two_gpu_measurements(patterns, causal, layout, team):
    """The one table serves both measured models, and any other (or none: CPU)."""
    for gpu in (None, "NVIDIA H200", H100, "Some Other GPU"):
        assert _team(patterns, causal, layout=layout, gpu=gpu) == team, gpu


def test_a_gpu_model_with_its_own_measurements_gets_them(monkeypatch):
    monkeypatch.setitem(MEASURED_ON, "Some Other GPU", {**MEASURED, (False, True, "contiguous"): "head"})
    assert _team(LONGNET, True, gpu="Some Other GPU") == 2
    assert _team(LONGNET, True, gpu=H100) == 1


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
