"""Single-GPU kernel benchmark: fused Triton kernel vs the composed (chunk-loop + SDPA) path.

Drives the patterns itself, as the ring does with world size 1: for each plan
``pattern_forward`` then the library's pattern combination (``ring.combine_patterns``)
into full-layout fp32 accumulators; backward: ``pattern_backward`` of every plan with the
final merged ``out``/``lse`` into fp32 ``dq``/``dk``/``dv``.

Methods: ``fused`` (one launch per pattern), ``sdpa-flash`` / ``sdpa-cudnn``
(pattern.py's chunk loop over ``SdpaKernel``), ``reference`` (plain torch), and
the ceiling ``dense-cudnn``: cuDNN SDPA on dense attention of exactly the same
unmasked work (every pattern is ``N/r / M`` blocks of ``M x M`` per head, so the
sum is ``B_eq`` dense sequences of length ``M``; all patterns here share ``M``).

Reported: median ms of CUDA-event timings after warm-up, TFLOP/s of the unmasked
work only (fwd: 4*M*M*D per block and head, halved+diag for causal; bwd 2.5x fwd),
and peak extra memory. ``kernel`` rows time the pattern kernels alone; ``pipeline``
rows add the merge (and the accumulators) the ring does around them.

    python benchmarks/bench_kernel.py [--sweep] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dilated_attention.kernels.fused import FusedConfig, FusedKernel, default_config  # noqa: E402
from dilated_attention.kernels.pattern import pattern_backward, pattern_forward  # noqa: E402
from dilated_attention.kernels.reference import ReferenceKernel  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.ring import combine_patterns  # noqa: E402

try:
    from dilated_attention.kernels.sdpa import SdpaKernel  # noqa: E402
except Exception:  # pragma: no cover
    SdpaKernel = None


def timed(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event timings after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def flops_fwd(plans, bsz: int, seq: int, dim: int, causal: bool) -> float:
    """Unmasked forward work: 4*D per (query, visible key) pair, per covered head and segment."""
    total = 0.0
    for p in plans:
        m = p.local_segment // p.dilation
        heads = sum(c.h1 - c.h0 for c in p.chunks)
        pairs = m * (m + 1) / 2 if causal else m * m
        total += 4.0 * bsz * heads * (seq // p.local_segment) * pairs * dim
    return total


def fwd_pipeline(kernel, q, k, v, plans, causal, scale, merge=True):
    bsz, n, heads, dim = q.shape
    if not merge:
        return [pattern_forward(kernel, q, k, v, p, packed=False, causal=causal, scale=scale) for p in plans]
    # exactly what the library's forward does around the kernels (ring.combine_patterns)
    parts = [(p, *pattern_forward(kernel, q, k, v, p, packed=False, causal=causal, scale=scale)) for p in plans]
    return combine_patterns(parts, q)


def bwd_pipeline(kernel, q, k, v, plans, out, lse, dout, causal, scale):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for p in plans:
        pattern_backward(kernel, q, k, v, p, out, lse, dout, dq, dk, dv, packed=False, causal=causal, scale=scale)
    return dq, dk, dv


def measure_method(name, kernel, q, k, v, dout, plans, causal, scale, warmup, reps, fl_fwd):
    rows = []

    def row(kind, ms, flops, extra=None):
        r = {"method": name, "causal": causal, "kind": kind, "ms": ms, "tflops": flops / ms / 1e9 if ms else None}
        r.update(extra or {})
        rows.append(r)
        print(f"  {name:12s} causal={causal!s:5s} {kind:22s} {ms:9.3f} ms  {r['tflops'] or 0:7.1f} TFLOP/s", flush=True)

    # memory of the forward kernels alone on the densest pattern (r = 1): extra beyond out+lse
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, s = pattern_forward(kernel, q, k, v, plans[0], packed=False, causal=causal, scale=scale)
    torch.cuda.synchronize()
    peak_fwd = torch.cuda.max_memory_allocated() - base
    out_lse = o.numel() * o.element_size() + s.numel() * s.element_size()
    del o, s

    ms = timed(lambda: fwd_pipeline(kernel, q, k, v, plans, causal, scale, merge=False), warmup, reps)
    row("fwd kernel", ms, fl_fwd, {"peak_fwd_plan0_bytes": peak_fwd, "out_lse_plan0_bytes": out_lse})
    out, lse = fwd_pipeline(kernel, q, k, v, plans, causal, scale)
    ms_bwd = timed(lambda: bwd_pipeline(kernel, q, k, v, plans, out, lse, dout, causal, scale), warmup, reps)
    row("bwd kernel (+acc zero)", ms_bwd, 2.5 * fl_fwd)
    ms = timed(lambda: fwd_pipeline(kernel, q, k, v, plans, causal, scale), warmup, reps)
    row("fwd pipeline", ms, fl_fwd)

    def step():
        o_, l_ = fwd_pipeline(kernel, q, k, v, plans, causal, scale)
        bwd_pipeline(kernel, q, k, v, plans, o_, l_, dout, causal, scale)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = timed(step, warmup, reps)
    row("fwd+bwd pipeline", ms, 3.5 * fl_fwd, {"peak_fwd_bwd_bytes": peak})
    ms_fk = [r for r in rows if r["kind"] == "fwd kernel"][0]["ms"]
    row("fwd+bwd kernel", ms_fk + ms_bwd, 3.5 * fl_fwd)
    return rows


def measure_dense(q_shape, dtype, causal, warmup, reps, fl_fwd, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    bsz, heads, m, dim = q_shape
    q = torch.randn(q_shape, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(q_shape, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(q_shape, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(q_shape, device="cuda", dtype=dtype)
    f = torch.nn.functional.scaled_dot_product_attention
    rows = []
    with sdpa_kernel([backend]):
        with torch.no_grad():
            ms = timed(lambda: f(q, k, v, is_causal=causal), warmup, reps)
        rows.append({"method": f"dense-{backend_name}", "causal": causal, "kind": "fwd kernel", "ms": ms, "tflops": fl_fwd / ms / 1e9})

        def step():
            o = f(q, k, v, is_causal=causal)
            torch.autograd.grad(o, (q, k, v), g)

        ms2 = timed(step, warmup, reps)
        rows.append({"method": f"dense-{backend_name}", "causal": causal, "kind": "fwd+bwd kernel", "ms": ms2, "tflops": 3.5 * fl_fwd / ms2 / 1e9})
    for r in rows:
        print(f"  {r['method']:12s} causal={causal!s:5s} {r['kind']:22s} {r['ms']:9.3f} ms  {r['tflops']:7.1f} TFLOP/s", flush=True)
    return rows


FWD_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3)]
BWD_SWEEP = [  # dq_m, dq_n, dkdv_m, dkdv_n, warps, stages
    (64, 64, 32, 64, 8, 2),
    (128, 64, 32, 64, 8, 2),
    (64, 64, 64, 64, 8, 1),
    (64, 64, 32, 64, 8, 3),
    (64, 32, 32, 64, 4, 2),
]


def sweep(q, k, v, dout, plans, causal, scale, warmup, reps):
    """Time fused configs (fwd and bwd separately); no Triton autotuner: accumulation buffers are re-zeroed."""
    base = default_config(q.shape[-1], q.dtype)
    results = []
    for fc in FWD_SWEEP:
        cfg = FusedConfig(*fc, base.dq_m, base.dq_n, base.dkdv_m, base.dkdv_n, base.bwd_warps, base.bwd_stages)
        kern = FusedKernel(cfg)
        try:
            ms = timed(lambda: fwd_pipeline(kern, q, k, v, plans, causal, scale, merge=False), warmup, reps)
        except Exception as exc:  # a config that does not compile/fit
            ms = None
            print(f"  sweep fwd {fc}: failed {type(exc).__name__}: {str(exc)[:200]}")
        results.append({"causal": causal, "part": "fwd", "config": fc, "ms": ms})
        print(f"  sweep fwd causal={causal} {fc}: {ms}", flush=True)
    out, lse = fwd_pipeline(FusedKernel(), q, k, v, plans, causal, scale)
    for bc in BWD_SWEEP:
        cfg = FusedConfig(base.fwd_m, base.fwd_n, base.fwd_warps, base.fwd_stages, *bc)
        kern = FusedKernel(cfg)
        try:
            ms = timed(lambda: bwd_pipeline(kern, q, k, v, plans, out, lse, dout, causal, scale), warmup, reps)
        except Exception as exc:
            ms = None
            print(f"  sweep bwd {bc}: failed {type(exc).__name__}: {str(exc)[:200]}")
        results.append({"causal": causal, "part": "bwd", "config": bc, "ms": ms})
        print(f"  sweep bwd causal={causal} {bc}: {ms}", flush=True)
    return results


def check_close(q, k, v, dout, plans, causal, scale):
    """Fused vs composed (sdpa-flash) outputs and gradients on the benchmark shape: relative errors."""
    if SdpaKernel is None:
        return {}
    a = fwd_pipeline(FusedKernel(), q, k, v, plans, causal, scale)
    b = fwd_pipeline(SdpaKernel("flash"), q, k, v, plans, causal, scale)
    ga = bwd_pipeline(FusedKernel(), q, k, v, plans, a[0], a[1], dout, causal, scale)
    gb = bwd_pipeline(SdpaKernel("flash"), q, k, v, plans, b[0], b[1], dout, causal, scale)

    def rel(x, y):
        return ((x.float() - y.float()).norm() / y.float().norm()).item()

    res = {"out": rel(a[0], b[0]), "lse": rel(a[1], b[1]), "dq": rel(ga[0], gb[0]), "dk": rel(ga[1], gb[1]), "dv": rel(ga[2], gb[2])}
    print(f"  fused vs sdpa-flash relative diff (causal={causal}): {res}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--segments", default="2048,4096,8192,16384,32768")
    ap.add_argument("--rates", default="1,2,4,8,16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="time a few fused configs too")
    ap.add_argument("--methods", default="fused,sdpa-flash,sdpa-cudnn,reference")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    torch.backends.cuda.matmul.allow_tf32 = False

    segs = [int(x) for x in args.segments.split(",")]
    rates = [int(x) for x in args.rates.split(",")]
    dtype = torch.bfloat16
    plans = plan_patterns(segs, rates, seq_len=args.seq, local_len=args.seq, num_heads=args.heads,
                          num_kv_heads=args.heads, mode="longnet")
    ms_set = {p.local_segment // p.dilation for p in plans}
    gpu = torch.cuda.get_device_name()
    tag = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    import triton

    meta = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "command": " ".join([sys.executable] + sys.argv),
        "shape": {"B": args.batch, "N": args.seq, "H": args.heads, "D": args.dim, "dtype": "bf16"},
        "segment_lengths": segs, "dilation_rates": rates, "mode": "longnet",
        "fused_config": str(default_config(args.dim, dtype)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(meta, indent=1), flush=True)
    scale = args.dim ** -0.5
    torch.manual_seed(0)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
    rows, sweeps, checks = [], [], {}
    for causal in (False, True):
        fl = flops_fwd(plans, args.batch, args.seq, args.dim, causal)
        print(f"causal={causal}: unmasked fwd work {fl / 1e12:.3f} TFLOP", flush=True)
        try:
            checks[str(causal)] = check_close(q, k, v, dout, plans, causal, scale)
        except Exception as exc:
            print(f"  check failed: {type(exc).__name__}: {exc}")
        for name in args.methods.split(","):
            if name == "fused":
                kern = FusedKernel()
            elif name.startswith("sdpa"):
                if SdpaKernel is None:
                    continue
                kern = SdpaKernel("flash" if name == "sdpa-flash" else "cudnn")
            elif name == "reference":
                kern = ReferenceKernel()
            else:
                raise SystemExit(f"unknown method {name}")
            w, r = (1, 3) if name == "reference" else (args.warmup, args.reps)
            try:
                rows += measure_method(name, kern, q, k, v, dout, plans, causal, scale, w, r, fl)
            except Exception as exc:
                print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"method": name, "causal": causal, "kind": "error", "error": str(exc)[:300]})
            torch.cuda.empty_cache()
        if len(ms_set) == 1:
            m = next(iter(ms_set))
            blocks = fl / (4.0 * args.heads * args.dim * (m * (m + 1) / 2 if causal else m * m))
            beq = int(round(blocks))
            for backend in ("cudnn", "flash"):
                try:
                    rows += measure_dense((beq, args.heads, m, args.dim), dtype, causal, args.warmup, args.reps, fl, backend)
                except Exception as exc:
                    print(f"  dense-{backend} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if args.sweep:
            sweeps += sweep(q, k, v, dout, plans, causal, scale, args.warmup, args.reps)

    os.makedirs(args.out, exist_ok=True)
    result = {"meta": meta, "rows": rows, "sweep": sweeps, "fused_vs_sdpa_rel_diff": checks}
    summary = summarize(rows)
    result["summary"] = summary
    with open(os.path.join(args.out, f"kernel_{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(meta, rows, summary)
    with open(os.path.join(args.out, f"kernel_{tag}.md"), "w") as f:
        f.write(md)
    try:
        plot(rows, os.path.join(args.out, f"kernel_{tag}.png"), gpu)
    except Exception as exc:
        print(f"plot failed: {exc}")
    print(md)


def _get(rows, method, causal, kind):
    for r in rows:
        if r["method"] == method and r["causal"] == causal and r["kind"] == kind:
            return r
    return None


def summarize(rows):
    out = {}
    for causal in (False, True):
        f = _get(rows, "fused", causal, "fwd+bwd pipeline")
        fk = _get(rows, "fused", causal, "fwd+bwd kernel")
        comp = [r for r in (_get(rows, m, causal, "fwd+bwd pipeline") for m in ("sdpa-flash", "sdpa-cudnn")) if r]
        compk = [r for r in (_get(rows, m, causal, "fwd+bwd kernel") for m in ("sdpa-flash", "sdpa-cudnn")) if r]
        dense = _get(rows, "dense-cudnn", causal, "fwd+bwd kernel")
        densef = _get(rows, "dense-cudnn", causal, "fwd kernel")
        ff = _get(rows, "fused", causal, "fwd kernel")
        s = {}
        if f and comp:
            s["speedup_vs_best_composed_pipeline"] = min(r["ms"] for r in comp) / f["ms"]
        if fk and compk:
            s["speedup_vs_best_composed_kernel"] = min(r["ms"] for r in compk) / fk["ms"]
        if fk and dense:
            s["fused_over_dense_cudnn_fwd_bwd_tflops"] = fk["tflops"] / dense["tflops"]
        if ff and densef:
            s["fused_over_dense_cudnn_fwd_tflops"] = ff["tflops"] / densef["tflops"]
        if ff and "peak_fwd_plan0_bytes" in ff:
            s["fused_fwd_extra_bytes_beyond_out_lse"] = ff["peak_fwd_plan0_bytes"] - ff["out_lse_plan0_bytes"]
        out[str(causal)] = s
    return out


def markdown(meta, rows, summary):
    lines = [
        f"# Kernel benchmark on {meta['gpu']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; "
        f"B={meta['shape']['B']} N={meta['shape']['N']} H={meta['shape']['H']} D={meta['shape']['D']} bf16, "
        f"longnet segments {meta['segment_lengths']} rates {meta['dilation_rates']}.",
        f"Command: `{meta['command']}`",
        "",
        "| method | causal | what | ms | TFLOP/s | peak extra MiB |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r["kind"] == "error":
            lines.append(f"| {r['method']} | {r['causal']} | error | | | {r['error'][:80]} |")
            continue
        mem = r.get("peak_fwd_bwd_bytes", r.get("peak_fwd_plan0_bytes"))
        mem = f"{mem / 2**20:.0f}" if mem is not None else ""
        lines.append(f"| {r['method']} | {r['causal']} | {r['kind']} | {r['ms']:.3f} | {r['tflops']:.1f} | {mem} |")
    lines += ["", "Summary: " + json.dumps(summary), ""]
    return "\n".join(lines)


def plot(rows, path, gpu):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["fwd kernel", "fwd+bwd kernel", "fwd+bwd pipeline"]
    methods = []
    for r in rows:
        if r["kind"] != "error" and r["method"] not in methods and r["method"] != "reference":
            methods.append(r["method"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            vals = []
            for kind in kinds:
                r = _get(rows, m, causal, kind)
                vals.append(r["tflops"] if r else 0)
            ax.bar([x + i * width for x in range(len(kinds))], vals, width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(kinds))])
        ax.set_xticklabels(kinds)
        ax.set_title(f"causal={causal}")
        ax.set_ylabel("effective TFLOP/s (unmasked work)")
    axes[0].legend()
    fig.suptitle(f"dilated attention kernels, {gpu}, N=32768 H=16 D=128 bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
