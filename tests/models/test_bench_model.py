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

from dilated_attention.testing.spawn import UNINTERPRETED, environ_with, run_torchrun  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_model.py")


def load_script():
    """The benchmark script as a module."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_model

    return bench_model


def test_tiny_run_on_two_ranks(tmp_path):
    variants = "ours,sdpa,sdpa_cudnn,flash4,ulysses,torch_cp"
    proc = run_torchrun([SCRIPT, "--tiny", "--device", "cpu", "--variants", variants, "--ulysses-impl", "plain",
                         "--find-max", "ours", "--time-budget", "3", "--profile", "--out", str(tmp_path)], cwd=ROOT,
                         done="wrote", nproc=2, timeout=300, env=UNINTERPRETED)
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
        # the profiled step: the ring's and Ulysses' exchanges, and FSDP's, are communication, not attention
        spent = r["profile"]["ms"]
        assert spent["communication"] > 0 and spent["attention"] > 0
        assert spent["projections"] > 0 and spent["mlp"] > 0 and spent["logits"] > 0  # told apart by their widths
        assert sum(spent.values()) == pytest.approx(r["profile"]["gpu_busy_ms"])
    skipped = {s["variant"]: s["reason"] for s in data["skipped"]}
    assert set(skipped) == {"sdpa", "sdpa_cudnn", "flash4", "torch_cp"} and "CUDA" in skipped["torch_cp"]
    assert all("one process only" in skipped[v] for v in ("sdpa", "sdpa_cudnn", "flash4"))
    (search,) = data["find_max"]
    assert search["variant"] == "ours" and search["max_seq_len"] >= 256 and search["why"]
    md = (tmp_path / "model_cpu.md").read_text()
    os.remove(tmp_path / "model_cpu.md")
    done = subprocess.run([sys.executable, SCRIPT, "--plot-only", str(tmp_path / "model_cpu.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "model_cpu.md").read_text() == md and "| 2 | 256 | ours |" in md
    assert "What a step spends" in md


def test_packed_run_on_two_ranks(tmp_path):
    """``--packed``: one packed row of documents on two ranks, ours on the ring (``--strategy ring``: documents
    whole on a rank or dealt over both); the peers that take no packed documents are listed with the reason; FLOPs
    count pairs inside documents; the table says what data ran."""
    proc = run_torchrun([SCRIPT, "--tiny", "--device", "cpu", "--variants", "ours,ulysses", "--ulysses-impl", "plain",
                         "--packed", "--packed-shortest", "16", "--strategy", "ring", "--out", str(tmp_path)],
                        cwd=ROOT, done="wrote", nproc=2, timeout=300, env=UNINTERPRETED)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((tmp_path / "model_cpu-packed.json").read_text())
    (record,) = data["records"]
    assert record["variant"] == "ours" and all(math.isfinite(x) for x in record["losses"])
    assert "strategy=ring over K" in record["attention"]
    bench_model = load_script()
    args = bench_model.parse_args(["--tiny", "--packed", "--packed-shortest", "16"])
    whole = bench_model.parse_args(["--tiny"])
    assert len(bench_model.documents(args, 256)) > 2  # several documents in the row
    assert record["step_tflop"] < 1e-12 * bench_model.step_flops(whole, _tiny_shape(), "ours", 256)
    assert {s["variant"]: s["reason"] for s in data["skipped"]}["ulysses"].startswith("ulysses does not take packed")
    assert "data: one packed row of documents" in (tmp_path / "model_cpu-packed.md").read_text()


def _tiny_shape():
    from dilated_attention.models.hf_training import LlamaShape

    t = load_script().TINY
    return LlamaShape(t["hidden"], t["layers"], t["heads"], t["kv_heads"], t["head_dim"], t["mlp"], t["vocab"])


def test_packed_batch_restarts_positions_and_targets_per_document():
    import torch

    from dilated_attention.models.hf_training import IGNORE_INDEX, packed_batch, packed_offsets

    offsets = packed_offsets(512, 16, seed=3)
    assert offsets[0] == 0 and offsets[-1] == 512 and all(b > a for a, b in zip(offsets, offsets[1:]))
    batch = packed_batch(offsets, 160, seed=0, step=1, comm=None, device="cpu")
    ids, pos, labels = batch["input_ids"][0], batch["position_ids"][0], batch["labels"][0]
    for a, b in zip(offsets, offsets[1:]):
        assert torch.equal(pos[a:b], torch.arange(b - a))  # positions from 0 in every document
        assert torch.equal(labels[a:b - 1], ids[a + 1:b]) and labels[b - 1] == IGNORE_INDEX  # its own next tokens
    assert batch["normalizer"] == 512 - (len(offsets) - 1)
    assert batch["cu_seq_lens_q"].tolist() == offsets and batch["max_length_q"] == max(
        b - a for a, b in zip(offsets, offsets[1:]))


def test_profile_run_on_cpu(tmp_path):
    """``--profile`` on one process: each record's extra step is classified (self CPU time of every op, each once)
    and tabled."""
    proc = subprocess.run([sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--variants",
                           "ours,sdpa,sdpa_cudnn,flash4", "--profile", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=environ_with({"DS_ACCELERATOR": "cpu", **UNINTERPRETED}))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((tmp_path / "model_cpu.json").read_text())
    bench_model = load_script()
    assert {r["variant"] for r in data["records"]} == {"ours", "sdpa"}
    assert {s["variant"]: s["reason"] for s in data["skipped"]} == {"sdpa_cudnn": "sdpa_cudnn needs CUDA",
                                                                   "flash4": "flash4 needs CUDA"}
    assert data["runs"]["1"]["code"] and data["runs"]["1"]["commands"]
    for r in data["records"]:  # each record says what made it
        assert r["provenance"]["command"].startswith("bench_model.py --tiny") and r["provenance"]["code"]
        assert r["provenance"]["versions"]["torch"] and r["provenance"]["date"]
    for r in data["records"]:
        p = r["profile"]
        assert set(p["ms"]) == set(bench_model.PROFILE_CATEGORIES)
        assert all(ms >= 0 for ms in p["ms"].values())
        assert p["ms"]["attention"] > 0  # the attention call
        # the matrix products outside it, by the widths their ops read (record_shapes): none left unknown
        assert p["ms"]["projections"] > 0 and p["ms"]["mlp"] > 0 and p["ms"]["logits"] > 0
        assert p["ms"]["matmul"] == 0
        assert sum(p["ms"].values()) == pytest.approx(p["gpu_busy_ms"])  # every op once
        assert p["host_bound_ms"] == pytest.approx(max(0.0, p["step_ms"] - p["gpu_busy_ms"]))
        assert p["step_ms"] > 0 and p["top"] and all(t["ms"] > 0 for t in p["top"])
    md = (tmp_path / "model_cpu.md").read_text()
    table = md[md.index("What a step spends"):]
    header = ("| GPUs | tokens/seq | variant | step ms | attention | projections | mlp | logits | matmul | communication "
              "| copies | other | GPU idle |")
    assert header in table
    assert "| 1 | 256 | ours |" in table and "| 1 | 256 | sdpa |" in table
    assert "Code: " in md and "Commands: `bench_model.py --tiny" in md


def _causal_oracle(q, k, v, scale):
    """Causal attention in float64, KV heads repeated to the query heads: ``(B, L, H, D)``."""
    import torch

    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.double() for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    scores = q @ k.transpose(-1, -2) * scale
    n = q.shape[2]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_forced_sdpa_is_causal_attention_in_transformers_layout(kv_heads):
    """``sdpa_cudnn``'s attention function, on the one backend the CPU has (math): transformers' interface (q, k, v
    ``(B, H, L, D)`` in, ``(B, L, H, D)`` out, ``scaling`` honoured), causal, fewer KV heads shared; against the
    float64 oracle."""
    import torch
    from torch.nn.attention import SDPBackend

    bm = load_script()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, 40, 16, generator=g) for _ in range(2))
    out, weights = bm.forced_sdpa(SDPBackend.MATH)(None, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 40, 4, 16) and out.is_contiguous()
    ref = _causal_oracle(q, k, v, 0.3)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
    assert bm.takes_gqa(SDPBackend.MATH, q, k, v)


def test_forced_sdpa_raises_where_its_backend_cannot_run():
    """A backend that cannot take the inputs (cuDNN on CPU) raises SDPA's error rather than running another kernel."""
    import torch
    from torch.nn.attention import SDPBackend

    bm = load_script()
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError):
        bm.forced_sdpa(SDPBackend.CUDNN_ATTENTION)(None, q, q, q, None)


