"""Where the library path's time goes on one GPU: a kernel-level profile of forward + backward.

Runs the library's ring schedule on one device (``block_forward`` + ``block_backward``, as
``bench_kernel.py``'s pipeline rows) under ``torch.profiler`` and reports, per kernel choice and
causal flag: wall time per step (CUDA events, no profiler), GPU busy time per step (sum of kernel
and memory-op durations), the gap between them (launch and Python overhead the GPU waits on), and
the kernels grouped by what they are (attention kernels, merge, elementwise, copies, fills), with
the top kernels by name; the CPU time to issue one step, the top CPU operators by self time, and
the runtime calls that block the CPU on the GPU. ``--api`` profiles the public call instead
(``dilated_attention`` forward and autograd's backward: the schedule plus what the API adds). Where a lone
step's GPU waits on the host: a second profile records CUDA activity only (the host then runs at its own
speed), each step after a drained GPU and a marker kernel, and reports the GPU's wait for the step's first
kernel and its idle time between kernels, by the kernel groups around each gap. ``--host-timeline``: what the
host is doing meanwhile, as the times from a lone step's start at which it enters and leaves the forward, the
backward and each kernel call (``host_cost.host_timeline``).

    python benchmarks/profile_pipeline.py [--methods auto,fused,cudnn-det] [--api] [--out /tmp/profile.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import os
import re
import statistics
import sys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--segments", default="2048,4096,8192,16384,32768")
    ap.add_argument("--rates", default="1,2,4,8,16")
    ap.add_argument("--methods", default="auto,fused,cudnn-det")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--python-profile", type=int, default=0, metavar="LINES",
                    help="also print cProfile's top LINES functions by own time per method and causal flag")
    ap.add_argument("--python-sort", default="tottime", choices=("tottime", "cumulative"),
                    help="cProfile's order: own time, or time including callees")
    ap.add_argument("--pstats", metavar="DIR", default=None,
                    help="also write each method and causal flag's cProfile as DIR/<method>_<causal|full>.pstats")
    ap.add_argument("--forward-only", action="store_true", help="profile the forward alone (no backward)")
    ap.add_argument("--api", action="store_true",
                    help="profile the public call (dilated_attention and autograd's backward) instead of the schedule")
    ap.add_argument("--host-timeline", action="store_true",
                    help="also print when, in a lone step's issue, the host enters (>) and leaves (<) the forward, the "
                         "backward, each kernel call (by op), stack, combine and gradient sum: ms from the step's start "
                         "(with --api)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors before torch loads

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_cost import host_timeline, issue_ms  # noqa: E402

from dilated_attention import dilated_attention, execution  # noqa: E402
from dilated_attention.kernels.dispatch import select_kernel  # noqa: E402
from dilated_attention.kernels.guard import GuardedKernel  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.ring import block  # noqa: E402
from dilated_attention.ring.block import block_backward, block_forward  # noqa: E402
from dilated_attention.ring.routes import RingCall, plan_ring  # noqa: E402

GROUPS = [  # (group, pattern on the kernel name, any case), first match wins
    ("fused forward", r"fwd_kernel"),
    ("fused dK/dV", r"dkdv_kernel"),
    ("fused dQ", r"dq_kernel"),
    ("fused delta", r"delta_kernel"),
    ("merge", r"merge_kernel"),
    ("combine", r"combine_(lse_)?kernel"),
    ("cuDNN attention", r"cudnn|sm90|sdpa|flash|fmha|xmma|cutlass"),
    ("fill", r"fill|memset"),
    ("copy", r"copy|memcpy"),
    ("reduce", r"reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def wall_ms(step, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def profile_step(step, reps: int) -> dict:
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(evt.name, []).append(evt.time_range.elapsed_us() / 1000.0)
    by_name = {n: {"ms_per_step": sum(t) / reps, "calls_per_step": len(t) / reps, "group": group_of(n)}
               for n, t in kernels.items()}
    groups: dict[str, dict] = {}
    for n, row in by_name.items():
        g = groups.setdefault(row["group"], {"ms_per_step": 0.0, "calls_per_step": 0.0})
        g["ms_per_step"] += row["ms_per_step"]
        g["calls_per_step"] += row["calls_per_step"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1]["ms_per_step"])[:15]
    cpu = [{"name": e.key[:120], "self_ms_per_step": e.self_cpu_time_total / 1000.0 / reps,
            "calls_per_step": e.count / reps}
           for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    cpu.sort(key=lambda r: -r["self_ms_per_step"])
    return {"busy_ms": sum(r["ms_per_step"] for r in by_name.values()), "groups": groups,
            "top": [{"name": n[:120], **r} for n, r in top], "cpu_top": cpu[:20],
            "blocking_calls": [r for r in cpu if re.search(SYNCS, r["name"])]}


MARKER = "spin_kernel"  # ``torch.cuda._sleep``'s kernel: marks where each step of ``idle_structure`` starts


def idle_of(events: list[tuple[str, float, float]], marker: str = MARKER) -> dict:
    """Where the GPU waited in steps each issued after a ``marker`` kernel: ``events`` are ``(name, start, end)``
    of every GPU activity in microseconds. Per step (medians in ms): ``first_kernel_ms``, from the marker's end to
    the step's first kernel (the host's time to issue it, the GPU idle); ``idle_ms``, the GPU idle between the
    step's kernels (concurrent kernels count once); ``gaps``, that idle by the groups of the kernels before and
    after each gap, in ms per step. Gaps under 5 us are launch spacing, not waits."""
    steps: list[list[tuple[str, float, float]]] = []
    for e in sorted(events, key=lambda e: e[1]):
        if marker in e[0]:
            steps.append([e])
        elif steps:
            steps[-1].append(e)
    steps = [st for st in steps if len(st) > 1]
    if not steps:
        return {"steps": 0, "first_kernel_ms": 0.0, "idle_ms": 0.0, "gaps": {}}
    firsts, idles, gaps = [], [], {}
    for st in steps:
        firsts.append((st[1][1] - st[0][2]) / 1000.0)
        idle, busy_until = 0.0, st[1][2]
        for prev, nxt in zip(st[1:], st[2:]):
            busy_until = max(busy_until, prev[2])
            gap = nxt[1] - busy_until
            if gap > 5:
                idle += gap
                pair = f"{group_of(prev[0])} -> {group_of(nxt[0])}"
                gaps[pair] = gaps.get(pair, 0.0) + gap / 1000.0 / len(steps)
        idles.append(idle / 1000.0)
    return {"steps": len(steps), "first_kernel_ms": statistics.median(firsts), "idle_ms": statistics.median(idles),
            "gaps": dict(sorted(gaps.items(), key=lambda kv: -kv[1]))}


def idle_structure(step, reps: int) -> dict:
    """``idle_of`` ``reps`` lone steps, profiled with CUDA activity only (no host-side recording to slow the host)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(1)  # the marker: a kernel of its own name just before the step
            step()
        torch.cuda.synchronize()
    return idle_of([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA])


