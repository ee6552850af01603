"""The one multi-rank battery every communication backend passes (docs/design.md section 7).

Every case builds global inputs from a seed (identical on all ranks), computes
the float64 dense oracle, shards the sequence, runs the ring on the group's
ranks through each backend, and compares this rank's rows of the output and of
the q/k/v gradients. Backends must also agree bit for bit with each other.

Runs inside an initialised process group:

* CPU, under pytest: ``run_spawned(...)`` spawns gloo ranks once for all cases;
* GPUs: ``torchrun --nproc_per_node=K -m dilated_attention.testing.harness --backend collective``.

Ranks out of step (``drifts``): after agreeing on two configurations, one rank runs the other
one, runs its backwards in another order, or skips a call; every rank must raise ``ValueError``
(at the call on CPU, at ``verify()`` on GPUs) naming the call and the difference, and stamped
calls must give the same bits as unstamped ones. ``tests/parallel/test_out_of_step.py`` runs them on gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import causal_share, memory
from ..comm import get_backend
from ..comm.base import CommBackend
from ..distributed import shard_indices
from ..functional import dilated_attention
from ..launch_utils import init_distributed
from ..patterns import hybrid_team_size
from .compare import as_layout, rel_err, tolerance
from .graphs import capture, eager_and_compiled, replay_problem
from .oracle import dense_dilated_attention
from .spawn import spawn_ranks

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str = "longnet"
    causal: bool = False
    heads: int = 4
    kv_heads: int = 4
    local_len: int = 16
    batch: int = 2
    dim: int = 8
    dtype: str = "float64"
    layout: str = "contiguous"  # any of testing.compare.LAYOUTS
    kernel: str = "auto"
    strategy: str = "ring"
    masked: bool = False  # a random key_padding_mask (about a quarter of the keys)
    docs: tuple[int, ...] | None = None  # cu_seqlens over the global sequence (batch 1)
    shards: str = "contiguous"  # the shard layout (dilated_attention's layout=): which rows each rank holds
    head_chunks: bool = False  # run the heads in as many chunks as there are kv heads (memory.py's rule forced)
    shared: bool = False  # causal rings share their cross blocks at any length (causal_share.SHARE_MIN_ROWS = 0)

    @property
    def seq_len(self) -> int:
        return self.world * self.local_len


@dataclass
class Result:
    case: str
    backend: str
    rank: int
    world: int
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    message: str = ""


def cases(world: int, device_type: str = "cpu") -> list[Case]:
    """The battery for one world size (global length ``world * 16``)."""
    n = 16 * world
    spanning = ((8, 16, n), (1, 2, 4))  # local, shard-sized, and (world > 1) spanning every rank
    out = []
    for mode in ("longnet", "grouped"):
        for causal in (False, True):
            tag = f"{mode}-{'causal' if causal else 'full'}"
            out.append(Case(f"P{world}-{tag}", world, *spanning, mode=mode, causal=causal))
            out.append(Case(f"P{world}-{tag}-gqa-transposed", world, *spanning, mode=mode, causal=causal,
                            heads=6, kv_heads=2, layout="transposed"))
    out.append(Case(f"P{world}-head-slice-mqa", world, *spanning, heads=3, kv_heads=1, layout="head_slice", causal=True))
    out.append(Case(f"P{world}-dilation-above-heads", world, (16, n), (1, 8), heads=4))
    if world % 2 == 0 and world > 2:
        out.append(Case(f"P{world}-disjoint-rings", world, (8, 32, n), (2, 2, 4), causal=True))
    if n > 16:
        out.append(Case(f"P{world}-segment-clamped", world, (4, 4 * n), (1, 4), causal=True))
    for layout in ("strided_head_dim", "permuted", "storage_offset", "zero_stride"):
        out.append(Case(f"P{world}-{layout}", world, *spanning, causal=layout != "permuted", layout=layout))
    # head-parallel (all-to-all) and hybrid (all-to-all in teams, ring across): 12 heads split over
    # 1-4 ranks; kv heads 4 (split at P=2/4, expanded at P=3) and 1 (one kv head per rank)
    heads = 12 if 12 % world == 0 else 8 * world
    strategies = ["head"] + (["hybrid"] if world >= 4 else [])
    for strategy in strategies:
        for mode in ("longnet", "grouped"):
            out.append(Case(f"P{world}-{strategy}-{mode}-causal-gqa", world, *spanning, mode=mode, causal=True,
                            heads=heads, kv_heads=4, layout="transposed", strategy=strategy))
        out.append(Case(f"P{world}-{strategy}-mqa", world, *spanning, heads=heads, kv_heads=1, strategy=strategy))
        out.append(Case(f"P{world}-{strategy}-bfloat16", world, *spanning, causal=True, heads=heads, kv_heads=4,
                        dtype="bfloat16", dim=16, strategy=strategy))
    low = ["float32", "bfloat16"] + (["float16"] if device_type == "cuda" else [])
    for dt in low:
        out.append(Case(f"P{world}-{dt}", world, *spanning, causal=True, heads=4, kv_heads=2, dtype=dt, dim=16))
    # grouped mode in low precision too: on GPUs this is the fused kernel inside the ring
    out.append(Case(f"P{world}-grouped-bfloat16", world, *spanning, mode="grouped", heads=6, kv_heads=3,
                    dtype="bfloat16", dim=32, layout="transposed"))
    # masks: a key padding mask on the ring (spanning patterns read the visiting block's mask
    # rows), packed documents spanning ranks and internal padding with the head strategy
    for causal in (False, True):
        out.append(Case(f"P{world}-ring-key-padding-{'causal' if causal else 'full'}", world, *spanning,
                        causal=causal, heads=4, kv_heads=2, masked=True, layout="transposed"))
        out.append(Case(f"P{world}-head-docs-{'causal' if causal else 'full'}", world, (4, 8, 16), (1, 2, 4),
                        causal=causal, heads=heads, kv_heads=4, batch=1, masked=causal, strategy="head",
                        docs=(0, 5, 5, n // 2 + 3, n)))
    out.append(Case(f"P{world}-head-padded", world, (8, 32), (1, 2), causal=True, heads=heads, kv_heads=4,
                    local_len=12, strategy="head"))
    out.append(Case(f"P{world}-masked-bfloat16", world, *spanning, causal=True, heads=4, kv_heads=2, dim=16,
                    dtype="bfloat16", masked=True))
    # head chunks (memory.py): each kv group's heads in turn, written into slices of one result
    out.append(Case(f"P{world}-ring-head-chunks-causal", world, *spanning, causal=True, heads=8, kv_heads=4,
                    layout="transposed", head_chunks=True))
    out.append(Case(f"P{world}-ring-head-chunks-key-padding", world, *spanning, heads=4, kv_heads=2, masked=True,
                    dtype="bfloat16", dim=16, head_chunks=True))
    out.append(Case(f"P{world}-head-chunks-head-docs", world, (4, 8, 16), (1, 2, 4), causal=True, heads=heads,
                    kv_heads=4, batch=1, strategy="head", docs=(0, 5, 5, n // 2 + 3, n), head_chunks=True))
    # the head strategy in chunks swaps one chunk's heads at a time (head_parallel.py), the backward again
    out.append(Case(f"P{world}-head-chunks-full", world, (n,), (1,), heads=heads, kv_heads=4, strategy="head",
                    layout="transposed", head_chunks=True))
    out.append(Case(f"P{world}-head-chunks-longnet-causal", world, *spanning, causal=True, heads=heads,
                    kv_heads=3, strategy="head", masked=True, head_chunks=True))  # 2, 4 ranks: kv heads expanded
    # causal rings on contiguous blocks sharing their cross blocks: full attention, dilated rings kept whole by key padding
    out.append(Case(f"P{world}-ring-shared-dilated-causal", world, *spanning, causal=True, heads=6, kv_heads=2,
                    layout="transposed", masked=True, shared=True))
    out.append(Case(f"P{world}-ring-shared-full-causal", world, (n,), (1,), causal=True, shared=True))
    out.append(Case(f"P{world}-ring-shared-key-padding", world, *spanning, causal=True, heads=4, kv_heads=2,
                    masked=True, dtype="bfloat16", dim=16, shared=True))
    out.append(Case(f"P{world}-ring-shared-head-chunks", world, (n,), (1,), causal=True, heads=8, kv_heads=4,
                    layout="transposed", head_chunks=True, shared=True))  # each kv group's heads a ring of its own
    if world >= 4:  # the ring across teams of the hybrid, each team a block of its lane's rows
        out.append(Case(f"P{world}-hybrid-head-chunks-causal", world, *spanning, causal=True, heads=heads,
                        kv_heads=4, strategy="hybrid", head_chunks=True))
        out.append(Case(f"P{world}-hybrid-shared-full-causal", world, (n,), (1,), causal=True, heads=heads,
                        kv_heads=4, strategy="hybrid", shared=True))
    if world > 1:
        out.extend(zigzag_cases(world))
        out.append(Case(f"P{world}-zigzag-ring-head-chunks", world, (8, 2 * n), (1, 2), causal=True, heads=6,
                        kv_heads=3, shards="zigzag", head_chunks=True))
        out.append(Case(f"P{world}-zigzag-head-chunks", world, (8, 2 * n), (1, 2), causal=True, heads=heads,
                        kv_heads=2, strategy="head", shards="zigzag", dtype="bfloat16", dim=16, head_chunks=True))
    return out


def zigzag_cases(world: int) -> list[Case]:
    """The zigzag shard layout (rank ``j`` holds chunks ``j`` and ``2P - 1 - j``): full attention, LongNet-like
    patterns (local, spanning some chunks, spanning all; at P = 3 the segment of chunks 2-3 lies on one rank),
    dilation, GQA, key masks, causal and not, ring and head (hybrid at P = 4)."""
    n = 16 * world
    longnet = ((8, 16, n), (1, 2, 4))
    heads = 12 if 12 % world == 0 else 8 * world
    out = []
    for causal in (False, True):
        tag = "causal" if causal else "full"
        out.append(Case(f"P{world}-zigzag-ring-dense-{tag}", world, (n,), (1,), causal=causal, shards="zigzag"))
        out.append(Case(f"P{world}-zigzag-ring-longnet-{tag}", world, *longnet, causal=causal, heads=6, kv_heads=2,
                        layout="transposed", shards="zigzag"))
        out.append(Case(f"P{world}-zigzag-head-longnet-{tag}", world, *longnet, causal=causal, heads=heads,
                        kv_heads=4, strategy="head", shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-ring-dilated-grouped", world, (16, 2 * n), (4, 8), mode="grouped", causal=True,
                    heads=4, kv_heads=1, shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-ring-key-padding", world, *longnet, causal=True, heads=4, kv_heads=2, masked=True,
                    shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-head-docs", world, (4, 8, 16), (1, 2, 4), causal=True, heads=heads, kv_heads=4,
                    batch=1, masked=True, strategy="head", docs=(0, 5, 5, n // 2 + 3, n), shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-ring-bfloat16", world, *longnet, causal=True, heads=4, kv_heads=2, dim=16,
                    dtype="bfloat16", shards="zigzag"))
    if world >= 4:
        out.append(Case(f"P{world}-zigzag-hybrid-causal", world, *longnet, causal=True, heads=heads, kv_heads=4,
                        masked=True, strategy="hybrid", shards="zigzag"))
    return out


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = 1 if case.layout == "zero_stride" else case.batch  # then expanded: every batch row alike
    shape_q = (batch, case.seq_len, case.heads, case.dim)
    shape_kv = (batch, case.seq_len, case.kv_heads, case.dim)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).expand(case.batch, -1, -1, -1)
               for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, torch.randn((case.batch, *shape_q[1:]), generator=g, dtype=torch.float64)


def _masks(case: Case, seed: int) -> dict:
    """``key_padding_mask`` (global) and ``cu_seqlens`` keywords of a case."""
    kw = {}
    if case.masked:
        g = torch.Generator().manual_seed(seed + 1)
        kw["key_padding_mask"] = torch.rand(case.batch, case.seq_len, generator=g) < 0.25
    if case.docs is not None:
        kw["cu_seqlens"] = torch.tensor(case.docs, dtype=torch.int32)
    return kw


def _oracle(case: Case, q, k, v, dout, dtype, seed: int):
    """Dense attention in ``dtype`` on CPU: output and q/k/v gradients (float64 = the oracle)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*leaves, case.segment_lengths, case.dilation_rates, mode=case.mode, causal=case.causal,
                                  **_masks(case, seed))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return [t.double() for t in (out, *grads)]


