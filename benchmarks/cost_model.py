"""The cost model (``cost_model_lib.py`` beside this script) from the command line: predict, validate, fit, calibrate.

Predictions: forward+backward time, exposed communication, efficiency and memory per GPU count and
strategy, for a LongNet or full-attention problem. ``--validate``: predicted vs measured efficiency
of every multi-GPU record of the library in scaling JSONs (``bench_scaling.py``), each in the wait
mode its file recorded unless ``--waits`` says. ``--fit``: the kernel and memory constants fitted
to the whole calls of scaling JSONs (how the presets were made). ``--calibrate``:
fit the kernel and memory constants to single-GPU measurements (a kernel benchmark JSON of the
fused kernel, and the ``single_gpu`` entries of scaling JSONs) of the code the model describes: it
says so when no physical fit exists (the committed ``kernel_h200.json`` measures compact parts
combined once, which the model's memory terms do not describe).

    python benchmarks/cost_model.py --tokens 1073741824 --gpus 64,128,256,512,1024
    python benchmarks/cost_model.py --tokens-per-gpu 32768 --gpus 8,16,64,256,1024      # docs/performance.md
    python benchmarks/cost_model.py --validate tests/data/cost_model_h200_x2.json
    python benchmarks/cost_model.py --calibrate kernel_<gpu>.json scaling_<gpu>_x*.json
    python benchmarks/cost_model.py --gpu h100 --validate tests/data/cost_model_h100_x2.json --impl ours+graph
    python benchmarks/cost_model.py --gpu h100 --fit tests/data/cost_model_h100_x*.json --impl ours+graph \
        --names bwd_tflops,bwd_launch_us,causal_keys,key_penalty,hbm_gbps,op_us,dispatch_us   # a preset,
    python benchmarks/cost_model.py --gpu h100 --fit tests/data/cost_model_h100_x*.json --names issue_us  # then this

``--impl ours+graph`` reads the records ``bench_scaling.py --cuda-graph`` times as CUDA graph replays, which
the model replays without host issue time (``issue_us``); ``--cuda-graph`` predicts such steps.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import replace
from typing import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_model_lib import (  # noqa: E402
    _FITTED, FIT_NAMES, IMPLS, LONGNET_RATES, LONGNET_SEGMENTS, PLAUSIBLE, PRESETS, STRATEGIES, Hardware, Prediction,
    Problem, calibrate, config_patterns, fit, graph_replay, predict, validate,
)


def _ints(text: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _duration(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 1e3 else f"{ms / 1e3:,.2f} s"


def format_predictions(rows: list[Prediction], causal: bool) -> str:
    lines = ["| GPUs | tokens/GPU | causal | strategy | compute | exposed comm | fwd+bwd | efficiency | GiB/GPU |",
             "| ---: | ---: | :---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for x in rows:
        mem = f"{x.memory_gib:.0f}" + ("" if x.fits else " (does not fit)")
        note = f" ({'; '.join(x.notes)})" if x.notes else ""
        lines.append(f"| {x.gpus} | {x.tokens / x.gpus:,.0f} | {'yes' if causal else 'no'} | {x.strategy}{note} | "
                     f"{_duration(x.compute_ms)} | {_duration(x.exposed_comm_ms)} | {_duration(x.ms)} | "
                     f"{100 * x.efficiency:.1f}% | {mem} |")
    return "\n".join(lines)


def format_validation(rows: list[dict]) -> str:
    lines = ["| config | causal | strategy | GPUs | tokens/GPU | measured ms | predicted ms | measured eff | "
             "predicted eff | error | waits |",
             "| --- | :---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {'yes' if r['causal'] else 'no'} | {r['strategy']} | {r['gpus']} | "
                     f"{r['tokens_per_gpu']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{100 * r['measured']:.1f}% | {100 * r['predicted']:.1f}% | {r['error_pct']:+.1f}% | {r['waits']} |")
    return "\n".join(lines)


def _expand(patterns: Sequence[str]) -> list[str]:
    return sorted({p for pat in patterns for p in (glob.glob(pat) or [pat])})


def _print_fit(fitter, patterns: list[str], hw, names, what: str) -> int:
    """Run ``--calibrate`` or ``--fit``: the fitted constants, then measured against model per measurement
    (and the efficiency error where the measurement has one)."""
    try:
        fitted, report = fitter(_expand(patterns), hw)
    except ValueError as exc:
        print(f"cost_model.py: {exc}", file=sys.stderr)
        return 1
    for name in names:
        print(f"{name} = {getattr(fitted, name):.4g}")
    efficiency = any("measured_efficiency" in r for r in report)  # whole calls on several GPUs (--fit)
    print(f"\n| {what} | measured ms | model ms | error |" + (" efficiency error |" if efficiency else "")
          + "\n| --- | ---: | ---: | ---: |" + (" ---: |" if efficiency else ""))
    for r in report:
        row = (f"| {r['name']} | {r['measured_ms']:.2f} | {r['model_ms']:.2f} | "
               f"{100 * (r['model_ms'] / r['measured_ms'] - 1):+.1f}% |")
        if efficiency:
            row += "" if r["measured_efficiency"] is None else \
                f" {100 * (r['model_efficiency'] / r['measured_efficiency'] - 1):+.1f}%"
            row += " |"
        print(row)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    hw0 = Hardware()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=2**30, help="whole sequence N (default 2^30)")
    ap.add_argument("--tokens-per-gpu", type=float, default=None,
                    help="weak scaling: N = this x GPUs for each GPU count (instead of --tokens)")
    ap.add_argument("--gpus", type=_ints, default=[64, 128, 256, 512, 1024])
    ap.add_argument("--config", choices=["longnet", "full"], default="longnet")
    ap.add_argument("--segments", type=_ints, default=list(LONGNET_SEGMENTS), help="LongNet segments before N")
    ap.add_argument("--rates", type=_ints, default=list(LONGNET_RATES), help="LongNet rates, one more than segments")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="2 for bf16/fp16")
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--balanced", action="store_true", help="causal rings in zigzag order (equal work per rank)")
    ap.add_argument("--waits", choices=["stream", "host"], default=None,
                    help="stream: NCCL's default, stream-ordered (predictions' default); host: every exchange "
                         "waited for on the host (a timeout set). --validate: default each file's own mode")
    ap.add_argument("--host-waits", dest="waits", action="store_const", const="host", help="same as --waits host")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--gpu", choices=sorted(PRESETS), default="h200",
                    help="whose fitted constants (cost_model.PRESETS); the options below override them")
    for name in ("fwd_tflops", "bwd_tflops", "bwd_launch_us", "causal_keys", "key_penalty", "hbm_gbps", "op_us", "dispatch_us",
                 "issue_us", "nvlink_gbps", "ib_gbps", "latency_us", "poll_ms", "memory_gib"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                        help="default " + ", ".join(f"{g} {getattr(hw, name):g}" for g, hw in sorted(PRESETS.items())))
    ap.add_argument("--gpus-per-node", type=int, default=None, help=f"default {hw0.gpus_per_node}")
    ap.add_argument("--validate", nargs="+", default=None, metavar="JSON",
                    help="compare with measured scaling JSONs (globs allowed) instead of predicting")
    ap.add_argument("--calibrate", nargs="+", default=None, metavar="JSON",
                    help="fit the kernel and memory constants to the single-GPU runs in these JSONs")
    ap.add_argument("--fit", nargs="+", default=None, metavar="JSON",
                    help="fit the kernel and memory constants to the whole calls (one GPU and several) in these "
                         "scaling JSONs")
    ap.add_argument("--names", default=",".join(FIT_NAMES),
                    help=f"--fit: the constants to fit (any of {', '.join(sorted(PLAUSIBLE))}; default %(default)s)")
    ap.add_argument("--impl", choices=IMPLS, default="ours",
                    help="--validate/--fit: the library's eager records, or those timed as CUDA graph replays "
                         "(bench_scaling.py --cuda-graph), modelled without host issue time")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="predict steps replayed from a CUDA graph (no host issue time, issue_us = 0)")
    a = ap.parse_args(argv)
    names = [x for x in a.names.split(",") if x]
    for name in names:
        if name not in PLAUSIBLE:
            ap.error(f"--names: {name!r} is not one of {sorted(PLAUSIBLE)}")
    host = None if a.waits is None else a.waits == "host"
    hw = replace(PRESETS[a.gpu], **{name: getattr(a, name) for name in Hardware.__dataclass_fields__
                                     if getattr(a, name) is not None})
    if a.calibrate:
        return _print_fit(calibrate, a.calibrate, hw, _FITTED + ("causal_keys",), "single-GPU measurement")
    if a.fit:
        return _print_fit(lambda paths, base: fit(paths, base, names, impl=a.impl), a.fit, hw, names, "measurement")
    if a.validate:
        paths = _expand(a.validate)
        rows = validate(paths, hw, host_waits=host, impl=a.impl)
        if rows:
            print(format_validation(rows))
            worst = max(abs(r["error_pct"]) for r in rows)
            mean = sum(abs(r["error_pct"]) for r in rows) / len(rows)
            worst_ms = max(abs(r["ms_error_pct"]) for r in rows)
            modes = sorted({r["waits"] for r in rows})
            print(f"\n{len(rows)} records; efficiency: mean |error| {mean:.1f}%, worst {worst:.1f}%; "
                  f"time: worst {worst_ms:.1f}% ({'/'.join(modes)} waits)")
        else:
            print("no multi-GPU records of 'ours' with an efficiency in", paths)
        return 0
    if a.cuda_graph:
        hw = graph_replay(hw)
    n = int(a.tokens)
    per_gpu = int(a.tokens_per_gpu) if a.tokens_per_gpu else None
    strategies = [s for s in a.strategies.split(",") if s]
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: {s!r} is not one of {STRATEGIES}")
    pats = config_patterns(a.config, n, a.segments, a.rates)
    size = f"N = {per_gpu:,} tokens x GPUs" if per_gpu else \
        f"N = {n:,} tokens, {a.config} patterns w={[w for w, _ in pats]} r={[r for _, r in pats]}"
    print(f"{size}, {a.config} attention, "
          f"B={a.batch} H={a.heads} Hkv={a.kv_heads or a.heads} D={a.head_dim}, {a.dtype_bytes}-byte dtype")
    print(f"assumed: attention kernel {hw.fwd_tflops:g}/{hw.bwd_tflops:g} TFLOP/s fwd/bwd, HBM passes "
          f"{hw.hbm_gbps:g} GB/s, NVLink {hw.nvlink_gbps:g} GB/s, InfiniBand {hw.ib_gbps:g} GB/s per GPU, "
          f"{hw.gpus_per_node} GPUs per node, {hw.latency_us:g} us per message, {hw.memory_gib:g} GiB per GPU"
          + f", {'host-timed' if host else 'stream-ordered'} waits" + (", zigzag causal rings" if a.balanced else "")
          + (f", {hw.issue_us:g} us of host per op (eager)" if hw.issue_us else ""))
    for causal in {"no": [False], "yes": [True], "both": [False, True]}[a.causal]:
        rows = []
        for k in a.gpus:
            nk = per_gpu * k if per_gpu else n
            prob = Problem(nk, tuple(config_patterns(a.config, nk, a.segments, a.rates)), a.heads, a.kv_heads,
                           a.head_dim, a.batch, a.dtype_bytes, causal)
            rows += [x for s in strategies if (x := predict(prob, k, s, hw, balanced=a.balanced, host_waits=bool(host)))]
        print()
        print(format_predictions(rows, causal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
