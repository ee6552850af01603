"""Single-GPU kernel benchmark: every implementation ``kernel="auto"`` can choose, the library path, the ceilings.

The pipelines are the library's own ring schedule on one device (``ring.block.block_forward``/``block_backward``:
each local pattern a compact part combined once at the end, or merged into a running fp32 result, as the
kernel's ``parts`` says); the "kernel" rows run the patterns alone (forward: compact results; backward:
``backward_pattern`` of every plan, with the final merged ``out``/``lse``, into fp32 accumulators).

Methods (``--methods``): ``fused`` (Triton, one launch per pattern), ``flash4`` (flash-attn-4, one call per
pattern and head-offset group, where it is installed and the GPU runs it; ``flash4-nondet`` with its default,
non-deterministic backward), ``cudnn``
(zero-copy strided cuDNN calls, ``kernels/cudnn.py``), ``auto`` (per pattern and
direction the implementation measured fastest in *this* run, deterministic
backward only), ``auto-any`` (the same, cuDNN's non-deterministic backward
allowed), ``cudnn-det`` (cuDNN forward, cuDNN's deterministic backward through the
cuDNN frontend, when ``nvidia-cudnn-frontend`` is installed), ``cudnn-dkdv`` (cuDNN
forward and dK/dV, the fused kernel's dQ),
``sdpa-flash``/``sdpa-cudnn`` (the composed chunk loop, copies),
``reference``. Ceilings: ``dense-cudnn``/``dense-flash``, torch SDPA on dense
attention of exactly the same unmasked work (every pattern is ``N/r / M`` blocks
of ``M x M`` per head; all patterns here share ``M``).

The auto table: every plan is timed forward and backward with each
implementation (flash4 among them where it runs); plans are classed dense (``r = 1``) or dilated and by
the length class of their segment rows (``auto.length_class``: the LongNet plans' 2048-row segments are
short, the ``--mid-segments`` plans' 4096-8192-row ones mid, the full-attention plan over ``--full-seq`` rows
long), and the class sums decide (a backward must also be bitwise reproducible to be the deterministic
choice, and every implementation must agree with the fused kernel to be chosen at
all); where a runner-up is close, the combinations are timed on the pipeline
itself and the fastest is kept, or within ``TRIAL_TIE`` (1%) of it the combination whose step peaks lowest
(``refine_by_pipeline``, ``pipeline_trials`` in the JSON). Each entry ranks the implementations that
qualified, the kept one first, then the others fastest first (auto takes the first that runs on the device).
``--write-table <json>`` stores a run's choices in ``kernels/auto_table.py``; ``--table-only`` measures just
the table (LongNet plans and the full-attention plan). The ``auto`` and ``auto-any`` rows run the table shipped for
this GPU model, what ``kernel="auto"`` runs (``--auto-choices run``: this run's choices, a candidate table timed
before it is written; a GPU with no shipped table always runs the run's). Where the run ranks otherwise than the
shipped table, both run the LongNet call through the API, alternated, back to back (``table_ab`` in the JSON), and
``--write-table`` keeps the shipped entries of that call's length classes where the run's ranking was slower
(``--force-table`` writes them anyway). Pipeline trials time back to back too: the pace of a training loop.

Reported: median ms of CUDA-event timings after warm-up, TFLOP/s of the unmasked
work only (fwd: 4*M*M*D per block and head, halved+diag for causal; bwd 2.5x fwd),
peak extra memory; ``api`` rows time ``dilated_attention`` forward+backward through
autograd; the full-attention rows (one pattern ``w = N``, ``r = 1``) compare the
library with cuDNN SDPA itself. The JSON summary has, per causal flag,
``library_fwd_bwd_vs_dense_cudnn`` (library path vs dense cuDNN, rate ratio).

Causal split (``--causal-block N[,N...]``): the ``flash4`` and ``cudnn-det`` methods (and ``auto``'s
implementations of those names) run with ``causal_block`` = the first value (0: never split; without the
option each kernel's default), and each further value adds the methods ``flash4-cb<N>`` and
``cudnn-det-cb<N>``: so ``--causal-block 0,2048`` times unsplit and split in one run. The split happens in the
library's schedule (``ring/block.py``), so it shows in the pipeline, ``api`` and full-attention rows, not in the
``kernel`` rows (patterns called alone). The JSON records the values (``meta.causal_block``).

Writes ``kernel_<gpu>.json`` (everything, the markdown included), ``.md`` and ``.png`` into ``--out``,
``<gpu>`` the model (``gpu_tag.py``: ``h200``, ``h100``).

    python benchmarks/bench_kernel.py [--sweep] [--out benchmarks/results]
    python benchmarks/bench_kernel.py --smoke          # CPU, Triton interpreter, tiny shapes
    python benchmarks/bench_kernel.py --render benchmarks/results/kernel_h200.json       # markdown and plot next to it
    python benchmarks/bench_kernel.py --write-table benchmarks/results/kernel_h200.json
    python benchmarks/bench_kernel.py --table-only --full-seq 65536 --out /tmp/t   # the table by length class
    python benchmarks/bench_kernel.py --methods flash4 --full-seq 65536 --causal-block 0,1024,2048,4096
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import pprint
import sys
import time
from dataclasses import replace


SPLIT_METHODS = ("flash4", "cudnn-det")  # the methods --causal-block applies to


def causal_blocks(text: str) -> list[int]:
    """``--causal-block``'s values: ints >= 0, comma-separated, each once."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...] with ints >= 0, got {text!r}") from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct ints >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--segments", default="2048,4096,8192,16384,32768")
    ap.add_argument("--rates", default="1,2,4,8,16")
    ap.add_argument("--mid-segments", default="4096,8192,32768",
                    help="the plans of the table's mid class (segment rows over 2048 up to 8192; default: dense "
                         "4096-row segments, dilated 4096- and 8192-row ones, as LongNet's 8192-65536 segments)")
    ap.add_argument("--mid-rates", default="1,2,4")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="time a few fused configs too")
    ap.add_argument("--methods", default="fused,flash4,flash4-nondet,cudnn,cudnn-det,cudnn-dkdv,auto,auto-any,sdpa-cudnn")
    ap.add_argument("--full-seq", type=int, default=None,
                    help="rows of the full-attention plan (table's long class and comparison; default --seq)")
    ap.add_argument("--table-only", action="store_true", help="measure only the auto table (by length class)")
    ap.add_argument("--force-table", action="store_true",
                    help="with --write-table: write every class measured, even where the run's ranking ran the "
                         "benchmark's call slower than the shipped table (its table_ab)")
    ap.add_argument("--auto-choices", choices=["shipped", "run"], default="shipped",
                    help="the table the auto/auto-any rows run: the one shipped for this GPU in kernels/auto_table.py "
                         "(what kernel='auto' runs; this run's choices where none is shipped), or this run's choices "
                         "(a candidate before --write-table)")
    ap.add_argument("--table-extra", default="", help="more table entries, 'dim:dtype,...' (e.g. 64:bfloat16,128:float16)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-attention comparison")
    ap.add_argument("--causal-block", type=causal_blocks, default=None, metavar="N[,N...]",
                    help="causal_block of the flash4 and cudnn-det methods (0: no split); each further value adds "
                         "methods flash4-cb<N>, cudnn-det-cb<N> (e.g. 0,2048: unsplit and split in one run)")
    ap.add_argument("--no-md", action="store_true", help="write only JSON and PNG (the markdown is in the JSON)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: checks the script")
    ap.add_argument("--render", metavar="JSON", help="write the markdown and plot of a result JSON next to it and exit")
    ap.add_argument("--write-table", metavar="JSON", help="store a result JSON's auto choices in kernels/auto_table.py")
    ap.add_argument("--table-classes", default="short,mid,long",
                    help="with --write-table: the length classes whose entries are replaced (e.g. long: the table "
                         "times kernels alone, and where the api rows disagree for a class, keep its entries)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors before torch and the kernels load

if "--smoke" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_tag import gpu_tag  # noqa: E402
from host_cost import back_to_back_ms, issue_ms, kernel_launches  # noqa: E402

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.kernels.auto import (  # noqa: E402
    LENGTH_CLASSES, AutoKernel, available_choices, device_choices, length_class, normalize_choices, table_key)
from dilated_attention.kernels.cudnn import CudnnKernel  # noqa: E402
from dilated_attention.kernels.cudnn_frontend import CudnnFrontendOps  # noqa: E402
from dilated_attention.kernels.flash4 import Flash4Kernel  # noqa: E402
from dilated_attention.kernels.registry import FLASH4_NAMES  # noqa: E402
from dilated_attention.kernels.flash4 import unavailable_reason as flash4_unavailable  # noqa: E402
from dilated_attention.kernels.fused import FusedKernel, default_config  # noqa: E402
from dilated_attention.kernels.protocol import CallSpec  # noqa: E402
from dilated_attention.kernels.registry import KERNELS, build_kernel  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.ring.block import block_backward, block_forward  # noqa: E402
from dilated_attention.ring.routes import RingCall, plan_ring  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TABLE_FILE = os.path.join(ROOT, "dilated_attention", "kernels", "auto_table.py")


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, warmup: int, reps: int, device=torch.device("cuda")) -> float:
    """Median milliseconds of ``fn`` over ``reps`` timings (CUDA events on a GPU) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def pace(fn, warmup: int, reps: int, device) -> float:
    """Milliseconds per call of ``fn`` at a training loop's pace: issued back to back on a GPU (the host issues a
    call while the GPU runs the last), the median of ``timed`` elsewhere."""
    if device.type == "cuda":
        return back_to_back_ms(fn, reps=max(reps, 4), warmup=max(warmup, 1))
    return timed(fn, warmup, reps, device)


def alternated(calls: list, warmup: int, reps: int, device) -> list[list[float]]:
    """Each of ``calls`` timed at a training loop's pace (``pace``) once per round, round robin over
    ``TRIAL_ROUNDS`` rounds (a slow spell of the machine hits every call alike): the rounds of each."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(TRIAL_ROUNDS):
        for fn, ms in zip(calls, times):
            ms.append(pace(fn, warmup, reps, device))
    return times


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
    if not merge:
        return [kernel.forward_pattern(q, k, v, p, CallSpec(causal, scale)) for p in plans]
    # exactly what the library's forward does around the kernels (the ring schedule on one device)
    return block_forward(q, k, v, None, RingCall(plan_ring(plans, kernel, causal=causal, scale=scale), None, 0))