@contextlib.contextmanager
def recorded_exchanges(phrase: str, check: Callable[[list, list, str], None] | None = None):
    """This process's exchanges (``CommBackend.exchange``) and all-to-alls (``CommBackend.all_to_all``, however it
    moves its blocks) whose ``what`` names ``phrase`` are recorded into the list it yields, and
    ``check(sends, recvs, what)`` runs on each (an all-to-all's as the ``(block, rank)`` pairs it sends and
    receives); restored on exit."""
    seen: list[str] = []
    exchange, all_to_all = CommBackend.exchange, CommBackend.all_to_all
    inside = [0]  # an all-to-all over part of the group runs as an exchange: recorded once

    def note(sends, recvs, what):
        if phrase in what:
            seen.append(what)
            if check is not None:
                check(sends, recvs, what)

    def recording_exchange(self, sends, recvs, what="exchange", **kwargs):
        if not inside[0]:
            note(sends, recvs, what)
        return exchange(self, sends, recvs, what, **kwargs)

    def recording_all_to_all(self, sends, ranks, what="all-to-all", **kwargs):
        me = ranks.index(self.rank)
        pairs = [(x[m], r) for m, r in enumerate(ranks) if m != me for x in sends]
        note(pairs, pairs, what)
        inside[0] += 1
        try:
            return all_to_all(self, sends, ranks, what, **kwargs)
        finally:
            inside[0] -= 1

    CommBackend.exchange, CommBackend.all_to_all = recording_exchange, recording_all_to_all
    try:
        yield seen
    finally:
        CommBackend.exchange, CommBackend.all_to_all = exchange, all_to_all


