"""benchmarks/bench_kernel.py --smoke end to end (CPU, Triton's interpreter, tiny shapes): the auto table it
measures (LongNet segments and full attention, keyed by length class), the summary and the report files."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke is the CPU path; a GPU runs the real benchmark")
def test_bench_kernel_smoke(tmp_path):
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "benchmarks/bench_kernel.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed" not in proc.stdout, proc.stdout[-3000:]
    result = json.loads((tmp_path / "kernel_smoke.json").read_text())
    assert result["complete"]
    assert not [row for row in result["table"] if "error" in row]
    (entry,) = result["auto_table"].values()
    choices = entry["choices"]
    # smoke: N=64, LongNet segments 16/32/64 at rates 1/2/4 (16 rows each) and full attention (64 rows): all
    # in the short length class; each entry ranks the qualified implementations, fastest first
    for causal in ("full", "causal"):
        for direction in ("fwd", "bwd", "bwd-any"):
            assert f"{direction}/dense/{causal}/D16/float32/short" in choices
            assert f"{direction}/dilated/{causal}/D16/float32/short" in choices
    assert all(names and set(names) <= {"fused", "reference"} for names in choices.values())
    assert entry["measured"] == ["fused", "reference"]  # what auto's gap warning reads
    summary = result["summary"]
    for causal in ("False", "True"):
        assert summary[causal]["library_fwd_bwd_vs_dense_cudnn"] > 0
    assert (tmp_path / "kernel_smoke.png").exists()


def _benchmark(name: str):
    """A script of ``benchmarks/`` imported as a module."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_profile_pipeline_groups_kernels_by_what_they_are():
    """The profile's kernel groups (names as the H200 profile recorded them)."""
    prof = _benchmark("profile_pipeline")
    names = {
        "dkdv_kernel": "fused dK/dV", "dq_kernel": "fused dQ", "fwd_kernel": "fused forward",
        "delta_kernel": "fused delta", "merge_kernel": "merge", "combine_kernel": "combine",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1": "cuDNN attention",
        "void cudnn::fusion::matmul_dq<true, 128>(void const*, void const*, void*)": "cuDNN attention",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at": "copy",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::CUDAFu": "elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "fill",
        "Memcpy DtoD (Device -> Device)": "copy",
        "some_unknown_kernel": "other",
    }
    assert {n: prof.group_of(n) for n in names} == names
    assert prof.re.search(prof.SYNCS, "cudaDeviceSynchronize") and prof.re.search(prof.SYNCS, "cudaMalloc")
    assert not prof.re.search(prof.SYNCS, "cudaMemcpyAsync")


