"""The scaling benchmark end to end on 2 CPU ranks (gloo, --smoke, --profile): schema, plots, cost-model check."""

import json
import math
import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_scaling  # noqa: E402
import gpu_tag  # noqa: E402
import plot_scaling  # noqa: E402

from cost_model_lib import validate  # noqa: E402
from dilated_attention.testing.spawn import UNINTERPRETED, run_torchrun  # noqa: E402

RECORD_KEYS = {"impl", "strategy", "config", "causal", "gpus", "tokens_per_gpu", "layout", "ms", "efficiency",
               "peak_gib", "own_gib"}


def test_gpu_tag_names_the_model():
    assert gpu_tag.gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_tag.gpu_tag("NVIDIA H100 PCIe") == "h100"
    assert gpu_tag.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_tag.gpu_tag("NVIDIA GeForce RTX 4090") == "rtx_4090"
    assert gpu_tag.gpu_tag("cpu") == "cpu"


def test_default_patterns():
    args = bench_scaling.parse_args([])
    assert bench_scaling.patterns_for(args, "longnet", 262144) == ([2048, 8192, 32768, 131072, 262144], [1, 2, 4, 8, 16])
    assert bench_scaling.patterns_for(args, "longnet", 65536) == ([2048, 8192, 32768, 65536], [1, 2, 4, 8])
    assert bench_scaling.patterns_for(args, "full", 65536) == ([65536], [1])
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--longnet-rates", "1,2"])
    assert bench_scaling.parse_args([]).memory_bound is None
    assert bench_scaling.parse_args(["--memory-bound", "0.4,0"]).memory_bound == (0.4, 0)
    for bad in ("0.4", "x,0", "0.4,-1", "-1,0"):
        with pytest.raises(SystemExit):
            bench_scaling.parse_args(["--memory-bound", bad])


def test_pipelined_parses_steps_per_iteration():
    assert bench_scaling.parse_args([]).pipelined == 0
    assert bench_scaling.parse_args(["--pipelined"]).pipelined == 8
    assert bench_scaling.parse_args(["--pipelined", "3"]).pipelined == 3
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            bench_scaling.parse_args(["--pipelined", bad])


@pytest.mark.parametrize("pipelined, steps", [(0, 1), (3, 3)])
def test_an_iteration_times_its_steps_back_to_back(pipelined, steps):
    """One timed iteration runs one step, or ``--pipelined``'s steps back to back, and records their mean."""
    import torch

    args = bench_scaling.parse_args(["--iters", "4", "--min-iters", "4", "--warmup", "2"]
                                    + (["--pipelined", str(pipelined)] if pipelined else []))
    bench = bench_scaling.Bench(types.SimpleNamespace(device=torch.device("cpu")), args)
    calls = []
    ms, peak = bench.measure(lambda: calls.append(1), collective=False)
    assert len(calls) == (2 + 4) * steps and peak is None and ms >= 0