def run_case(case: Case, backend_name: str, group, device: torch.device, seed: int):
    """Run one case on this rank; returns ``(Result, tensors)`` (tensors for the bitwise check)."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    q, k, v, dout = _inputs(case, seed)
    names = ("out", "dq", "dk", "dv")
    oracle = _oracle(case, q, k, v, dout, torch.float64, seed)
    dtype = DTYPES[case.dtype]
    if case.dtype == "float64":
        tol = {n: tolerance(dtype, None) for n in names}
    else:
        plain = _oracle(case, q, k, v, dout, dtype, seed)
        tol = {n: tolerance(dtype, rel_err(p, o)) for n, p, o in zip(names, plain, oracle)}
    rows = shard_indices(case.seq_len, case.world, rank, case.shards)
    g = torch.Generator(device=device).manual_seed(seed)
    local = [as_layout(t[:, rows].to(device=device, dtype=dtype), case.layout, generator=g).requires_grad_()
             for t in (q, k, v)]
    masks = _masks(case, seed)
    if "key_padding_mask" in masks:
        masks["key_padding_mask"] = masks["key_padding_mask"][:, rows].to(device)
    if "cu_seqlens" in masks:
        masks["cu_seqlens"] = masks["cu_seqlens"].to(device)
    rule = memory.BOUND.key, causal_share.SHARE_MIN_ROWS
    if case.head_chunks:
        memory.set_memory_bound(0.0, 0)
    if case.shared:
        causal_share.SHARE_MIN_ROWS = 0
    try:
        out = dilated_attention(*local, case.segment_lengths, case.dilation_rates, mode=case.mode,
                                causal=case.causal, comm=comm, kernel=case.kernel, strategy=case.strategy,
                                layout=case.shards, **masks)
        grads = torch.autograd.grad(out, local, dout[:, rows].to(device=device, dtype=dtype))
    finally:
        memory.set_memory_bound(*rule[0])
        causal_share.SHARE_MIN_ROWS = rule[1]
    got = [t.detach().cpu() for t in (out, *grads)]
    errors = {n: rel_err(g, o[:, rows]) for n, g, o in zip(names, got, oracle)}
    ok = all(errors[n] <= tol[n] for n in names) and all(torch.isfinite(g).all().item() for g in got)
    res = Result(case.name, backend_name, rank, case.world, ok, errors, tol)
    if not ok:
        res.message = "error above tolerance: " + ", ".join(
            f"{n} {errors[n]:.2e} > {tol[n]:.2e}" for n in names if not errors[n] <= tol[n])
    return res, got


def check_disagreement(backend_name: str, group, device: torch.device) -> Result:
    """Ranks that disagree on the call must all raise ValueError, none may hang."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    n_local = 16
    q = torch.randn(1, n_local, 2, 8, dtype=torch.float64, device=device)
    segs = (8, n_local * comm.world_size) if rank == 0 else (16, n_local * comm.world_size)
    try:
        dilated_attention(q, q, q, segs, (1, 2), comm=comm)
    except ValueError as exc:
        # the message shows the differing values themselves, not hashes
        ok = "disagree" in str(exc) and f"segment_lengths: rank 0=[8, {n_local * comm.world_size}]" in str(exc)
        return Result("disagreeing-ranks", backend_name, rank, comm.world_size, ok, message=str(exc)[:200])
    return Result("disagreeing-ranks", backend_name, rank, comm.world_size, False, message="no error raised")