def test_one_gpu_dense_peers_register_with_transformers(monkeypatch):
    """On one CUDA process: ``sdpa_cudnn`` registers its forced-cuDNN function and a causal (mask-free) mask under
    its own name; ``flash4`` is transformers' ``flash_attention_4`` where flash-attn-4 is installed, else skipped
    naming the package; on several processes both are skipped (their sequence-parallel forms are other variants)."""
    from types import SimpleNamespace

    import torch
    import transformers.utils
    from transformers import AttentionInterface, AttentionMaskInterface

    bm = load_script()
    args = bm.parse_args(["--tiny"])
    shape = SimpleNamespace(heads=4)
    one_gpu = SimpleNamespace(world_size=1, device=torch.device("cuda", 0))  # registration touches no GPU
    name, how = bm.attention_for("sdpa_cudnn", args, shape, 256, one_gpu, None, {})
    assert name in AttentionInterface() and "cuDNN" in how
    assert AttentionMaskInterface()[name]() is None
    monkeypatch.setattr(transformers.utils, "is_flash_attn_4_available", lambda: False)
    with pytest.raises(bm.Skip, match="flash-attn-4 is not installed"):
        bm.attention_for("flash4", args, shape, 256, one_gpu, None, {})
    monkeypatch.setattr(transformers.utils, "is_flash_attn_4_available", lambda: True)
    name, how = bm.attention_for("flash4", args, shape, 256, one_gpu, None, {})
    assert name == "flash_attention_4" and "flash-attn-4" in how
    assert AttentionInterface()[name] is AttentionInterface()["flash_attention_2"]  # transformers' flash path
    two = SimpleNamespace(world_size=2, device=torch.device("cuda", 0))
    for variant in ("sdpa_cudnn", "flash4"):
        with pytest.raises(bm.Skip, match="one process only"):
            bm.attention_for(variant, args, shape, 256, two, None, {})