def test_profile_pipeline_finds_where_a_lone_step_waits():
    """Steps after a marker kernel: the wait for each step's first kernel, the idle between its kernels (overlapping
    kernels count once, spacing under 5 us is not a wait), and the idle by the kernel groups around it."""
    prof = _benchmark("profile_pipeline")
    marker = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    events = []
    for t0, first in ((0.0, 500.0), (10_000.0, 700.0)):
        events += [(marker, t0, t0 + 2),
                   ("fwd_kernel", t0 + 2 + first, t0 + 1000),
                   ("fwd_kernel", t0 + 900, t0 + 1500),  # overlaps the first (another stream)
                   ("combine_kernel", t0 + 1503, t0 + 1600),  # 3 us after: launch spacing
                   ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", t0 + 2200, t0 + 3000)]
    waits = prof.idle_of(events[::-1])
    assert waits["steps"] == 2
    assert waits["first_kernel_ms"] == pytest.approx((0.5 + 0.7) / 2)
    assert waits["idle_ms"] == pytest.approx(0.6)
    assert waits["gaps"] == {"combine -> cuDNN attention": pytest.approx(0.6)}
    assert prof.idle_of([("fwd_kernel", 0.0, 1.0)]) == {"steps": 0, "first_kernel_ms": 0.0, "idle_ms": 0.0,
                                                         "gaps": {}}


def test_host_timeline_marks_entries_and_returns_in_call_order():
    """``host_cost.host_timeline``: each marked function's entry and return, by label (a label function reads the
    call's arguments), in call order, times rising from the step's start; every attribute restored after, also
    when the step raises; steps that mark different sequences and static methods are refused."""
    import types

    host_cost = _benchmark("host_cost")
    ns = types.SimpleNamespace(inner=lambda x: time.sleep(0.002) or x, outer=None)
    ns.outer = lambda x: ns.inner(x) + ns.inner(x)
    original = (ns.inner, ns.outer)
    timeline = host_cost.host_timeline(lambda: ns.outer(1), [(ns, "outer", "outer"), (ns, "inner", lambda x: f"in{x}")],
                                       reps=3, warmup=1)
    assert [name for name, _ in timeline] == ["outer>", "in1>", "in1<", "in1>", "in1<", "outer<", "issued"]
    times = [ms for _, ms in timeline]
    assert times == sorted(times) and times[2] - times[1] >= 2.0  # (the sleep inside)
    assert (ns.inner, ns.outer) == original

    calls = iter(range(100))
    with pytest.raises(ValueError, match="different sequences"):
        host_cost.host_timeline(lambda: ns.outer(1) if next(calls) % 2 else ns.inner(1), [(ns, "inner", "in")],
                                reps=2, warmup=0)
    assert (ns.inner, ns.outer) == original
    with pytest.raises(ZeroDivisionError):
        host_cost.host_timeline(lambda: ns.inner(0) / 0, [(ns, "inner", "in")], reps=1, warmup=0)
    assert (ns.inner, ns.outer) == original

    class Owner:
        @staticmethod
        def fixed():
            return 1

        def method(self):
            return 2

    class Heir(Owner):
        pass

    with pytest.raises(TypeError, match="Owner.fixed is staticmethod"):
        host_cost.host_timeline(Owner.fixed, [(Owner, "fixed", "fixed")])
    heir = Heir()
    marked = host_cost.host_timeline(lambda: heir.method(), [(Heir, "method", "m")], reps=1, warmup=0)
    assert [name for name, _ in marked] == ["m>", "m<", "issued"]
    assert "method" not in vars(Heir) and heir.method() == 2  # an inherited method is inherited again


def test_profile_pipeline_host_timeline_follows_the_library_call():
    """``--host-timeline``'s marks on a real call (CPU): forward, every kernel call by op, the combine, backward
    and the gradient sums, in the order the library issues them; the library's functions restored after."""
    prof = _benchmark("profile_pipeline")
    host_cost = _benchmark("host_cost")
    from dilated_attention import dilated_attention, execution

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 64, 4, 16, generator=gen, requires_grad=True) for _ in range(3))

    def step():
        dilated_attention(q, k, v, [16, 32, 64], [1, 2, 4]).backward(torch.randn(1, 64, 4, 16, generator=gen))

    forward = execution.forward
    names = [name for name, _ in host_cost.host_timeline(step, prof.timeline_points(), reps=2, warmup=1)]
    assert execution.forward is forward
    assert names[0] == "forward>" and names[-1] == "issued"
    fwd, bwd = names[:names.index("forward<") + 1], names[names.index("backward>"):names.index("backward<") + 1]
    assert fwd.count("forward_pattern>") == 3 and fwd[-3:] == ["combine>", "combine<", "forward<"]
    assert bwd.count("backward_pattern_parts>") == 3 and bwd.count("gradient sum>") == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_profile_pipeline_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a GPU"):
        _benchmark("profile_pipeline").main([])


