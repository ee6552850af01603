"""Ranks out of step (``drifts``): after agreeing on two configurations, one rank runs the other one, runs its
backwards in another order, or skips a call; every rank must raise ``ValueError`` (at the call on CPU, at
``verify()`` on GPUs) naming the call and the difference, and stamped calls must give the same bits as
unstamped ones. The harness runs them as its ``out-of-step`` steps; ``tests/parallel/test_out_of_step.py``
runs them on gloo.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import get_backend
from ..functional import dilated_attention
from ..patterns import hybrid_team_size
from .cases import Result


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
    ``ring.routes.Share``, and causal rings on compact rows whose ranks divide the heads run head-parallel,
    ``ring/swapped.py``, both with exchanges of their own, so ranks that drift between such a call and another
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
