"""Rank faults on gloo for every backend: each must raise on every rank, within the timeout, and exit cleanly.

One spawn of 3 ranks per backend runs every scenario, each on a fresh process group
(a timed-out group keeps stale pending messages). Each rank records what it raised and
how long it took. The spawn itself must end with exit code 0 on every rank (no SIGABRT
at exit after the errors). Bounded: a regression that hangs fails at the pytest-level
``timeout`` of the spawn, not after the process group's 30 minutes.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dilated_attention import dilated_attention
from dilated_attention.comm import BACKEND_NAMES, PeerTimeoutError, get_backend
from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks

WORLD = 3
TIMEOUT = 2.0  # seconds the library waits on a peer in these tests
L = 16
SEGS, RATES = (8, L * WORLD), (1, 2)  # the second pattern is a ring over all 3 ranks


def _inputs(rank, requires_grad=(True, True, True), heads=3):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(1, L, heads, 8, generator=g, dtype=torch.float64).requires_grad_(rg) for rg in requires_grad]


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # what each rank raised is the result
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "message": "", "seconds": time.monotonic() - start}


def _scenarios(rank: int, world_size: int, backend: str) -> dict:
    out = {}

    def fresh(**kw):
        return get_backend(backend, dist.new_group(list(range(WORLD))), timeout=TIMEOUT, **kw)

    # 1. a rank skips backward (say, after a NaN loss): the others wait for it, then raise
    comm = fresh()
    q, k, v = _inputs(rank)
    o = dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy="ring")
    out["skipped_backward"] = {"error": None} if rank == 0 else _outcome(lambda: o.sum().backward())

    # 2. ranks out of step: rank 0 skips the second of two identical calls
    comm = fresh()
    q, k, v = _inputs(rank, (False, False, False))
    dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy="ring")
    out["out_of_step"] = {"error": None} if rank == 0 else _outcome(
        lambda: dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy="ring"))

    # 3. ranks differ only in v.requires_grad
    comm = fresh()
    q, k, v = _inputs(rank, (False, False, rank == 0))
    out["requires_grad_mismatch"] = _outcome(lambda: dilated_attention(q, k, v, SEGS, RATES, comm=comm))

    # 4. a peer that skipped the all-to-all of the head-parallel strategy
    comm = fresh()
    q, k, v = _inputs(rank, (False, False, False))
    dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy="head")
    out["head_out_of_step"] = {"error": None} if rank == 0 else _outcome(
        lambda: dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy="head"))

    dist.barrier()  # rank 0 stays alive until the others have timed out (a closed peer errors sooner)

    # 5. the library's default timeout is the user's init_process_group timeout (fairscale creates
    #    its own groups with torch's default: the waits still honour the user's)
    out["default_timeout"] = {"seconds": get_backend(backend).timeout}
    return out


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def outcomes(request):
    if request.param == "deepspeed":
        pytest.importorskip("deepspeed")
        from dilated_attention.comm.deepspeed import prebuild_ops

        prebuild_ops()
    if request.param == "fairscale":
        pytest.importorskip("fairscale")
    # each rank runs every scenario (init_process_group timeout 120 s); raises if any rank exits
    # non-zero, e.g. SIGABRT at exit after the errors (no second try)
    return request.param, spawn_ranks(_scenarios, WORLD, request.param, teardown_retry=False, env=UNINTERPRETED)


def _waiting_ranks_time_out(got, scenario, words):
    for rank in range(1, WORLD):
        res = got[rank][scenario]
        assert res["error"] == PeerTimeoutError.__name__, (rank, res)
        for word in words:
            assert word in res["message"], (rank, word, res["message"])
        assert TIMEOUT * 0.9 <= res["seconds"] <= TIMEOUT * 3 + 5, (rank, res["seconds"])


def test_skipped_backward_raises_on_waiting_ranks(outcomes):
    backend, got = outcomes
    _waiting_ranks_time_out(got, "skipped_backward", ["backward", "pattern 1", "ring step", "call 1", "rank "])


def test_out_of_step_call_raises_instead_of_hanging(outcomes):
    backend, got = outcomes
    _waiting_ranks_time_out(got, "out_of_step", ["call 2", "forward", "same dilated_attention calls"])


def test_head_parallel_out_of_step_raises(outcomes):
    backend, got = outcomes
    _waiting_ranks_time_out(got, "head_out_of_step", ["all-to-all", "call 2"])


def test_requires_grad_mismatch_raises_everywhere_with_values(outcomes):
    backend, got = outcomes
    for rank in range(WORLD):
        res = got[rank]["requires_grad_mismatch"]
        assert res["error"] == "ValueError", (rank, res)
        assert "requires_grad.v: rank 0=True, rank 1=False" in res["message"], res["message"]
        assert res["seconds"] < 30


def test_default_timeout_is_the_process_groups(outcomes):
    backend, got = outcomes
    assert all(g["default_timeout"]["seconds"] == 120 for g in got)