def library_backward(kernel, q, k, v, plans, out, lse, dout, causal, scale):
    # exactly what the library's backward does around the kernels (the ring schedule on one device)
    return block_backward(q, k, v, None, (out, lse, dout),
                          RingCall(plan_ring(plans, kernel, causal=causal, scale=scale), None, 0))


def fwd_bwd_pipeline(kernel, q, k, v, plans, dout, causal, scale):
    """One training step's attention on one device, as the library runs it: ``block_forward`` + ``block_backward``."""
    out, lse = fwd_pipeline(kernel, q, k, v, plans, causal, scale)
    return library_backward(kernel, q, k, v, plans, out, lse, dout, causal, scale)


def bwd_pipeline(kernel, q, k, v, plans, out, lse, dout, causal, scale):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for p in plans:
        kernel.backward_pattern(q, k, v, p, CallSpec(causal, scale), (out, lse, dout), (dq, dk, dv))
    return dq, dk, dv


def _print_row(r):
    tf = r.get("tflops") or 0
    host = f"  host {r['host_issue_ms']:.2f} ms, {r['launches']} kernels" if "host_issue_ms" in r else ""
    host += f", back to back {r['back_to_back_ms']:.3f} ms" if "back_to_back_ms" in r else ""
    print(f"  {r['method']:12s} causal={r['causal']!s:5s} {r['kind']:22s} {r['ms']:9.3f} ms  {tf:7.1f} TFLOP/s{host}",
          flush=True)


def peak_extra(fn, device) -> tuple[int, object]:
    """Peak bytes allocated by ``fn`` beyond what was allocated before, and its result."""
    if device.type != "cuda":
        return 0, fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, res


def measure_method(name, kernel, q, k, v, dout, plans, causal, scale, warmup, reps, fl_fwd, api_args=None):
    rows = []
    dev = q.device

    def row(kind, ms, flops, extra=None):
        r = {"method": name, "causal": causal, "kind": kind, "ms": ms, "tflops": flops / ms / 1e9 if ms else None}
        r.update(extra or {})
        rows.append(r)
        _print_row(r)

    # memory of the forward kernels alone on the densest pattern (r = 1): extra beyond out+lse
    peak_fwd, (o, s) = peak_extra(lambda: kernel.forward_pattern(q, k, v, plans[0], CallSpec(causal, scale)), dev)
    out_lse = o.numel() * o.element_size() + s.numel() * s.element_size()
    del o, s

    ms = timed(lambda: fwd_pipeline(kernel, q, k, v, plans, causal, scale, merge=False), warmup, reps, dev)
    row("fwd kernel", ms, fl_fwd, {"peak_fwd_plan0_bytes": peak_fwd, "out_lse_plan0_bytes": out_lse})
    out, lse = fwd_pipeline(kernel, q, k, v, plans, causal, scale)
    ms_bwd = timed(lambda: bwd_pipeline(kernel, q, k, v, plans, out, lse, dout, causal, scale), warmup, reps, dev)
    row("bwd kernel (+acc zero)", ms_bwd, 2.5 * fl_fwd)
    ms = timed(lambda: fwd_pipeline(kernel, q, k, v, plans, causal, scale), warmup, reps, dev)
    row("fwd pipeline", ms, fl_fwd)

    def step():
        fwd_bwd_pipeline(kernel, q, k, v, plans, dout, causal, scale)

    peak, _ = peak_extra(step, dev)
    ms = timed(step, warmup, reps, dev)
    row("fwd+bwd pipeline", ms, 3.5 * fl_fwd, {"peak_fwd_bwd_bytes": peak})
    ms_fk = [r for r in rows if r["kind"] == "fwd kernel"][0]["ms"]
    row("fwd+bwd kernel", ms_fk + ms_bwd, 3.5 * fl_fwd)
    if api_args is not None:  # the public function through autograd: what a model sees
        segs, rates = api_args
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def api():
            o_ = dilated_attention(*leaves, segs, rates, causal=causal, kernel=kernel)
            torch.autograd.grad(o_, leaves, dout)

        host = {"host_issue_ms": issue_ms(api), "launches": kernel_launches(api),
                "back_to_back_ms": back_to_back_ms(api)} if dev.type == "cuda" else {}
        row("api fwd+bwd", timed(api, warmup, reps, dev), 3.5 * fl_fwd, host)
    return rows


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[name]


