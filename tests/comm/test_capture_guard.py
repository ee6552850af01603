"""Calls with ``comm`` inside a CUDA graph capture (gloo ranks; the capture itself is simulated).

A capture forbids reading the device on the host, and what it records replays without Python. So a
captured call must already have been checked across ranks (its eager warm-up), carries no stamps (each
replay would rewrite the same ones into log rows later calls reuse), skips the periodic verdict, and
waits for transfers on the stream, not the host. The real capture runs in the harness on GPUs
(``check_cuda_graph``) and in ``tests/kernels/test_cuda_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dilated_attention import consistency, dilated_attention
from dilated_attention.comm import base, get_backend
from dilated_attention.testing.spawn import spawn_ranks
from dilated_attention.planning import call_state

WORLD = 2
L = 16
SEGS, RATES = (8, L * WORLD), (1, 2)


def _inputs(rank):
    g = torch.Generator().manual_seed(300 + rank)
    return [torch.randn(1, L, 4, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def _captured(fn):
    """``fn()`` as if the current stream were being captured: ``(result, error text or None)``."""
    saved = base.capturing, consistency.capturing
    base.capturing = consistency.capturing = lambda: True
    try:
        return fn(), None
    except ValueError as exc:
        return None, str(exc)
    finally:
        base.capturing, consistency.capturing = saved


def _scenarios(rank: int, world_size: int) -> dict:
    out = {}
    for strategy in ("ring", "head"):
        q, k, v = _inputs(rank)
        group = dist.new_group(list(range(WORLD)))

        # never run eagerly: the capture cannot check it across ranks
        comm = get_backend("collective", group)
        _, err = _captured(lambda: dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy))
        out[f"{strategy}-unchecked"] = err

        # warmed up (checked), then captured: no stamps, no verdict though one is due, host waits on the stream
        comm = get_backend("collective", group, check_every=1, timeout=30)
        comm.ledger.defer = True  # the device path of the stamps (a log and a periodic verdict), on CPU
        eager = dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy)
        logged, calls, gathers = len(comm.ledger._expect), call_state(comm).calls, []
        gather = comm.all_gather
        comm.all_gather = lambda *a, **kw: gathers.append(1) or gather(*a, **kw)
        got, err = _captured(lambda: dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy))
        comm.all_gather = gather
        out[f"{strategy}-captured"] = {"error": err, "same": got is not None and torch.equal(got, eager),
                                       "new_log_rows": len(comm.ledger._expect) - logged, "gathers": len(gathers),
                                       "calls": call_state(comm).calls - calls, "host_waits": comm.host_waits}
        out[f"{strategy}-after"] = torch.equal(dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy),
                                               eager)  # the next eager call still checks and matches

        # every call checked on the host: cannot be captured at all
        comm = get_backend("collective", group, check_calls="always")
        dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy)
        _, err = _captured(lambda: dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy))
        out[f"{strategy}-always"] = err
    return out


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_scenarios, WORLD)


@pytest.mark.parametrize("strategy", ["ring", "head"])
def test_a_call_never_run_eagerly_raises_naming_the_warm_up(outcomes, strategy):
    for got in outcomes:
        err = got[f"{strategy}-unchecked"]
        assert err is not None and "CUDA graph" in err and "warm-up" in err and "check_calls=False" in err, err


@pytest.mark.parametrize("strategy", ["ring", "head"])
def test_a_warmed_up_call_is_captured_without_stamps_or_verdict(outcomes, strategy):
    for got in outcomes:
        res = got[f"{strategy}-captured"]
        assert res["error"] is None and res["same"], res
        assert res["new_log_rows"] == 0 and res["gathers"] == 0, res  # no stamp logged, no verdict gathered
        assert res["calls"] == 1 and res["host_waits"], res  # counted; host waits asked for, stream waits used
        assert got[f"{strategy}-after"]


@pytest.mark.parametrize("strategy", ["ring", "head"])
def test_check_calls_always_cannot_be_captured(outcomes, strategy):
    for got in outcomes:
        err = got[f"{strategy}-always"]
        assert err is not None and "check_calls='always'" in err, err
