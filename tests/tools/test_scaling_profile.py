"""The scaling benchmark's profile arithmetic and memory units on hand-made inputs (no GPU, nothing timed):
interval unions, exposed communication, step and phase assignment, the profiler-event reader, case selection,
own bytes and the markdown tables."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_scaling as bs  # noqa: E402
import plot_scaling  # noqa: E402

G = bs.GpuEvent


def test_interval_union_and_subtract():
    assert bs.interval_union([(5, 7), (0, 2), (1, 3), (7, 9), (4, 4), (10, 11)]) == [(0, 3), (5, 9), (10, 11)]
    assert bs.interval_union([]) == []
    a = bs.interval_union([(0, 10), (20, 30)])
    b = bs.interval_union([(2, 4), (6, 22), (25, 26), (29, 40)])
    assert bs.interval_subtract(a, b) == [(0, 2), (4, 6), (22, 25), (26, 29)]
    assert bs.interval_subtract(a, []) == a
    assert bs.interval_subtract(a, [(-5, 50)]) == []
    assert bs.interval_total(bs.interval_subtract(a, b)) == 2 + 2 + 3 + 3


# One step on three compute streams and NCCL's (microseconds):
#   compute A [0,10] [15,20], B [18,25], C [32,40]; NCCL [8,17] [22,28]
#   compute union [0,10] [15,25] [32,40] = 28; comm union = 9 + 6 = 15
#   exposed: [10,15] + [25,28] = 8; busy [0,28] [32,40] = 36, so idle [28,32] = 4; span 40 = 28 + 8 + 4
STEP = [G("cudnn_fwd", 0, 10), G("merge", 15, 20), G("gemm", 18, 25), G("combine", 32, 40),
        G("ncclDevKernel_SendRecv(ncclDevKernelArgs)", 8, 17), G("ncclKernel_AllReduce_RING_LL_Sum_float", 22, 28)]


def test_breakdown_exposed_communication():
    b = bs.breakdown(STEP)
    assert b == {"span_ms": 0.040, "compute_ms": 0.028, "comm_ms": 0.015, "exposed_comm_ms": 0.008,
                 "exposed_comm_frac": 0.2, "idle_ms": 0.004, "nccl_kernels": 2, "kernels": 6}
    # all communication under compute: nothing exposed
    hidden = bs.breakdown([G("k", 0, 100), G("ncclDevKernel_SendRecv", 10, 90)])
    assert hidden["exposed_comm_ms"] == 0 and hidden["comm_ms"] == 0.080 and hidden["idle_ms"] == 0
    # against a wider cover (the whole step's compute), a phase's comm can be hidden by the other phase's kernels
    assert bs.breakdown([G("ncclDevKernel_SendRecv", 8, 17)], [(0, 10), (15, 25)])["exposed_comm_ms"] == 0.005
    assert bs.breakdown([])["span_ms"] == 0 and bs.breakdown([])["exposed_comm_frac"] == 0


def test_comm_kernel_names():
    assert bs.is_comm_kernel("ncclDevKernel_SendRecv(ncclDevKernelArgs)")
    assert bs.is_comm_kernel("ncclKernel_AllReduce_RING_LL_Sum_bfloat16")
    assert not bs.is_comm_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop")
    assert not bs.is_comm_kernel("Memcpy DtoD (Device -> Device)")


def test_steps_by_launch_then_start_and_phases():
    windows = [(0, 100), (200, 300)]
    events = [G("barrier ncclKernel_AllReduce", 150, 160, None),  # between steps: dropped
              G("fwd", 5, 20, 1), G("nccl_fwd", 10, 30, 2), G("bwd", 40, 90, 35),
              G("fwd2", 210, 220, None), G("late", 95, 110, 99)]  # launched in step 1, ran past its window
    steps = bs.assign_steps(events, windows)
    assert [[e.name for e in s] for s in steps] == [["fwd", "nccl_fwd", "bwd", "late"], ["fwd2"]]
    fwd, bwd = bs.split_phases(steps[0], backward_start=33)
    assert [e.name for e in fwd] == ["fwd", "nccl_fwd"] and [e.name for e in bwd] == ["bwd", "late"]
    assert bs.split_phases(steps[1], backward_start=250) is None  # a launch time is missing
    assert bs.split_phases(steps[0], backward_start=None) is None


def _shift(events, dt):
    return [G(e.name, e.start + dt, e.end + dt, e.launch + dt) for e in events]


def test_rank_profile_means_and_phases():
    # forward: compute [0,10], NCCL [8,17]; backward: compute [15,20] [18,25] [32,40], NCCL [22,28]
    launched = [G(e.name, e.start, e.end, 0 if e.start < 12 else 12) for e in STEP]
    second = [G(e.name, 2 * e.start, 2 * e.end, 0 if e.start < 12 else 12) for e in STEP]  # twice as long
    gpu = launched + _shift(second, 1000)
    ranges = {bs.STEP_RANGE: [(-1, 50), (999, 1100)], bs.FORWARD_RANGE: [(0, 11), (1000, 1011)],
              bs.BACKWARD_RANGE: [(12, 45), (1012, 1090)]}
    p = bs.rank_profile(gpu, ranges)
    assert p["steps"] == 2 and p["nccl_kernels"] == 2 and p["kernels"] == 6
    assert p["span_ms"] == pytest.approx(0.060) and p["exposed_comm_ms"] == pytest.approx(0.012)
    assert p["compute_ms"] == pytest.approx(0.042) and p["idle_ms"] == pytest.approx(0.006)
    assert p["exposed_comm_frac"] == pytest.approx(0.2)
    # forward's NCCL [8,17]: exposed [10,15] against the step's compute; backward's [22,28]: [25,28]
    assert p["forward"]["exposed_comm_ms"] == pytest.approx(0.0075) and p["forward"]["nccl_kernels"] == 1
    assert p["backward"]["exposed_comm_ms"] == pytest.approx(0.0045) and p["backward"]["kernels"] == 4
    # without launch times the step numbers stay, the phases go
    bare = [G(e.name, e.start, e.end) for e in gpu]
    q = bs.rank_profile(bare, ranges)
    assert q["exposed_comm_ms"] == pytest.approx(0.012) and q["forward"] is None and q["backward"] is None
    assert bs.rank_profile([], ranges) is None


def _evt(name, device, start, end, id_=0, kind="cpu_op", annotation=False):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), id=id_,
                           activity_type=kind, is_user_annotation=annotation)


def test_gpu_activity_reads_profiler_events():
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        _evt(bs.STEP_RANGE, cpu, 0, 100, kind="user_annotation", annotation=True),
        _evt(bs.FORWARD_RANGE, cpu, 1, 20, kind="user_annotation", annotation=True),
        _evt(bs.BACKWARD_RANGE, cpu, 21, 90, kind="user_annotation", annotation=True),
        _evt(bs.STEP_RANGE, cuda, 3, 95, kind="gpu_user_annotation", annotation=True),  # GPU copy: not a kernel
        _evt("aten::mm", cpu, 2, 6, id_=7),  # shares a number with a kernel's correlation id: not a launch
        _evt("cudaLaunchKernel", cpu, 4, 5, id_=7, kind="cuda_runtime"),
        _evt("cuLaunchKernelEx", cpu, 22, 23, id_=8, kind="cuda_driver"),
        _evt("gemm", cuda, 10, 30, id_=7, kind="kernel"),
        _evt("ncclDevKernel_SendRecv", cuda, 25, 60, id_=8, kind="kernel"),
        _evt("Memset (Device)", cuda, 61, 62, id_=9, kind="gpu_memset"),
    ]
    gpu, ranges = bs.gpu_activity(events, cuda, cpu)
    assert gpu == [G("gemm", 10, 30, 4), G("ncclDevKernel_SendRecv", 25, 60, 22), G("Memset (Device)", 61, 62, None)]
    assert ranges == {bs.STEP_RANGE: [(0, 100)], bs.FORWARD_RANGE: [(1, 20)], bs.BACKWARD_RANGE: [(21, 90)]}


def test_profiler_ranges_on_cpu():
    """The real profiler's events carry the step, forward and backward ranges the reader looks for; a CPU run
    has no GPU activity, so the rank's profile is None (recorded as nothing)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(16, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function(bs.STEP_RANGE):
                with record_function(bs.FORWARD_RANGE):
                    y = (x @ x).sum()
                with record_function(bs.BACKWARD_RANGE):
                    y.backward()
    gpu, ranges = bs.gpu_activity(prof.events(), DeviceType.CUDA, DeviceType.CPU)
    assert gpu == [] and bs.rank_profile(gpu, ranges) is None
    steps = ranges[bs.STEP_RANGE]
    assert len(steps) == 2 and len(ranges[bs.FORWARD_RANGE]) == 2 and len(ranges[bs.BACKWARD_RANGE]) == 2
    for (s, e), (fs, fe), (bs_, be) in zip(steps, ranges[bs.FORWARD_RANGE], ranges[bs.BACKWARD_RANGE]):
        assert s <= fs <= fe <= bs_ <= be <= e