def measure_dense(q_shape, dtype, causal, warmup, reps, fl_fwd, backend_name, device, method=None):
    """torch SDPA forward and forward+backward on dense ``(B, H, M, D)`` inputs (the ceiling)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(q_shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(q_shape, device=device, dtype=dtype)
    f = torch.nn.functional.scaled_dot_product_attention
    method = method or f"dense-{backend_name}"
    rows = []
    with sdpa_kernel([_sdpa_backend(backend_name)]):
        with torch.no_grad():
            ms = timed(lambda: f(q, k, v, is_causal=causal), warmup, reps, device)
        rows.append({"method": method, "causal": causal, "kind": "fwd kernel", "ms": ms, "tflops": fl_fwd / ms / 1e9})

        def step():
            o = f(q, k, v, is_causal=causal)
            torch.autograd.grad(o, (q, k, v), g)

        ms2 = timed(step, warmup, reps, device)
        rows.append({"method": method, "causal": causal, "kind": "fwd+bwd kernel", "ms": ms2,
                     "tflops": 3.5 * fl_fwd / ms2 / 1e9})
        if device.type == "cuda":  # the reference of the API's back-to-back pace: the same pace (and clocks)
            rows[-1]["back_to_back_ms"] = back_to_back_ms(step)
    for r in rows:
        _print_row(r)
    return rows


# ---------------------------------------------------------------------------
# the auto table: per plan class and direction, the fastest correct implementation


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure_table(impls, q, k, v, dout, plans, causal, scale, warmup, reps, tol=2e-2):
    """Per plan and implementation: fwd/bwd ms, agreement with fused, bitwise reproducibility of the backward.

    Returns ``(per-plan rows, choices)`` with choices keyed by ``auto.table_key``.
    """
    dev, dim, dtype = q.device, q.shape[-1], q.dtype
    fused = impls["fused"]
    out, lse = fwd_pipeline(fused, q, k, v, plans, causal, scale)
    rows = []
    for p in plans:
        ref_f = fused.forward_pattern(q, k, v, p, CallSpec(causal, scale))
        ref_b = [torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in (q, k, v)]
        fused.backward_pattern(q, k, v, p, CallSpec(causal, scale), (out, lse, dout), ref_b)
        for name, impl in impls.items():
            r = {"plan": p.index, "w": p.segment, "r": p.dilation, "causal": causal, "impl": name}
            if impl.supports(q, k) is not None:
                r["error"] = impl.supports(q, k)
                rows.append(r)
                continue
            try:
                o, s = impl.forward_pattern(q, k, v, p, CallSpec(causal, scale))
                o2, s2 = impl.forward_pattern(q, k, v, p, CallSpec(causal, scale))
                r["fwd_reproducible"] = bool(torch.equal(o, o2) and torch.equal(s, s2))
                del o2, s2
                rows_o = torch.cat([o[:, :, c.h0:c.h1].flatten(2) for c in p.chunks], -1)
                rows_r = torch.cat([ref_f[0][:, :, c.h0:c.h1].flatten(2) for c in p.chunks], -1)
                grads = []
                for _ in range(2):
                    acc = [torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in (q, k, v)]
                    impl.backward_pattern(q, k, v, p, CallSpec(causal, scale), (out, lse, dout), acc)
                    grads.append(acc)
                r["rel_vs_fused"] = max([_rel(rows_o, rows_r)] + [_rel(a, b) for a, b in zip(grads[0], ref_b)])
                r["bwd_reproducible"] = all(torch.equal(a, b) for a, b in zip(*grads))
                # what the library calls (ring/block.py): a compact part (combined once at the end, not timed here),
                # or the pattern merged into a running result, the first one fresh when it covers everything
                fresh = p is plans[0] and p.covers_all(q.shape[2], k.shape[2])
                run_o = torch.zeros(q.shape, dtype=torch.float32, device=dev)
                run_l = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=dev)
                r["parts"] = [impl.parts(d, p, q, k, causal=causal, masked=False) for d in ("fwd", "bwd")]
                spec = CallSpec(causal, scale)
                fwd = (lambda: impl.forward_pattern(q, k, v, p, spec)) if r["parts"][0] else (
                    lambda: impl.forward_pattern_into(q, k, v, p, spec, (run_o, run_l), fresh=fresh))
                acc = grads[0]
                bwd = (lambda: impl.backward_pattern_parts(q, k, v, p, spec, (out, lse, dout))) if r["parts"][1] else (
                    lambda: impl.backward_pattern(q, k, v, p, spec, (out, lse, dout), acc, fresh=fresh))
                r["fwd_ms"] = timed(fwd, warmup, reps, dev)
                r["bwd_ms"] = timed(bwd, warmup, reps, dev)
            except Exception as exc:  # an implementation that cannot run this plan is never chosen
                r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(r)
            print(f"  table causal={causal} plan {p.index} (w={p.segment}, r={p.dilation}) {name:9s} "
                  + (f"fwd {r['fwd_ms']:.3f} ms bwd {r['bwd_ms']:.3f} ms rel {r['rel_vs_fused']:.1e} "
                     f"reproducible fwd {r['fwd_reproducible']} bwd {r['bwd_reproducible']}"
                     if "error" not in r else r["error"]), flush=True)
    choices, ranking = {}, {}
    rows_of = {p.index: p.local_segment // p.dilation for p in plans}
    for dense, length in sorted({(x["r"] == 1, length_class(rows_of[x["plan"]])) for x in rows}):
        cls = [x for x in rows if (x["r"] == 1) == dense and length_class(rows_of[x["plan"]]) == length]
        r0, m = cls[0]["r"], rows_of[cls[0]["plan"]]
        runs = {name for name in impls if all("error" not in x for x in cls if x["impl"] == name)}
        for direction in ("fwd", "bwd", "bwd-any"):
            best, best_ms, timed_ok = None, None, []
            for name in impls:
                mine = [x for x in cls if x["impl"] == name]
                ok = all("error" not in x and x["rel_vs_fused"] <= tol for x in mine)
                if direction == "bwd":  # declared deterministic, and no run-to-run difference seen
                    ok = ok and impls[name].deterministic_backward and all(x.get("bwd_reproducible") for x in mine)
                if direction == "fwd":  # the library's backends promise bitwise-equal results
                    ok = ok and all(x.get("fwd_reproducible") for x in mine)
                    ok = ok and SAME_FORWARD.get(name) not in runs  # one kernel timed twice: name the one kept
                if not ok or not mine:
                    continue
                ms = sum(x["fwd_ms" if direction == "fwd" else "bwd_ms"] for x in mine)
                timed_ok.append((ms, name))
                if best_ms is None or ms < best_ms:
                    best, best_ms = name, ms
            if best is not None:
                key = table_key(direction, r0, causal, dim, dtype, m)
                choices[key] = best
                ranking[key] = [(name, ms) for ms, name in sorted(timed_ok)]
    return rows, choices, ranking


def ranked_choices(choices, ranking):
    """Each key's winner first, then the other qualified implementations fastest first (the table's entries)."""
    return {key: (name, *(n for n, _ in ranking.get(key, ()) if n != name)) for key, name in choices.items()}


CLOSE_CALL = 1.3  # a runner-up within this factor of the fastest pattern timing is tried in the pipeline too
TRIAL_ROUNDS = 3  # rounds of pipeline trials; each combination's median over them decides
# trials within this fraction of the fastest are a tie (trial medians move 2-3% between rounds): the one whose
# step peaks lowest is kept (a cuDNN deterministic backward's workspace, say, that another kernel does not hold)
TRIAL_TIE = 0.01


def refine_by_pipeline(impls, choices, ranked, q, k, v, dout, plans, causal, scale, warmup, reps):
    """The table's fwd/bwd choices, decided on the library's pipeline among close calls.

    Patterns timed one by one hide what overlaps in the pipeline (one implementation's host work runs
    under the previous pattern's kernels), so where the runner-up of a key is within ``CLOSE_CALL`` of its
    fastest, every combination of the two is timed as ``block_forward`` + ``block_backward`` through an
    ``AutoKernel`` (deterministic backward) and the fastest combination is kept (``pick_trial``). Returns
    ``(choices, trials)``; a trial is ``{"choices": {key: name}, "ms": median, "rounds": [...], "peak_bytes":
    int}`` for the keys tried, timed at a training loop's pace (``pace``: back to back on a GPU) in
    ``TRIAL_ROUNDS`` round-robin rounds (timings drift by 10% over a run on a busy host), its peak taken on one
    more step (bytes beyond the inputs; 0 off a GPU)."""
    keys = [key for key, names in ranked.items()
            if key.split("/")[0] in ("fwd", "bwd") and len(names) > 1 and names[1][1] <= CLOSE_CALL * names[0][1]]
    if not keys:
        return choices, []
    combos = [dict(zip(keys, combo)) for combo in itertools.product(*([name for name, _ in ranked[key][:2]]
                                                                        for key in keys))]
    kernels = [AutoKernel(impls, {**choices, **tried}) for tried in combos]
    times = alternated([lambda kernel=kernel: fwd_bwd_pipeline(kernel, q, k, v, plans, dout, causal, scale)
                        for kernel in kernels], warmup, reps, q.device)
    peaks = [peak_extra(lambda: fwd_bwd_pipeline(kernel, q, k, v, plans, dout, causal, scale), q.device)[0]
             for kernel in kernels]
    trials = [{"choices": tried, "ms": sorted(ms)[len(ms) // 2], "rounds": ms, "peak_bytes": peak}
              for tried, ms, peak in zip(combos, times, peaks)]
    for trial in trials:
        print(f"  pipeline trial causal={causal} {trial['choices']}: {trial['ms']:.3f} ms "
              f"(rounds {', '.join(f'{x:.3f}' for x in trial['rounds'])}), peak {trial['peak_bytes'] / 2**20:.0f} MiB",
              flush=True)
    return {**choices, **pick_trial(trials)["choices"]}, trials


def pick_trial(trials: list[dict]) -> dict:
    """The trial kept: the fastest, or among those within ``TRIAL_TIE`` of it the one whose step peaks lowest
    (at equal peaks, as off a GPU, the fastest)."""
    fastest = min(trials, key=lambda t: t["ms"])
    tied = [t for t in trials if t["ms"] <= fastest["ms"] * (1 + TRIAL_TIE)]
    return min(tied, key=lambda t: (t["peak_bytes"], t["ms"]))


def differs(shipped: dict, choices: dict) -> bool:
    """Whether a shipped table would run any key this run measured otherwise (no shipped table: False)."""
    shipped, choices = normalize_choices(shipped), normalize_choices(choices)
    return bool(shipped) and any(shipped.get(key, ())[:1] != names[:1] for key, names in choices.items())


def compare_tables(impls, tables: dict[str, dict], q, k, v, dout, segs, rates, causal, warmup, reps) -> dict:
    """The LongNet call through the API under each of ``tables`` (name -> auto choices), alternated over
    ``TRIAL_ROUNDS`` rounds at a training loop's pace (``pace``): ``{name: {"ms": median, "rounds": [...]}}``.
    Decides whether a run's ranking may replace the shipped table (``write_table``)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    def api(kernel):
        return lambda kernel=kernel: torch.autograd.grad(
            dilated_attention(*leaves, segs, rates, causal=causal, kernel=kernel), leaves, dout)

    times = alternated([api(AutoKernel(impls, choices)) for choices in tables.values()], warmup, reps, q.device)
    return {name: {"ms": sorted(ts)[len(ts) // 2], "rounds": ts} for name, ts in zip(tables, times)}


def lost_classes(result: dict) -> set[str]:
    """The length classes of the benchmark's LongNet call where the run's ranking ran that call slower than the
    shipped table (beyond ``TRIAL_TIE``, either causal flag; ``table_ab`` in the result): ``write_table`` keeps
    the shipped entries of those classes."""
    meta, compared = result["meta"], (result.get("table_ab") or {}).values()
    if not any(ab["run"]["ms"] > ab["shipped"]["ms"] * (1 + TRIAL_TIE) for ab in compared):
        return set()
    return {length_class(w // r) for w, r in zip(meta["segment_lengths"], meta["dilation_rates"])}


# ---------------------------------------------------------------------------


# (block_m, block_n, warps, stages) of one kernel; the others keep the pinned config.
SWEEP = {
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
            (64, 128, 4, 3)],
    "dq": [(64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 32, 4, 4), (128, 32, 4, 3), (128, 32, 4, 5), (128, 32, 8, 3),
           (128, 64, 8, 3), (64, 64, 4, 3)],
    "dkdv": [(32, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (32, 64, 4, 4), (32, 128, 4, 3), (32, 128, 4, 5), (32, 128, 8, 3),
             (64, 128, 8, 3), (16, 64, 4, 3), (64, 64, 4, 3)],
}


def sweep(q, k, v, dout, plans, causal, scale, warmup, reps):
    """Time fused configs, one kernel at a time (forward kernels; backward = delta + dQ + dK/dV with fresh
    accumulators); no Triton autotuner, so every configuration is a pinned, reproducible launch."""
    base = default_config(q.shape[-1], q.dtype)
    out, lse = fwd_pipeline(FusedKernel(), q, k, v, plans, causal, scale)
    results = []
    for part, configs in SWEEP.items():
        for m, n, warps, stages in configs:
            try:
                cfg = replace(base, **{f"{part}_m": m, f"{part}_n": n, f"{part}_warps": warps, f"{part}_stages": stages})
                kern = FusedKernel(cfg)
                if part == "fwd":
                    ms = timed(lambda: fwd_pipeline(kern, q, k, v, plans, causal, scale, merge=False), warmup, reps)
                else:
                    ms = timed(lambda: bwd_pipeline(kern, q, k, v, plans, out, lse, dout, causal, scale), warmup, reps)
            except Exception as exc:  # a config that does not compile or fit
                ms = None
                print(f"  sweep {part} {(m, n, warps, stages)}: failed {type(exc).__name__}: {str(exc)[:200]}")
            results.append({"causal": causal, "part": part, "config": [m, n, warps, stages], "ms": ms})
            print(f"  sweep {part} causal={causal} {(m, n, warps, stages)}: {ms}", flush=True)
    return results


def full_attention(q, k, v, dout, causal, impls, warmup, reps):
    """One pattern ``w = N, r = 1`` through ``dilated_attention`` vs cuDNN SDPA on the same (B, N, H, D) data."""
    from torch.nn.attention import sdpa_kernel

    bsz, n, heads, dim = q.shape
    dev = q.device
    fl = 4.0 * bsz * heads * dim * (n * (n + 1) / 2 if causal else n * n)
    rows = []
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    backend = "cudnn" if dev.type == "cuda" else "math"
    with sdpa_kernel([_sdpa_backend(backend)]):
        bh = [x.transpose(1, 2) for x in leaves]
        with torch.no_grad():
            ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(*bh, is_causal=causal), warmup, reps, dev)
        rows.append({"method": f"full-sdpa-{backend}", "causal": causal, "kind": "fwd", "ms": ms, "tflops": fl / ms / 1e9})

        def sdpa_step():
            o = torch.nn.functional.scaled_dot_product_attention(*[x.transpose(1, 2) for x in leaves], is_causal=causal)
            torch.autograd.grad(o, leaves, dout.transpose(1, 2))

        ms = timed(sdpa_step, warmup, reps, dev)
        rows.append({"method": f"full-sdpa-{backend}", "causal": causal, "kind": "fwd+bwd", "ms": ms,
                     "tflops": 3.5 * fl / ms / 1e9})
    for name, kern in impls.items():
        try:
            with torch.no_grad():
                ms = timed(lambda: dilated_attention(*leaves, [n], [1], causal=causal, kernel=kern), warmup, reps, dev)
            rows.append({"method": f"full-{name}", "causal": causal, "kind": "fwd", "ms": ms, "tflops": fl / ms / 1e9})

            def step():
                o = dilated_attention(*leaves, [n], [1], causal=causal, kernel=kern)
                torch.autograd.grad(o, leaves, dout)

            ms = timed(step, warmup, reps, dev)
            rows.append({"method": f"full-{name}", "causal": causal, "kind": "fwd+bwd", "ms": ms,
                         "tflops": 3.5 * fl / ms / 1e9})
        except Exception as exc:
            print(f"  full-{name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append({"method": f"full-{name}", "causal": causal, "kind": "error", "error": str(exc)[:300]})
    for r in rows:
        if r["kind"] != "error":
            _print_row(r)
    return rows


def check_close(impls, q, k, v, dout, plans, causal, scale):
    """Every implementation vs the fused kernel on the benchmark shape, through the pipeline: relative errors."""
    res = {}
    a = fwd_pipeline(impls["fused"], q, k, v, plans, causal, scale)
    ga = bwd_pipeline(impls["fused"], q, k, v, plans, a[0], a[1], dout, causal, scale)
    for name, kern in impls.items():
        if name == "fused":
            continue
        try:
            b = fwd_pipeline(kern, q, k, v, plans, causal, scale)
            gb = bwd_pipeline(kern, q, k, v, plans, b[0], b[1], dout, causal, scale)
            res[name] = {"out": _rel(b[0], a[0]), "lse": _rel(b[1], a[1]),
                         **{f"d{x}": _rel(y, z) for x, y, z in zip("qkv", gb, ga)}}
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(f"  {name} vs fused relative diff (causal={causal}): {res[name]}", flush=True)
    return res


def split_kernel(name: str, block: int | None):
    """The library's kernel ``name`` with ``causal_block=block`` where ``name`` is one of ``SPLIT_METHODS``
    (``None``: its default), else as the registry builds it."""
    if block is None or name not in SPLIT_METHODS:
        return build_kernel(name)
    if name == "flash4":
        return Flash4Kernel(causal_block=block)
    return CudnnKernel(CudnnFrontendOps(), causal_block=block)


def split_variants(methods: list[str], blocks: list[int] | None) -> list[str]:
    """``methods`` with ``<m>-cb<N>`` after each split method ``m`` for every ``--causal-block`` value but the first."""
    extra = blocks[1:] if blocks else []
    return [v for m in methods for v in (m, *(f"{m}-cb{b}" for b in extra if m in SPLIT_METHODS))]


RUN_CHOICES = "this run's choices"
SHIPPED_CHOICES = "shipped table (kernels/auto_table.py)"


def shipped_choices(device, table_impls) -> dict:
    """The table shipped for this GPU model (what ``kernel="auto"`` runs) over the implementations measured here;
    empty where none is shipped (or off a GPU)."""
    return available_choices(device_choices(device), table_impls) if device.type == "cuda" else {}


def make_kernel(name, table_impls, choices, block=None):
    """A new instance of method ``name``: ``auto``/``auto-any`` over ``table_impls`` with ``choices``, ``<m>-cb<N>``
    the split method ``m`` with ``causal_block=N``, else the library's kernel of that name (``kernels/registry.py``;
    ``sdpa-flash`` is ``sdpa``), a split method with ``causal_block=block`` (``None``: its default)."""
    if name in ("auto", "auto-any"):
        return AutoKernel(table_impls, choices, allow_nondeterministic=name == "auto-any")
    base, _, cb = name.rpartition("-cb")
    if base in SPLIT_METHODS and cb.isdigit():
        return split_kernel(base, int(cb))
    if name in SPLIT_METHODS:
        return split_kernel(name, block)
    kernel = {"sdpa-flash": "sdpa"}.get(name, name)
    if kernel not in KERNELS:
        raise SystemExit(f"unknown method {name}")
    return build_kernel(kernel)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.mid_segments.split(",")) != len(args.mid_rates.split(",")):
        parser.error("--mid-rates needs one rate per --mid-segments entry")
    if args.render:
        return render(args.render)
    if args.write_table:
        return write_table(args.write_table, tuple(args.table_classes.split(",")), force=args.force_table)
    if args.smoke:
        args.batch, args.seq, args.heads, args.dim = 1, 64, 2, 16
        args.segments, args.rates, args.warmup, args.reps = "16,32,64", "1,2,4", 0, 1
        args.dtype = "float32"
        args.methods = "fused,auto,auto-any,reference"
        device = torch.device("cpu")
    else:
        assert torch.cuda.is_available(), "this benchmark needs a GPU (or --smoke)"
        device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False

    segs = [int(x) for x in args.segments.split(",")]
    rates = [int(x) for x in args.rates.split(",")]
    dtype = getattr(torch, args.dtype)
    plans = plan_patterns(segs, rates, seq_len=args.seq, local_len=args.seq, num_heads=args.heads,
                          num_kv_heads=args.heads, mode="longnet")
    ms_set = {p.local_segment // p.dilation for p in plans}
    mid_plans = plan_patterns([int(x) for x in args.mid_segments.split(",")],
                              [int(x) for x in args.mid_rates.split(",")], seq_len=args.seq, local_len=args.seq,
                              num_heads=args.heads, num_kv_heads=args.heads, mode="longnet")
    if not any(length_class(p.local_segment // p.dilation) == "mid" for p in mid_plans):
        mid_plans = []  # (--smoke: tiny shapes, every plan short)
    full_seq = args.full_seq or args.seq
    full_plan = plan_patterns([full_seq], [1], seq_len=full_seq, local_len=full_seq, num_heads=args.heads,
                              num_kv_heads=args.heads, mode="longnet")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu-smoke ({platform.machine()})"
    tag = gpu_tag(gpu) if device.type == "cuda" else "smoke"
    import triton

    meta = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "python": platform.python_version(), "command": " ".join([sys.executable] + sys.argv),
        "shape": {"B": args.batch, "N": args.seq, "H": args.heads, "D": args.dim, "dtype": args.dtype},
        "segment_lengths": segs, "dilation_rates": rates, "mode": "longnet", "full_seq": full_seq,
        "mid_plans": [(p.segment, p.dilation) for p in mid_plans],
        "fused_config": str(default_config(args.dim, dtype)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(meta, indent=1), flush=True)
    # the implementations auto may choose between (on CPU the reference stands in for cuDNN)
    names = ("fused", "cudnn", "cudnn-det", "cudnn-dkdv") if device.type == "cuda" else ("fused", "reference")
    flash4_reason = flash4_unavailable(device)
    if flash4_reason is None:
        names += FLASH4_NAMES
    elif set(FLASH4_NAMES) & set(args.methods.split(",")):
        print(f"flash4 not measured: {flash4_reason}", flush=True)
        args.methods = ",".join(m for m in args.methods.split(",") if m not in FLASH4_NAMES)
    meta["flash4"] = flash4_reason or "measured"
    block = args.causal_block[0] if args.causal_block else None
    args.methods = ",".join(split_variants(args.methods.split(","), args.causal_block))
    table_impls = {name: split_kernel(name, block) for name in names}
    meta["causal_block"] = {"values": args.causal_block,
                            **{m: table_impls[m].causal_block for m in SPLIT_METHODS if m in table_impls}}
    scale = args.dim ** -0.5
    torch.manual_seed(0)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    # full attention over --full-seq rows (the table's long class): the same tensors when it is --seq
    full = (q, k, v, dout) if full_seq == args.seq else tuple(
        torch.randn((args.batch, full_seq, args.heads, args.dim), device=device, dtype=dtype) for _ in range(4))
    rows, sweeps, checks, table_rows, choices, full_rows, pipeline_trials = [], [], {}, [], {}, [], []
    table_ab: dict[str, dict] = {}  # causal flag -> the shipped table against this run's, through the API
    shipped = shipped_choices(device, table_impls)
    meta["auto_rows"] = SHIPPED_CHOICES if shipped and args.auto_choices == "shipped" else RUN_CHOICES
    for causal in (False, True):
        fl = flops_fwd(plans, args.batch, args.seq, args.dim, causal)
        print(f"causal={causal}: unmasked fwd work {fl / 1e12:.3f} TFLOP", flush=True)
        # LongNet's plans (their classes), then the mid-class plans (only their mid-class keys)
        for plan_set, classes in ((plans, LENGTH_CLASSES), (mid_plans, ("mid",))):
            if not plan_set:
                continue
            try:
                t_rows, t_choices, ranking = measure_table(table_impls, q, k, v, dout, plan_set, causal, scale,
                                                           args.warmup, args.reps)
                t_choices, trials = refine_by_pipeline(table_impls, t_choices, ranking, q, k, v, dout, plan_set,
                                                       causal, scale, args.warmup, args.reps)
                pipeline_trials += [{"causal": causal, **t} for t in trials]
                table_rows += t_rows
                choices.update({key: names for key, names in ranked_choices(t_choices, ranking).items()
                                if key.rpartition("/")[2] in classes})
            except Exception as exc:
                print(f"  table failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if not args.no_full:  # one long dense segment (full attention): the table's long-class entries
            try:
                t_rows, t_choices, ranking = measure_table(table_impls, *full, full_plan, causal, scale, 1,
                                                           max(3, args.reps // 2))
                table_rows += t_rows
                choices.update(ranked_choices(t_choices, ranking))
            except Exception as exc:
                print(f"  full-attention table failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        print(f"  auto choices so far: {json.dumps(choices)}", flush=True)
        if args.table_only:
            continue
        kernels = {}
        rows_choices = shipped if meta["auto_rows"] == SHIPPED_CHOICES else choices
        if differs(shipped, choices):
            try:
                table_ab[str(causal)] = ab = compare_tables(table_impls, {"shipped": shipped, "run": choices}, q, k, v,
                                                            dout, segs, rates, causal, args.warmup, args.reps)
                print(f"  tables through the API (causal={causal}): shipped {ab['shipped']['ms']:.3f} ms, "
                      f"this run's {ab['run']['ms']:.3f} ms", flush=True)
            except Exception as exc:
                print(f"  table comparison failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        for name in args.methods.split(","):
            try:
                kernels[name] = make_kernel(name, table_impls, rows_choices, block)
            except Exception as exc:
                rows.append({"method": name, "causal": causal, "kind": "error", "error": str(exc)[:300]})
        try:
            checks[str(causal)] = check_close({"fused": table_impls["fused"], **kernels}, q, k, v, dout, plans, causal, scale)
        except Exception as exc:
            print(f"  check failed: {type(exc).__name__}: {exc}", flush=True)
        for name, kern in kernels.items():
            w, r = (1, 3) if name == "reference" and device.type == "cuda" else (args.warmup, args.reps)
            api = (segs, rates) if name.rpartition("-cb")[0] in SPLIT_METHODS or name in (
                "fused", *FLASH4_NAMES, "auto", "auto-any", "cudnn", "cudnn-det", "cudnn-dkdv") else None
            try:
                rows += measure_method(name, kern, q, k, v, dout, plans, causal, scale, w, r, fl, api)
            except Exception as exc:
                print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"method": name, "causal": causal, "kind": "error", "error": str(exc)[:300]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if len(ms_set) == 1:
            m = next(iter(ms_set))
            blocks = fl / (4.0 * args.heads * args.dim * (m * (m + 1) / 2 if causal else m * m))
            beq = int(round(blocks))
            for backend in (("cudnn", "flash") if device.type == "cuda" else ("math",)):
                try:
                    rows += measure_dense((beq, args.heads, m, args.dim), dtype, causal, args.warmup, args.reps, fl,
                                          backend, device, method="dense-cudnn" if backend == "math" else None)
                except Exception as exc:
                    print(f"  dense-{backend} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if not args.no_full:
            full_impls = {n: kern for n, kern in kernels.items()
                          if n in ("fused", *FLASH4_NAMES, "cudnn-det", "auto", "auto-any")
                          or n.rpartition("-cb")[0] in SPLIT_METHODS}
            try:
                full_rows += full_attention(*full, causal, full_impls, args.warmup, args.reps)
            except Exception as exc:
                print(f"  full attention failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if args.sweep and device.type == "cuda":
            sweeps += sweep(q, k, v, dout, plans, causal, scale, args.warmup, args.reps)

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kernel_{tag}.json")

    def save(final: bool) -> None:
        """Written once the main measurements are done (a later timeout keeps them) and again at the end."""
        summary = summarize(rows, full_rows)
        summary["auto_choices"] = choices
        summary["bwd_reproducible"] = {name: all(x.get("bwd_reproducible", False) for x in table_rows
                                                 if x["impl"] == name and "error" not in x) for name in table_impls}
        result = {"meta": meta, "rows": rows, "full_attention": full_rows, "table": table_rows, "sweep": sweeps,
                  "pipeline_trials": pipeline_trials, "table_ab": table_ab, "rel_diff_vs_fused": checks,
                  "summary": summary, "complete": final,
                  "auto_table": {gpu: {"source": f"benchmarks/results/kernel_{tag}.json ({meta['time']})",
                                       "torch": meta["torch"], "cudnn": meta["cudnn"], "measured": sorted(names),
                                       "choices": choices}}}
        md = markdown(result)
        result["markdown"] = md
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        try:
            plot(rows, full_rows, os.path.join(args.out, f"kernel_{tag}.png"), gpu, meta)
        except Exception as exc:
            print(f"plot failed: {exc}")
        if final:
            if not args.no_md:
                with open(os.path.join(args.out, f"kernel_{tag}.md"), "w") as f:
                    f.write(md)
            print(md)

    save(final=False)
    for extra in filter(None, args.table_extra.split(",")):  # more table entries at other head dims / dtypes
        dim_s, dt_s = extra.split(":")
        dim, dt = int(dim_s), getattr(torch, dt_s)
        xs = [torch.randn(args.batch, args.seq, args.heads, dim, device=device, dtype=dt) for _ in range(4)]
        for causal in (False, True):
            try:
                t_rows, t_choices, _ = measure_table(table_impls, *xs, plans, causal, dim ** -0.5, 1,
                                                     max(3, args.reps // 2))
                table_rows += [{**x, "dim": dim, "dtype": dt_s} for x in t_rows]
                choices.update(t_choices)
            except Exception as exc:
                print(f"  table {extra} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del xs
    save(final=True)
    return 0


def _get(rows, method, causal, kind):
    for r in rows:
        if r["method"] == method and r["causal"] == causal and r["kind"] == kind:
            return r
    return None


def summarize(rows, full_rows=()):
    out = {}
    for causal in (False, True):
        s = {}
        dense = _get(rows, "dense-cudnn", causal, "fwd+bwd kernel")
        densef = _get(rows, "dense-cudnn", causal, "fwd kernel")
        for method in ("auto", "auto-any", "fused", *FLASH4_NAMES, "cudnn", "cudnn-det", "cudnn-dkdv"):
            tag = "library" if method == "auto" else f"library_{method.replace('-', '_')}"
            pipe = _get(rows, method, causal, "fwd+bwd pipeline")
            fwd = _get(rows, method, causal, "fwd pipeline")
            fk = _get(rows, method, causal, "fwd kernel")
            api = _get(rows, method, causal, "api fwd+bwd")
            if pipe and dense:  # same unmasked work: the time ratio is the rate ratio
                s[f"{tag}_fwd_bwd_vs_dense_cudnn"] = dense["ms"] / pipe["ms"]
            if fwd and densef:
                s[f"{tag}_fwd_vs_dense_cudnn"] = densef["ms"] / fwd["ms"]
            if api and dense:
                s[f"{tag}_api_fwd_bwd_vs_dense_cudnn"] = dense["ms"] / api["ms"]
                if "back_to_back_ms" in api:  # a training loop's pace: the host's issue overlaps the GPU's work
                    s[f"{tag}_api_back_to_back_vs_dense_cudnn"] = (dense.get("back_to_back_ms", dense["ms"])
                                                                   / api["back_to_back_ms"])
            if fk and fwd:
                s[f"{tag}_fwd_pipeline_over_kernels"] = fwd["ms"] / fk["ms"]
            if fk and "peak_fwd_plan0_bytes" in fk:
                s[f"{method.replace('-', '_')}_fwd_extra_bytes_beyond_out_lse"] = (
                    fk["peak_fwd_plan0_bytes"] - fk["out_lse_plan0_bytes"])
        comp = [r for r in (_get(rows, m, causal, "fwd+bwd pipeline") for m in ("sdpa-flash", "sdpa-cudnn")) if r]
        lib = _get(rows, "auto", causal, "fwd+bwd pipeline") or _get(rows, "fused", causal, "fwd+bwd pipeline")
        if lib and comp:
            s["speedup_vs_best_composed_pipeline"] = min(r["ms"] for r in comp) / lib["ms"]
        sd = [r for r in full_rows if r["causal"] == causal and r["method"].startswith("full-sdpa") and r["kind"] == "fwd+bwd"]
        for r in full_rows:
            if r["causal"] == causal and r["kind"] in ("fwd", "fwd+bwd") and not r["method"].startswith("full-sdpa") and sd:
                ref = [x for x in full_rows if x["causal"] == causal and x["method"] == sd[0]["method"]
                       and x["kind"] == r["kind"]][0]
                s[f"{r['method'].replace('-', '_')}_{r['kind'].replace('+', '_')}_vs_cudnn_sdpa"] = ref["ms"] / r["ms"]
        out[str(causal)] = s
    return out


def markdown(result):
    meta, rows, summary = result["meta"], result["rows"], result["summary"]
    sh = meta["shape"]
    lines = [
        f"# Kernel benchmark on {meta['gpu']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, cuDNN {meta.get('cudnn')}; "
        f"B={sh['B']} N={sh['N']} H={sh['H']} D={sh['D']} {sh['dtype']}, "
        f"longnet segments {meta['segment_lengths']} rates {meta['dilation_rates']}.",
        f"Command: `{meta['command']}`",
        "",
        f"Table of the auto and auto-any rows: {meta.get('auto_rows', RUN_CHOICES)} (the run's own ranking is the "
        "auto table at the end, stored with `--write-table`).",
        "",
        *[f"Tables through the API, causal={flag}, back to back: shipped {ab['shipped']['ms']:.3f} ms, this run's "
          f"{ab['run']['ms']:.3f} ms." for flag, ab in sorted((result.get("table_ab") or {}).items())],
        *([""] if result.get("table_ab") else []),
        "Host issue: the host's milliseconds to issue one forward+backward through the API, the GPU drained "
        "first (an eager step is host-bound where this exceeds the GPU's ms); kernels: CUDA kernels it launches; "
        "back to back: ms per API forward+backward issued one after another, as a training loop issues its layers "
        "(the host issues a call while the GPU runs the last one; every other ms is one call, the GPU drained "
        "before it).",
        "",
        "| method | causal | what | ms | TFLOP/s | peak extra MiB | host issue ms | kernels | back to back ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r["kind"] == "error":
            lines.append(f"| {r['method']} | {r['causal']} | error | | | {r['error'][:80]} | | | |")
            continue
        mem = r.get("peak_fwd_bwd_bytes", r.get("peak_fwd_plan0_bytes"))
        mem = f"{mem / 2**20:.0f}" if mem is not None else ""
        host = f"{r['host_issue_ms']:.2f} | {r['launches']}" if "host_issue_ms" in r else " | "
        host += f" | {r['back_to_back_ms']:.3f}" if "back_to_back_ms" in r else " | "
        lines.append(f"| {r['method']} | {r['causal']} | {r['kind']} | {r['ms']:.3f} | {r['tflops']:.1f} | {mem} | {host} |")
    full = result.get("full_attention") or []
    if full:
        lines += ["", f"Full attention (one pattern w=N={meta.get('full_seq', sh['N'])}, r=1) through `dilated_attention` vs cuDNN SDPA:", "",
                  "| method | causal | what | ms | TFLOP/s |", "| --- | --- | --- | ---: | ---: |"]
        for r in full:
            if r["kind"] != "error":
                lines.append(f"| {r['method']} | {r['causal']} | {r['kind']} | {r['ms']:.3f} | {r['tflops']:.1f} |")
    table = [x for x in result.get("table", []) if "error" not in x]
    if table:
        lines += ["", "Per-pattern timings behind the auto table (ms; rel = max relative difference to fused):", "",
                  "| D | dtype | causal | w | r | impl | fwd | bwd | rel | reproducible fwd / bwd |",
                  "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
        for x in table:
            lines.append(f"| {x.get('dim', sh['D'])} | {x.get('dtype', sh['dtype'])} | {x['causal']} | {x['w']} | {x['r']} "
                         f"| {x['impl']} | {x['fwd_ms']:.3f} | {x['bwd_ms']:.3f} | {x['rel_vs_fused']:.1e} "
                         f"| {x['fwd_reproducible']} / {x['bwd_reproducible']} |")
    lines += ["", "Summary:", "", "```", json.dumps(summary, indent=1), "```", ""]
    return "\n".join(lines)


def plot(rows, full_rows, path, gpu, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["fwd kernel", "fwd+bwd kernel", "fwd+bwd pipeline", "api fwd+bwd"]
    methods = []
    for r in rows:
        if r["kind"] != "error" and r["method"] not in methods and r["method"] != "reference":
            methods.append(r["method"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, causal in zip(axes[:2], (False, True)):
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            vals = []
            for kind in kinds:
                r = _get(rows, m, causal, kind)
                vals.append(r["tflops"] if r else 0)
            ax.bar([x + i * width for x in range(len(kinds))], vals, width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(kinds))])
        ax.set_xticklabels(kinds, fontsize=8)
        ax.set_title(f"LongNet patterns, causal={causal}")
        ax.set_ylabel("effective TFLOP/s (unmasked work)")
    axes[0].legend(fontsize=7)
    ax = axes[2]
    names = []
    for r in full_rows:
        if r["kind"] == "fwd+bwd" and r["method"] not in names:
            names.append(r["method"])
    for i, causal in enumerate((False, True)):
        vals = [next((r["tflops"] for r in full_rows if r["method"] == n and r["causal"] == causal
                      and r["kind"] == "fwd+bwd"), 0) for n in names]
        ax.bar([x + i * 0.4 for x in range(len(names))], vals, 0.4, label=f"causal={causal}")
    ax.set_xticks([x + 0.2 for x in range(len(names))])
    ax.set_xticklabels(names, fontsize=7, rotation=20)
    ax.set_title("full attention w=N, r=1: fwd+bwd")
    ax.legend(fontsize=7)
    sh = meta["shape"]
    fig.suptitle(f"dilated attention kernels, {gpu}, N={sh['N']} H={sh['H']} D={sh['D']} {sh['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(path: str) -> int:
    with open(path) as f:
        result = json.load(f)
    md = markdown(result)  # (not the stored text: a fixed label reaches the files this way)
    base = os.path.splitext(path)[0]
    with open(base + ".md", "w") as f:
        f.write(md)
    plot(result["rows"], result.get("full_attention") or [], base + ".png", result["meta"]["gpu"], result["meta"])
    print(f"wrote {base}.md and {base}.png")
    return 0


# implementations whose forward runs the same cuDNN kernel as another's: cudnn-dkdv's is torch's op (cudnn's);
# cudnn-det's is the frontend's graph of that kernel, written straight into the compact parts where torch's
# op leaves a copy. Where cudnn-det runs, a forward entry names it (one kernel: timing differences are noise
# plus cudnn's copies); at run time, without the frontend, auto runs torch's op for it (FORWARD_STAND_INS).
# flash4-nondet's forward is flash4's (only their backwards differ).
SAME_FORWARD = {"cudnn-dkdv": "cudnn-det", "cudnn": "cudnn-det", "flash4-nondet": "flash4"}


def write_table(path: str, classes: tuple[str, ...] = LENGTH_CLASSES, force: bool = False) -> int:
    """Merge a result JSON's measured rankings (fused, the cuDNN kernels, flash4) into ``kernels/auto_table.py``:
    a key measured now, of a length class in ``classes``, replaces the old entry of its class; the others stay.
    Classes where the run's ranking ran the benchmark's call slower than the shipped table (``lost_classes``)
    keep theirs unless ``force``."""
    from dilated_attention.kernels.auto_table import TABLE

    with open(path) as f:
        result = json.load(f)
    lost = lost_classes(result)
    if lost and not force:
        for flag, ab in sorted(result["table_ab"].items()):
            print(f"causal={flag}: through the API the shipped table ran {ab['shipped']['ms']:.3f} ms, this run's "
                  f"{ab['run']['ms']:.3f} ms")
        print(f"keeping the shipped entries of the {sorted(lost)} class(es) (--force-table writes them anyway)")
        classes = tuple(c for c in classes if c not in lost)
    table = {k: dict(v) for k, v in TABLE.items()}
    deterministic = {name: build_kernel(name).deterministic_backward
                     for name in ("fused", "cudnn", "cudnn-det", "cudnn-dkdv", *FLASH4_NAMES)}
    for gpu, entry in result["auto_table"].items():
        choices = {}
        for key, names in normalize_choices(entry["choices"]).items():  # a result JSON may list any measured one
            if key.rpartition("/")[2] not in classes:
                continue
            kept = []
            for name in names:
                name = SAME_FORWARD.get(name, name) if key.startswith("fwd/") else name
                if name not in deterministic or name in kept:
                    continue
                if key.startswith("bwd/") and not deterministic[name]:
                    print(f"dropping {key} -> {name}: {name}'s backward is not deterministic")
                    continue
                kept.append(name)
            if kept:
                choices[key] = kept[0] if len(kept) == 1 else tuple(kept)
        if not choices:
            continue
        merged = {k: v if len(v) > 1 else v[0]
                  for k, v in normalize_choices(table.get(gpu, {}).get("choices", {})).items()}
        merged.update(choices)
        table[gpu] = {**{k: v for k, v in entry.items() if k != "choices"}, "choices": dict(sorted(merged.items()))}
    with open(TABLE_FILE) as f:
        head = f.read().split("TABLE: dict[str, dict] =")[0]
    with open(TABLE_FILE, "w") as f:
        f.write(head + "TABLE: dict[str, dict] = " + pprint.pformat(table, width=110, sort_dicts=True) + "\n")
    print(f"wrote {TABLE_FILE}: {sorted(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
