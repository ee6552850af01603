"""strategy="auto": the team size the scaling benchmark measured fastest (dilated_attention/auto_strategy.py)."""

import glob
import os

import pytest

from dilated_attention import memory
from dilated_attention.auto_strategy import MEASURED, MEASURED_ON, auto_team_size, pattern_spans
from dilated_attention.testing.scripts import load_script

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


# forward+backward ms at K=2, eager / replayed (scaling_h200_x2.json; scaling_h100_x2.json)
@pytest.mark.parametrize("patterns, causal, layout, team", [
    (LONGNET, False, "contiguous", 1),  # ring 16.5 / 13.4, head 15.6 / 15.4: head's replay 1.15x the ring's
    (LONGNET, True, "contiguous", 1),  # ring 11.3 / 8.1, head 11.8 / 10.5
    (FULL, False, "contiguous", 2),  # ring 106.7 / 106.5, head 105.0 / 104.8: within 3%, head's peak 0.47x
    (FULL, True, "contiguous", 2),  # ring 59.2 / 58.3, head 57.1 / 57.1
    (LONGNET, False, "zigzag", 2),  # ring 19.4 / 15.5, head 16.5 / 16.2: the ring's eager 1.18x head's
    (LONGNET, True, "zigzag", 2),  # ring 16.5 / 10.1, head 11.6 / 11.4
    (FULL, False, "zigzag", 2),  # ring 107.0 / 106.1, head 105.7 / 105.3: within 3%, head's peak 0.47x
    (FULL, True, "zigzag", 2),  # ring 58.2 / 57.3 (balanced), head 57.7 / 57.5: within 3%, head's peak 0.66x
])
def test_two_gpu_measurements(patterns, causal, layout, team):
    """The H200 table serves any GPU model measured no otherwise (or none: CPU); the H100 chose the same."""
    for gpu in (None, "NVIDIA H200", H100, "Some Other GPU"):
        assert _team(patterns, causal, layout=layout, gpu=gpu) == team, gpu


def _plot_scaling():
    """benchmarks/plot_scaling.py, whose ``auto_choices`` is the table's rule."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_script(os.path.join(root, "benchmarks", "plot_scaling.py")), root


def test_the_tables_are_the_rule_applied_to_the_pinned_runs():
    """Every pinned default run (not under ``--memory-bound`` or ``--pipelined``: those measure other settings than
    the ones ``auto`` serves): ``tests/data/scaling_*_x2.json`` are copies of the runs the tables were set from, so
    a new benchmark run changes what this checks only when it is copied there with the tables it implies."""
    plot_scaling, root = _plot_scaling()
    runs = sorted(glob.glob(os.path.join(root, "tests", "data", "scaling_*_x2.json")))
    default_bound = [memory.DEFAULT_SCRATCH_SHARE, memory.DEFAULT_SCRATCH_FLOOR]
    checked = 0
    for path in runs:
        records, (meta,) = plot_scaling.load([path])
        if meta.get("pipelined") or meta.get("memory_bound", default_bound) != default_bound:
            continue
        assert plot_scaling.auto_choices(records) == MEASURED_ON.get(meta["gpu"], MEASURED), path
        checked += 1
    assert checked >= 2  # the H200 and the H100 runs


def test_the_rule_weighs_eager_and_replayed_times():
    plot_scaling, _ = _plot_scaling()

    def run(ring, head, layout="contiguous"):  # (eager ms, replayed ms) per strategy, full causal attention
        return [{"impl": impl, "strategy": s, "config": "full", "causal": True, "gpus": 2, "tokens_per_gpu": 32768,
                 "layout": layout, "ms": times[i]} for s, times in (("ring", ring), ("head", head))
                for i, impl in enumerate(("ours", "ours+graph"))]

    assert plot_scaling.auto_choices(run((10.0, 8.0), (9.5, 9.0))) == {(True, True, "contiguous"): "ring"}
    assert plot_scaling.auto_choices(run((12.0, 8.0), (9.0, 8.2))) == {(True, True, "contiguous"): "head"}
    assert plot_scaling.auto_choices(run((10.2, 8.2), (10.0, 8.0))) == {(True, True, "contiguous"): "ring"}  # tie
    eager_only = [r for r in run((10.0, 0.0), (9.0, 0.0)) if r["impl"] == "ours"]
    assert plot_scaling.auto_choices(eager_only) == {(True, True, "contiguous"): "head"}


@pytest.mark.parametrize("ring_peak, head_peak, choice", [
    (4.0, 1.9, "head"),  # a tie goes to the strategy holding clearly less memory
    (4.0, 3.8, "ring"),  # ... not to one within 10% of the ring's peak: the simpler ring
    (1.4, 2.0, "ring"),
    (None, None, "ring"),  # a run without peaks (CPU): the ring
])
def test_a_tie_goes_to_the_leaner_strategy(ring_peak, head_peak, choice):
    plot_scaling, _ = _plot_scaling()
    peaks = {"ring": ring_peak, "head": head_peak}
    records = [{"impl": impl, "strategy": s, "config": "full", "causal": False, "gpus": 2, "tokens_per_gpu": 32768,
                "ms": ms, "peak_gib": peaks[s]} for s, ms in (("ring", 10.2), ("head", 10.0)) for impl in ("ours",)]
    assert plot_scaling.auto_choices(records) == {(True, False, "contiguous"): choice}
    records[1]["ms"] = 11.0  # head 8% slower: beyond the tie the faster strategy wins, whatever its memory
    assert plot_scaling.auto_choices(records)[True, False, "contiguous"] == "ring"


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
