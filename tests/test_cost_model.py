"""The cost model's arithmetic on cases small enough to do by hand (no timing)."""

import json

import pytest

from dilated_attention.cost_model import (
    Hardware, Problem, alltoall_ms, best, hybrid_team, config_patterns, longnet_patterns, main, packed_pairs,
    pattern_flops, predict, ring_ms, single_gpu_ms, validate,
)

# 1 FLOP per ms and 1 byte per ms make every time below a count of flops or bytes.
UNIT = Hardware(tflops=1e-9, nvlink_gbps=1e-6, ib_gbps=0.5e-6, gpus_per_node=8, latency_us=0.0)


def test_pattern_flops_by_hand():
    # 8 rows, segments of 4, rate 2: 2 segments x (2 x 2 scores) x 2 matmuls x 2 flops x D=1 = 32
    assert pattern_flops(8, 4, 2, heads=1, head_dim=1) == 32
    assert pattern_flops(8, 4, 2, heads=1, head_dim=1, causal=True) == 16
    assert pattern_flops(8, 4, 2, heads=3, head_dim=5, batch=2) == 32 * 3 * 5 * 2


def test_longnet_patterns_drop_and_clamp():
    assert longnet_patterns(262144) == [(2048, 1), (8192, 2), (32768, 4), (131072, 8), (262144, 16)]
    assert longnet_patterns(131072) == [(2048, 1), (8192, 2), (32768, 4), (131072, 8)]
    assert longnet_patterns(65536) == [(2048, 1), (8192, 2), (32768, 4), (65536, 8)]
    assert longnet_patterns(32768) == [(2048, 1), (8192, 2), (32768, 4)]
    assert longnet_patterns(1024) == [(1024, 1)]
    assert longnet_patterns(64, [16, 32], [1, 2, 4]) == [(16, 1), (32, 2), (64, 4)]
    assert config_patterns("full", 4096) == [(4096, 1)]
    with pytest.raises(ValueError, match="one more entry"):
        longnet_patterns(64, [16, 32], [1, 2])
    with pytest.raises(ValueError, match="config"):
        config_patterns("sparse", 64)


def test_packed_pairs():
    assert packed_pairs(16, 16, 4) == 16  # MHA: each head its own kv head, one offset each
    assert packed_pairs(16, 4, 4) == 4  # offsets h // 4 coincide with the kv groups
    assert packed_pairs(16, 4, 1) == 4  # one offset
    assert packed_pairs(16, 1, 4) == 4  # MQA: one kv head read at 4 offsets
    assert packed_pairs(16, 16, 2, (0, 8)) == 8


def test_single_gpu_time():
    p = Problem(8, ((4, 2),), heads=1, head_dim=1)
    assert single_gpu_ms(p, UNIT) == pytest.approx(3.5 * 32)


def _ring_problem(causal=False):
    # N=8 on 2 ranks (L=4), one pattern (8, 2) spanning both: a ring of 2
    return Problem(8, ((8, 2),), heads=1, head_dim=1, dtype_bytes=2, causal=causal)


def test_ring_compute_bound_by_hand():
    # block: 4 rows x 4 keys at rate 2 = 2x2 scores, 4 flops each -> 16 ms; K/V block 2*(4/2)*1*1 elems
    # = 8 bytes bf16 (8 ms), fp32 accumulators 16 ms.
    # fwd = max(16, 8) + 16 = 32; bwd = max(40, 8 + 16) + 40 + 16 (last accumulator hop) = 96
    compute, exposed = ring_ms(_ring_problem(), UNIT, 4)
    assert compute == pytest.approx(32 + 80)
    assert exposed == pytest.approx(16)
    pred = predict(_ring_problem(), 2, "ring", UNIT)
    assert pred.ms == pytest.approx(128)
    assert pred.t1_ms == pytest.approx(3.5 * 64)
    assert pred.efficiency == pytest.approx(224 / (2 * 128))


def test_ring_comm_bound_by_hand():
    slow = Hardware(tflops=1e-9, nvlink_gbps=0.25e-6, ib_gbps=0.25e-6, latency_us=0.0)  # 0.25 byte per ms
    compute, exposed = ring_ms(_ring_problem(), slow, 4)
    # fwd = max(16, 32) + 16 = 48; bwd = max(40, 32 + 64) + 40 + 64 = 200
    assert compute + exposed == pytest.approx(248)
    assert exposed == pytest.approx(248 - 112)


def test_causal_ring_imbalance_and_balance():
    # unbalanced: steps 8 (own block, causal) then 16 (the last rank's full block)
    # fwd = max(8, 8) + 16 = 24; bwd = max(20, 24) + 40 + 16 = 80
    compute, exposed = ring_ms(_ring_problem(True), UNIT, 4)
    assert compute + exposed == pytest.approx(104)
    assert predict(_ring_problem(True), 2, "ring", UNIT).efficiency == pytest.approx(112 / (2 * 104))
    # zigzag: every step 8; fwd = max(8, 8) + 8 = 16; bwd = max(20, 24) + 20 + 16 = 60
    compute, exposed = ring_ms(_ring_problem(True), UNIT, 4, balanced=True)
    assert compute + exposed == pytest.approx(76)