@pytest.fixture(scope="module")
def smoke_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    proc = run_torchrun([os.path.join(ROOT, "benchmarks", "bench_scaling.py"), "--smoke", "--out", str(out), "--tag",
                         "smoke", "--profile", "--profile-trace", str(out / "traces"), "--compile"], cwd=ROOT,
                        done=f"wrote {out}", env={"DILATED_ATTENTION_TIMEOUT": "60", **UNINTERPRETED}, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "scaling_smoke_x2.json"


def test_smoke_json_schema(smoke_json):
    data = json.loads(smoke_json.read_text())
    meta, records = data["meta"], data["records"]
    assert meta["gpus"] == 2 and meta["heads"] == 2 and meta["single_gpu"]
    assert meta["memory_bound"] == [0.4, 1 << 32]  # the default rule: no --memory-bound
    for rec in records:
        extra = set(rec) - RECORD_KEYS
        assert extra == ({"max_tokens"} if extra else set()), rec
        assert rec["gpus"] == 2 and rec["ms"] > 0 and math.isfinite(rec["ms"])
        # B=1, 2 heads (kv heads too), D=8, float32: 8 tensors of tokens x 2 x 8 x 4 bytes
        assert rec["own_gib"] * 2**30 == 8 * rec["tokens_per_gpu"] * 2 * 8 * 4, rec
    assert all(s["own_gib"] * 2**30 == 8 * s["tokens"] * 2 * 8 * 4 for s in meta["single_gpu"])
    timed = [r for r in records if "max_tokens" not in r]
    ring = [r for r in timed if r["impl"] == "ours" and r["strategy"] == "ring"]
    assert {r["causal"] for r in ring} == {False, True}
    for r in ring:
        assert 0 < r["efficiency"] < 10  # T1 / (K * TK) from the same run
    # --compile: the same cases with the call inside torch.compile(mode="reduce-overhead"), against its own T1
    compiled = [r for r in timed if r["impl"] == "ours+compiled" and r["strategy"] == "ring"]
    assert meta["compile"] and {r["causal"] for r in compiled} == {False, True}
    assert all(0 < r["efficiency"] < 10 for r in compiled)
    assert {(s["impl"], s["causal"]) for s in meta["single_gpu"]} >= {("ours+compiled", False), ("ours+compiled", True)}
    # every requested strategy either ran or says why not
    for s in ("head", "hybrid"):
        for causal in (False, True):
            ran = any(r["strategy"] == s and r["causal"] == causal for r in timed)
            why = any(x["strategy"] == s and x["causal"] == causal and x["reason"] for x in meta["skipped"])
            assert ran or why, (s, causal)
    probe = [r for r in records if "max_tokens" in r]
    assert [r["tokens_per_gpu"] for r in probe] == [64, 128]  # doubled up to the smoke cap
    assert all(r["max_tokens"] == 256 for r in probe) and meta["probe"]["stop"] == "cap"
    # --profile on gloo: the cases ran under the profiler on both ranks, found no GPU kernels, recorded nothing
    assert data["profile"] == []
    prof = meta["profiling"]
    assert prof["cases"] == "ring,head" and prof["steps"] == 3 and prof["profiled"] == 0
    assert "no CUDA kernels" in prof["note"] and "failed" not in prof and "unfinished" not in prof
    traces = sorted(p.name for p in (smoke_json.parent / "traces").iterdir())
    assert len(traces) == 8 and "profile_x2_longnet_causal_head_contiguous_64_rank1.json" in traces


def test_plots_tables_and_validation(smoke_json, tmp_path):
    png, md = tmp_path / "s.png", tmp_path / "s.md"
    assert plot_scaling.main([str(smoke_json), "--png", str(png), "--md", str(md)]) == 0
    assert png.stat().st_size > 10_000
    table = md.read_text()
    assert "| ours | ring | longnet | no |" in table and "| 2 | 256 | 128 |" in table
    assert "Profile: no CUDA kernels in the profile" in table and "Where communication is exposed" not in table
    meta = json.loads(smoke_json.read_text())["meta"]
    assert f"Runs: K=2 {meta['date'][:16]}: `{meta['command']}`" in table  # each column says which run it is
    rows = validate([str(smoke_json)])
    assert {(r["strategy"], r["causal"]) for r in rows} >= {("ring", False), ("ring", True)}
    assert all(math.isfinite(r["error_pct"]) for r in rows)


def test_probe_bisects_towards_the_first_size_that_does_not_fit(monkeypatch):
    """Sizes up to 5 x 64 tokens fit: doubling stops at 512 (OOM), bisection tries 384 (OOM), then 320 (runs);
    the next midpoint in whole multiples of 64 is 320 again, so it stops there."""
    tried = []

    def step(bench, comm, strategy, tokens):
        tried.append(tokens)
        return (None, 1.0, tokens / 64) if tokens <= 320 else ("OOM", 1.0, None)

    monkeypatch.setattr(bench_scaling, "_probe_step", step)
    records, meta = [], {}
    bench_scaling.probe(_probe_bench(lambda seconds: seconds), None, (None, "ring"), records, meta, _NO_PROGRESS)
    assert tried == [64, 128, 256, 512, 384, 320]
    assert meta["probe"]["max_tokens"] == 2 * 320 and "2 bisection steps" in meta["probe"]["stop"]
    assert all(r["max_tokens"] == meta["probe"]["max_tokens"] for r in records)


_NO_PROGRESS = types.SimpleNamespace(set_postfix_str=lambda s: None)


def _probe_bench(max_over_ranks, probe_seconds: float = 1e9):
    """A stand-in ``Bench`` for ``probe`` on 2 ranks: ``max_over_ranks`` is what the other ranks answer."""
    args = types.SimpleNamespace(tokens=[64], probe_cap=1 << 20, probe_seconds=probe_seconds, probe_refine=3)
    return types.SimpleNamespace(torch=None, args=args, env=types.SimpleNamespace(world_size=2, device="cpu"),
                                 cuda=False, own_gib=lambda n: n / 1e9, max_over_ranks=max_over_ranks)


def test_probe_stops_on_the_slowest_ranks_clock(monkeypatch):
    """The time budget reads the slowest rank's elapsed time, so every rank stops at the same size: here this
    rank's own clock is well inside the budget, a peer's is past it."""
    tried = []

    def step(bench, comm, strategy, tokens):
        tried.append(tokens)
        return None, 1.0, None

    monkeypatch.setattr(bench_scaling, "_probe_step", step)
    records, meta = [], {}
    slowest = _probe_bench(lambda seconds: seconds + 100.0, probe_seconds=60.0)
    bench_scaling.probe(slowest, None, (None, "ring"), records, meta, _NO_PROGRESS)
    assert tried == [64] and meta["probe"]["stop"] == "time budget"