def check_one_rank_invalid(backend_name: str, group, device: torch.device) -> Result:
    """A rank whose own input is invalid raises its error; the others raise too, instead of waiting."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, device=device)
    rates = (1, 3) if rank == comm.world_size - 1 else (1, 2)  # 3 does not divide the segment
    try:
        dilated_attention(q, q, q, (8, 16 * comm.world_size), rates, comm=comm)
    except ValueError as exc:
        ok = ("dilation_rates" in str(exc)) if rank == comm.world_size - 1 else ("rejected" in str(exc))
        return Result("one-rank-invalid", backend_name, rank, comm.world_size, ok, message=str(exc)[:200])
    return Result("one-rank-invalid", backend_name, rank, comm.world_size, False, message="no error raised")


def check_unchecked_calls(backend_name: str, group, device: torch.device) -> Result:
    """``check_calls=False`` skips only the signature gather: results are bitwise the same."""
    checked, unchecked = get_backend(backend_name, group), get_backend(backend_name, group, check_calls=False)
    rank, size = checked.rank, checked.world_size
    g = torch.Generator().manual_seed(7)
    full = torch.randn(1, 16 * size, 4, 8, generator=g, dtype=torch.float64)
    mine = full[:, rank * 16 : (rank + 1) * 16].to(device)  # on the harness's device: NCCL moves CUDA tensors only
    a = dilated_attention(mine, mine, mine, (8, 16 * size), (1, 4), causal=True, comm=checked)
    b = dilated_attention(mine, mine, mine, (8, 16 * size), (1, 4), causal=True, comm=unchecked)
    same = torch.equal(a, b)
    return Result("unchecked-calls", backend_name, rank, size, same, message="" if same else "results differ")


def check_cuda_graph(backend_name: str, group, device: torch.device) -> list[Result]:
    """GPUs: a ring and a head call's forward+backward captured into one CUDA graph (after an eager warm-up,
    with the default call checks) replay bit for bit what the eager call gives, on new input values."""
    comm = get_backend(backend_name, group)
    rank, size = comm.rank, comm.world_size
    results = []
    for strategy in ("ring", "head"):
        shape = (1, 16, 4 * size, 16)
        leaves = [torch.zeros(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        dout = torch.zeros(shape, device=device, dtype=torch.bfloat16)

        def fill(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for x in (*leaves, dout):
                    full = torch.randn((1, 16 * size, *shape[2:]), generator=g)
                    x.copy_(full[:, rank * 16:(rank + 1) * 16])

        def step() -> torch.Tensor:
            for x in leaves:
                x.grad = None
            out = dilated_attention(*leaves, (8, 16 * size), (1, 2), causal=True, comm=comm, strategy=strategy)
            out.backward(dout)
            return out

        try:
            fill(1)
            graph, out = capture(step, warmup=2)
            grads = [x.grad for x in leaves]
            fill(2)
            graph.replay()
            got = [t.clone() for t in (out, *grads)]
            eager = step()
            same = all(torch.equal(a, b) for a, b in zip(got, (eager, *(x.grad for x in leaves))))
            msg = "" if same else "replay differs from the eager call"
        except Exception as exc:
            same, msg = False, f"{type(exc).__name__}: {exc}"[:200]
        results.append(Result(f"cuda-graph-{strategy}", backend_name, rank, size, same, message=msg))
    return results


def check_compiled_graphs(backend_name: str, group, device: torch.device) -> Result:
    """GPUs: a ring call inside ``torch.compile(mode="reduce-overhead")`` gives, step after step, what the eager
    call gives, bit for bit, and from the third step on the cudagraph tree replays it (the op's body runs in
    the warm-up and the recording only)."""
    comm = get_backend(backend_name, group)
    rank, size = comm.rank, comm.world_size

    def layer(q, k, v):
        return dilated_attention(q * 2, k, v, (8, 16 * size), (1, 2), causal=True, comm=comm) * 3

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    same, msg = True, ""
    try:
        for seed in range(4):  # warm-up, recording, then replays
            g = torch.Generator().manual_seed(100 + seed)
            full = [torch.randn((1, 16 * size, 4 * size, 16), generator=g) for _ in range(4)]
            q, k, v, dout = (x[:, rank * 16:(rank + 1) * 16].to(device, torch.bfloat16) for x in full)
            eager, got, runs = eager_and_compiled(layer, compiled, q, k, v, dout)
            if not all(torch.equal(a, b) for a, b in zip(eager, got)):
                same, msg = False, f"step {seed}: the compiled call differs from the eager one"
                break
            problem = replay_problem(seed, runs)
            if problem is not None:
                same, msg = False, problem
                break
    except Exception as exc:
        same, msg = False, f"{type(exc).__name__}: {exc}"[:200]
    return Result("compiled-reduce-overhead", backend_name, rank, size, same, message=msg)


# -- ranks out of step: every exchange carries the call's stamp -----------------------------------


@dataclass(frozen=True)
class Drift:
    """Two configurations every rank has agreed on (say, two layers) with the same shapes, and how rank 0
    then leaves the others: ``switch`` (it runs ``b`` where they run ``a``), ``skip`` (it skips ``a``, runs
    ``b``, then makes ``a`` up: as many calls as its peers, so nothing is left waiting where errors wait for
    a verdict) or ``backward-order`` (it runs two calls' backwards in the other order)."""

    name: str
    a: dict
    b: dict
    words: tuple[str, ...]  # what the error must name on ranks 0 and 1 (the others may only hear of it)
    kind: str = "switch"
    heads: int = 4
    kv_heads: int = 4
    local_len: int = 16
    strategies: tuple[str, ...] = ("ring", "head", "hybrid")  # where both configurations make the same exchanges
    masked: bool = False  # with a key_padding_mask (its all-gather carries the stamp too)


def drifts(world: int) -> list[Drift]:
    """Each case keeps every exchange the same size (so without stamps it is a silent wrong result). Not mode
    under hybrid: there grouped mode leaves a lane without the ring longnet runs, so a peer waits (a timeout).
    (The causal flag keeps them the same here, with one kv head: long causal rings share their cross blocks,
    ``causal_share.Share``, and causal rings on compact rows whose ranks divide the heads run head-parallel,
    ``ring_swaps.py``, both with exchanges of their own, so ranks that drift between such a call and another
    fail loudly, a gloo error or the process group's timeout, not with the stamps' ``ValueError``.)"""
    n, m = 16 * world, 24 * world
    base = {"segment_lengths": (8, n), "dilation_rates": (1, 2)}
    mqa = {"segment_lengths": (8, n), "dilation_rates": (1, 1)}  # longnet and grouped pack one kv head alike
    thirds = {"segment_lengths": (12, m), "dilation_rates": (1, 3)}  # offsets of 4 heads at r = 3 differ
    return [
        Drift("causal", {**base, "causal": True}, {**base, "causal": False}, ("call 3 (forward)", "causal: rank 0="),
              kv_heads=1),
        Drift("scale", base, {**base, "softmax_scale": 0.5}, ("call 3 (forward)", "softmax_scale: rank 0=")),
        Drift("masked-causal", {**base, "causal": True}, {**base, "causal": False}, ("call 3 (forward)", "causal"),
              masked=True),
        Drift("mode", mqa, {**mqa, "mode": "grouped"}, ("call 3 (forward)", "mode: rank 0="), kv_heads=1,
              strategies=("ring", "head")),
        Drift("head-offsets", thirds, {**thirds, "head_offsets": "torchscale"},
              ("call 3 (forward)", "head_offsets: rank 0="), local_len=24),
        Drift("patterns", base, {**base, "segment_lengths": (16, n)}, ("call 3 (forward)", "segment_lengths: rank 0=")),
        Drift("skipped-call", base, {**base, "segment_lengths": (16, n)}, ("call 3 (forward)", "segment_lengths"),
              kind="skip"),
        Drift("backward-order", base, base, ("call 3 (backward)", "call 4 (backward)"), kind="backward-order"),
    ]


def drift_strategies(world: int, heads: int = 4) -> list[str]:
    """The strategies a drift runs with at this world size (head and hybrid where the heads split)."""
    out = ["ring"]
    if heads % world == 0:
        out.append("head")
    if hybrid_team_size(world, heads, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)):
        out.append("hybrid")
    return out


