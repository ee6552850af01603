"""Scaling benchmark: efficiency against one GPU, peers in the same run, longest sequence.

Run once per GPU count K under torchrun (``benchmarks/run_scaling.sh`` loops over K):

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_scaling.py               # GPUs, NCCL, bf16
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_scaling.py --smoke       # CPU, gloo, tiny

For every tokens-per-GPU value, configuration (LongNet ``w=[2048, 8192, 32768,
131072, N]``, ``r=[1, 2, 4, 8, 16]`` with segments not shorter than N dropped and
N taking the next rate; full attention ``w=[N]``, ``r=[1]``), causal and not:

- ``ours``: forward+backward of ``dilated_attention`` on K ranks for every
  strategy (ring, head, hybrid) and shard layout (``--layouts``: contiguous, and
  zigzag where the installed package accepts ``layout=``), median over iterations of
  the slowest rank's time (CUDA events; wall clock on CPU); peak memory of the
  largest rank. ``--waits stream`` (default: what a user gets, NCCL without a timeout)
  or ``host`` (``DILATED_ATTENTION_TIMEOUT`` set: a host sync per exchange); the mode
  the backend ran is ``meta.waits`` (gloo always waits on the host).
- T1: the same library on ONE GPU over the whole sequence N = K x tokens, measured
  in the same run on rank 0 while the others wait. Efficiency = T1 / (K x TK).
- ``torch_cp``: PyTorch context parallel (``context_parallel``, cuDNN SDPA), full
  attention only; causal runs load-balanced (torch's head-tail order), non-causal
  without (torch accepts load balancing for causal attention only). Its efficiency
  is against cuDNN SDPA on one GPU, same run.
- ``ulysses``: DeepSpeed ``DistributedAttention`` (all-to-all) around the library's
  single-device call; efficiency against the library's T1.
- ``--cuda-graph`` (GPUs): the library's cases, its T1 and ``ulysses`` are timed a second time as
  replays of one CUDA graph of the forward+backward, captured after a warm-up (records ``ours+graph``,
  ``ulysses+graph``; efficiency against the graphed T1): what a step captured whole runs at, with
  no host launch overhead. The other peers run eager only.
- ``--compile``: the library's cases and its T1 are timed again with the call inside
  ``torch.compile(mode="reduce-overhead")`` (records ``ours+compiled``; efficiency against the
  compiled T1): on GPUs its cudagraph tree replays the attention, with the tree's input copies and
  a forward and a backward graph per step.
- ``ring_flash_attn``: ring-flash-attention's zigzag ring (``zigzag_ring_flash_attn_func``,
  flash-attn blocks), full causal attention only (the zigzag order exists to even out
  causal work); efficiency against flash-attn's ``flash_attn_func`` on one GPU.
- max-length probe: LongNet, tokens per GPU doubled until a clean OOM (or the cap
  or time budget), then bisected (``--probe-refine``); every probe step is a record with ``max_tokens`` (= K x the
  largest tokens per GPU that ran).

- ``--profile``: after the timed cases, a few forward+backward steps of the library's cases
  (``--profile-cases``; default the ring and head strategies) under ``torch.profiler`` on every
  rank. From the GPU events of each step: its span, compute time (union of non-NCCL kernels,
  copies and fills), communication time (union of NCCL kernels) and the exposed communication
  (NCCL running while no compute does), per step and per phase (forward / backward, split by
  where each kernel was launched), for the slowest rank and for each rank (the ``profile`` list).
  CPU runs (gloo) have no GPU kernels: the profile says so and records nothing.
- Memory against the rank's own bytes: every record has ``own_gib``, the bytes of this rank's
  q, k, v, out, dout, dq, dk, dv (k, v, dk, dv with the kv heads) in the input dtype, so
  ``peak_gib / own_gib`` is the peak in units of the tensors the caller holds anyway.
- ``--memory-bound SHARE,FROM``: every call of the library (its T1 too) runs under
  ``dilated_attention.set_memory_bound(SHARE, FROM)`` (head chunks; ``0.4,0``: every call within about
  1.4x its own bytes), recorded in ``meta.memory_bound``; the file is ``scaling_<gpu>-bound_x<K>.json``
  unless ``--tag`` names it, so the default run's file stays.
- ``--pipelined [STEPS]``: each timed iteration runs STEPS forward+backward steps (default 8) back to back
  and records their mean, for every case, peer and T1 alike: what a loop that does not sync each step
  sees, the host issuing a step while the GPU runs the last one. By default each step runs alone after a
  barrier and a device sync (what a loop that syncs every step sees: a host-bound step also pays its
  start). Recorded in ``meta.pipelined``; the file is ``scaling_<gpu>-pipelined_x<K>.json`` unless
  ``--tag`` names it.

Peers are optional: a failed import or call is recorded in ``meta.skipped`` with
the reason; a measurement that started but never returned (a hang the job was killed
in, or a crash) is left in ``meta.skipped`` as such. Results:
``<out>/scaling_<gpu>_x<K>.json`` (``{"meta", "records", "profile"}``), ``<gpu>`` the model as
``gpu_tag.py`` names it (``h200``). Plots and tables: ``benchmarks/plot_scaling.py``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_tag import gpu_tag, package_versions  # noqa: E402
from cli_types import int_list, name_list  # noqa: E402
from host_cost import issue_ms, kernel_launches  # noqa: E402

STRATEGIES = ("ring", "head", "hybrid")
CONFIGS = ("longnet", "full")
PEERS = ("torch_cp", "ulysses", "ring_flash_attn")
LAYOUTS = ("contiguous", "zigzag")


def steps_per_iteration(text: str) -> int:
    """``--pipelined``: forward+backward steps per timed iteration (>= 1)."""
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise argparse.ArgumentTypeError(f"expected a number of steps >= 1, got {text!r}")
    return steps


def memory_bound(text: str) -> tuple[float, int]:
    """``--memory-bound``: ``SHARE,FROM`` as ``set_memory_bound`` takes them (a fraction >= 0, bytes >= 0)."""
    try:
        share, start = text.split(",")
        bound = float(share), int(start)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SHARE,FROM_BYTES (e.g. 0.4,0), got {text!r}") from None
    if not (bound[0] >= 0 and bound[1] >= 0):
        raise argparse.ArgumentTypeError(f"SHARE and FROM_BYTES must be >= 0, got {text!r}")
    return bound


# -- profile: which cases, and what the GPU did in each step (pure: no torch, checked on CPU) ------------

PROFILE_CASES = "ring,head"
CAUSAL_TERMS = ("causal", "non-causal")
# host ranges around each profiled step and its two phases (record_function names)
STEP_RANGE, FORWARD_RANGE, BACKWARD_RANGE = "bench_scaling.step", "bench_scaling.forward", "bench_scaling.backward"


def parse_profile_cases(text: str) -> list[tuple[str, ...]]:
    """``"ring:full:causal,head"`` -> ``[("ring", "full", "causal"), ("head",)]``; ValueError on an unknown term."""
    selectors = []
    for item in text.split(","):
        terms = tuple(t for t in item.strip().split(":") if t)
        if not terms:
            continue
        for t in terms:
            known = t in STRATEGIES or t in LAYOUTS or t in CONFIGS or t in CAUSAL_TERMS or t == "all"
            if not (known or t.isdigit()):
                raise ValueError(f"unknown term {t!r} (a strategy {STRATEGIES}, layout {LAYOUTS}, config {CONFIGS}, "
                                 f"{' or '.join(CAUSAL_TERMS)}, a tokens-per-GPU number, or all)")
        selectors.append(terms)
    if not selectors:
        raise ValueError("no selector given")
    return selectors


def profile_selected(selectors: list[tuple[str, ...]], strategy: str, layout: str, config: str, causal: bool,
                     tokens: int) -> bool:
    """Whether a measured case matches any selector (every term of a selector must match)."""
    def hit(t: str) -> bool:
        if t == "all":
            return True
        if t in STRATEGIES:
            return t == strategy
        if t in LAYOUTS:
            return t == layout
        if t in CONFIGS:
            return t == config
        if t in CAUSAL_TERMS:
            return causal == (t == "causal")
        return int(t) == tokens

    return any(all(hit(t) for t in sel) for sel in selectors)


class GpuEvent(NamedTuple):
    """One GPU activity (kernel, copy, fill) in microseconds; ``launch``: host time of its launch call, if known."""

    name: str
    start: float
    end: float
    launch: float | None = None


Interval = tuple[float, float]


def interval_union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals`` (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def interval_total(union: list[Interval]) -> float:
    return sum(e - s for s, e in union)


def interval_subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time of union ``a`` not covered by union ``b`` (both sorted and disjoint, as interval_union gives)."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:  # b ends before this piece of a (and so before every later one)
            j += 1
        cur, i = s, j
        while i < len(b) and b[i][0] < e and cur < e:
            if b[i][0] > cur:
                out.append((cur, b[i][0]))
            cur = max(cur, b[i][1])
            i += 1
        if cur < e:
            out.append((cur, e))
    return out


def is_comm_kernel(name: str) -> bool:
    """NCCL's kernels (``ncclDevKernel_SendRecv``, ``ncclKernel_AllReduce_...``): communication."""
    return "nccl" in name.lower()