def test_vs_best_dense_is_against_the_fastest_peer():
    bm = load_script()

    def record(variant, tokens_per_s, gpus=1, n=1024):
        return {"variant": variant, "gpus": gpus, "seq_len": n, "tokens_per_s": tokens_per_s,
                "step_s": n / tokens_per_s, "mfu": 0.3, "peak_gib": 10.0, "losses": [1.0, 1.0],
                "checkpointing": "layer"}

    records = [record("ours", 3000), record("sdpa", 500), record("sdpa_cudnn", 1000), record("flash4", 1200),
               record("ulysses", 2000, gpus=2), record("flash4", 5000, n=2048)]
    assert bm.best_dense(records, 1, 1024)["variant"] == "flash4"
    assert bm.best_dense(records, 1, 4096) is None
    meta = {"gpu": "GPU", "model": "m", "training": "t", "timing": "t", "peak_tflops": 989.0, "flops": "f",
            "versions": {"torch": "2"}, "pattern_rule": "p", "date": "d", "command": "c", "code": "abc"}
    md = bm.render_md({"runs": {"1": meta}, "records": records, "skipped": [], "find_max": []})
    assert "| 1 | 1,024 | ours | 0.341 | 3,000 | 2.50x flash4 |" in md


class _FakeRunner:
    """What ``find_max`` uses of ``Runner``: a GPU of 80 GiB whose steps take 1 s per 1024 tokens and whose peak is
    10 GiB of state plus 1 GiB per 1024 tokens, on one rung; ``ran``: the lengths it ran."""

    def __init__(self, args):
        from types import SimpleNamespace

        self.args, self.env, self.ran = args, SimpleNamespace(world_size=1), []
        self.shape = SimpleNamespace(heads=4)

    def capacity(self):
        return self.args.memory_limit * 80 * 2**30

    def memory_plan(self, n):
        return load_script().LADDER[1]

    def predicted(self, plan, n):
        return 10 * 2**30 + n / 1024 * 2**30

    def max_over_ranks(self, value):
        return value

    def free(self):
        pass

    def agree(self, error):
        return error

    def run(self, variant, n, warmup, steps):
        self.ran.append(n)
        return {"variant": variant, "gpus": 1, "seq_len": n, "step_s": n / 1024, "tokens_per_s": 1024.0,
                "peak_gib": 10 + n / 1024, "state_gib": 10.0, "mfu": 0.3, "checkpointing": "layer"}