def _drift_inputs(drift: Drift, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(50 + rank)  # every rank its own rows
    shapes = [(1, drift.local_len, h, 8) for h in (drift.heads, drift.kv_heads, drift.kv_heads)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device).requires_grad_() for s in shapes]


def run_drift(drift: Drift, strategy: str, backend_name: str, group, device: torch.device, *,
              timeout: float | None = None, defer: bool = False, check_every: int = 64) -> Result:
    """One drift on this rank: it must raise ``ValueError`` at the call or at the ``verify()`` every rank
    makes after it. ``defer``: compare stamps at the verdict as on GPUs, also on CPU tensors."""
    comm = get_backend(backend_name, group, timeout=timeout, check_every=check_every)
    comm.ledger.defer = defer or comm.ledger.defer
    rank = comm.rank
    q, k, v = _drift_inputs(drift, rank, device)
    mask = {}
    if drift.masked:
        mask["key_padding_mask"] = (torch.arange(drift.local_len) % 5 == rank).to(device)[None]

    def call(cfg: dict) -> torch.Tensor:
        return dilated_attention(q, k, v, comm=comm, strategy=strategy, **cfg, **mask)

    for cfg in (drift.a, drift.b):  # both agreed (and cached) on every rank
        call(cfg).sum().backward()
    start, where, message = time.monotonic(), "", "no error raised"
    try:
        if drift.kind == "switch":
            call(drift.b if rank == 0 else drift.a).sum().backward()
        elif drift.kind == "skip":
            order = (drift.b, drift.a) if rank == 0 else (drift.a, drift.b)
            sum(call(cfg).sum() for cfg in order).backward()
        else:
            first, second = call(drift.a), call(drift.a)
            if rank == 0:
                first, second = second, first
            second.sum().backward()
            first.sum().backward()
    except ValueError as exc:
        where, message = "call", str(exc)
    try:
        comm.verify()
    except ValueError as exc:
        if not where:
            where, message = "verify", str(exc)
    seconds = time.monotonic() - start
    ok = bool(where) and "ranks out of step" in message and (rank > 1 or all(w in message for w in drift.words))
    return Result(f"out-of-step-{strategy}-{drift.name}" + ("-deferred" if defer else ""), backend_name, rank,
                  comm.world_size, ok, {"seconds": seconds}, message=f"[{where or 'nowhere'}] {message}")


