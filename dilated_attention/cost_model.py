"""Cost model for sequence-parallel dilated attention: compute per step vs bytes per step.

Pure arithmetic (no devices, no process groups). It predicts the time of one
forward+backward on ``K`` GPUs for each strategy (DESIGN.md section 2) and the
per-GPU efficiency ``T1(N) / (K * TK(N))`` against one GPU running the whole
sequence, and it checks itself against a measured scaling JSON.

Assumptions (each a CLI option; defaults documented in ``Hardware``):

- Compute. A pattern ``(w', r)`` over ``n`` query rows costs
  ``4 * B * H * D * n * w' / r**2`` forward FLOPs (two matmuls per dilated
  segment of ``w'/r`` rows), half that when causal; backward costs 2.5x forward
  (flash-attention's accounting), so forward+backward is 3.5x. Every block runs
  at one achieved rate (``tflops``); calibrate it from the single-GPU time.
- Ring (per spanning pattern of ring size ``G``, local length ``L``). Each step
  sends the packed dilated K and V of the pattern, ``2 * B * (L/r) * pairs * D``
  elements (``pairs`` = distinct (kv head, offset) pairs), in the input dtype.
  The receive for step ``t+1`` overlaps step ``t``'s compute, so a step costs
  ``max(compute, transfer)``; the last step's compute is exposed. Backward moves
  the blocks again plus fp32 dK/dV accumulators of the same shape every step
  (overlapped with the next step's compute); the last accumulator hop home is
  exposed. Causal without balancing: at step ``t >= 1`` the last rank of the
  ring still computes a full block while others skip, so the ring runs at the
  slowest rank's pace (``c/2 + (G-1) c``); ``balanced=True`` (zigzag order)
  gives every rank ``c/2`` per step. Local patterns and the pattern combine are
  pure compute.
- Head (Ulysses). Four all-to-alls forward (q, k, v, out) and four backward
  (dout, dq, dk, dv), none overlapped; k/v heads are replicated up to ``K`` when
  ``Hkv < K``. Compute is exactly ``T1 / K`` (every rank runs the whole sequence
  for ``H/K`` heads). Needs ``K | H``.
- Hybrid. All-to-all inside teams of ``A`` ranks (a node when the job spans
  nodes, else the largest proper divisor of ``K`` that divides ``H``: the
  library's rule), then the ring across the ``K/A`` teams on the team's ``A*L``
  rows with ``H/A`` heads.
- Links. A ring or all-to-all confined to one node uses NVLink (``nvlink_gbps``
  per GPU per direction); anything crossing nodes is limited by InfiniBand
  (``ib_gbps`` per GPU: NDR 400 Gb/s = 50 GB/s). Every message pays
  ``latency_us``.

Command line::

    python -m dilated_attention.cost_model --tokens 1e9 --gpus 64,128,256,512,1024
    python -m dilated_attention.cost_model --validate benchmarks/results/scaling_*.json
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from dataclasses import dataclass, field, replace
from typing import Sequence

from .patterns import hybrid_team_size, longnet_offsets

FWD_BWD = 3.5  # forward + backward FLOPs over forward FLOPs (backward = 2.5x forward)
STRATEGIES = ("ring", "head", "hybrid")
LONGNET_SEGMENTS = (2048, 8192, 32768, 131072)  # followed by N itself
LONGNET_RATES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Hardware:
    """Calibration inputs. Defaults: H200 nodes of 8 GPUs on NVLink (NV18, 450 GB/s per
    direction nominal, about 350 achievable by NCCL point-to-point), one InfiniBand
    NDR 400 Gb/s NIC per GPU (50 GB/s), and the library's fused kernel at about
    300 TFLOP/s forward+backward on long bf16 blocks (measured: 846 ms for full
    attention over 262144 tokens on 8 x H200 at 97% efficiency)."""

    tflops: float = 300.0
    nvlink_gbps: float = 350.0
    ib_gbps: float = 50.0
    gpus_per_node: int = 8
    latency_us: float = 20.0
    memory_gib: float = 139.0  # usable HBM per GPU (H200: 141 GB nominal)

    def __post_init__(self) -> None:
        for name in ("tflops", "nvlink_gbps", "ib_gbps", "memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.gpus_per_node < 1 or self.latency_us < 0:
            raise ValueError(f"gpus_per_node must be >= 1 and latency_us >= 0, got "
                             f"{self.gpus_per_node} and {self.latency_us}")


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
    compute_ms: float  # per rank, forward + backward, including idle steps of an unbalanced causal ring
    exposed_comm_ms: float  # communication not hidden behind compute
    ms: float
    t1_ms: float  # one GPU, whole sequence
    efficiency: float
    memory_gib: float
    fits: bool
    notes: list[str] = field(default_factory=list)


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
    """Forward FLOPs of one pattern over ``rows`` query rows cut in segments of ``segment``."""
    flops = 4.0 * batch * heads * head_dim * rows * segment / rate**2
    return flops / 2 if causal else flops


def packed_pairs(heads: int, kv_heads: int, rate: int, head_range: tuple[int, int] | None = None) -> int:
    """Distinct (kv head, offset) pairs the query heads in ``head_range`` read (what a ring packs)."""
    group = heads // kv_heads
    offsets = longnet_offsets(heads, rate)
    h0, h1 = head_range or (0, heads)
    return len({(h // group, offsets[h]) for h in range(h0, h1)})


def single_gpu_ms(p: Problem, hw: Hardware) -> float:
    """T1: the whole sequence on one GPU, all patterns local."""
    flops = sum(pattern_flops(p.tokens, min(w, p.tokens), r, heads=p.heads, head_dim=p.head_dim,
                              batch=p.batch, causal=p.causal) for w, r in p.patterns)
    return FWD_BWD * flops / (hw.tflops * 1e9)


def _transfer_ms(nbytes: float, gbps: float, hw: Hardware) -> float:
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


def ring_ms(p: Problem, hw: Hardware, local_len: float, *, head_shards: int = 1,
            balanced: bool = False) -> tuple[float, float]:
    """(compute ms, exposed comm ms) of forward+backward of every pattern on a ring layout.

    Each rank holds ``local_len`` rows of ``H / head_shards`` query heads; with head
    shards (the hybrid) ring neighbours are ``head_shards`` global ranks apart.
    """
    nh = p.heads // head_shards
    rate_ms = 1.0 / (hw.tflops * 1e9)
    compute = exposed = 0.0
    for w, r in p.patterns:
        w = min(w, p.tokens)
        if w <= local_len:
            f = pattern_flops(local_len, w, r, heads=nh, head_dim=p.head_dim, batch=p.batch, causal=p.causal)
            compute += FWD_BWD * f * rate_ms
            continue
        g = round(w / local_len)
        block = pattern_flops(local_len, local_len, r, heads=nh, head_dim=p.head_dim, batch=p.batch) * rate_ms
        if not p.causal:
            steps = [block] * g
        elif balanced:
            steps = [block / 2] * g
        else:  # own block causal, then the last rank of the ring computes a full block every step
            steps = [block / 2] + [block] * (g - 1)
        pairs = max(packed_pairs(p.heads, p.hkv, r, (i * nh, (i + 1) * nh)) for i in range(head_shards))
        elems = 2 * p.batch * (local_len / r) * pairs * p.head_dim
        link = _ring_link(g * head_shards, hw)
        m_kv = _transfer_ms(elems * p.dtype_bytes, link, hw)
        m_grad = _transfer_ms(elems * 4, link, hw)
        fwd = sum(max(c, m_kv) for c in steps[:-1]) + steps[-1]
        bwd_steps = [2.5 * c for c in steps]
        bwd = sum(max(c, m_kv + m_grad) for c in bwd_steps[:-1]) + bwd_steps[-1] + m_grad
        busy = sum(steps) + sum(bwd_steps)
        compute += busy
        exposed += fwd + bwd - busy
    return compute, exposed


def hybrid_team(gpus: int, heads: int, hw: Hardware) -> int | None:
    """The hybrid's all-to-all team size, as ``functional._team_size`` picks it: a node when
    the job spans nodes and a node's GPUs divide the heads, else the largest proper divisor
    of ``gpus`` that divides the heads; None when there is none (then it is not a hybrid)."""
    return hybrid_team_size(gpus, heads, hw.gpus_per_node)


def memory_gib(p: Problem, tokens_per_gpu: float) -> float:
    """Rough peak per GPU: q, k, v, out, dout, dq, dk, dv (input dtype) plus 40% (issue 9's target)."""
    per_token = (6 * p.heads + 2 * 2 * p.hkv) * p.head_dim * p.dtype_bytes
    return 1.4 * p.batch * tokens_per_gpu * per_token / 2**30


def predict(p: Problem, gpus: int, strategy: str = "ring", hw: Hardware = Hardware(),
            *, balanced: bool = False) -> Prediction | None:
    """Predicted forward+backward on ``gpus`` GPUs, or None where the strategy cannot run."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    t1 = single_gpu_ms(p, hw)
    local = p.tokens / gpus
    notes: list[str] = []
    if gpus == 1:
        compute, exposed = t1, 0.0
    elif strategy == "ring":
        compute, exposed = ring_ms(p, hw, local, balanced=balanced)
    elif strategy == "head":
        if p.heads % gpus:
            return None
        kv = max(p.hkv, gpus)  # kv heads replicated up to one per rank
        elems = p.batch * local * p.head_dim
        a2a = 2 * (alltoall_ms(elems * p.heads * p.dtype_bytes, gpus, hw)
                   + alltoall_ms(elems * p.heads * p.dtype_bytes, gpus, hw)
                   + 2 * alltoall_ms(elems * kv * p.dtype_bytes, gpus, hw))
        compute, exposed = t1 / gpus, a2a
    else:
        a = hybrid_team(gpus, p.heads, hw)
        if a is None:
            return None
        notes.append(f"a2a teams of {a}")
        kv = max(p.hkv, a)
        elems = p.batch * local * p.head_dim
        a2a = 2 * (2 * alltoall_ms(elems * p.heads * p.dtype_bytes, a, hw)
                   + 2 * alltoall_ms(elems * kv * p.dtype_bytes, a, hw))
        compute, exposed = ring_ms(p, hw, local * a, head_shards=a, balanced=balanced)
        exposed += a2a
    ms = compute + exposed
    mem = memory_gib(p, local)
    return Prediction(strategy, gpus, compute, exposed, ms, t1, t1 / (gpus * ms), mem,
                      mem <= hw.memory_gib, notes)


def best(p: Problem, gpus: int, hw: Hardware = Hardware(), *, balanced: bool = False) -> Prediction:
    """The fastest feasible strategy (what ``strategy="auto"`` should pick by this model)."""
    preds = [x for s in STRATEGIES if (x := predict(p, gpus, s, hw, balanced=balanced)) is not None]
    return min(preds, key=lambda x: x.ms)


# -- validation against a measured scaling JSON ---------------------------------------------------


def validate(paths: Sequence[str], hw: Hardware = Hardware()) -> list[dict]:
    """Compare predicted with measured efficiency for every multi-GPU record of ``ours``.

    The achieved TFLOP/s is calibrated per record from its own single-GPU time
    ``T1 = efficiency * gpus * ms`` (same run), so what is tested is the
    communication and balance model, not a guess of the kernel's speed.
    """
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        segs = meta.get("longnet_segments", LONGNET_SEGMENTS)
        rates = meta.get("longnet_rates", LONGNET_RATES)
        for rec in data["records"]:
            if (rec["impl"] != "ours" or rec["gpus"] < 2 or rec.get("efficiency") is None
                    or rec["strategy"] not in STRATEGIES or "max_tokens" in rec):
                continue
            n = rec["gpus"] * rec["tokens_per_gpu"]
            prob = Problem(n, tuple(config_patterns(rec["config"], n, segs, rates)), heads=meta["heads"],
                           kv_heads=meta.get("kv_heads"), head_dim=meta["head_dim"], batch=meta["batch"],
                           dtype_bytes=meta.get("dtype_bytes", 2), causal=rec["causal"])
            t1 = rec["efficiency"] * rec["gpus"] * rec["ms"]
            calibrated = replace(hw, tflops=single_gpu_ms(prob, replace(hw, tflops=1.0)) / t1)
            pred = predict(prob, rec["gpus"], rec["strategy"], calibrated, balanced=bool(meta.get("balanced")))
            if pred is None:
                continue
            rows.append({"file": path, "config": rec["config"], "causal": rec["causal"],
                         "strategy": rec["strategy"], "gpus": rec["gpus"], "tokens_per_gpu": rec["tokens_per_gpu"],
                         "tflops": calibrated.tflops, "measured": rec["efficiency"], "predicted": pred.efficiency,
                         "error_pct": 100.0 * (pred.efficiency - rec["efficiency"]) / rec["efficiency"]})
    return rows


# -- command line -----------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _duration(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 1e3 else f"{ms / 1e3:,.2f} s"


def format_predictions(rows: list[Prediction], tokens: int, causal: bool) -> str:
    lines = ["| GPUs | tokens/GPU | causal | strategy | compute | exposed comm | fwd+bwd | efficiency | GiB/GPU |",
             "| ---: | ---: | :---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for x in rows:
        mem = f"{x.memory_gib:.0f}" + ("" if x.fits else " (does not fit)")
        note = f" ({'; '.join(x.notes)})" if x.notes else ""
        lines.append(f"| {x.gpus} | {tokens / x.gpus:,.0f} | {'yes' if causal else 'no'} | {x.strategy}{note} | "
                     f"{_duration(x.compute_ms)} | {_duration(x.exposed_comm_ms)} | {_duration(x.ms)} | "
                     f"{100 * x.efficiency:.1f}% | {mem} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    hw0 = Hardware()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1e9, help="whole sequence N (default 1e9)")
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
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--tflops", type=float, default=hw0.tflops, help=f"achieved fwd+bwd TFLOP/s per GPU ({hw0.tflops:g})")
    ap.add_argument("--nvlink-gbps", type=float, default=hw0.nvlink_gbps, help=f"GB/s per GPU per direction ({hw0.nvlink_gbps:g})")
    ap.add_argument("--ib-gbps", type=float, default=hw0.ib_gbps, help=f"GB/s per GPU across nodes ({hw0.ib_gbps:g})")
    ap.add_argument("--gpus-per-node", type=int, default=hw0.gpus_per_node)
    ap.add_argument("--latency-us", type=float, default=hw0.latency_us)
    ap.add_argument("--memory-gib", type=float, default=hw0.memory_gib)
    ap.add_argument("--validate", nargs="+", default=None, metavar="JSON",
                    help="compare with measured scaling JSONs (globs allowed) instead of predicting")
    a = ap.parse_args(argv)
    hw = Hardware(a.tflops, a.nvlink_gbps, a.ib_gbps, a.gpus_per_node, a.latency_us, a.memory_gib)
    if a.validate:
        paths = sorted({p for pat in a.validate for p in (glob.glob(pat) or [pat])})
        rows = validate(paths, hw)
        print("| config | causal | strategy | GPUs | tokens/GPU | calibrated TFLOP/s | measured | predicted | error |")
        print("| --- | :---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['config']} | {'yes' if r['causal'] else 'no'} | {r['strategy']} | {r['gpus']} | "
                  f"{r['tokens_per_gpu']} | {r['tflops']:.3g} | {100 * r['measured']:.1f}% | "
                  f"{100 * r['predicted']:.1f}% | {r['error_pct']:+.1f}% |")
        if rows:
            worst = max(abs(r["error_pct"]) for r in rows)
            mean = sum(abs(r["error_pct"]) for r in rows) / len(rows)
            print(f"\n{len(rows)} records; mean |error| {mean:.1f}%, worst {worst:.1f}%")
        else:
            print("no multi-GPU records of 'ours' with an efficiency in", paths)
        return 0
    n = int(a.tokens)
    strategies = [s for s in a.strategies.split(",") if s]
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: {s!r} is not one of {STRATEGIES}")
    pats = config_patterns(a.config, n, a.segments, a.rates)
    print(f"N = {n:,} tokens, {a.config} patterns w={[w for w, _ in pats]} r={[r for _, r in pats]}, "
          f"B={a.batch} H={a.heads} Hkv={a.kv_heads or a.heads} D={a.head_dim}, {a.dtype_bytes}-byte dtype")
    print(f"assumed: {hw.tflops:g} TFLOP/s achieved per GPU, NVLink {hw.nvlink_gbps:g} GB/s, "
          f"InfiniBand {hw.ib_gbps:g} GB/s per GPU, {hw.gpus_per_node} GPUs per node, "
          f"{hw.latency_us:g} us per message, {hw.memory_gib:g} GiB per GPU")
    for causal in {"no": [False], "yes": [True], "both": [False, True]}[a.causal]:
        prob = Problem(n, tuple(pats), a.heads, a.kv_heads, a.head_dim, a.batch, a.dtype_bytes, causal)
        rows = [x for k in a.gpus for s in strategies if (x := predict(prob, k, s, hw, balanced=a.balanced))]
        print()
        print(format_predictions(rows, n, causal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