def breakdown(events: list[GpuEvent], compute_cover: list[Interval] | None = None) -> dict:
    """Where the GPU's time went over ``events`` (one step or one phase), in ms.

    span: first start to last end. compute: union of non-NCCL activity. comm: union of NCCL kernels
    (which includes an NCCL kernel's wait for its peer). exposed_comm: comm time with no compute running
    (against ``compute_cover``, default these events' own compute). idle: span with nothing running.
    span = compute + exposed_comm + idle when the cover is the events' own compute.
    """
    comm = interval_union((e.start, e.end) for e in events if is_comm_kernel(e.name))
    compute = interval_union((e.start, e.end) for e in events if not is_comm_kernel(e.name))
    cover = compute if compute_cover is None else compute_cover
    busy = interval_union(comm + compute)
    span = (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0
    exposed = interval_total(interval_subtract(comm, cover))
    return {"span_ms": span / 1e3, "compute_ms": interval_total(compute) / 1e3,
            "comm_ms": interval_total(comm) / 1e3, "exposed_comm_ms": exposed / 1e3,
            "exposed_comm_frac": exposed / span if span > 0 else 0.0, "idle_ms": (span - interval_total(busy)) / 1e3,
            "nccl_kernels": sum(is_comm_kernel(e.name) for e in events), "kernels": len(events)}


def mean_breakdown(rows: list[dict]) -> dict:
    """Per-field mean over steps; the exposed fraction is the mean exposed time over the mean span."""
    keys = [k for k in rows[0] if k != "exposed_comm_frac"]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    out["exposed_comm_frac"] = out["exposed_comm_ms"] / out["span_ms"] if out["span_ms"] > 0 else 0.0
    return out


def assign_steps(events: list[GpuEvent], windows: list[Interval]) -> list[list[GpuEvent]]:
    """GPU events per host step window (sorted, disjoint): by launch time where known, else by GPU start
    (each step is bracketed by device synchronizations, so its kernels run inside its window). Events
    outside every window (the barrier between steps) are dropped."""
    starts = [w[0] for w in windows]
    out: list[list[GpuEvent]] = [[] for _ in windows]
    for e in events:
        t = e.launch if e.launch is not None else e.start
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= windows[i][1]:
            out[i].append(e)
    return out


def split_phases(events: list[GpuEvent], backward_start: float | None) -> tuple[list, list] | None:
    """(forward, backward) events of one step: launched before the host entered backward, or after.
    None where that cannot be told (no backward range, or an event without its launch time)."""
    if backward_start is None or any(e.launch is None for e in events):
        return None
    return [e for e in events if e.launch < backward_start], [e for e in events if e.launch >= backward_start]


def gpu_activity(events, cuda_type, cpu_type) -> tuple[list[GpuEvent], dict[str, list[Interval]]]:
    """From ``torch.profiler``'s ``prof.events()``: the GPU activities (kernels, copies, fills; not the GPU
    copies of annotations) with their launch times, and the host ranges named STEP/FORWARD/BACKWARD_RANGE.
    Launch times come from the runtime/driver calls that share a kernel's correlation id."""
    launches = {}
    for e in events:
        if e.device_type == cpu_type and str(getattr(e, "activity_type", "") or "").lower() in ("cuda_runtime",
                                                                                             "cuda_driver"):
            launches[e.id] = e.time_range.start
    gpu, ranges = [], {STEP_RANGE: [], FORWARD_RANGE: [], BACKWARD_RANGE: []}
    for e in events:
        kind = str(getattr(e, "activity_type", "") or "").lower()
        if e.device_type == cuda_type:
            if not getattr(e, "is_user_annotation", False) and not any(
                    w in kind for w in ("annotation", "sync", "overhead")):
                gpu.append(GpuEvent(e.name, e.time_range.start, e.time_range.end, launches.get(e.id)))
        elif e.device_type == cpu_type and e.name in ranges:
            ranges[e.name].append((e.time_range.start, e.time_range.end))
    for v in ranges.values():
        v.sort()
    return gpu, ranges


def rank_profile(gpu: list[GpuEvent], ranges: dict[str, list[Interval]]) -> dict | None:
    """One rank's profile of one case: the mean step breakdown over its steps and, where every kernel's
    launch is known, the mean forward and backward breakdowns (exposed against the whole step's
    compute). None when the profile holds no GPU activity (a CPU run)."""
    windows = ranges[STEP_RANGE]
    if not gpu or not windows:
        return None
    steps, phases = [], []
    for window, events in zip(windows, assign_steps(gpu, windows)):
        if not events:
            continue
        steps.append(breakdown(events))
        bwd = [s for s, _ in ranges[BACKWARD_RANGE] if window[0] <= s <= window[1]]
        split = split_phases(events, bwd[0] if bwd else None)
        if split is not None and split[0] and split[1]:
            cover = interval_union((e.start, e.end) for e in events if not is_comm_kernel(e.name))
            phases.append((breakdown(split[0], cover), breakdown(split[1], cover)))
    if not steps:
        return None
    out = mean_breakdown(steps)
    out["steps"] = len(steps)
    whole = len(phases) == len(steps)  # phases only where every step split
    out["forward"] = mean_breakdown([f for f, _ in phases]) if whole else None
    out["backward"] = mean_breakdown([b for _, b in phases]) if whole else None
    return out


def own_bytes(batch: int, rows: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of a rank's own tensors: q, out, dout, dq with ``heads``; k, v, dk, dv with ``kv_heads``; ``rows``
    tokens each."""
    return 4 * batch * rows * head_dim * (heads + kv_heads) * dtype_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list, default=[32768], help="tokens per GPU, comma-separated "
                   "(default 32768; sweep: 8192,16384,32768,65536)")
    p.add_argument("--configs", type=name_list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--strategies", type=name_list(STRATEGIES), default=list(STRATEGIES))
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=["contiguous"],
                   help="shard layouts of ours (contiguous,zigzag); zigzag is skipped where dilated_attention "
                        "has no layout= argument")
    p.add_argument("--waits", choices=["stream", "host"], default="stream",
                   help="stream: DILATED_ATTENTION_TIMEOUT unset, NCCL's stream-ordered waits (the default a user "
                        "gets); host: DILATED_ATTENTION_TIMEOUT set (default 300 s), a host-timed wait per exchange")
    p.add_argument("--peers", type=name_list(PEERS), default=None, help="'' for none (default: all; none with --smoke)")
    p.add_argument("--backend", default="collective", choices=["collective", "fairscale", "deepspeed"])
    p.add_argument("--memory-bound", type=memory_bound, default=None, metavar="SHARE,FROM",
                   help="run the library under set_memory_bound(SHARE, FROM) (e.g. 0.4,0: every call within about "
                        "1.4x its own bytes, in head chunks); default tag <gpu>-bound")
    p.add_argument("--pipelined", type=steps_per_iteration, nargs="?", const=8, default=0, metavar="STEPS",
                   help="time STEPS steps back to back per iteration (default 8; every case, peer and T1), not "
                        "each step alone after a barrier and a device sync; default tag <gpu>-pipelined")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--longnet-segments", type=int_list, default=None,
                   help="segments before N (default: the cost model's, 2048,8192,32768,131072)")
    p.add_argument("--longnet-rates", type=int_list, default=None,
                   help="one more than segments (default: the cost model's, 1,2,4,8,16)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="at most this many timed iterations")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--seconds-per-measurement", type=float, default=3.0,
                   help="fewer iterations (not below --min-iters) when one takes long")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True, help="max-length probe")
    p.add_argument("--probe-strategy", default="ring", choices=STRATEGIES)
    p.add_argument("--probe-cap", type=int, default=1 << 23, help="largest tokens per GPU the probe tries")
    p.add_argument("--probe-seconds", type=float, default=90.0, help="time budget of the probe")
    p.add_argument("--probe-refine", type=int, default=3,
                   help="bisection steps between the last size that ran and the first that did not")
    p.add_argument("--profile", action="store_true",
                   help="after the timed cases, profile a few steps of the library's cases on every rank: "
                        "GPU step span, compute, NCCL and exposed NCCL time (the JSON's profile list)")
    p.add_argument("--profile-cases", default=None, metavar="SELECTORS",
                   help="which measured cases of the library to profile (implies --profile): comma-separated "
                        "selectors, each colon-joined terms that must all match: a strategy (ring, head, hybrid), "
                        "a layout (contiguous, zigzag), a config (longnet, full), causal or non-causal, a "
                        f"tokens-per-GPU number, or all. Default {PROFILE_CASES!r}; e.g. ring:full:causal,head")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="profiled forward+backward steps per case, after one unprofiled step (default 3)")
    p.add_argument("--profile-trace", default=None, metavar="DIR",
                   help="also write each rank's Chrome trace of each profiled case into DIR (implies --profile; "
                        "traces are large: not into benchmarks/results)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time the library (ours, its T1, and ulysses around it) as replays of one CUDA graph of "
                        "the forward+backward, captured after a warm-up: records ours+graph, ulysses+graph (GPUs)")
    p.add_argument("--compile", action="store_true",
                   help="also time the library (ours and its T1) with its call inside torch.compile("
                        "mode='reduce-overhead'): records ours+compiled")
    p.add_argument("--no-host-cost", dest="host_cost", action="store_false",
                   help="skip measuring each case's host issue time and kernel launches (host_cost.py; GPUs)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file name: scaling_<tag>_x<K>.json (default: the GPU name)")
    p.add_argument("--smoke", action="store_true", help="CPU gloo, tiny sizes (overrides sizes, no peers)")
    a = p.parse_args(argv)
    from cost_model_lib import LONGNET_RATES, LONGNET_SEGMENTS  # after --help: it loads torch

    a.longnet_segments = list(LONGNET_SEGMENTS) if a.longnet_segments is None else a.longnet_segments
    a.longnet_rates = list(LONGNET_RATES) if a.longnet_rates is None else a.longnet_rates
    if a.smoke:
        a.tokens, a.heads, a.head_dim = [64], 2, 8
        a.longnet_segments, a.longnet_rates = [16, 32], [1, 2, 4]
        a.configs, a.causal, a.warmup, a.iters, a.min_iters = ["longnet"], "both", 1, 2, 1
        a.probe_cap, a.probe_seconds = 128, 30.0
        a.peers = [] if a.peers is None else a.peers
    a.peers = list(PEERS) if a.peers is None else a.peers
    a.profile = a.profile or a.profile_cases is not None or a.profile_trace is not None
    a.profile_cases = PROFILE_CASES if a.profile_cases is None else a.profile_cases
    try:
        a.profile_selectors = parse_profile_cases(a.profile_cases)
    except ValueError as exc:
        p.error(f"--profile-cases: {exc}")
    if a.profile_trace is not None:
        results = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
        trace = os.path.realpath(a.profile_trace)
        if trace == results or trace.startswith(results + os.sep):
            p.error("--profile-trace: traces are large, write them outside benchmarks/results")
    for name in ("heads", "head_dim", "batch", "iters", "min_iters", "probe_cap", "profile_steps"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if any(t <= 0 for t in a.tokens):
        p.error(f"--tokens must be positive, got {a.tokens}")
    if len(a.longnet_rates) != len(a.longnet_segments) + 1:
        p.error("--longnet-rates needs one more entry than --longnet-segments (the last pattern is N)")
    return a


@dataclass
class Skip(Exception):
    """A measurement that could not run (import, API, constraint): recorded, not fatal."""

    reason: str


class Bench:
    """Timing and agreement across ranks for one torchrun job."""

    def __init__(self, env, args) -> None:
        import torch

        self.torch, self.env, self.args = torch, env, args
        self.cuda = env.device.type == "cuda"
        self.mesh = None  # torch_cp's device mesh, built on first use
        self.last_host: dict = {}  # the last ``measure``'s ``host_cost``

    # -- agreement ------------------------------------------------------------------------------

    def agree(self, error: str | None) -> str | None:
        """Every rank learns whether any rank failed, and the first rank's reason."""
        import torch.distributed as dist

        everyone: list = [None] * self.env.world_size
        dist.all_gather_object(everyone, error)
        return next((e for e in everyone if e is not None), None)

    def max_over_ranks(self, value: float) -> float:
        import torch.distributed as dist

        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.env.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    # -- timing ---------------------------------------------------------------------------------

    def _once(self, step: Callable[[], None], collective: bool) -> float:
        torch = self.torch
        if collective:
            import torch.distributed as dist

            dist.barrier()

        def iteration() -> None:
            for _ in range(self.steps):
                step()

        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            iteration()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / self.steps
        else:
            t0 = time.perf_counter()
            iteration()
            ms = 1e3 * (time.perf_counter() - t0) / self.steps
        return self.max_over_ranks(ms) if collective else ms

    @property
    def steps(self) -> int:
        """Steps per timed iteration: one alone, or ``--pipelined``'s back to back (their mean is the time)."""
        return self.args.pipelined or 1

    def measure(self, step: Callable[[], None], collective: bool = True) -> tuple[float, float | None]:
        """(median ms of the slowest rank, peak GiB of the largest rank) of ``step``.

        ``collective=False``: only this rank runs (the single-GPU reference).
        """
        torch, a = self.torch, self.args
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(max(1, a.warmup)):
            warm = self._once(step, collective)  # the last warm-up: compiled and cached
        n = max(a.min_iters, min(a.iters, int(1e3 * a.seconds_per_measurement / max(warm * self.steps, 1e-3))))
        times = [self._once(step, collective) for _ in range(n)]
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        self.last_host = self.host_cost(step, collective) if self.cuda and a.host_cost else {}
        if peak is not None:  # a graph's replay (``graphed``) allocates nothing: its capture's peak counts
            peak = max(peak, getattr(step, "peak_gib", 0.0))
        if collective and peak is not None:
            peak = self.max_over_ranks(peak)
        return statistics.median(times), peak

    def host_cost(self, step: Callable[[], None], collective: bool) -> dict:
        """The host's side of ``step`` (``host_cost.py``): issue time (slowest rank) and kernels launched."""
        import torch.distributed as dist

        issue = issue_ms(step, before=dist.barrier if collective else None)
        launches = kernel_launches(step)
        return {"host_issue_ms": self.max_over_ranks(issue) if collective else issue, "launches": launches}

    def randn(self, shape, seed: int, dtype=None):
        g = self.torch.Generator(device=self.env.device).manual_seed(seed)
        return self.torch.randn(shape, generator=g, device=self.env.device, dtype=dtype or self.dtype)

    @property
    def dtype(self):
        return self.torch.bfloat16 if self.cuda else self.torch.float32

    def own_gib(self, rows: int) -> float:
        """GiB of a rank's own q, k, v, out, dout, dq, dk, dv at ``rows`` tokens (kv heads = heads here)."""
        a = self.args
        return own_bytes(a.batch, rows, a.heads, a.heads, a.head_dim, self.torch.finfo(self.dtype).bits // 8) / 2**30

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def patterns_for(args, config: str, n: int) -> tuple[list[int], list[int]]:
    from cost_model_lib import config_patterns

    pats = config_patterns(config, n, args.longnet_segments, args.longnet_rates)
    return [w for w, _ in pats], [r for _, r in pats]


def has_strategy_argument() -> bool:
    from dilated_attention import dilated_attention

    return "strategy" in inspect.signature(dilated_attention).parameters


def has_layout_argument() -> bool:
    from dilated_attention import dilated_attention

    return "layout" in inspect.signature(dilated_attention).parameters


def ours_step(bench: Bench, n_local: int, config: str, causal: bool, n_total: int, comm, strategy: str | None,
              layout: str = "contiguous", phase=None, compiled: bool = False):
    """A closure running forward+backward of the library on (B, n_local, H, D) inputs (random rows:
    timing needs only the shapes, so a zigzag layout needs no reordering of real data). ``phase``: a
    context-manager factory (``record_function``) that names the forward and the backward on the host.
    ``compiled``: the call inside ``torch.compile(mode="reduce-overhead")`` (``--compile``)."""
    from dilated_attention import dilated_attention

    a, rank, torch = bench.args, bench.env.rank, bench.torch
    shape = (a.batch, n_local, a.heads, a.head_dim)
    q, k, v = (bench.randn(shape, 1000 * i + rank).requires_grad_() for i in range(3))
    dout = bench.randn(shape, 7000 + rank)
    segs, rates = patterns_for(a, config, n_total)
    extra = {"strategy": strategy} if strategy is not None else {}
    if layout != "contiguous":
        extra["layout"] = layout

    def attend(q_, k_, v_):
        return dilated_attention(q_, k_, v_, segs, rates, causal=causal, comm=comm, kernel=a.kernel, **extra)

    if compiled:  # each case compiles afresh (a new closure of one code object would count as a recompile)
        torch._dynamo.reset()
        attend = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    named = phase or (lambda _name: contextlib.nullcontext())

    def step() -> None:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are dead: the tree may reuse them
        with named(FORWARD_RANGE):
            out = attend(q, k, v)
        with named(BACKWARD_RANGE):
            out.backward(dout)
        q.grad = k.grad = v.grad = None

    return step


GRAPHED = "ours+graph"  # --cuda-graph: the library's records timed as CUDA graph replays
COMPILED = "ours+compiled"  # --compile: the library's call inside torch.compile(mode="reduce-overhead")


def graphed(bench: Bench, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured into one CUDA graph (``--cuda-graph``, ``testing.graphs.capture``); returns its replay.
    Every rank calls it at the same point (the warm-up talks)."""
    from dilated_attention.testing.graphs import capture

    torch = bench.torch
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the graph's memory is taken here, before measure() looks
    graph, _ = capture(step)

    def replay() -> None:
        graph.replay()

    replay.captured = step  # the graph reads the step's tensors where they lie: they must live as long as it
    replay.peak_gib = torch.cuda.max_memory_allocated() / 2**30  # warm-up and capture: the graph's own pool
    return replay


def cudnn_sdpa_step(bench: Bench, n: int, causal: bool):
    """Single-GPU cuDNN SDPA forward+backward over the whole sequence (torch_cp's T1)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = bench.args
    shape = (a.batch, a.heads, n, a.head_dim)
    q, k, v = (bench.randn(shape, 100 + i).requires_grad_() for i in range(3))
    dout = bench.randn(shape, 200)

    def step() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
        q.grad = k.grad = v.grad = None

    return step


def torch_cp_measure(bench: Bench, n: int, causal: bool) -> tuple[float, float | None, str]:
    """PyTorch context parallel over all ranks; every rank builds the same global tensors."""
    if not bench.cuda:
        raise Skip("torch_cp needs CUDA (cuDNN SDPA)")
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        raise Skip(f"torch_cp import failed: {exc}") from None
    try:  # private, and the only switch for load balancing (on by default)
        from torch.distributed.tensor.experimental._attention import _cp_options
    except ImportError:
        _cp_options = None
    if _cp_options is None and not causal:
        raise Skip("torch_cp: no _cp_options to turn load balancing off, which torch refuses without is_causal")
    a = bench.args
    if bench.mesh is None:  # one mesh for the whole run
        bench.mesh = init_device_mesh("cuda", (bench.env.world_size,))
    mesh = bench.mesh
    shape = (a.batch, a.heads, n, a.head_dim)
    q, k, v = (bench.randn(shape, 100 + i) for i in range(3))  # same seed on every rank: one global problem
    dout = bench.randn(shape, 200)
    bufs = [q, k, v, dout]
    before = _cp_options.enable_load_balance if _cp_options is not None else None
    if _cp_options is not None:
        # read when the context shards the buffers (head-tail order) and on every call: causal attention
        # gets the balanced order, non-causal the plain one (torch raises for balanced non-causal calls)
        _cp_options.enable_load_balance = causal
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), \
                context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
            # Grad-requiring aliases of the (now sharded) buffers, made inside the context: the buffers
            # themselves must not require grad, or the context cannot resize them in place.
            qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))

            def step() -> None:
                F.scaled_dot_product_attention(qa, ka, va, is_causal=causal).backward(dout)
                qa.grad = ka.grad = va.grad = None

            ms, peak = bench.measure(step)
            # the context turns balancing off where the sequence does not split into 2K chunks
            balance = "unknown" if _cp_options is None else \
                "load-balanced" if _cp_options.enable_load_balance else "no load balance"
    finally:
        if _cp_options is not None:
            _cp_options.enable_load_balance = before
    return ms, peak, balance


def ulysses_step(bench: Bench, n_local: int, config: str, causal: bool, n_total: int):
    """DeepSpeed Ulysses: all-to-all around the library's single-device call."""
    try:
        from deepspeed.sequence.layer import DistributedAttention

        from dilated_attention.comm.deepspeed import ensure_initialized
    except ImportError as exc:
        raise Skip(f"deepspeed import failed: {exc}") from None
    import torch.distributed as dist

    from dilated_attention import dilated_attention

    a = bench.args
    if a.heads % bench.env.world_size:
        raise Skip(f"ulysses needs the world size ({bench.env.world_size}) to divide heads ({a.heads})")
    ensure_initialized()
    segs, rates = patterns_for(a, config, n_total)

    def local_attention(q, k, v, *args, **kwargs):
        return dilated_attention(q, k, v, segs, rates, causal=causal, kernel=a.kernel)

    # (B, N, H, D): scatter heads (dim 2), gather sequence (dim 1)
    attn = DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    batch_arg = (0,) if "batch_dim_idx" in inspect.signature(attn.forward).parameters else ()
    rank = bench.env.rank
    shape = (a.batch, n_local, a.heads, a.head_dim)
    q, k, v = (bench.randn(shape, 1000 * i + rank).requires_grad_() for i in range(3))
    dout = bench.randn(shape, 7000 + rank)

    def step() -> None:
        attn(q, k, v, *batch_arg).backward(dout)
        q.grad = k.grad = v.grad = None

    return step


def flash_attn_step(bench: Bench, n: int, causal: bool):
    """Single-GPU flash-attn forward+backward over the whole sequence (ring_flash_attn's T1)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError as exc:
        raise Skip(f"flash_attn import failed: {exc}") from None
    a = bench.args
    shape = (a.batch, n, a.heads, a.head_dim)
    q, k, v = (bench.randn(shape, 100 + i).requires_grad_() for i in range(3))
    dout = bench.randn(shape, 200)

    def step() -> None:
        flash_attn_func(q, k, v, causal=causal).backward(dout)
        q.grad = k.grad = v.grad = None

    return step


def ring_flash_attn_step(bench: Bench, n_local: int):
    """ring-flash-attention's zigzag ring over all ranks, causal: rank ``r`` holds chunks ``r`` and
    ``2K-1-r`` of the sequence (timing needs only the shapes: random local rows stand in for them)."""
    if not bench.cuda:
        raise Skip("ring_flash_attn needs CUDA (flash-attn)")
    try:
        from ring_flash_attn import zigzag_ring_flash_attn_func
    except ImportError as exc:  # flash-attn missing lands here too
        raise Skip(f"ring_flash_attn import failed: {exc}") from None
    if n_local % 2:
        raise Skip(f"the zigzag ring splits each rank's rows in two: {n_local} tokens per GPU is odd")
    a, rank = bench.args, bench.env.rank
    shape = (a.batch, n_local, a.heads, a.head_dim)
    q, k, v = (bench.randn(shape, 1000 * i + rank).requires_grad_() for i in range(3))
    dout = bench.randn(shape, 7000 + rank)

    def step() -> None:
        zigzag_ring_flash_attn_func(q, k, v, causal=True).backward(dout)
        q.grad = k.grad = v.grad = None

    return step


def failure(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as a skip reason: the type and message of the error it arose from (torch.compile wraps the error a
    call raised while tracing in its own)."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


def run_guarded(bench: Bench, fn: Callable[[], object]) -> tuple[object, str | None]:
    """Run ``fn`` on every rank; if any rank fails, every rank returns (None, reason)."""
    result, error = None, None
    try:
        result = fn()
    except Skip as exc:
        error = exc.reason
    except Exception as exc:  # a peer's or strategy's failure is data, not the end of the run
        error = failure(exc)
    error = bench.agree(error)
    bench.free()
    return (None, error) if error else (result, None)


def single_gpu(bench: Bench, make_step: Callable[[], Callable[[], None]]) -> tuple[float | None, float | None, str | None]:
    """T1 on rank 0 (the others wait), shared with every rank."""
    import torch.distributed as dist

    box: list = [None]
    if bench.env.rank == 0:
        try:
            box[0] = bench.measure(make_step(), collective=False)
        except Exception as exc:
            box[0] = failure(exc)
    bench.free()
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        return None, None, box[0]
    return box[0][0], box[0][1], None


def _probe_step(bench: Bench, comm, strategy: str | None, tokens: int) -> tuple[str | None, float, float | None]:
    """One cold LongNet forward+backward at ``tokens`` per GPU on every rank: (failure, ms, peak GiB)."""
    torch, k = bench.torch, bench.env.world_size
    t0, status = time.perf_counter(), None
    try:
        if bench.cuda:
            torch.cuda.reset_peak_memory_stats()
        step = ours_step(bench, tokens, "longnet", False, k * tokens, comm, strategy)
        step()
        if bench.cuda:
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        status = "OOM"
    except Exception as exc:
        status = failure(exc, 200)
    step = None  # drop the inputs (and the traceback's references) before emptying the cache
    ms = 1e3 * (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if bench.cuda else None
    bench.free()
    status = bench.agree(status)  # every rank stops together, OOM on one is OOM for all
    if status is not None:
        return status, ms, peak
    return None, bench.max_over_ranks(ms), bench.max_over_ranks(peak) if peak is not None else None


def probe(bench: Bench, comm, how: tuple[str | None, str], records: list, meta: dict, progress) -> None:
    """LongNet, non-causal: double tokens per GPU until OOM, the cap or the time budget, then bisect
    between the last size that ran and the first that did not (``--probe-refine`` steps, sizes in
    multiples of the first). A size whose peak, extrapolated linearly from the last one, exceeds
    the GPU is not launched ("predicted OOM"): a rank that really runs out mid-ring leaves its peers
    waiting until the backend's timeout."""
    torch, a, k = bench.torch, bench.args, bench.env.world_size
    capacity = torch.cuda.get_device_properties(bench.env.device).total_memory / 2**30 if bench.cuda else None
    unit = max(a.tokens)
    tokens, start, steps, stop = unit, time.perf_counter(), [], "cap"
    last = None  # (tokens, ms, peak) of the largest size that ran
    too_big, refines = None, 0  # the smallest size that did not run; bisection steps taken
    while True:
        failure = None
        if tokens > a.probe_cap:
            failure = "cap"
        elif last is not None and capacity and last[2] and last[2] * tokens / last[0] > capacity:
            failure = f"predicted OOM ({last[2] * tokens / last[0]:.0f} GiB > {capacity:.0f} GiB)"
        elif last is not None and (bench.max_over_ranks(time.perf_counter() - start) + 4 * last[1] / 1e3
                                   > a.probe_seconds):
            # per-GPU work grows up to 4x per doubling (the N-long pattern); the slowest rank's clock decides, so
            # every rank stops at the same size
            failure = "time budget"
        if failure is None:
            progress.set_postfix_str(f"probe {tokens} tokens/GPU")
            failure, ms, peak = _probe_step(bench, comm, how[0], tokens)
            if failure is None:
                steps.append({"impl": "ours", "strategy": how[1], "config": "longnet", "causal": False,
                              "gpus": k, "tokens_per_gpu": tokens, "layout": "contiguous", "ms": ms,
                              "efficiency": None, "peak_gib": peak, "own_gib": bench.own_gib(tokens)})
                last = (tokens, ms, peak)
        memory_bound = failure is not None and (failure == "OOM" or failure.startswith("predicted"))
        if failure is not None and not memory_bound:
            stop = failure if too_big is None else f"{stop}; then {failure}"
            break
        if failure is not None:
            too_big, stop = tokens, failure
        if too_big is None:
            tokens *= 2
            continue
        if last is None or refines >= a.probe_refine:
            break
        mid = (last[0] + too_big) // 2 // unit * unit  # bisect in whole multiples of the first size
        if mid <= last[0]:
            break
        tokens, refines = mid, refines + 1
    stop += f"; {refines} bisection steps" if refines else ""
    max_tokens = k * last[0] if last else 0
    for rec in steps:
        rec["max_tokens"] = max_tokens
    records.extend(steps)
    meta["probe"] = {"stop": stop, "max_tokens": max_tokens, "seconds": time.perf_counter() - start,
                     "cap_tokens_per_gpu": a.probe_cap, "note": "ms of a probe step is one cold forward+backward"}


def profile_case(bench: Bench, comm, strategy: str | None, config: str, causal: bool, tokens: int, layout: str,
                 trace: str | None) -> dict | None:
    """This rank's profile of one case (``rank_profile``): one unprofiled step, then ``--profile-steps``
    steps under ``torch.profiler``, each after a barrier and bracketed by device synchronizations so
    that its GPU work sits inside its host range. ``trace``: Chrome trace path of this rank, or None."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    torch, k = bench.torch, bench.env.world_size

    def sync() -> None:
        if bench.cuda:
            torch.cuda.synchronize()

    step = ours_step(bench, tokens, config, causal, k * tokens, comm, strategy, layout, phase=record_function)
    step()  # the caches and the allocator as the timed iterations left them
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(bench.args.profile_steps):
            dist.barrier()
            sync()
            with record_function(STEP_RANGE):
                step()
                sync()
    if trace is not None:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)
    gpu, ranges = gpu_activity(prof.events(), torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU)
    return rank_profile(gpu, ranges)


def profile_cases(bench: Bench, comm, records: list[dict], meta: dict, strategies_ok: bool, out: list[dict],
                  save: Callable[[], None], progress) -> None:
    """``--profile``: every measured multi-GPU case of the library that ``--profile-cases`` selects, profiled
    on every rank; one entry per case appended to ``out`` (saved at once) with the slowest rank's numbers
    (largest mean step span) and every rank's in ``per_rank``. Nothing is recorded where the profile has
    no GPU kernels (CPU, gloo)."""
    import torch.distributed as dist

    a, env, k = bench.args, bench.env, bench.env.world_size
    start = time.perf_counter()
    cases = [r for r in records if r["impl"] == "ours" and r["gpus"] > 1 and "max_tokens" not in r
             and profile_selected(a.profile_selectors, r["strategy"], r["layout"], r["config"], r["causal"],
                                  r["tokens_per_gpu"])]
    info = meta["profiling"] = {
        "cases": a.profile_cases, "steps": a.profile_steps, "profiled": 0, "seconds": 0.0,
        "rank": "slowest rank (largest mean step span); per_rank has every rank",
        "how": "mean over steps of each step's GPU events: span (first start to last end), compute (union of "
               "non-NCCL kernels, copies, fills), comm (union of NCCL kernels, waits for the peer included), "
               "exposed_comm (comm while no compute runs), idle (nothing runs); forward/backward split by where "
               "each kernel was launched on the host (null where a launch time is missing)",
        "note": None}
    if k == 1:
        info["note"] = "one GPU: nothing is exchanged, nothing profiled"
    elif not cases:
        info["note"] = f"no measured case of the library matches --profile-cases {a.profile_cases!r}"
    no_kernels = False
    for rec in cases:
        case = f"{rec['strategy']}/{rec['layout']} {rec['config']} {'causal' if rec['causal'] else 'non-causal'} " \
               f"{rec['tokens_per_gpu']}/GPU"
        progress.set_postfix_str(f"profile {case}")
        t0 = time.perf_counter()
        trace = None
        if a.profile_trace is not None:
            trace = os.path.join(a.profile_trace, f"profile_x{k}_{rec['config']}_"
                                 f"{'causal' if rec['causal'] else 'noncausal'}_{rec['strategy']}_{rec['layout']}_"
                                 f"{rec['tokens_per_gpu']}_rank{env.rank}.json")
        info["unfinished"] = f"{case}: started but never finished (the job hung or crashed here)"
        save()
        res, err = run_guarded(bench, lambda: profile_case(
            bench, comm, rec["strategy"] if strategies_ok else None, rec["config"], rec["causal"],
            rec["tokens_per_gpu"], rec["layout"], trace))
        everyone: list = [None] * k
        dist.all_gather_object(everyone, res)
        del info["unfinished"]
        seconds = time.perf_counter() - t0
        if err:
            info.setdefault("failed", []).append({"case": case, "reason": err})
            continue
        if any(r is None for r in everyone):
            no_kernels = True
            continue
        slow = max(range(k), key=lambda i: everyone[i]["span_ms"])
        top = everyone[slow]
        entry = {"impl": "ours", "strategy": rec["strategy"], "config": rec["config"], "causal": rec["causal"],
                 "gpus": k, "tokens_per_gpu": rec["tokens_per_gpu"], "layout": rec["layout"],
                 "timed_ms": rec["ms"], "steps": top["steps"], "rank": slow, "step_ms": top["span_ms"],
                 **{key: top[key] for key in ("compute_ms", "comm_ms", "exposed_comm_ms", "exposed_comm_frac",
                                              "idle_ms", "nccl_kernels", "kernels")},
                 "forward": top["forward"], "backward": top["backward"], "seconds": seconds,
                 "per_rank": [{"rank": i, "step_ms": r["span_ms"],
                               **{key: v for key, v in r.items() if key not in ("span_ms", "forward", "backward")}}
                              for i, r in enumerate(everyone)]}
        out.append(entry)
        info["profiled"], info["seconds"] = len(out), time.perf_counter() - start
        save()
    if no_kernels:
        info["note"] = "no CUDA kernels in the profile (a CPU run): nothing recorded" if not bench.cuda else \
            "no CUDA kernels in the profile of some cases (is CUPTI available?): those recorded nothing"
    info["profiled"], info["seconds"] = len(out), time.perf_counter() - start


def versions(torch, cuda: bool) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    if cuda:
        out["cuda"] = torch.version.cuda
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    names = {"triton": "triton", "deepspeed": "deepspeed", "fairscale": "fairscale", "flash_attn": "flash-attn",
             "ring_flash_attn": "ring-flash-attn", "flash_attn_4": "flash-attn-4",
             "cudnn_frontend": "nvidia-cudnn-frontend"}  # (the kernels a run measured: auto's flash4 and cudnn-det)
    found = package_versions(*names.values())
    return {**out, **{name: found[dist] for name, dist in names.items()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.waits == "host":  # a stuck peer raises PeerTimeoutError
        os.environ.setdefault("DILATED_ATTENTION_TIMEOUT", "300")
    else:  # NCCL's watchdog bounds a stuck peer (the process group's timeout below)
        os.environ.pop("DILATED_ATTENTION_TIMEOUT", None)
    from dilated_attention.launch_utils import init_distributed

    env = init_distributed("cpu" if args.smoke else "auto", seed=0, timeout=300)
    import torch
    from tqdm import tqdm

    from dilated_attention import memory, set_memory_bound
    from dilated_attention.ring import routes
    from dilated_attention.ring.cross_share import Helper
    from dilated_attention.comm import get_backend

    if args.memory_bound is not None:
        set_memory_bound(*args.memory_bound)
    bench = Bench(env, args)
    k = env.world_size
    comm = get_backend(args.backend) if k > 1 else None
    strategies_ok = has_strategy_argument()
    layouts_ok = has_layout_argument()
    device_name = torch.cuda.get_device_name(env.device) if bench.cuda else "cpu"
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    records: list[dict] = []
    profile: list[dict] = []  # --profile: one entry per profiled case
    meta = {
        "gpu": device_name, "gpus": k, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        **versions(torch, bench.cuda), "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "dtype": str(bench.dtype).replace("torch.", ""), "dtype_bytes": torch.finfo(bench.dtype).bits // 8,
        "batch": args.batch, "heads": args.heads, "kv_heads": args.heads, "head_dim": args.head_dim,
        "backend": args.backend, "kernel": args.kernel, "tokens_per_gpu": args.tokens,
        "longnet_segments": args.longnet_segments, "longnet_rates": args.longnet_rates,
        "cuda_graph": bool(args.cuda_graph and bench.cuda),  # records of impl ours+graph (and ulysses+graph)
        "compile": args.compile,  # records of impl ours+compiled
        "strategy_argument": strategies_ok, "layout_argument": layouts_ok,
        "waits": ("host" if comm.host_waits else "stream") if comm is not None else None,
        "memory_bound": list(memory.BOUND.key),  # head chunks: set_memory_bound's rule
        "share_min_rows": routes.TUNING.share_min_rows,  # causal rings on full rows this long share their cross blocks
        "share_guests": Helper.order,  # a helper's guests' backward: one per idle step
        # (non-causal, causal): dilated rings whose ranks divide the heads run head-parallel (ring/swapped.py)
        "swap_compact": [routes.TUNING.swaps_rings(False), routes.TUNING.swaps_rings(True)],
        "waits_asked": args.waits, "warmup": args.warmup, "iters": args.iters,
        "timing": "median forward+backward over iterations, slowest rank, " + ("CUDA events" if bench.cuda else "wall clock")
                  + (f"; an iteration is the mean of {args.pipelined} steps run back to back" if args.pipelined
                     else "; an iteration is one step after a barrier and a device sync"),
        "pipelined": args.pipelined,  # steps per timed iteration, back to back (0: one step, synced)
        "efficiency": "T1 / (gpus * ms), T1 = one GPU on the whole sequence in this run: the library for ours and "
                      "ulysses, cuDNN SDPA for torch_cp, flash-attn for ring_flash_attn",
        "own_gib": "a rank's own q, k, v, out, dout, dq, dk, dv (k, v, dk, dv with kv_heads) in the input dtype, "
                   "at its tokens per GPU (one GPU: the whole sequence); peak_gib / own_gib: the peak in those "
                   "units",
        "single_gpu": [], "skipped": [],
        "gpu_memory_gib": torch.cuda.get_device_properties(env.device).total_memory / 2**30 if bench.cuda else None,
    }

    def skip(impl, strategy, config, causal, tokens, reason, layout="contiguous"):
        meta["skipped"].append({"impl": impl, "strategy": strategy, "config": config, "causal": causal,
                                "tokens_per_gpu": tokens, "layout": layout, "reason": reason})

    def record(impl, strategy, config, causal, tokens, ms, t1, peak, layout="contiguous"):
        records.append({"impl": impl, "strategy": strategy, "config": config, "causal": causal, "gpus": k,
                        "tokens_per_gpu": tokens, "layout": layout, "ms": ms,
                        "efficiency": (t1 / (k * ms)) if t1 else None, "peak_gib": peak,
                        "own_gib": bench.own_gib(tokens), **bench.last_host})
        save()  # after every record: a later case that hangs or is killed loses nothing measured

    def save():
        if env.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w") as f:
                json.dump({"meta": meta, "records": records, "profile": profile}, f, indent=1)

    def multi_gpu(impl, strategy, config, causal, tokens, t1, measure, layout="contiguous"):
        """One K-rank measurement, recorded or skipped with the reason. Until it returns, the saved JSON
        lists it as unfinished: a hang that ends the job (or a crash) still says where it stopped."""
        pending = {"impl": impl, "strategy": strategy, "config": config, "causal": causal, "tokens_per_gpu": tokens,
                   "layout": layout, "reason": "started but never finished: the job hung or crashed here"}
        meta["skipped"].append(pending)
        save()
        res, err = run_guarded(bench, measure)
        meta["skipped"].remove(pending)
        if err:
            skip(impl, strategy, config, causal, tokens, err, layout)
        else:
            record(impl, strategy, config, causal, tokens, res[0], t1, res[1], layout)
        return res

    def single_reference(impl, config, causal, tokens, n, make_step):
        """An implementation's own T1 on rank 0 (shared with every rank); at K=1 it is its record."""
        t1_, peak_, err_ = single_gpu(bench, make_step)
        meta["single_gpu"].append({"impl": impl, "config": config, "causal": causal, "tokens": n, "ms": t1_,
                                   "peak_gib": peak_, "own_gib": bench.own_gib(n), "error": err_,
                                   **(bench.last_host if env.rank == 0 and not err_ else {})})
        if k == 1:
            if err_:
                skip(impl, "single", config, causal, tokens, err_)
            else:
                record(impl, "single", config, causal, tokens, t1_, t1_, peak_)
        return t1_, err_

    tag = args.tag or ((gpu_tag(device_name) if bench.cuda else "cpu") + ("-bound" if args.memory_bound else "")
                       + ("-pipelined" if args.pipelined else ""))
    path = os.path.join(args.out, f"scaling_{tag}_x{k}.json")
    cases = [(t, c, z) for t in args.tokens for c in args.configs for z in causals]
    graphs = bool(args.cuda_graph and bench.cuda)
    per_case = 1 + (len(args.strategies) * len(args.layouts) if k > 1 else 0) + len(args.peers)
    progress = tqdm(total=len(cases) * per_case + args.profile + args.probe, disable=env.rank != 0,
                    desc=f"scaling x{k}",
                    dynamic_ncols=True)
    for tokens, config, causal in cases:
        n = k * tokens
        label = f"{config} {'causal' if causal else 'full-mask'} N={n}"
        progress.set_postfix_str(f"{label}: T1")
        t1, _ = single_reference("ours", config, causal, tokens, n,
                                 lambda: ours_step(bench, n, config, causal, n, None, None))
        progress.update()
        # (impl, its T1, how a step is timed, whether the library's call is compiled)
        timings = [("ours", t1, lambda step: step, False)]
        if graphs:  # the same cases again, each captured whole into a CUDA graph
            t1g, _ = single_reference(GRAPHED, config, causal, tokens, n,
                                      lambda: graphed(bench, ours_step(bench, n, config, causal, n, None, None)))
            timings.append((GRAPHED, t1g, lambda step: graphed(bench, step), False))
        if args.compile:  # and with the call inside torch.compile(mode="reduce-overhead")
            t1c, _ = single_reference(COMPILED, config, causal, tokens, n,
                                      lambda: ours_step(bench, n, config, causal, n, None, None, compiled=True))
            timings.append((COMPILED, t1c, lambda step: step, True))
        for strategy, layout in [(s, lay) for s in args.strategies for lay in args.layouts] if k > 1 else []:
            progress.set_postfix_str(f"{label}: ours/{strategy}/{layout}")
            if not strategies_ok and strategy != "ring":
                skip("ours", strategy, config, causal, tokens, "dilated_attention has no strategy= argument yet", layout)
            elif layout != "contiguous" and not layouts_ok:
                skip("ours", strategy, config, causal, tokens, "dilated_attention has no layout= argument yet", layout)
            else:
                for impl, t1_, wrap, compiled in timings:
                    multi_gpu(impl, strategy, config, causal, tokens, t1_, lambda: bench.measure(wrap(ours_step(
                        bench, tokens, config, causal, n, comm, strategy if strategies_ok else None, layout,
                        compiled=compiled))), layout)
            progress.update()
        # peers, the established one first: a peer that hangs ends the job (run_scaling.sh bounds each K)
        if "ulysses" in args.peers:
            progress.set_postfix_str(f"{label}: ulysses")
            if k == 1:
                skip("ulysses", "head", config, causal, tokens, "one GPU: nothing to exchange")
            else:
                for impl, t1_, wrap, compiled in timings:
                    if compiled:  # (Ulysses runs our call eagerly or captured whole)
                        continue
                    peer = impl.replace("ours", "ulysses")
                    multi_gpu(peer, "head", config, causal, tokens, t1_,
                              lambda: bench.measure(wrap(ulysses_step(bench, tokens, config, causal, n))))
            progress.update()
        if "ring_flash_attn" in args.peers:
            progress.set_postfix_str(f"{label}: ring_flash_attn")
            if config != "full" or not causal:
                skip("ring_flash_attn", "ring", config, causal, tokens,
                     "the zigzag ring runs full causal attention only")
            elif not bench.cuda:
                skip("ring_flash_attn", "ring", config, causal, tokens, "ring_flash_attn needs CUDA (flash-attn)")
            else:
                fa_t1, _ = single_reference("ring_flash_attn", config, causal, tokens, n,
                                            lambda: flash_attn_step(bench, n, causal))
                if k > 1:
                    multi_gpu("ring_flash_attn", "ring", config, causal, tokens, fa_t1,
                              lambda: bench.measure(ring_flash_attn_step(bench, tokens)))
            progress.update()
        if "torch_cp" in args.peers:
            progress.set_postfix_str(f"{label}: torch_cp")
            if config != "full":
                skip("torch_cp", "ring", config, causal, tokens, "context parallel runs full attention only")
            elif not bench.cuda:
                skip("torch_cp", "ring", config, causal, tokens, "torch_cp needs CUDA (cuDNN SDPA)")
            else:
                cp_t1, _ = single_reference("torch_cp", config, causal, tokens, n,
                                            lambda: cudnn_sdpa_step(bench, n, causal))
                if k > 1:
                    res = multi_gpu("torch_cp", "ring", config, causal, tokens, cp_t1,
                                    lambda: torch_cp_measure(bench, n, causal))
                    if res is not None:
                        cp = meta.setdefault("torch_cp", {
                            "balance": {}, "peak_gib": "includes the whole-sequence q, k, v, dout that "
                                                      "context_parallel shards in place (their storage keeps its size)"})
                        cp["balance"]["causal" if causal else "non-causal"] = res[2]
            progress.update()
    if args.profile:  # after the timed cases, before the probe (which ends at an out-of-memory)
        profile_cases(bench, comm, records, meta, strategies_ok, profile, save, progress)
        save()
        progress.update()
    if args.probe:
        # (strategy= argument, name in the records): one GPU runs without a backend; before
        # strategy= exists the ring is the only multi-GPU path.
        if k == 1:
            how = (None, "single")
        elif strategies_ok:
            how = (args.probe_strategy, args.probe_strategy)
        else:
            how = (None, "ring") if args.probe_strategy == "ring" else None
        if how is None:
            skip("ours", args.probe_strategy, "longnet", False, None, "dilated_attention has no strategy= argument yet")
        else:
            probe(bench, comm, how, records, meta, progress)
        progress.update()
    progress.close()

    save()
    if env.rank == 0:
        print(f"wrote {path}: {len(records)} records, {len(meta['skipped'])} skipped, {meta['waits']} waits",
              flush=True)
        for rec in records:
            eff = f"{100 * rec['efficiency']:.1f}%" if rec["efficiency"] is not None else "-"
            mem = f"{rec['peak_gib']:.1f} GiB ({rec['peak_gib'] / rec['own_gib']:.1f}x own)" \
                if rec["peak_gib"] is not None else "-"
            extra = f" max_tokens={rec['max_tokens']}" if "max_tokens" in rec else ""
            lay = "" if rec.get("layout", "contiguous") == "contiguous" else f"/{rec['layout']}"
            print(f"  {rec['impl']:8s} {rec['strategy'] + lay:14s} {rec['config']:8s} causal={str(rec['causal']):5s} "
                  f"K={k} tokens/GPU={rec['tokens_per_gpu']:>8d} {rec['ms']:10.2f} ms  eff {eff:>6s}  {mem}{extra}")
        for s in meta["skipped"]:
            print(f"  skipped {s['impl']}/{s['strategy']} {s['config']} causal={s['causal']}: {s['reason']}")
        if args.profile:
            info = meta["profiling"]
            print(f"profile: {info['profiled']} cases, {info['steps']} steps each, {info['seconds']:.1f} s"
                  + (f"; {info['note']}" if info["note"] else ""))
            for p in profile:
                print(f"  {p['strategy'] + '/' + p['layout']:18s} {p['config']:8s} causal={str(p['causal']):5s} "
                      f"step {p['step_ms']:8.2f} ms (timed {p['timed_ms']:.2f})  compute {p['compute_ms']:8.2f}  "
                      f"comm {p['comm_ms']:7.2f}  exposed {p['exposed_comm_ms']:7.2f} ms "
                      f"({100 * p['exposed_comm_frac']:.1f}%)  idle {p['idle_ms']:6.2f}  "
                      f"nccl/step {p['nccl_kernels']:.0f}  rank {p['rank']}")
            for f in info.get("failed", []):
                print(f"  profile failed {f['case']}: {f['reason']}")
    env.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