def test_profile_case_selection():
    sel = bs.parse_profile_cases("ring:full:causal, head,zigzag:32768")
    assert sel == [("ring", "full", "causal"), ("head",), ("zigzag", "32768")]
    assert bs.profile_selected(sel, "ring", "contiguous", "full", True, 8192)
    assert not bs.profile_selected(sel, "ring", "contiguous", "full", False, 8192)
    assert bs.profile_selected(sel, "head", "zigzag", "longnet", False, 8192)
    assert bs.profile_selected(sel, "hybrid", "zigzag", "longnet", True, 32768)
    assert not bs.profile_selected(sel, "hybrid", "zigzag", "longnet", True, 65536)
    assert bs.profile_selected(bs.parse_profile_cases("all"), "hybrid", "contiguous", "longnet", False, 1)
    assert bs.profile_selected(bs.parse_profile_cases("non-causal"), "ring", "contiguous", "longnet", False, 1)
    with pytest.raises(ValueError, match="unknown term 'rings'"):
        bs.parse_profile_cases("rings")
    with pytest.raises(ValueError):
        bs.parse_profile_cases(",")


def test_profile_options(tmp_path):
    a = bs.parse_args([])
    assert not a.profile and a.profile_selectors == [("ring",), ("head",)] and a.profile_steps == 3
    a = bs.parse_args(["--profile-cases", "ring:longnet"])  # implies --profile
    assert a.profile and a.profile_selectors == [("ring", "longnet")]
    a = bs.parse_args(["--profile-trace", str(tmp_path / "traces")])
    assert a.profile and a.profile_trace == str(tmp_path / "traces")
    for bad in (["--profile-cases", "ring:fast"], ["--profile-steps", "0"],
                ["--profile-trace", os.path.join(ROOT, "benchmarks", "results", "traces")]):
        with pytest.raises(SystemExit):
            bs.parse_args(bad)