def test_refine_by_pipeline_times_every_combination_of_close_calls():
    """Keys whose runner-up is within CLOSE_CALL of the fastest get every combination of their two best timed
    on the pipeline; the result is the fastest trial's assignment, other keys (a distant runner-up, bwd-any)
    keep their per-pattern choice."""
    pytest.importorskip("triton")
    bk = _benchmark("bench_kernel")
    from dilated_attention.kernels.fused import FusedKernel
    from dilated_attention.kernels.chunk_loop import ChunkLoop
    from dilated_attention.kernels.reference import ReferenceKernel
    from dilated_attention.patterns import plan_patterns

    if torch.cuda.is_available():
        pytest.skip("CPU check of the selection logic (the interpreter stands in for the GPU)")
    impls = {"fused": FusedKernel(), "reference": ChunkLoop(ReferenceKernel())}
    plans = plan_patterns([16, 32], [1, 2], seq_len=32, local_len=32, num_heads=2, num_kv_heads=2, mode="longnet")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 32, 2, 16, generator=g) for _ in range(4))
    key = lambda d, r: bk.table_key(d, r, False, 16, torch.float32, 16)  # noqa: E731
    ranked = {
        key("fwd", 1): [("fused", 1.0), ("reference", 1.2)],       # close: tried both ways
        key("bwd", 2): [("reference", 1.0), ("fused", 1.25)],      # close
        key("bwd", 1): [("fused", 1.0), ("reference", 2.0)],       # distant runner-up: kept
        key("bwd-any", 2): [("reference", 1.0), ("fused", 1.01)],  # bwd-any: never refined here
    }
    choices = {name: names[0][0] for name, names in ranked.items()}
    best, trials = bk.refine_by_pipeline(impls, choices, ranked, q, k, v, dout, plans, False, 0.25, 0, 1)
    assert len(trials) == 4
    assert {tuple(sorted(t["choices"].items())) for t in trials} == {
        ((key("bwd", 2), b), (key("fwd", 1), f)) for f in ("fused", "reference") for b in ("fused", "reference")}
    assert all(len(t["rounds"]) == bk.TRIAL_ROUNDS and t["ms"] == sorted(t["rounds"])[len(t["rounds"]) // 2]
               for t in trials), "each combination's median over its round-robin rounds"
    assert all(t["peak_bytes"] == 0 for t in trials)  # (no GPU: no peak, so the fastest is kept)
    fastest = min(trials, key=lambda t: t["ms"])
    assert best == {**choices, **fastest["choices"]}
    assert best[key("bwd", 1)] == "fused" and best[key("bwd-any", 2)] == "reference"
    no_close = {name: names[:1] + [(names[1][0], 9.0)] for name, names in ranked.items()}
    assert bk.refine_by_pipeline(impls, choices, no_close, q, k, v, dout, plans, False, 0.25, 0, 1) == (choices, [])


def test_a_pipeline_tie_goes_to_the_combination_that_peaks_lowest():
    """Within TRIAL_TIE of the fastest trial, the lowest peak wins; beyond it, or at equal peaks (no GPU), the
    fastest."""
    bk = _benchmark("bench_kernel")
    gib = 1 << 30

    def trial(name: str, ms: float, peak: int) -> dict:
        return {"choices": {"bwd/k": name}, "ms": ms, "peak_bytes": peak}

    fast, lean = trial("cudnn-det", 6.00, 3 * gib // 2), trial("flash4", 6.00 * (1 + bk.TRIAL_TIE / 2), gib)
    assert bk.pick_trial([fast, lean]) is lean
    slow_lean = trial("flash4", 6.00 * (1 + 2 * bk.TRIAL_TIE), gib)
    assert bk.pick_trial([fast, slow_lean]) is fast
    assert bk.pick_trial([trial("a", 6.03, 0), trial("b", 6.00, 0)])["choices"] == {"bwd/k": "b"}


def test_bench_kernel_measures_the_mid_class_on_its_own_plans(tmp_path, monkeypatch):
    """``--mid-segments``/``--mid-rates`` plans give the table its mid-class keys (dense and dilated, causal and
    not, with the LongNet plans' short ones beside them); shapes scaled down by moving the class bound."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU check of the table flow (the interpreter stands in for the GPU)")
    bk = _benchmark("bench_kernel")
    from dilated_attention.kernels import auto

    monkeypatch.setattr(auto, "SHORT_ROWS", 16)  # smoke LongNet plans: 16 rows (short); mid plans: 32 rows
    assert bk.main(["--smoke", "--table-only", "--no-full", "--out", str(tmp_path),
                    "--mid-segments", "32,64", "--mid-rates", "1,2"]) == 0
    result = json.loads((tmp_path / "kernel_smoke.json").read_text())
    assert result["meta"]["mid_plans"] == [[32, 1], [64, 2]]
    (entry,) = result["auto_table"].values()
    classes = {key.rpartition("/")[2] for key in entry["choices"]}
    assert classes == {"short", "mid"}
    for causal in ("full", "causal"):
        for kind in ("dense", "dilated"):
            assert f"fwd/{kind}/{causal}/D16/float32/mid" in entry["choices"]
            assert f"bwd/{kind}/{causal}/D16/float32/short" in entry["choices"]
    with pytest.raises(SystemExit):
        bk.main(["--smoke", "--mid-segments", "32,64", "--mid-rates", "1"])


def test_compare_tables_alternates_the_tables_through_the_api(monkeypatch):
    """Each table runs the LongNet call through the API once per round, the tables alternated round by round;
    each one's median over its rounds is reported."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU check of the comparison logic")
    bk = _benchmark("bench_kernel")
    from dilated_attention.kernels.chunk_loop import ChunkLoop
    from dilated_attention.kernels.fused import FusedKernel
    from dilated_attention.kernels.reference import ReferenceKernel

    impls = {"fused": FusedKernel(), "reference": ChunkLoop(ReferenceKernel())}
    keys = [bk.table_key(d, r, False, 16, torch.float32, 16) for d in ("fwd", "bwd") for r in (1, 2)]
    tables = {"shipped": dict.fromkeys(keys, "fused"), "run": dict.fromkeys(keys, "reference")}
    scripted = iter([3.0, 5.0, 1.0, 4.0, 2.0, 6.0])  # shipped, run, shipped, run, ...
    order = []

    def fake_pace(fn, warmup, reps, device):
        order.append(fn.__defaults__[0].choices[keys[0]])  # the kernel the call runs, as the API gets it
        fn()
        return next(scripted)

    monkeypatch.setattr(bk, "pace", fake_pace)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 32, 2, 16, generator=g) for _ in range(4))
    got = bk.compare_tables(impls, tables, q, k, v, dout, [16, 32], [1, 2], False, 0, 1)
    assert [names[0] for names in order] == ["fused", "reference"] * bk.TRIAL_ROUNDS
    assert got == {"shipped": {"ms": 2.0, "rounds": [3.0, 1.0, 2.0]}, "run": {"ms": 5.0, "rounds": [5.0, 4.0, 6.0]}}


