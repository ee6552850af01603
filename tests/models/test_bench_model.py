"""benchmarks/bench_model.py end to end on CPU: two gloo ranks, the tiny model, ours and the dense Ulysses
peer; then ``--plot-only`` remakes the table from the JSON. Checks what the results file promises: a record
per variant that ran (every step's loss finite, tokens/s from the median step), the one-GPU-only and
CUDA-only peers listed with their reason, the longest-sequence search's entry, the table."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from dilated_attention.testing.spawn import run_torchrun  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_model.py")


def test_tiny_run_on_two_ranks(tmp_path):
    proc = run_torchrun([SCRIPT, "--tiny", "--device", "cpu", "--variants", "ours,sdpa,ulysses,torch_cp",
                         "--ulysses-impl", "plain", "--find-max", "ours", "--time-budget", "3", "--out",
                         str(tmp_path)], cwd=ROOT, done="wrote", nproc=2, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((tmp_path / "model_cpu.json").read_text())
    assert set(data["runs"]) == {"2"} and "FSDP2 over 2 rank(s)" in data["runs"]["2"]["training"]
    ran = {r["variant"]: r for r in data["records"]}
    assert set(ran) == {"ours", "ulysses"}
    for r in ran.values():
        assert r["gpus"] == 2 and r["seq_len"] == 256 and len(r["losses"]) == 3
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["tokens_per_s"] == pytest.approx(256 / statistics.median(r["step_times_s"][1:]))
        assert r["step_tflop"] > 0
        assert r["checkpointing"] == "none"  # auto on CPU: activations kept
    skipped = {s["variant"]: s["reason"] for s in data["skipped"]}
    assert set(skipped) == {"sdpa", "torch_cp"} and "CUDA" in skipped["torch_cp"]
    (search,) = data["find_max"]
    assert search["variant"] == "ours" and search["max_seq_len"] >= 256 and search["why"]
    md = (tmp_path / "model_cpu.md").read_text()
    os.remove(tmp_path / "model_cpu.md")
    done = subprocess.run([sys.executable, SCRIPT, "--plot-only", str(tmp_path / "model_cpu.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "model_cpu.md").read_text() == md and "| 2 | 256 | ours |" in md


def test_checkpointing_auto_keeps_activations_only_where_they_fit():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_model
    from dilated_attention.models.hf_training import LlamaShape

    shape = LlamaShape()
    per_token = bench_model.activation_bytes(shape)
    # the default ~0.9B model keeps about 100 KiB per token and layer: q/k/v, rotated q/k, attention output and
    # copy (8 x 2048 x 2 B), the two RMSNorms (2 x 10 x 2048 B), the MLP's four (4 x 5632 x 2 B = 44 KiB)
    assert per_token == 2 * (2 * 2048 + 2 * 1024) + 2 * 2 * 2048 + 2 * 10 * 2048 + 8 * 5632
    assert bench_model.mlp_activation_bytes(shape) == 8 * 5632
    assert bench_model.attention_transient_bytes(shape) == 2 * 4 * 16 * 128  # two fp32 query-sized tensors
    # state: 16 bytes per parameter sharded, plus one layer's gathered bf16 weights
    state = 4 * shape.params() + 2 * shape.params() / shape.layers
    assert bench_model.predicted_bytes(shape, 0, 4) == state
    t = 100_000
    none, layer, tiled, offload = (bench_model.predicted_bytes(shape, t, 4, plan) - state for plan in bench_model.LADDER)
    assert none == pytest.approx(1.1 * t * (16 * per_token + 2 * 4 * 2048))
    assert layer == pytest.approx(1.1 * t * (per_token + 2 * 4 * 2048) + 16 * t * 2 * 2048)  # + the layer inputs
    assert tiled == pytest.approx(layer - 1.1 * t * 8 * 5632)  # no MLP intermediates kept
    assert offload == pytest.approx(tiled - 16 * t * 2 * 2048)  # the layer inputs in host memory

    capacity = 79.2 * 2**30  # an H100 80GB, as torch reports it; --memory-limit 0.95 (75 GiB, 81 GB)
    plans = {n: bench_model.choose_plan(shape, n // 4, 4, list(bench_model.LADDER), 0.95 * capacity).label
             for n in (131072, 524288, 2097152)}
    # 32,768 tokens a rank: every layer kept, 61 GiB (16 x 104 KiB + 16 KiB a token, x 1.1, + 3.4 GiB of state)
    assert plans[131072] == "none"
    # 131,072: keeping every layer would take 234 GiB; checkpointed, 29 GiB (8 GiB of layer inputs)
    assert plans[524288] == "layer"
    # 524,288: checkpointed 101 GiB (32 GiB of layer inputs, one layer's 104 KiB + 16 KiB a token x 1.1 = 66 GiB);
    # the tiled MLP drops 44 KiB a token (77 GiB, over 75); the layer inputs offloaded leave 45 GiB
    assert plans[2097152] == "layer+tiled-mlp+offload"
    assert bench_model.predicted_bytes(shape, 2097152 // 4, 4, bench_model.LADDER[2]) > 0.95 * capacity
    # forced off the ladder's first rungs, the first allowed one that fits; none fitting, the last allowed
    layer_only = bench_model.allowed_rungs(bench_model.parse_args(["--tiled-mlp", "off"]))
    assert bench_model.choose_plan(shape, 2097152 // 4, 4, layer_only, 0.95 * capacity).label == "layer"
    assert bench_model.choose_plan(shape, 2097152 // 4, 4, layer_only, None).label == "none"  # CPU: the first


def test_flags_force_their_part_of_the_ladder():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_model

    def rungs(*flags):
        return [plan.label for plan in bench_model.allowed_rungs(bench_model.parse_args(list(flags)))]

    assert rungs() == ["none", "layer", "layer+tiled-mlp", "layer+tiled-mlp+offload"]
    assert rungs("--checkpointing", "layer") == ["layer", "layer+tiled-mlp", "layer+tiled-mlp+offload"]
    assert rungs("--checkpointing", "none") == ["none"]
    assert rungs("--checkpointing", "none", "--tiled-mlp", "on") == ["tiled-mlp"]
    assert rungs("--tiled-mlp", "off") == ["none", "layer"]
    assert rungs("--offload-checkpoints") == ["layer+tiled-mlp+offload"]
    assert rungs("--offload-checkpoints", "--tiled-mlp", "off") == ["layer+offload"]
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--offload-checkpoints", "--checkpointing", "none"])