def test_own_bytes():
    # B=1, 32768 tokens, 16 heads (kv 16), D=128, bf16: 8 tensors of 128 MiB = 1 GiB
    assert bs.own_bytes(1, 32768, 16, 16, 128, 2) == 2**30
    # kv heads: q, out, dout, dq with 16 heads; k, v, dk, dv with 4
    assert bs.own_bytes(2, 1000, 16, 4, 64, 4) == 4 * 2 * 1000 * 64 * 4 * 16 + 4 * 2 * 1000 * 64 * 4 * 4
    meta = {"batch": 1, "heads": 16, "kv_heads": 16, "head_dim": 128, "dtype_bytes": 2}
    assert plot_scaling.own_gib(meta, 65536) == 2.0


def _write(path, meta, records, profile=None):
    path.write_text(json.dumps({"meta": meta, "records": records, **({"profile": profile} if profile else {})}))
    return str(path)


def test_markdown_memory_and_profile_tables(tmp_path):
    base = {"gpu": "NVIDIA H200", "torch": "2.11", "dtype": "bfloat16", "batch": 1, "heads": 16, "kv_heads": 16,
            "head_dim": 128, "dtype_bytes": 2, "backend": "collective", "kernel": "auto"}
    rec = {"impl": "ours", "config": "longnet", "causal": False, "tokens_per_gpu": 32768, "layout": "contiguous"}
    one = _write(tmp_path / "x1.json", {**base, "gpus": 1},  # an older file: no own_gib, taken from its meta
                 [{**rec, "strategy": "single", "gpus": 1, "ms": 12.0, "efficiency": 1.0, "peak_gib": 3.28}])
    entry = {"impl": "ours", "strategy": "ring", "config": "longnet", "causal": True, "gpus": 2,
             "tokens_per_gpu": 32768, "layout": "zigzag", "timed_ms": 13.0, "steps": 3, "rank": 1, "step_ms": 12.5,
             "compute_ms": 10.0, "comm_ms": 4.0, "exposed_comm_ms": 1.25, "exposed_comm_frac": 0.1, "idle_ms": 1.25,
             "nccl_kernels": 12.0, "kernels": 300.0, "forward": {"exposed_comm_ms": 0.5},
             "backward": {"exposed_comm_ms": 0.75}, "seconds": 2.0, "per_rank": []}
    two = _write(tmp_path / "x2.json", {**base, "gpus": 2},
                 [{**rec, "strategy": "ring", "gpus": 2, "ms": 15.6, "efficiency": 0.89, "peak_gib": 3.5,
                   "own_gib": 1.0},
                  {**rec, "impl": "ulysses", "strategy": "head", "gpus": 2, "ms": 16.9, "efficiency": 0.83,
                   "peak_gib": None, "own_gib": 1.0}], [entry])
    records, metas = plot_scaling.load([one, two])
    assert records[0]["own_gib"] == 1.0  # 8 x 32768 x 16 x 128 x 2 bytes
    table = plot_scaling.markdown(records, metas, plot_scaling.load_profile([one, two]))
    assert "| ours | ring | longnet | no | 3.28 (3.3x) | 3.50 (3.5x) |" in table
    assert "| ulysses | head | longnet | no | 3.28 (3.3x) | - |" in table
    assert ("| 2 | ring/zigzag longnet causal, 32768/GPU | 12.50 | 13.00 | 10.00 | 4.00 | 1.25 | 10.0% | "
            "0.50 / 0.75 | 1.25 | 12 |") in table
    no_phase = plot_scaling.profile_table([{**entry, "forward": None, "backward": None, "layout": "contiguous"}])
    assert no_phase[-2].startswith("| 2 | ring longnet causal, 32768/GPU |") and "| - |" in no_phase[-2]
    assert plot_scaling.profile_table([]) == []