def test_find_max_starts_from_this_runs_record(monkeypatch):
    """A record this run made at the search's first length is that size: the search extrapolates from it to the next
    (not running it again) and stops where the extrapolated peak passes the limit, before running that size."""
    bm = load_script()
    monkeypatch.setattr(bm, "step_flops", lambda args, shape, variant, n: float(n))
    runner = _FakeRunner(bm.parse_args(["--time-budget", "1e9"]))
    record = runner.run("ours", 16384, 1, 2)
    runner.ran.clear()
    data = {"find_max": []}
    bm.find_max(runner, "ours", 16384, lambda: None, data, _NoBar(), [record])
    (entry,) = data["find_max"]
    # 76 GiB is 95% of 80: 32768 (42 GiB) and 65536 (74 GiB) fit, 131072 (138 GiB) is predicted out of memory
    assert runner.ran == [32768, 65536]
    assert [s["seq_len"] for s in entry["sizes"]] == [16384, 32768, 65536]
    assert entry["sizes"][0]["measured_as"] == "this run's record"
    assert entry["max_seq_len"] == 65536 and entry["stopped_at"] == 131072 and "predicted OOM" in entry["why"]
    # without a record, the first length runs; a tight time budget stops with the predicted step and peak
    runner = _FakeRunner(bm.parse_args(["--time-budget", "40"]))
    data = {"find_max": []}
    bm.find_max(runner, "ours", 16384, lambda: None, data, _NoBar())
    (entry,) = data["find_max"]
    assert runner.ran == [16384] and entry["stopped_at"] == 32768
    assert entry["why"].startswith("time budget (40 s): a step of 32,768 tokens would take about 32 s")
    assert "42 GiB" in entry["why"] and "would fit" in entry["why"]


class _NoBar:
    def set_postfix_str(self, text):
        pass

    def update(self):
        pass


@pytest.mark.parametrize("name, category", [
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
     "matmul"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::mm", "matmul"),
    ("ncclDevKernel_AllGather_RING_LL", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
    ("ncclDevKernel_SendRecv", "communication"),
    ("c10d::allgather_", "communication"),
    ("_fwd_kernel", "attention"),
    ("dkdv_kernel", "attention"),
    ("combine_lse_kernel", "attention"),
    ("merge_kernel", "attention"),
    ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8>>",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassB_f32_aligned_64x64_k64_sm80", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_softmax_backward_data", "attention"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("Memset (Device)", "copies"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>", "copies"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2>>",
     "copies"),
    ("aten::copy_", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "other"),  # the loss, not attention
    ("aten::_log_softmax_backward_data", "other"),
    ("aten::broadcast_tensors", "other"),
    ("void at::native::index_elementwise_kernel<128, 4, scatter_gather>", "other"),
    ("multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>", "other"),
])
def test_kernel_names_fall_in_their_category(name, category):
    assert load_script().category(name) == category


class _FakeProfile:
    """Events shaped like ``prof.events()``: host ops (``op``) and kernels (``kernel``), each kernel listed under
    the host op that launched it (``FunctionEvent.kernels``), as the profiler does."""

    def __init__(self) -> None:
        self.launchers: dict = {}

    def op(self, ident, name, parent=None, shapes=None):
        from types import SimpleNamespace

        from torch.autograd import DeviceType
        from torch.autograd.profiler_util import Interval

        self.launchers[ident] = SimpleNamespace(id=ident, name=name, device_type=DeviceType.CPU, is_async=False,
                                                cpu_parent=parent, time_range=Interval(0, 1), self_cpu_time_total=1.0,
                                                kernels=[], input_shapes=shapes or [])
        return self.launchers[ident]

    def kernel(self, name, start, end, launcher=0, kind="kernel", note=False):
        from types import SimpleNamespace

        from torch.autograd import DeviceType
        from torch.autograd.profiler_util import Interval, Kernel

        if launcher:
            self.launchers[launcher].kernels.append(Kernel(name, 0, end - start))
        return SimpleNamespace(id=0, name=name, device_type=DeviceType.CUDA, is_async=False, cpu_parent=None,
                               time_range=Interval(start, end), activity_type=kind, is_user_annotation=note)