# runtime calls that make the CPU wait for the GPU (the GPU then idles while the CPU issues the next work)
SYNCS = r"Synchronize|cudaMalloc|cudaFree|cudaMemcpy(?!Async)|cudaHostAlloc"


def timeline_points() -> list[tuple]:
    """What ``--host-timeline`` marks in the public call: its forward and backward, every kernel call by its op
    (through the guard the call runs each kernel in), the stacked calls, the combine and the gradient sums."""
    return [(execution, "forward", "forward"), (execution, "backward", "backward"),
            (GuardedKernel, "call", lambda kernel, op, *args: op),
            (block, "stack_forward", "stack"), (block, "stack_backward", "stack"),
            (block, "combine_results", "combine"), (block, "sum_grads", "gradient sum")]


def python_profile(step, reps: int, lines: int, order: str = "tottime", dump: str | None = None) -> str:
    """cProfile of ``reps`` steps (GPU drained before each): where the CPU issue time goes, by function
    (``dump``: also a pstats file of it, for ``python -m pstats`` or snakeviz)."""
    prof = cProfile.Profile()
    for _ in range(reps):
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    if dump:
        prof.dump_stats(dump)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(lines)
    return buf.getvalue()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.host_timeline and not args.api:
        parser.error("--host-timeline follows the public call: add --api")
    if not torch.cuda.is_available():
        raise SystemExit("profile_pipeline.py needs a GPU")
    segs = [int(x) for x in args.segments.split(",")]
    rates = [int(x) for x in args.rates.split(",")]
    shape = (1, args.seq, args.heads, args.dim)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    plans = tuple(plan_patterns(segs, rates, seq_len=args.seq, local_len=args.seq, num_heads=args.heads,
                                num_kv_heads=args.heads, mode="longnet"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B=1 N={args.seq} H={args.heads} "
          f"D={args.dim} bf16, segments {segs}, rates {rates}", flush=True)
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))  # --api: autograd's inputs
    results = []
    for method in args.methods.split(","):
        kernel = select_kernel(method, q, k)
        for causal in (False, True):
            call = RingCall(plan_ring(plans, kernel, causal=causal, scale=args.dim ** -0.5), None, 0)

            def step():
                if args.api:
                    for x in leaves:
                        x.grad = None  # as a training step's zero_grad(set_to_none=True): no accumulation pass
                    out = dilated_attention(*leaves, segs, rates, causal=causal, kernel=method)
                    if not args.forward_only:
                        out.backward(dout)
                    return
                out, lse = block_forward(q, k, v, None, call)
                if not args.forward_only:
                    block_backward(q, k, v, None, (out.to(q.dtype), lse, dout), call)

            row = {"method": method, "kernel": kernel.name, "causal": causal, "forward_only": args.forward_only,
                   "api": args.api,
                   "wall_ms": wall_ms(step, args.reps),
                   **profile_step(step, args.reps)}
            row["gap_ms"] = row["wall_ms"] - row["busy_ms"]
            row["cpu_issue_ms"] = issue_ms(step, args.reps)
            row["gpu_waits"] = idle_structure(step, args.reps)
            if args.host_timeline:
                row["host_timeline"] = host_timeline(step, timeline_points(), args.reps)
            if args.python_profile or args.pstats:
                dump = (os.path.join(args.pstats, f"{method}_{'causal' if causal else 'full'}.pstats")
                        if args.pstats else None)
                row["python_profile"] = python_profile(step, args.reps, args.python_profile or 40, args.python_sort,
                                                       dump)
            results.append(row)
            what = " forward" if args.forward_only else ""
            print(f"\n{method} causal={causal}{what}: wall {row['wall_ms']:.2f} ms, GPU busy {row['busy_ms']:.2f} ms, "
                  f"gap {row['gap_ms']:.2f} ms, CPU issue {row['cpu_issue_ms']:.2f} ms", flush=True)
            waits = row["gpu_waits"]
            print(f"  a lone step's GPU waits {waits['first_kernel_ms']:.2f} ms for its first kernel and idles "
                  f"{waits['idle_ms']:.2f} ms between kernels" + "".join(
                      f"; {ms:.2f} ms {pair}" for pair, ms in list(waits["gaps"].items())[:3]), flush=True)
            for name, grp in sorted(row["groups"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
                print(f"  {name:16s} {grp['ms_per_step']:7.3f} ms  {grp['calls_per_step']:6.1f} calls", flush=True)
            for t in row["top"][:8]:
                print(f"    {t['ms_per_step']:7.3f} ms {t['calls_per_step']:5.1f}x  {t['name'][:90]}", flush=True)
            for t in row["cpu_top"][:10]:
                print(f"    CPU {t['self_ms_per_step']:7.3f} ms {t['calls_per_step']:5.1f}x  {t['name'][:80]}", flush=True)
            for t in row["blocking_calls"]:
                print(f"    BLOCKING {t['self_ms_per_step']:7.3f} ms {t['calls_per_step']:5.1f}x  {t['name']}", flush=True)
            if args.host_timeline:
                print("  host timeline of a lone step, ms from its start: " + "  ".join(
                    f"{name} {ms:.3f}" for name, ms in row["host_timeline"]), flush=True)
            if args.python_profile:
                print(f"  cProfile over {args.reps} steps:\n{row['python_profile']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