def check_stamps_change_nothing(backend_name: str, group, device: torch.device) -> list[Result]:
    """Stamped calls (``check_calls=True``) give the bits of unstamped ones (``False``): outputs and gradients."""
    results = []
    stamped = get_backend(backend_name, group)
    plain = get_backend(backend_name, group, check_calls=False)
    rank, size = stamped.rank, stamped.world_size
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(1, 16 * size, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    mask = torch.rand(1, 16 * size, generator=g) < 0.25
    rows = slice(rank * 16, (rank + 1) * 16)
    for strategy in drift_strategies(size):
        got = []
        for comm in (stamped, plain):
            q, k, v = (t[:, rows].to(device).requires_grad_() for t in full)
            out = dilated_attention(q, k, v, (8, 16 * size), (1, 2), causal=True, comm=comm, strategy=strategy,
                                    key_padding_mask=mask[:, rows].to(device))
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            got.append([out.detach(), *grads])
        same = all(torch.equal(a, b) for a, b in zip(*got))
        results.append(Result(f"stamps-change-nothing-{strategy}", backend_name, rank, size, same,
                              message="" if same else "stamped and unstamped results differ"))
    return results


def run_out_of_step(backends: list[str], group, device: torch.device, *, timeout: float | None = None,
                    defer: bool = False) -> list[Result]:
    """Every drift with every strategy and backend on ``group`` (all ranks call it), and the bitwise check."""
    size = dist.get_world_size(group)
    results = []
    for name in backends:
        for strategy in drift_strategies(size):
            for drift in (d for d in drifts(size) if strategy in d.strategies):
                try:
                    results.append(run_drift(drift, strategy, name, group, device, timeout=timeout, defer=defer))
                except Exception as exc:  # report, keep going
                    results.append(Result(f"out-of-step-{strategy}-{drift.name}", name, dist.get_rank(group), size,
                                          False, message=f"{type(exc).__name__}: {exc}"))
        try:
            results.extend(check_stamps_change_nothing(name, group, device))
        except Exception as exc:
            results.append(Result("stamps-change-nothing", name, dist.get_rank(group), size, False, message=repr(exc)))
    return results


# -- the battery: steps every rank runs in the same order, each bounded, their outcome agreed ----------------


GROUPS = ("cases", "checks", "graphs", "out-of-step")  # what --only selects
CASE_TIMEOUT = 300.0  # seconds one step may take on a rank (first kernel builds and compiles included)
WATCHDOG_MARGIN = 1.5  # a rank still in a step after this many case timeouts ends itself


@dataclass(frozen=True)
class Step:
    """One unit of the battery: ``run()`` gives this rank's results; every rank of the size-``world`` group runs
    it, then they agree on its outcome."""

    group: str  # one of GROUPS
    world: int
    label: str
    run: Callable[[], list[Result]]


class HarnessStopped(RuntimeError):
    """A step left a rank waiting for a peer that had failed or hung: the run cannot go on."""


def _case_step(case: Case, index: int, backends: list[str], group, device: torch.device) -> Callable[[], list[Result]]:
    def run() -> list[Result]:
        results, tensors = [], {}
        rank = dist.get_rank(group)
        for name in backends:
            try:
                res, got = run_case(case, name, group, device, 1000 * case.world + index)
                tensors[name] = got
            except Exception as exc:  # report, keep going: one failure must not hide the rest
                res = Result(case.name, name, rank, case.world, False, message=f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
            results.append(res)
        if len(tensors) > 1:
            first, ref = next(iter(tensors.items()))
            same = all(all(torch.equal(a, b) for a, b in zip(ref, t)) for t in tensors.values())
            results.append(Result(case.name + "[bitwise]", "+".join(tensors), rank, case.world, same,
                                  message="" if same else f"backends differ from {first}"))
        return results
    return run


def _guarded_step(check: Callable, label: str, *args) -> Callable[[], list[Result]]:
    """A check as a step: its result(s), or a failed result naming what it raised."""
    def run() -> list[Result]:
        try:
            got = check(*args)
        except Exception as exc:
            group = args[1]
            return [Result(label, args[0], dist.get_rank(group), dist.get_world_size(group), False,
                           message=f"{type(exc).__name__}: {exc}"[:500])]
        return got if isinstance(got, list) else [got]
    return run


def battery_steps(backends: list[str], device: torch.device, size: int, group, *, out_of_step: bool = False
                  ) -> list[Step]:
    """Every step at world size ``size`` (the same list on every rank)."""
    steps = [Step("cases", size, f"{case.name} [{','.join(backends)}]", _case_step(case, i, backends, group, device))
             for i, case in enumerate(cases(size, device.type))]
    if size > 1:
        for name in backends:
            for check in (check_disagreement, check_one_rank_invalid, check_unchecked_calls):
                steps.append(Step("checks", size, f"{check.__name__} [{name}] P{size}",
                                  _guarded_step(check, check.__name__, name, group, device)))
    if size > 1 and device.type == "cuda":
        for name in backends:
            steps.append(Step("graphs", size, f"cuda-graph [{name}] P{size}",
                              _guarded_step(check_cuda_graph, "cuda-graph", name, group, device)))
        steps.append(Step("graphs", size, f"compiled-reduce-overhead [{backends[0]}] P{size}",  # one backend: compiling costs
                          _guarded_step(check_compiled_graphs, "compiled-reduce-overhead", backends[0], group, device)))
    if size > 1 and out_of_step:
        for name in backends:
            steps.append(Step("out-of-step", size, f"out-of-step [{name}] P{size}",
                              lambda name=name: run_out_of_step([name], group, device)))
    return steps


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (``0 <= i < n``) -> ``(i, n)``; ``ValueError`` naming the form otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be i/n with integers 0 <= i < n (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard must be i/n with 0 <= i < n (e.g. 0/2), got {text!r}")
    return i, n


def _watchdog(label: str, rank: int, seconds: float) -> threading.Timer:
    """Ends this process if the step outlives ``seconds``: it waits for a peer that failed or hangs (a blocking
    transfer cannot be interrupted), so its peers' agreement learns of it instead of waiting forever."""
    def stop() -> None:
        print(f"[harness] rank {rank}: {label} did not finish within {seconds:g} s (a peer failed before the "
              "transfer this rank waits in, or hangs): stopping this rank", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


def _agree(results: list[Result], side, label: str, timeout: float) -> list[Result]:
    """Every rank's verdict on the step (over ``side``, a gloo group apart from the transfers under test): if any
    rank failed, every rank records the step failed, naming who failed and why. ``HarnessStopped`` where a peer
    did not report in time (it hangs, or its watchdog ended it)."""
    verdict = {"rank": dist.get_rank(side), "failed": [f"{r.case} [{r.backend}]: {r.message}"[:300] for r in results if not r.ok]}
    everyone: list = [None] * dist.get_world_size(side)
    try:
        dist.all_gather_object(everyone, verdict, group=side)
    except Exception as exc:
        raise HarnessStopped(f"{label}: a peer did not report within {timeout:g} s (it failed or hangs): "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    others = [f"rank {v['rank']}: {line}" for v in everyone if v["rank"] != verdict["rank"] for line in v["failed"]]
    if others and all(r.ok for r in results):  # failed elsewhere: recorded here too, so every rank reports it
        results = results + [Result(label, "peers", verdict["rank"], dist.get_world_size(side), False,
                                    message="; ".join(others)[:500])]
    return results


def run_battery(backends: list[str], device: torch.device, world_sizes: list[int] | None = None,
                progress: bool = False, out_of_step: bool = False, *, only: list[str] | None = None,
                shard: tuple[int, int] = (0, 1), case_timeout: float = CASE_TIMEOUT,
                select: Callable[[Step], bool] | None = None) -> list[Result]:
    """Every step for every world size that fits, on this rank (call on all ranks of the world): ``only`` keeps the
    named ``GROUPS``, ``shard=(i, n)`` every ``n``-th step from the ``i``-th (counted over the whole run),
    ``select`` the steps it accepts. Each step is bounded by ``case_timeout`` seconds and its outcome agreed by
    every rank of its group, so a failure on one rank is reported by all and the run goes on; a rank left
    waiting by a failed or hung peer ends (``HarnessStopped`` on the others), never hangs."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    world_sizes = world_sizes or list(range(1, world + 1))
    results: list[Result] = []
    sizes = []
    for size in world_sizes:
        # collective calls: every rank takes part. The agreement travels on gloo, apart from the transfers tested
        group = dist.new_group(list(range(size)))
        side = dist.new_group(list(range(size)), backend="gloo", timeout=timedelta(seconds=case_timeout))
        sizes.append((size, group, side))
    plan = []
    for size, group, side in sizes:
        steps = battery_steps(backends, device, size, group, out_of_step=out_of_step)
        plan.extend((step, side) for step in steps)
    plan = [(step, side) for i, (step, side) in enumerate(plan) if i % shard[1] == shard[0]
            and (not only or step.group in only) and (select is None or select(step))]
    start, entered = time.monotonic(), set()
    for i, (step, side) in enumerate(plan):
        if rank >= step.world:
            continue
        if step.world not in entered:  # ranks arrive from other sizes' steps: no step's clock runs while waiting
            dist.monitored_barrier(side, timeout=timedelta(hours=2), wait_all_ranks=True)  # (a dead peer: raises)
            entered.add(step.world)
        # a little later than the peers' agreement gives up on this rank: they report first, then this one
        timer = _watchdog(step.label, rank, case_timeout * WATCHDOG_MARGIN)
        try:
            got = step.run()
        finally:
            timer.cancel()
        got = _agree(got, side, step.label, case_timeout)
        results.extend(got)
        if progress and rank == 0:
            bad = [r for r in got if not r.ok]
            print(f"[harness {i + 1}/{len(plan)} {time.monotonic() - start:6.0f} s] P{step.world} {step.label}: "
                  + ("ok" if not bad else "FAIL " + "; ".join(f"{r.case} [{r.backend}]: {r.message}"[:300]
                                                            for r in bad)), flush=True)
    return results


# -- spawning gloo ranks on one machine (pytest, demo) ------------------------------------------


def _battery(rank: int, world_size: int, backends: list[str]) -> list[dict]:
    return [asdict(r) for r in run_battery(backends, torch.device("cpu"))]


def spawn_battery(backends: list[str], world_size: int = 4) -> list[Result]:
    return [Result(**x) for part in spawn_ranks(_battery, world_size, backends) for x in part]


# -- torchrun entry point ------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    lines = [f"{'case':44s} {'backend':28s} {'P':>2s} {'rank':>4s}  {'max rel err (out/dq/dk/dv)':40s} ok"]
    for r in results:
        errs = ("/".join(f"{r.errors[n]:.1e}" for n in ("out", "dq", "dk", "dv")) if "out" in r.errors
                else r.message[:40])
        lines.append(f"{r.case:44s} {r.backend:28s} {r.world:2d} {r.rank:4d}  {errs:40s} {'ok' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes world sizes separated by commas (e.g. 2,4), got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be positive world sizes, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", choices=["collective", "fairscale", "deepspeed"],
                        help="repeat to test several (and check they agree bitwise); default collective")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="world sizes to run, e.g. 4 or 2,4 (default: 1 to the number of ranks)")
    parser.add_argument("--only", action="append", choices=GROUPS,
                        help="run only this group of steps (repeat for several; default: all)")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="run every N-th step from the I-th (0 <= I < N), to split a run over several jobs")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT, metavar="SECONDS",
                        help=f"bound on one step on a rank (default {CASE_TIMEOUT:g}): a rank that outlives it "
                             "(waiting for a peer that failed) stops, and the run stops on every rank")
    args = parser.parse_args(argv)
    if args.case_timeout <= 0:
        parser.error(f"--case-timeout must be positive, got {args.case_timeout}")
    env = init_distributed(args.device)
    sizes = [p for p in (args.sizes or range(1, dist.get_world_size() + 1)) if p <= dist.get_world_size()]
    try:
        results = run_battery(args.backend or ["collective"], env.device, sizes, progress=True, out_of_step=True,
                              only=args.only, shard=args.shard, case_timeout=args.case_timeout)
    except HarnessStopped as exc:  # peers are gone or stuck: no teardown (it would wait for them)
        print(f"[harness] rank {dist.get_rank()}: stopped: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [asdict(r) for r in results])
    all_results = [Result(**x) for part in everyone for x in part]
    failed = [r for r in all_results if not r.ok]
    if dist.get_rank() == 0:
        print(format_table(all_results))
        print(f"{len(all_results) - len(failed)} passed, {len(failed)} failed")
    env.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