def test_step_profile_of_gpu_kernels():
    """The GPU path of ``step_profile`` on events shaped like ``prof.events()``: device time per category (a
    kernel launched inside the attention call is attention, an NCCL one communication), busy time the union
    of the kernels' intervals, idle the rest of the step; host ranges' GPU mirrors are not kernels."""
    bm = load_script()
    fake = _FakeProfile()
    op, kernel = fake.op, fake.kernel
    attention = op(1, "Attention")
    pad = op(2, "aten::copy_", attention)
    send = op(3, "c10d::send", attention)
    linear = op(4, "aten::mm")
    events = [attention, pad, send, linear,
              kernel("fwd_kernel", 0, 4000, 1),                    # attention
              kernel("direct_copy_kernel_cuda", 4000, 4500, 2),    # a copy inside the attention call: attention
              kernel("ncclDevKernel_SendRecv", 3000, 6000, 3),      # overlaps: busy is the union
              kernel("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT", 7000, 9000, 4),
              kernel("Memcpy HtoD (Pinned -> Device)", 9000, 9500),  # no launcher known: by name
              kernel("vectorized_elementwise_kernel<4, FillFunctor>", 9500, 10000),
              kernel("FSDP::all_gather", 0, 10000, note=True, kind="gpu_user_annotation")]
    p = bm.step_profile(events, step_ms=12.0, cuda=True)
    assert p["ms"] == pytest.approx({"attention": 4.5, "projections": 0.0, "mlp": 0.0, "logits": 0.0, "matmul": 2.0,
                                     "communication": 3.0, "copies": 0.5, "other": 0.5})
    assert p["gpu_busy_ms"] == pytest.approx(9.0)  # 0-6, 7-10 ms
    assert p["host_bound_ms"] == pytest.approx(3.0) and p["events"] == 6
    assert p["top"][0] == {"name": "fwd_kernel", "category": "attention", "ms": pytest.approx(4.0)}
    assert bm.step_profile(events, step_ms=8.0, cuda=True)["host_bound_ms"] == 0  # never negative


def test_matrix_products_are_told_apart_by_the_widths_their_ops_read():
    """Outside attention, a matrix product is ``mlp`` or ``logits`` where its op (or the nearest matrix-product op
    above the one that launched it) read that width, else ``projections``; ``matmul`` where no shapes were
    recorded; a width two categories share names neither; inside the attention call it stays attention."""
    bm = load_script()
    fake = _FakeProfile()
    op, kernel = fake.op, fake.kernel
    up = op(1, "aten::mm", shapes=[[4096, 2048], [2048, 5632]])  # the MLP's up projection
    down_grad = op(2, "aten::mm", shapes=[[5632, 4096], [4096, 2048]])  # a backward product of the MLP
    head = op(3, "aten::linear", shapes=[[4096, 2048], [32000, 2048], []])
    head_mm = op(4, "aten::mm", head)  # shapes only on the op above: the nearest matrix-product op that has them
    qkv = op(5, "aten::addmm", shapes=[[1024], [4096, 2048], [2048, 1024]])
    unknown = op(6, "aten::mm")
    attention = op(7, "Attention")
    inner = op(8, "aten::mm", attention, shapes=[[4096, 5632], [5632, 2048]])
    events = [up, down_grad, head, head_mm, qkv, unknown, attention, inner,
              kernel("nvjet_a", 0, 1000, 1), kernel("nvjet_b", 1000, 3000, 2), kernel("nvjet_c", 3000, 6000, 4),
              kernel("nvjet_d", 6000, 6500, 5), kernel("nvjet_e", 6500, 7000, 6), kernel("nvjet_f", 7000, 8000, 8)]
    widths = {"logits": 32000, "mlp": 5632}
    p = bm.step_profile(events, step_ms=8.0, cuda=True, widths=widths)
    assert p["ms"] == pytest.approx({"attention": 1.0, "projections": 0.5, "mlp": 3.0, "logits": 3.0, "matmul": 0.5,
                                     "communication": 0.0, "copies": 0.0, "other": 0.0})
    shared = bm.step_profile(events, step_ms=8.0, cuda=True, widths={"logits": 5632, "mlp": 5632})
    assert shared["ms"]["mlp"] == shared["ms"]["logits"] == 0 and shared["ms"]["projections"] == pytest.approx(6.5)
    assert bm.step_profile(events, step_ms=8.0, cuda=True)["ms"]["matmul"] == pytest.approx(7.0)  # no widths


def test_checkpointing_auto_keeps_activations_only_where_they_fit():
    bench_model = load_script()
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
    bench_model = load_script()

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