@pytest.mark.parametrize("run_ms, force, written", [(1.2, False, False), (1.2, True, True), (1.005, False, True),
                                                    (0.9, False, True)])
def test_write_table_keeps_the_shipped_classes_a_slower_ranking_measured(tmp_path, monkeypatch, run_ms, force,
                                                                         written):
    """A run whose ranking ran the benchmark's LongNet call slower than the shipped table (beyond TRIAL_TIE) has
    its entries of that call's length classes left out, unless forced; its other classes are written."""
    bk = _benchmark("bench_kernel")
    table_file = tmp_path / "auto_table.py"
    table_file.write_text(open(bk.TABLE_FILE).read())
    monkeypatch.setattr(bk, "TABLE_FILE", str(table_file))
    short, long = "bwd/dilated/full/D128/bfloat16/short", "bwd/dense/full/D128/bfloat16/long"
    result = {"meta": {"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]},
              "table_ab": {"False": {"shipped": {"ms": 1.0, "rounds": [1.0]}, "run": {"ms": run_ms, "rounds": [run_ms]}}},
              "auto_table": {"Test GPU": {"source": "test", "measured": ["cudnn-det", "fused"],
                                          "choices": {short: ["cudnn-det", "fused"], long: ["fused", "cudnn-det"]}}}}
    path = tmp_path / "kernel_test.json"
    path.write_text(json.dumps(result))
    assert bk.write_table(str(path), force=force) == 0
    namespace: dict = {}
    exec(table_file.read_text(), namespace)
    choices = namespace["TABLE"]["Test GPU"]["choices"]
    assert choices[long] == ("fused", "cudnn-det")
    assert (choices.get(short) == ("cudnn-det", "fused")) is written
