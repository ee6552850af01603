"""Cost model for sequence-parallel dilated attention: compute per step vs bytes per step.

Pure arithmetic (no devices, no process groups). It predicts the time of one
forward+backward on ``K`` GPUs for each strategy (docs/design.md section 2), the
per-GPU efficiency ``T1(N) / (K * TK(N))`` against one GPU running the whole
sequence (``T1`` predicted by the same model), and checks itself against
measured scaling JSONs.

Each rank's call is replayed op by op, in the library's order, on two GPU
streams (compute, communication) and a host thread (``_Timeline``):

- **Attention kernels** (the fused kernel, one launch per pattern forward, three
  backward). A pattern ``(w', r)`` over ``n`` query rows has ``F = 4 B H D n w'/r^2``
  forward FLOPs (``w'/r`` keys per segment). Forward: ``F / fwd_tflops``; backward:
  ``bwd_launch_us + 2.5 F / bwd_tflops``, both times ``1 + key_penalty min(m, 65536) / 65536``
  for blocks of ``m`` keys (one GPU runs full attention over 65536 keys 12% slower per FLOP than
  over 32768). The launches' fixed cost does not shrink
  with the block, so small ring blocks run at a lower rate than big dense ones.
  Causal: a segment of ``m`` keys costs ``1/2 + causal_keys / (2 m)`` of the unmasked
  one (diagonal tiles and uneven rows: small causal blocks save far less than half).
- **Memory-bound passes** at ``hbm_gbps`` plus ``op_us`` per elementwise op: the
  fp32 pattern combine (bytes ~ tokens x (10 + 10 sum 1/r), ``6 + 5 P`` ops), each
  ring step's merge of its partial into the fp32 running result (``merge.merge_two``:
  50 bytes per compact output element, 32 ops), K/V packing and unpacking, dK/dV
  scratch zeroing and adds, dq/dk/dv accumulator zeroing and casts, the
  head-parallel swap's copies.
- **Links**: a transfer of ``b`` bytes takes ``b / gbps + latency_us``; NVLink
  (``nvlink_gbps``) inside a node of ``gpus_per_node``, InfiniBand (``ib_gbps`` per
  GPU) across nodes. Ring exchanges are posted before the step they overlap (the
  NCCL stream also waits for compute already queued); all-to-alls are not overlapped.
- **Host issue** (``issue_us``): eagerly, the host spends ``issue_us`` on every replayed op (a
  pattern's kernel calls, a pass, a transfer: Python, checks and launches) before the GPU can start
  it, so host-bound stretches (LongNet's short patterns) run at the host's pace. A CUDA graph replay
  has none (``graph_replay``).
- **Waits** (``host_waits``, every entry point takes it; default stream-ordered, what a user
  gets by default): with NCCL and no timeout set, a wait only orders the compute stream. With
  ``host_waits=True`` (NCCL with ``DILATED_ATTENTION_TIMEOUT`` or a ``timeout=`` set; gloo always)
  the host blocks in torch's timed wait, which polls completion every ``poll_ms``
  (``kSynchronizeBusyWaitMillis`` = 1 ms in ProcessGroupNCCL): it wakes on the first poll after
  the transfer ends, and work it then issues to an idle GPU starts ``dispatch_us`` later. A
  scaling JSON says which mode it measured (``meta.waits``; files without it were host-timed).
- **Strategies**: ring (rank ``K-1``, the slowest when causal, is replayed; with ``balanced``,
  the zigzag order, and on rings of full rows of at least ``ring.routes.Tuning.share_min_rows`` and at most
  ``Tuning.share_max_ranks`` ranks, which share their cross blocks, every step after its own is half
  a block (a helper runs one guest's backward per idle step, ``ring.cross_share.Helper``; files measured before
  that say ``meta.share_guests = "at_once"`` or nothing: there the first rank ran every guest's at its first
  idle step, ``guests_at_once``, which held back the dK/dV accumulator passing it, the last rank's own, by
  ``G - 2`` half blocks); causal dilated rings whose ranks divide the heads run head-parallel, ``ring/swapped.py``: the
  segment's compact rows of ``1/G`` of the heads gathered by one all-to-all, computed whole, sent home),
  head (Ulysses: four all-to-alls and copies, then the whole sequence for ``H/K``
  heads), hybrid (all-to-all inside teams of ``A``, ring across teams on ``A L`` rows with ``H/A`` heads).

Constants: ``fit`` moves the kernel and memory constants (and, on eager records, ``issue_us``) to
whole-call measurements (one-GPU references and multi-GPU records of scaling JSONs, each replayed in
the wait mode it was measured with); ``calibrate`` solves them linearly from single-GPU runs alone, which needs a kernel
benchmark's partial pipelines to tell launches from passes. Link, latency and poll constants are
documented hardware/software figures. The memory-pass terms are those of a per-pattern fp32
combine and merge; today's code combines compact parts once (``merge.combine_results``), and the
fitted pass constants absorb the difference (one-GPU LongNet calls at N = 32768 come out about
12% slow).

Command line (predictions, ``--validate``, ``--fit``, ``--calibrate``): ``benchmarks/cost_model.py``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Sequence

from dilated_attention.patterns import hybrid_team_size, longnet_offsets
from dilated_attention.ring import routes

STRATEGIES = ("ring", "head", "hybrid")
LONGNET_SEGMENTS = (2048, 8192, 32768, 131072)  # followed by N itself
LONGNET_RATES = (1, 2, 4, 8, 16)
# The benchmark's set-up, for what a scaling JSON's meta leaves out.
DEFAULT_META = {"heads": 16, "kv_heads": 16, "head_dim": 128, "batch": 1, "dtype_bytes": 2,
                "longnet_segments": list(LONGNET_SEGMENTS), "longnet_rates": list(LONGNET_RATES)}


@dataclass(frozen=True)
class Hardware:
    """Model constants (the H200's by default). Kernel and memory figures: ``fit`` (``benchmarks/cost_model.py
    --fit ... --impl ours+graph``) on the CUDA-graph records of ``tests/data/cost_model_h200_x{1,2}.json`` (2 x H200,
    bf16, D=128, 16 heads, flash-attn-4 installed, stream-ordered waits): the four one-GPU references at N = 32768
    and 65536 and the eight K=2 records, each constant kept inside its ``PLAUSIBLE`` range, with the forward held
    at flash4's measured rate on full attention (``kernel_h200.json``: 642 TFLOP/s; whole calls determine only
    the sum of the forward and backward terms). Replays have no host launch time, so the launch and dispatch terms
    sit at their floor and ``issue_us`` at 0 (a replay); ``H200`` adds the eager host time, fitted alone
    (``--fit ... --names issue_us``) on the same files' eager records. Links: H200 nodes of 8
    GPUs on NVLink (NV18, 450 GB/s per direction nominal, about 350 achievable by NCCL), one
    InfiniBand NDR 400 Gb/s NIC per GPU (50 GB/s), 20 us per message: documented figures, not
    fitted. ``poll_ms``: torch's timed-wait poll (1 ms)."""

    fwd_tflops: float = 642.0  # attention forward (flash4's full-attention rate)
    bwd_tflops: float = 600.3  # attention backward, on 2.5x the forward FLOPs
    bwd_launch_us: float = 1.0  # fixed GPU time of one pattern's backward (3 launches)
    causal_keys: float = 258.2  # causal segment of m keys costs 1/2 + causal_keys / (2 m) of unmasked
    key_penalty: float = 0.0  # kernel time x (1 + key_penalty x min(keys, 65536) / 65536): long blocks slower
    hbm_gbps: float = 3369.0  # elementwise/copy passes
    op_us: float = 3.36  # per elementwise op of those passes
    dispatch_us: float = 1.0  # host work before a call's first kernel (or after a host wake-up)
    issue_us: float = 0.0  # host work to issue one replayed op eagerly (none in a CUDA graph replay; H200: 442)
    nvlink_gbps: float = 350.0
    ib_gbps: float = 50.0
    gpus_per_node: int = 8
    latency_us: float = 20.0
    poll_ms: float = 1.0
    memory_gib: float = 139.0  # usable HBM per GPU (H200: 141 GB nominal)

    def __post_init__(self) -> None:
        for name in ("fwd_tflops", "bwd_tflops", "hbm_gbps", "nvlink_gbps", "ib_gbps", "poll_ms", "memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("bwd_launch_us", "causal_keys", "key_penalty", "op_us", "dispatch_us", "issue_us", "latency_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")


# 2 x H100 80GB, fitted as the defaults are, on ``tests/data/cost_model_h100_x{1,2}.json`` (flash-attn-4 installed),
# with the forward held at flash4's measured rate on full attention (``kernel_h100.json``: 654 TFLOP/s). Links as
# for the H200 (NVLink 4, NDR).
H100 = Hardware(fwd_tflops=654.0, bwd_tflops=586.0, bwd_launch_us=1.0, causal_keys=792.0, key_penalty=0.0,
                hbm_gbps=2788.0, op_us=5.65, dispatch_us=1.0, issue_us=414.0, memory_gib=79.0)
H200 = Hardware(issue_us=442.0)  # the defaults with the eager host time fitted on the same files
PRESETS = {"h200": H200, "h100": H100}  # the constants ``--gpu`` names
IMPLS = ("ours", "ours+graph")  # a scaling JSON's records of the library: eager, or timed as CUDA graph replays


def graph_replay(hw: Hardware) -> Hardware:
    """``hw`` for a step replayed from a CUDA graph: no host issue time."""
    return replace(hw, issue_us=0.0)


def _for_impl(hw: Hardware, impl: str) -> Hardware:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return graph_replay(hw) if impl == "ours+graph" else hw


@dataclass(frozen=True)
class Problem:
    """One attention call: ``tokens`` is the whole sequence N (all ranks together)."""

    tokens: int
    patterns: tuple[tuple[int, int], ...]  # (segment w, rate r); w is clamped to N
    heads: int = 16
    kv_heads: int | None = None
    head_dim: int = 128
    batch: int = 1
    dtype_bytes: int = 2
    causal: bool = False

    @property
    def hkv(self) -> int:
        return self.kv_heads or self.heads


@dataclass
class Prediction:
    strategy: str
    gpus: int
    compute_ms: float  # busy time of the compute stream (kernels and memory passes), slowest rank
    exposed_comm_ms: float  # the rest of the call: transfers, waits and host issue not hidden behind compute
    ms: float
    t1_ms: float  # one GPU, whole sequence (same model)
    efficiency: float
    memory_gib: float
    fits: bool
    notes: list[str] = field(default_factory=list)
    tokens: int = 0  # the whole sequence N


def longnet_patterns(n: int, segments: Sequence[int] = LONGNET_SEGMENTS,
                     rates: Sequence[int] = LONGNET_RATES) -> list[tuple[int, int]]:
    """The LongNet configuration ``w = [*segments, N]``, ``r = rates`` for a sequence of ``n``.

    Segments not shorter than ``n`` are dropped and ``n`` itself comes next with the
    next rate, so ``n = 65536`` gives ``[(2048, 1), (8192, 2), (32768, 4), (65536, 8)]``.
    """
    if len(rates) != len(segments) + 1:
        raise ValueError(f"rates needs one more entry than segments (the last pattern is N), "
                         f"got {len(segments)} segments and {len(rates)} rates")
    kept = [(w, r) for w, r in zip(segments, rates) if w < n]
    return kept + [(n, rates[len(kept)])]


def config_patterns(config: str, n: int, segments: Sequence[int] = LONGNET_SEGMENTS,
                    rates: Sequence[int] = LONGNET_RATES) -> list[tuple[int, int]]:
    """``"longnet"`` (see ``longnet_patterns``) or ``"full"`` (one pattern ``(N, 1)``)."""
    if config == "full":
        return [(n, 1)]
    if config == "longnet":
        return longnet_patterns(n, segments, rates)
    raise ValueError(f"config must be 'longnet' or 'full', got {config!r}")


def pattern_flops(rows: float, segment: float, rate: int, *, heads: int, head_dim: int,
                  batch: int = 1, causal: bool = False) -> float:
    """Forward FLOPs of one pattern over ``rows`` query rows cut in segments of ``segment`` (unmasked
    work halved when causal: the FLOP count, not the time; see ``causal_factor``)."""
    flops = 4.0 * batch * heads * head_dim * rows * segment / rate**2
    return flops / 2 if causal else flops


def packed_pairs(heads: int, kv_heads: int, rate: int, head_range: tuple[int, int] | None = None) -> int:
    """Distinct (kv head, offset) pairs the query heads in ``head_range`` read (what a ring packs)."""
    group = heads // kv_heads
    offsets = longnet_offsets(heads, rate)
    h0, h1 = head_range or (0, heads)
    return len({(h // group, offsets[h]) for h in range(h0, h1)})


def offset_runs(heads: int, rate: int, head_range: tuple[int, int] | None = None) -> int:
    """Runs of consecutive heads sharing an offset (a ring packs and unpacks one chunk per run)."""
    offsets = longnet_offsets(heads, rate)
    h0, h1 = head_range or (0, heads)
    return 1 + sum(offsets[h] != offsets[h - 1] for h in range(h0 + 1, h1))


# -- terms -------------------------------------------------------------------------------------------


def causal_factor(keys: float, hw: Hardware) -> float:
    """Time of a causal segment of ``keys`` keys over the unmasked one: ``1/2 + causal_keys / (2 keys)``."""
    return min(1.0, 0.5 + hw.causal_keys / (2.0 * keys))


def key_factor(keys: float, hw: Hardware) -> float:
    """Time per FLOP over blocks of ``keys`` keys relative to short blocks: ``1 + key_penalty keys / 65536``,
    held at its value for 65536 keys beyond (the longest blocks measured: no extrapolation)."""
    return 1.0 + hw.key_penalty * min(keys, 65536) / 65536


def kernel_fwd_ms(flops: float, keys: float, causal: bool, hw: Hardware) -> float:
    """One pattern's forward launch over blocks of ``keys`` keys; ``flops`` unmasked."""
    return flops * (causal_factor(keys, hw) if causal else 1.0) * key_factor(keys, hw) / (hw.fwd_tflops * 1e9)


def kernel_bwd_ms(flops: float, keys: float, causal: bool, hw: Hardware) -> float:
    """One pattern's backward (delta, dq, dk/dv launches); ``flops`` are the unmasked forward FLOPs."""
    work = 2.5 * flops * (causal_factor(keys, hw) if causal else 1.0) * key_factor(keys, hw)
    return hw.bwd_launch_us / 1e3 + work / (hw.bwd_tflops * 1e9)


def pass_ms(nbytes: float, ops: int, hw: Hardware) -> float:
    """Memory-bound elementwise/copy passes: bytes read + written, and the number of ops."""
    return nbytes / (hw.hbm_gbps * 1e6) + ops * hw.op_us / 1e3


def combine_terms(rows: float, heads: int, rates: Sequence[int], head_dim: int, batch: int = 1,
                  dtype_bytes: int = 2) -> tuple[float, int]:
    """(bytes, ops) of the fp32 pattern combine over ``rows`` x ``heads``: an lse pass and an output
    pass per pattern (rows ``1/r`` of the output each), the zero fill and the cast."""
    n = batch * rows * heads
    o = n * head_dim
    nbytes = n * (18 + sum(40.0 / r for r in rates)) + o * (4 + (4 + dtype_bytes)
                                                            + sum((8 + dtype_bytes) / r for r in rates))
    return nbytes, 6 + 5 * len(rates)


def merge_terms(rows: float, heads: int, head_dim: int, batch: int = 1, dtype_bytes: int = 2) -> tuple[float, int]:
    """(bytes, ops) of one ``merge.merge_two`` of a ring step's partial into the fp32 running one."""
    n = batch * rows * heads
    return n * head_dim * (48 + dtype_bytes) + 240 * n, 32


def accumulator_terms(rows: float, heads: int, kv_heads: int, head_dim: int, batch: int = 1,
                      dtype_bytes: int = 2) -> tuple[tuple[float, int], tuple[float, int]]:
    """((bytes, ops) zeroing fp32 dq/dk/dv, (bytes, ops) casting them to the input dtype)."""
    e = batch * rows * (heads + 2 * kv_heads) * head_dim
    return (4 * e, 3), ((4 + dtype_bytes) * e, 3)


def transfer_ms(nbytes: float, gbps: float, hw: Hardware) -> float:
    """One message of ``nbytes`` over a link of ``gbps`` (GB/s), plus the per-message latency."""
    return nbytes / (gbps * 1e6) + hw.latency_us / 1e3


def _ring_link(span_ranks: int, hw: Hardware) -> float:
    """Bandwidth of a ring over ``span_ranks`` consecutive ranks (rings start at multiples of their size)."""
    return hw.nvlink_gbps if span_ranks <= hw.gpus_per_node else hw.ib_gbps


def alltoall_ms(nbytes_per_rank: float, ranks: int, hw: Hardware) -> float:
    """One all-to-all where every rank holds ``nbytes_per_rank`` and keeps 1/ranks of it."""
    if ranks == 1:
        return 0.0
    on_node = min(ranks, hw.gpus_per_node)
    intra = nbytes_per_rank * (on_node - 1) / ranks
    inter = nbytes_per_rank * (ranks - on_node) / ranks
    return max(intra / (hw.nvlink_gbps * 1e6), inter / (hw.ib_gbps * 1e6)) + hw.latency_us / 1e3


class _Timeline:
    """A compute stream, a communication stream and the host thread of one rank.

    The host spends ``issue_us`` issuing each op (eagerly) and blocks in host-timed waits; work
    issued after the compute stream ran dry starts ``dispatch_us`` later. A transfer starts when the
    communication stream is free and the compute work queued before it is done.
    """

    def __init__(self, hw: Hardware, host_waits: bool = False) -> None:
        self.hw, self.host_waits = hw, host_waits
        self.compute = hw.dispatch_us / 1e3  # the call's own host work before its first kernel
        self.comm = 0.0
        self.host = 0.0
        self.busy = 0.0

    def run(self, ms: float) -> None:
        self.host += self.hw.issue_us / 1e3
        start = self.compute if self.compute >= self.host else self.host + self.hw.dispatch_us / 1e3
        self.compute = start + ms
        self.busy += ms

    def send(self, ms: float) -> float:
        """Post a transfer; returns when it ends."""
        self.host += self.hw.issue_us / 1e3
        self.comm = max(self.comm, self.compute, self.host) + ms
        return self.comm

    def wait(self, end: float) -> None:
        if self.host_waits and end > self.host:  # first poll at once, then every poll_ms
            self.host += self.hw.poll_ms * math.ceil((end - self.host) / self.hw.poll_ms - 1e-9)
        self.compute = max(self.compute, end)

    @property
    def end(self) -> float:
        return max(self.compute, self.host)


@dataclass(frozen=True)
class _Layout:
    """What one rank computes: ``rows`` query rows of ``heads`` query heads (global heads
    ``[head0, head0 + heads)``) and ``kv_heads`` kv heads; rings join ``stride``-spaced ranks."""

    rows: float
    heads: int
    kv_heads: int
    head0: int = 0
    stride: int = 1


def _local_kv_heads(p: Problem, team: int) -> int:
    """``HeadSplit.local_kv_heads``: split, one per rank, or expanded to one per query head."""
    if p.hkv % team == 0:
        return p.hkv // team
    return 1 if team % p.hkv == 0 else p.heads // team


def _attention(tl: _Timeline, p: Problem, lay: _Layout, hw: Hardware, direction: str, balanced: bool,
               share_rows: int | None, swap: tuple[bool, bool], guests_at_once: bool = False) -> None:
    """Replay forward or backward of every pattern (local, or a ring on the slowest rank)."""
    d, e, b = p.head_dim, p.dtype_bytes, p.batch
    if direction == "bwd":
        tl.run(pass_ms(*accumulator_terms(lay.rows, lay.heads, lay.kv_heads, d, b, e)[0], hw))
    for w, r in p.patterns:
        w = min(w, p.tokens)
        if w <= lay.rows:  # local: one launch over rows / w segments
            flops = pattern_flops(lay.rows, w, r, heads=lay.heads, head_dim=d, batch=b)
            kernel = kernel_fwd_ms if direction == "fwd" else kernel_bwd_ms
            tl.run(kernel(flops, w / r, p.causal, hw))
            continue
        g, m = max(1, round(w / lay.rows)), lay.rows / r  # ring of g ranks, m dilated rows per block
        heads_range = (lay.head0, lay.head0 + lay.heads)
        pairs = packed_pairs(p.heads, p.hkv, r, heads_range)
        if swap[p.causal] and r > 1 and not balanced and pairs == lay.kv_heads \
                and lay.heads % g == 0 and lay.kv_heads % g == 0:  # ring.routes._swap_members
            _swapped(tl, p, lay, hw, direction, g, m)
            continue
        half = b * m * pairs * d  # elements of K (or V) of a block
        runs = offset_runs(p.heads, r, heads_range)
        link = _ring_link(g * lay.stride, hw)
        block_flops = pattern_flops(m, m, 1, heads=lay.heads, head_dim=d, batch=b)
        tl.run(pass_ms(2 * half * 2 * e, 2 * runs, hw))  # pack_kv: read + write both halves
        pos = g - 1  # the last rank of the ring: sees every earlier block when causal
        shared = share_rows is not None and r == 1 and lay.rows >= share_rows and g <= routes.TUNING.share_max_ranks  # routes.plan_share
        seen, grads_end = 0, None
        for step in range(g):
            kv_end = tl.send(transfer_ms(2 * half * e, link, hw)) if step < g - 1 else None
            src = (pos - step) % g
            own, hidden = src == pos, p.causal and src > pos
            causal_block = p.causal and own
            flops = block_flops / 2 if (p.causal and (balanced or shared) and not own) else block_flops
            if direction == "fwd":
                if not hidden:
                    tl.run(kernel_fwd_ms(flops, m, causal_block, hw))
                    if seen:
                        tl.run(pass_ms(*merge_terms(m, lay.heads, d, b, e), hw))
                    seen += 1
            else:
                if not hidden:
                    tl.run(pass_ms(2 * half * 4, 1, hw))  # scratch.zero_()
                    tl.run(kernel_bwd_ms(flops, m, causal_block, hw))
                if step > 0:
                    tl.wait(grads_end)
                    if not hidden:
                        tl.run(pass_ms(2 * half * 12, 1, hw))  # incoming.add_(scratch)
                grads_end = tl.send(transfer_ms(2 * half * 4, link, hw))  # fp32 dK/dV accumulator
            if kv_end is not None:
                tl.wait(kv_end)
        if direction == "bwd":
            if shared and p.causal and guests_at_once and g > 2:  # it passed the first rank at its guests' step
                grads_end += (g - 2) * kernel_bwd_ms(block_flops / 2, m, False, hw)
            tl.wait(grads_end)  # our own block's accumulator is home
            tl.run(pass_ms(2 * half * 12, 2 * runs, hw))  # unpack_add_
    if direction == "fwd":
        rates = [r for _, r in p.patterns]
        tl.run(pass_ms(*combine_terms(lay.rows, lay.heads, rates, d, b, e), hw))
    else:
        tl.run(pass_ms(*accumulator_terms(lay.rows, lay.heads, lay.kv_heads, d, b, e)[1], hw))


def _swapped(tl: _Timeline, p: Problem, lay: _Layout, hw: Hardware, direction: str, g: int, m: float) -> None:
    """A ring pattern run head-parallel (``ring/swapped.py``) on ``g`` ranks of ``m`` compact rows each: its compact
    q, k, v (backward: and out, dO) packed and sent, the whole segment computed for ``1/g`` of the heads, the
    results packed and sent home (lse left out: ``1/D`` of a tensor)."""
    d, e, b = p.head_dim, p.dtype_bytes, p.batch
    q, kv = b * m * lay.heads * d * e, b * m * lay.kv_heads * d * e  # bytes of a compact q, and of k (or v)
    fwd = direction == "fwd"
    (out, n_out), (home, n_home) = ((q + 2 * kv, 3), (q, 2)) if fwd else ((3 * q + 2 * kv, 6), (q + 2 * kv, 3))
    tl.run(pass_ms(4 * out, 2 * n_out, hw))  # compact copies, then into the send buffer
    tl.wait(tl.send(alltoall_ms(out, g, hw)))
    tl.run(pass_ms(2 * out, n_out, hw))  # the rows out of the received buffer
    flops = pattern_flops(g * m, g * m, 1, heads=lay.heads // g, head_dim=d, batch=b)
    tl.run((kernel_fwd_ms if fwd else kernel_bwd_ms)(flops, g * m, p.causal, hw))
    tl.run(pass_ms(2 * home, n_home, hw))
    tl.wait(tl.send(alltoall_ms(home, g, hw)))
    tl.run(pass_ms(2 * home, n_home, hw))


def _swap(tl: _Timeline, nbytes: float, team: int, before: tuple[float, int], after: tuple[float, int],
          hw: Hardware) -> None:
    """A head-parallel all-to-all of ``nbytes`` per rank: copies, the exchange (not overlapped), copies."""
    tl.run(pass_ms(*before, hw))
    tl.wait(tl.send(alltoall_ms(nbytes, team, hw)))
    tl.run(pass_ms(*after, hw))


def rank_ms(p: Problem, gpus: int, team: int, hw: Hardware, *, balanced: bool = False,
            host_waits: bool = False, share_rows: int | None = routes.TUNING.share_min_rows,
            swap: tuple[bool, bool] | None = None, guests_at_once: bool = False) -> tuple[float, float]:
    """(ms, compute-stream busy ms) of one forward+backward on the slowest rank: all-to-all inside
    teams of ``team`` ranks (1: none), then every pattern locally or as a ring across teams."""
    tl = _Timeline(hw, host_waits)
    swap = (routes.TUNING.swaps_rings(False), routes.TUNING.swaps_rings(True)) if swap is None else swap
    local = p.tokens / gpus
    hl, hk = p.heads // team, _local_kv_heads(p, team)
    lay = _Layout(local * team, hl, hk, head0=(team - 1) * hl, stride=team)  # last lane of the last team
    qkv = p.batch * local * team * (hl + 2 * hk) * p.head_dim * p.dtype_bytes  # the swap's send buffer
    out = p.batch * local * p.heads * p.head_dim * p.dtype_bytes
    if team > 1:  # q/k/v to heads: build the send buffer; received rows reshaped, q/k/v made contiguous
        _swap(tl, qkv, team, (2 * qkv, 3), (4 * qkv, 4), hw)
    _attention(tl, p, lay, hw, "fwd", balanced, share_rows, swap, guests_at_once)
    if team > 1:  # output back to sequence
        _swap(tl, out, team, (2 * out, 1), (2 * out, 1), hw)
        _swap(tl, out, team, (2 * out, 1), (2 * out, 1), hw)  # backward: dout to heads
    _attention(tl, p, lay, hw, "bwd", balanced, share_rows, swap, guests_at_once)
    if team > 1:  # dq/dk/dv: cat, contiguous; received heads merged
        _swap(tl, qkv, team, (4 * qkv, 2), (2 * qkv, 3), hw)
    return tl.end, tl.busy


def single_gpu_ms(p: Problem, hw: Hardware) -> float:
    """T1: the whole sequence on one GPU, all patterns local."""
    return rank_ms(p, 1, 1, hw)[0]


def hybrid_team(gpus: int, heads: int, hw: Hardware) -> int | None:
    """The hybrid's all-to-all team size, as ``planning.team_size`` picks it: a node when
    the job spans nodes and a node's GPUs divide the heads, else the largest proper divisor
    of ``gpus`` that divides the heads; None when there is none (then it is not a hybrid)."""
    return hybrid_team_size(gpus, heads, hw.gpus_per_node)


def memory_gib(p: Problem, tokens_per_gpu: float) -> float:
    """Rough peak per GPU: q, k, v, out, dout, dq, dk, dv (input dtype) plus 40% headroom."""
    per_token = (6 * p.heads + 2 * 2 * p.hkv) * p.head_dim * p.dtype_bytes
    return 1.4 * p.batch * tokens_per_gpu * per_token / 2**30


def predict(p: Problem, gpus: int, strategy: str = "ring", hw: Hardware = H200,
            *, balanced: bool = False, host_waits: bool = False, share_rows: int | None = routes.TUNING.share_min_rows,
            swap: tuple[bool, bool] | None = None, guests_at_once: bool = False) -> Prediction | None:
    """Predicted forward+backward on ``gpus`` GPUs, or None where the strategy cannot run.

    ``balanced``: causal rings in zigzag order (``layout="zigzag"``: every step half a block).
    ``share_rows``: causal rings on full rows of at least this many share their cross blocks (``ring.routes.Share``;
    ``None``: none do, the code before sharing). ``guests_at_once``: their first rank runs every guest's backward at
    its first idle step (the order of files measured before ``ring.cross_share.Helper``); default: one guest per idle
    step, the library's order.
    ``swap``: (non-causal, causal) whether dilated rings whose ranks divide the heads run head-parallel
    (``ring/swapped.py``); ``None``: as ``ring.routes.Tuning.swapped_rings`` says.
    ``host_waits``: every exchange waited for on the host; default stream-ordered (module doc).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    t1 = single_gpu_ms(p, hw)
    notes: list[str] = []
    if gpus == 1:
        ms, busy = t1, t1
    else:
        if strategy == "ring":
            team = 1
        elif strategy == "head":
            if p.heads % gpus:
                return None
            team = gpus
        else:
            team = hybrid_team(gpus, p.heads, hw)
            if team is None:
                return None
            notes.append(f"a2a teams of {team}")
        ms, busy = rank_ms(p, gpus, team, hw, balanced=balanced, host_waits=host_waits, share_rows=share_rows,
                           swap=swap, guests_at_once=guests_at_once)
    mem = memory_gib(p, p.tokens / gpus)
    return Prediction(strategy, gpus, busy, ms - busy, ms, t1, t1 / (gpus * ms), mem, mem <= hw.memory_gib, notes,
                      p.tokens)


def best(p: Problem, gpus: int, hw: Hardware = H200, *, balanced: bool = False,
         host_waits: bool = False) -> Prediction:
    """The fastest feasible strategy by this model (``auto_strategy.py`` holds what was measured)."""
    preds = [x for s in STRATEGIES
             if (x := predict(p, gpus, s, hw, balanced=balanced, host_waits=host_waits)) is not None]
    return min(preds, key=lambda x: x.ms)


# -- calibration on single-GPU measurements ---------------------------------------------------------

# The constants ``calibrate`` fits (the model is linear in them for a fixed ``causal_keys``).
_FITTED = ("fwd_tflops", "bwd_tflops", "bwd_launch_us", "hbm_gbps", "op_us", "dispatch_us")


def _single_terms(p: Problem, causal_keys: float, *, key_penalty: float = 0.0, fwd: bool = True, bwd: bool = True,
                  combine: bool = True, casts: bool = True, dispatch: bool = True) -> list[float]:
    """Coefficients of (1/fwd_tflops, 1/bwd_tflops, bwd_launch_us, 1/hbm_gbps, op_us, dispatch_us) in the
    single-GPU time of ``p`` (ms), for the parts of the call a single-GPU benchmark timed."""
    unit = Hardware(fwd_tflops=1.0, bwd_tflops=1.0, causal_keys=causal_keys, key_penalty=key_penalty)
    d, e, b, n = p.head_dim, p.dtype_bytes, p.batch, p.tokens
    t = [0.0] * 6
    for w, r in p.patterns:
        w = min(w, n)
        flops = pattern_flops(n, w, r, heads=p.heads, head_dim=d, batch=b)
        factor = (causal_factor(w / r, unit) if p.causal else 1.0) * key_factor(w / r, unit)
        if fwd:
            t[0] += flops * factor / 1e9
        if bwd:
            t[1] += 2.5 * flops * factor / 1e9
            t[2] += 1e-3
    passes = []
    if combine:
        passes.append(combine_terms(n, p.heads, [r for _, r in p.patterns], d, b, e))
    if bwd:
        zero, cast = accumulator_terms(n, p.heads, p.hkv, d, b, e)
        passes += [zero] + ([cast] if casts else [])
    for nbytes, ops in passes:
        t[3] += nbytes / 1e6
        t[4] += ops / 1e3
    t[5] = 1e-3 if dispatch else 0.0
    return t


def _to_hardware(x: Sequence[float], causal_keys: float, base: Hardware) -> Hardware:
    return replace(base, fwd_tflops=1 / x[0], bwd_tflops=1 / x[1], bwd_launch_us=x[2], hbm_gbps=1 / x[3],
                   op_us=x[4], dispatch_us=x[5], causal_keys=causal_keys)


def _solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares of relative errors (each row divided by its measurement), columns scaled."""
    a = [[v / y for v in row] for row, y in zip(rows, ys)]
    k = len(a[0])
    scale = [max(abs(row[j]) for row in a) or 1.0 for j in range(k)]
    a = [[row[j] / scale[j] for j in range(k)] for row in a]
    m = [[sum(row[i] * row[j] for row in a) for j in range(k)] + [sum(row[i] for row in a)] for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting on the normal equations
        piv = max(range(col, k), key=lambda i: abs(m[i][col]))
        m[col], m[piv] = m[piv], m[col]
        for i in range(k):
            if i != col and m[col][col]:
                f = m[i][col] / m[col][col]
                m[i] = [vi - f * vc for vi, vc in zip(m[i], m[col])]
    return [m[i][k] / m[i][i] / scale[i] if m[i][i] else 0.0 for i in range(k)]


def single_gpu_samples(paths: Sequence[str]) -> list[tuple[str, Problem, dict, float]]:
    """(name, problem, timed parts, ms) of every single-GPU measurement of the library in ``paths``:
    ``single_gpu`` entries of scaling JSONs (whole API calls), and the fused kernel's pipelines and
    full-attention API rows of a kernel benchmark JSON (``kernel_<gpu>.json``)."""
    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            continue
        meta = data.get("meta", {})
        if "single_gpu" in meta:
            segs = meta.get("longnet_segments", LONGNET_SEGMENTS)
            rates = meta.get("longnet_rates", LONGNET_RATES)
            for s in meta["single_gpu"]:
                if s.get("impl") != "ours" or s.get("error") or not s.get("ms"):
                    continue
                n = s["tokens"]
                p = Problem(n, tuple(config_patterns(s["config"], n, segs, rates)), heads=meta["heads"],
                            kv_heads=meta.get("kv_heads"), head_dim=meta["head_dim"], batch=meta["batch"],
                            dtype_bytes=meta.get("dtype_bytes", 2), causal=s["causal"])
                out.append((f"{os.path.basename(path)}: {s['config']} causal={s['causal']} N={n}", p, {}, s["ms"]))
        elif "rows" in data and "shape" in meta:
            shape = meta["shape"]
            bsz, n, heads, dim = (shape[k] for k in "BNHD") if isinstance(shape, dict) else shape
            pats = tuple(zip(meta["segment_lengths"], meta["dilation_rates"]))
            parts = {"fwd kernel": dict(bwd=False, combine=False, dispatch=False),
                     "bwd kernel (+acc zero)": dict(fwd=False, combine=False, casts=False, dispatch=False),
                     "fwd pipeline": dict(bwd=False, dispatch=False),
                     "fwd+bwd pipeline": dict(casts=False, dispatch=False),
                     "api fwd+bwd": {}}
            for r in data["rows"]:
                if r.get("method") == "fused" and r.get("kind") in parts and r.get("ms"):
                    p = Problem(n, pats, heads=heads, head_dim=dim, batch=bsz, causal=r["causal"])
                    out.append((f"{os.path.basename(path)}: longnet {r['kind']} causal={r['causal']}", p,
                                parts[r["kind"]], r["ms"]))
            for r in data.get("full_attention", []):
                if r.get("method") == "full-fused" and r.get("ms"):
                    p = Problem(n, ((n, 1),), heads=heads, head_dim=dim, batch=bsz, causal=r["causal"])
                    kind = {"fwd": dict(bwd=False), "fwd+bwd": {}}[r["kind"]]
                    out.append((f"{os.path.basename(path)}: full {r['kind']} causal={r['causal']}", p, kind, r["ms"]))
    return out


def calibrate(paths: Sequence[str], base: Hardware = Hardware(),
              causal_keys: Sequence[float] = tuple(range(0, 3001, 25))) -> tuple[Hardware, list[dict]]:
    """Fit the kernel and memory constants to single-GPU measurements only (see ``single_gpu_samples``).

    Least squares of relative errors; ``causal_keys`` by grid search. Returns the fitted
    hardware (links and the rest from ``base``) and, per measurement, measured vs modelled ms.
    """
    samples = single_gpu_samples(paths)
    if len(samples) < len(_FITTED) + 1:
        raise ValueError(f"need at least {len(_FITTED) + 1} single-GPU measurements, found {len(samples)} in {paths}")
    ys = [ms for *_, ms in samples]
    fits = []
    for ck in causal_keys:
        rows = [_single_terms(p, ck, key_penalty=base.key_penalty, **parts) for _, p, parts, _ in samples]
        x = _solve(rows, ys)
        if min(x[0], x[1], x[3]) <= 0 or min(x[2], x[4], x[5]) < 0:
            continue  # unphysical (a negative cost): not a candidate
        err = sum((sum(a * b for a, b in zip(row, x)) / y - 1) ** 2 for row, y in zip(rows, ys))
        fits.append((err, ck, x, rows))
    if not fits:
        raise ValueError("no physical fit (every candidate needs a negative cost)")
    _, ck, x, rows = min(fits, key=lambda f: f[0])
    hw = _to_hardware(x, ck, base)
    report = [{"name": name, "measured_ms": y, "model_ms": sum(a * b for a, b in zip(row, x))}
              for (name, *_), row, y in zip(samples, rows, ys)]
    return hw, report


# -- validation against measured scaling JSONs ------------------------------------------------------


def _records(path: str) -> tuple[dict, list[dict]]:
    """(meta, records) of a scaling JSON (``bench_scaling.py``)."""
    with open(path) as f:
        data = json.load(f)
    given = data.get("meta", {})
    meta = dict(DEFAULT_META, kv_heads=given.get("kv_heads"), **{k: v for k, v in given.items() if k != "kv_heads"})
    return meta, data.get("records", [])


def file_host_waits(meta: dict) -> bool:
    """Whether a scaling JSON was measured with host-timed waits: its ``meta.waits``; files without it
    (written before the benchmark recorded the mode) ran with ``DILATED_ATTENTION_TIMEOUT`` set: host."""
    return meta.get("waits", "host") == "host"


def file_share_rows(meta: dict) -> int | None:
    """The ``ring.routes.Tuning.share_min_rows`` a scaling JSON was measured with (``meta.share_min_rows``); files without it
    were measured before causal rings shared their cross blocks: ``None``."""
    return meta.get("share_min_rows")


def file_guests_at_once(meta: dict) -> bool:
    """Whether a scaling JSON's shared causal rings ran every guest's backward at the first idle step
    (``meta.share_guests``: ``"at_once"``, what files without it measured, or ``"spread"``: one per idle step)."""
    return meta.get("share_guests", "at_once") == "at_once"


def file_swap(meta: dict) -> tuple[bool, bool]:
    """The ``ring.routes.Tuning.swapped_rings`` (non-causal, causal) a scaling JSON was measured with (``meta.swap_compact``);
    files without it were measured before dilated rings ran head-parallel: neither."""
    return tuple(meta.get("swap_compact", (False, False)))


def _problem(meta: dict, config: str, causal: bool, n: int) -> Problem:
    return Problem(n, tuple(config_patterns(config, n, meta["longnet_segments"], meta["longnet_rates"])),
                   heads=meta["heads"], kv_heads=meta.get("kv_heads"), head_dim=meta["head_dim"],
                   batch=meta["batch"], dtype_bytes=meta.get("dtype_bytes", 2), causal=causal)


def _multi_records(meta: dict, records: list[dict], impl: str = "ours") -> list[dict]:
    """Timed multi-GPU records of the library (``impl``: ``"ours"``, or ``"ours+graph"`` for the step timed as CUDA
    graph replays) in a strategy the model replays (contiguous shards)."""
    return [r for r in records if r["impl"] == impl and r["gpus"] >= 2 and r.get("efficiency") is not None
            and r["strategy"] in STRATEGIES and "max_tokens" not in r
            and r.get("layout", "contiguous") == "contiguous"]


def validate(paths: Sequence[str], hw: Hardware = H200, *, host_waits: bool | None = None,
             impl: str = "ours") -> list[dict]:
    """Compare predicted with measured efficiency (and ms) for every multi-GPU record of ``impl`` (``ours``, or
    ``ours+graph``: ``bench_scaling.py --cuda-graph``'s replays, modelled without host issue time).

    Efficiency is ``T1 / (K TK)`` on both sides: measured T1 and TK from the file, predicted
    ones from the model. ``host_waits``: the wait mode to model; None takes each file's own
    (``file_host_waits``).
    """
    rows, hw = [], _for_impl(hw, impl)
    for path in paths:
        meta, records = _records(path)
        host = file_host_waits(meta) if host_waits is None else host_waits
        for rec in _multi_records(meta, records, impl):
            n = rec["gpus"] * rec["tokens_per_gpu"]
            pred = predict(_problem(meta, rec["config"], rec["causal"], n), rec["gpus"], rec["strategy"], hw,
                           balanced=bool(meta.get("balanced")), host_waits=host, share_rows=file_share_rows(meta),
                           swap=file_swap(meta), guests_at_once=file_guests_at_once(meta))
            if pred is None:
                continue
            rows.append({"file": path, "config": rec["config"], "causal": rec["causal"],
                         "strategy": rec["strategy"], "gpus": rec["gpus"], "tokens_per_gpu": rec["tokens_per_gpu"],
                         "waits": "host" if host else "stream",
                         "measured": rec["efficiency"], "predicted": pred.efficiency,
                         "error_pct": 100.0 * (pred.efficiency - rec["efficiency"]) / rec["efficiency"],
                         "measured_ms": rec["ms"], "predicted_ms": pred.ms,
                         "ms_error_pct": 100.0 * (pred.ms - rec["ms"]) / rec["ms"],
                         "measured_t1_ms": rec["efficiency"] * rec["gpus"] * rec["ms"], "predicted_t1_ms": pred.t1_ms})
    return rows


# -- fit on whole calls, one GPU and several ---------------------------------------------------------

# The constants ``fit`` moves by default: the kernel's and memory passes' rates and fixed costs. Links,
# latency and the poll interval stay at their documented figures.
FIT_NAMES = ("fwd_tflops", "bwd_tflops", "bwd_launch_us", "causal_keys", "key_penalty", "hbm_gbps", "op_us",
             "dispatch_us")
# What a fitted constant may be on the GPUs the model describes (H200: 989 dense bf16 TFLOP/s, 4.8 TB/s of
# HBM): the fit stays inside these ranges, so a constant that whole calls cannot pin down stays physical.
PLAUSIBLE = {"fwd_tflops": (150.0, 989.0), "bwd_tflops": (100.0, 989.0), "bwd_launch_us": (1.0, 500.0),
             "causal_keys": (1.0, 4096.0), "key_penalty": (0.0, 1.0), "hbm_gbps": (500.0, 4800.0),
             "op_us": (1.0, 100.0), "dispatch_us": (1.0, 1000.0), "issue_us": (1.0, 2000.0)}


def _nelder_mead(f, x0: list[float], step: float, iters: int) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (the downhill simplex; deterministic, no dependencies)."""
    pts = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12:
            break
        c = [sum(col) / (len(pts) - 1) for col in zip(*pts[:-1])]

        def at(t: float) -> list[float]:
            return [ci + t * (ci - wi) for ci, wi in zip(c, pts[-1])]

        xr = at(1.0)
        fr = f(xr)
        if fr < vals[0]:
            xe = at(2.0)
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = at(-0.5)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:  # shrink towards the best point
                pts = [pts[0]] + [[b + 0.5 * (v - b) for b, v in zip(pts[0], p)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = min(range(len(pts)), key=vals.__getitem__)
    return pts[best], vals[best]


def fit_samples(paths: Sequence[str], impl: str = "ours") -> list[dict]:
    """Every whole-call measurement of the library (records of ``impl``, as ``validate``) in scaling JSONs: the
    one-GPU references (``single_gpu``) and the multi-GPU records, each with its problem and wait mode."""
    out = []
    for path in paths:
        meta, records = _records(path)
        name = os.path.basename(path)
        for s in meta.get("single_gpu", []):
            if s.get("impl") == impl and not s.get("error") and s.get("ms"):
                out.append({"name": f"{name}: T1 {s['config']} causal={s['causal']} N={s['tokens']}", "gpus": 1,
                            "strategy": "ring", "problem": _problem(meta, s["config"], s["causal"], s["tokens"]),
                            "ms": s["ms"], "efficiency": None, "host_waits": False, "share_rows": None,
                            "swap": (False, False), "guests_at_once": True})
        for r in _multi_records(meta, records, impl):
            out.append({"name": f"{name}: {r['strategy']} {r['config']} causal={r['causal']} K={r['gpus']}",
                        "gpus": r["gpus"], "strategy": r["strategy"],
                        "problem": _problem(meta, r["config"], r["causal"], r["gpus"] * r["tokens_per_gpu"]),
                        "ms": r["ms"], "efficiency": r["efficiency"], "host_waits": file_host_waits(meta),
                        "share_rows": file_share_rows(meta), "swap": file_swap(meta),
                        "guests_at_once": file_guests_at_once(meta)})
    return out


def _fit_errors(samples: list[dict], hw: Hardware) -> list[tuple[float, float | None]]:
    """(ms error, efficiency error) per sample, relative; efficiency only for multi-GPU records."""
    out = []
    for s in samples:
        pred = predict(s["problem"], s["gpus"], s["strategy"], hw, host_waits=s["host_waits"],
                       share_rows=s["share_rows"], swap=s["swap"], guests_at_once=s["guests_at_once"])
        if pred is None:
            out.append((1.0, None))
            continue
        eff = None if s["efficiency"] is None else pred.efficiency / s["efficiency"] - 1
        out.append((pred.ms / s["ms"] - 1, eff))
    return out


def fit(paths: Sequence[str], base: Hardware = H200, names: Sequence[str] = FIT_NAMES, *,
        single_weight: float = 1.0, rounds: int = 4, impl: str = "ours") -> tuple[Hardware, list[dict]]:
    """Fit ``names`` to whole calls: least squares of relative errors of every multi-GPU time and
    efficiency, plus ``single_weight`` times those of the one-GPU references, plus the square of the
    worst multi-GPU error (so no record is sacrificed to the mean). Each record is replayed in the
    wait mode it was measured with. Nelder-Mead on log constants, from ``base``, restarted
    ``rounds`` times. Returns the fitted hardware and, per measurement, measured vs model."""
    samples, base = fit_samples(paths, impl), _for_impl(base, impl)
    if impl == "ours+graph" and "issue_us" in names:
        raise ValueError("issue_us is the eager host time: fit it on eager records (impl='ours')")
    if len(samples) <= len(names):
        raise ValueError(f"need more than {len(names)} measurements to fit {len(names)} constants, "
                         f"found {len(samples)} in {paths}")
    floor = {"causal_keys": 1.0, "key_penalty": 0.05, "bwd_launch_us": 1.0, "op_us": 0.1, "dispatch_us": 1.0,
             "issue_us": 1.0}

    def make(x: Sequence[float]) -> Hardware:
        values = {n: math.exp(v) for n, v in zip(names, x)}
        return replace(base, **{n: min(max(v, PLAUSIBLE[n][0]), PLAUSIBLE[n][1]) if n in PLAUSIBLE else v
                                for n, v in values.items()})

    def cost(x: Sequence[float]) -> float:
        try:
            hw = make(x)
        except ValueError:
            return math.inf
        total, worst = 0.0, 0.0
        for s, (e_ms, e_eff) in zip(samples, _fit_errors(samples, hw)):
            if e_eff is None:
                total += single_weight * e_ms**2
                continue
            total += e_ms**2 + e_eff**2
            worst = max(worst, abs(e_ms), abs(e_eff))
        return total + worst**2

    x = [math.log(min(max(getattr(base, n), floor.get(n, 1e-6)), PLAUSIBLE.get(n, (0, math.inf))[1])) for n in names]
    for step in [0.5] + [0.15] * (rounds - 1):
        x, _ = _nelder_mead(cost, x, step, 400 * len(names))
    hw = make(x)
    report = [{"name": s["name"], "measured_ms": s["ms"], "model_ms": s["ms"] * (1 + e_ms),
               "measured_efficiency": s["efficiency"],
               "model_efficiency": None if e_eff is None else s["efficiency"] * (1 + e_eff)}
              for s, (e_ms, e_eff) in zip(samples, _fit_errors(samples, hw))]
    return hw, report


if __name__ == "__main__":  # the model itself; its command line is cost_model.py
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n")[0],
                            epilog="The cost model's library; run benchmarks/cost_model.py for predictions, "
                                   "validation and fits.").parse_args()
    print(__doc__.split("\n")[0] + ": run benchmarks/cost_model.py --help")