def test_local_patterns_cost_no_communication():
    p = Problem(16, ((4, 1), (8, 2)), heads=2, head_dim=3)
    compute, exposed = ring_ms(p, UNIT, 8)  # both patterns fit in a shard of 8
    assert exposed == 0
    assert compute == pytest.approx(3.5 * (pattern_flops(8, 4, 1, heads=2, head_dim=3)
                                           + pattern_flops(8, 8, 2, heads=2, head_dim=3)))
    assert predict(p, 2, "ring", UNIT).efficiency == pytest.approx(1.0)


def test_alltoall_by_hand():
    assert alltoall_ms(16, 2, UNIT) == pytest.approx(8)  # half of 16 bytes leaves, at 1 byte/ms
    assert alltoall_ms(16, 1, UNIT) == 0
    two_nodes = Hardware(tflops=1e-9, nvlink_gbps=1e-6, ib_gbps=0.5e-6, gpus_per_node=2, latency_us=0.0)
    # 4 ranks on 2 nodes, 40 bytes: 10 stay on the node (10 ms), 20 cross at 0.5 byte/ms (40 ms)
    assert alltoall_ms(40, 4, two_nodes) == pytest.approx(40)


def test_head_strategy_by_hand():
    p = Problem(8, ((8, 1),), heads=2, head_dim=1, dtype_bytes=2)
    # T1 = 3.5 * 4 * 2 heads * 8 * 8 = 1792, computed in halves; each all-to-all moves 8 of its 16 bytes:
    # q, k, v, out forward and dout, dq, dk, dv backward = 8 x 8 ms
    pred = predict(p, 2, "head", UNIT)
    assert pred.compute_ms == pytest.approx(896)
    assert pred.exposed_comm_ms == pytest.approx(64)
    assert predict(p, 4, "head", UNIT) is None  # 4 does not divide 2 heads


def test_hybrid_and_links():
    p = Problem(2**20, tuple(longnet_patterns(2**20)), heads=16)
    assert predict(p, 2, "hybrid") is None  # no team between 1 and 2
    assert predict(p, 4, "hybrid").notes == ["a2a teams of 2"]  # one node: largest proper divisor
    assert predict(p, 64, "hybrid").notes == ["a2a teams of 8"]  # across nodes: a node per team
    assert hybrid_team(12, 16, Hardware(gpus_per_node=12)) == 4
    # a ring that leaves the node runs at InfiniBand speed: slower than the same ring inside a node
    fat = Hardware(gpus_per_node=64)
    assert predict(p, 64, "ring").exposed_comm_ms >= predict(p, 64, "ring", fat).exposed_comm_ms
    assert best(p, 8).strategy in ("ring", "head")


def test_bad_inputs():
    with pytest.raises(ValueError, match="strategy"):
        predict(_ring_problem(), 2, "tree")
    with pytest.raises(ValueError, match="gpus"):
        predict(_ring_problem(), 0)
    with pytest.raises(ValueError, match="tflops"):
        Hardware(tflops=0)


def test_validate_round_trip(tmp_path):
    """A measurement equal to the model's own prediction validates with 0% error."""
    hw = Hardware()
    records = []
    for cfg, causal, k in (("longnet", False, 2), ("full", True, 4)):
        n = 4096 * k
        p = Problem(n, tuple(config_patterns(cfg, n)), heads=16, head_dim=128, causal=causal)
        pred = predict(p, k, "ring", hw)
        records.append({"impl": "ours", "strategy": "ring", "config": cfg, "causal": causal, "gpus": k,
                        "tokens_per_gpu": 4096, "ms": pred.ms, "efficiency": pred.efficiency, "peak_gib": 1.0})
    records.append({"impl": "torch_cp", "strategy": "ring", "config": "full", "causal": True, "gpus": 4,
                    "tokens_per_gpu": 4096, "ms": 1.0, "efficiency": 0.5, "peak_gib": 1.0})
    path = tmp_path / "scaling_test_x4.json"
    path.write_text(json.dumps({"meta": {"heads": 16, "head_dim": 128, "batch": 1}, "records": records}))
    rows = validate([str(path)], hw)
    assert len(rows) == 2  # the peer is not modelled
    for r in rows:
        assert r["error_pct"] == pytest.approx(0.0, abs=1e-6)
        assert r["tflops"] == pytest.approx(hw.tflops)


def test_cli_prints_a_table(capsys):
    assert main(["--tokens", "65536", "--gpus", "2,4", "--causal", "yes"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 32,768 | yes | ring |" in out
    assert "| 4 | 16,384 | yes | head |" in out
