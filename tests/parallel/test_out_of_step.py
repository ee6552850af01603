"""Ranks out of step after agreeing on their configurations: every rank raises ValueError, none computes garbage.

Agreement is cached per configuration, so a rank that switches to another agreed configuration of the
same shapes, runs two backwards in another order, or skips a call is caught by the stamps every
exchange carries (``comm/stamps.py``). The harness's drifts (``testing.harness.drifts``) run on
spawned gloo ranks for every backend and strategy: 2 ranks (ring, head) and 4 (ring, head, hybrid;
the 4-rank ring and the hybrid also check that the news reaches ranks that never exchanged with the
drifting one). Each rank records what it raised and how long it took.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist

from dilated_attention import dilated_attention
from dilated_attention.comm import BACKEND_NAMES, base, get_backend
from dilated_attention.testing.harness import drift_strategies, drifts, run_out_of_step
from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks

INSTALLED = [n for n in BACKEND_NAMES if n == "collective" or importlib.util.find_spec(n) is not None]
TIMEOUT = 2.0  # seconds the library waits on a peer here


def _group(world: int):
    return dist.new_group(list(range(world)))


def _skipped_backward(rank: int, world: int, backend: str) -> dict:
    """Rank 0 skips a backward (a NaN loss, say) and runs the next forward: the K/V block of its forward meets
    the peer's backward, whose next exchange (dK/dV) then never comes."""
    comm = get_backend(backend, _group(world), timeout=TIMEOUT)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    segs = (8, 16 * world)
    dilated_attention(x, x, x, segs, (1, 2), comm=comm, strategy="ring").sum().backward()  # agreed
    out = dilated_attention(x, x, x, segs, (1, 2), comm=comm, strategy="ring")
    with _timeouts() as waited:
        try:
            if rank == 0:
                dilated_attention(x, x, x, segs, (1, 2), comm=comm, strategy="ring")
            else:
                out.sum().backward()
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc), "timeouts": len(waited)}
    return {"error": None, "message": "", "timeouts": len(waited)}


@contextlib.contextmanager
def _timeouts():
    """Records each wait on a peer that ran out of time (``PeerTimeoutError`` made): behaviour, not a clock."""
    made, original = [], base._Waiting._timeout_error

    def recording(self):
        made.append(self.what)
        return original(self)

    base._Waiting._timeout_error = recording
    try:
        yield made
    finally:
        base._Waiting._timeout_error = original


def _deferred_periodic(rank: int, world: int) -> dict:
    """The device path (stamps compared at the verdict), on CPU: a drift raises at the next call the agreement
    runs for (``check_every``), on every rank. (Three heads: a causal ring then runs on the same exchanges as a
    non-causal one, ``harness.drifts``.)"""
    comm = get_backend("collective", _group(world), timeout=TIMEOUT, check_every=4)
    comm.ledger.defer = True
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 16, 3, 8, generator=g, dtype=torch.float64)
    segs, rates = (8, 16 * world), (1, 2)
    for causal in (True, False):
        dilated_attention(x, x, x, segs, rates, causal=causal, comm=comm, strategy="ring")
    dilated_attention(x, x, x, segs, rates, causal=rank == 0, comm=comm, strategy="ring")  # call 3: no error yet
    try:
        dilated_attention(x, x, x, segs, rates, comm=comm, strategy="ring")  # call 4: 4 % check_every == 0
    except ValueError as exc:
        return {"error": "ValueError", "message": str(exc)}
    return {"error": None, "message": ""}


def _setup_output(backends: list[str]) -> dict:
    """What building each backend for the first time prints and warns in a user's script (this rank)."""
    import contextlib
    import io
    import warnings

    seen = {}
    for name in backends:
        text = io.StringIO()
        with contextlib.redirect_stdout(text), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            get_backend(name)  # fairscale: initialises its model parallel over the world
        seen[name] = {"printed": text.getvalue(), "warnings": [str(w.message) for w in caught]}
    return seen


def _scenarios(rank: int, world: int, backends: list[str]) -> dict:
    from dataclasses import asdict

    setup = _setup_output(backends) if world == 2 else {}
    cpu = torch.device("cpu")
    with _timeouts() as waited:
        drifted = [asdict(r) for r in run_out_of_step(backends, _group(world), cpu, timeout=TIMEOUT)]
    out = {"setup": setup, "drifts": drifted, "drift_timeouts": waited,
           # the device path (GPUs), emulated on CPU tensors: every drift, one backend
           "deferred": [asdict(r) for r in run_out_of_step(["collective"], _group(world), cpu, timeout=TIMEOUT,
                                                           defer=True) if r.case.startswith("out-of-step")]}
    if world == 2:
        out["periodic"] = _deferred_periodic(rank, world)
        out["skipped_backward"] = {}
        for name in backends:
            out["skipped_backward"][name] = _skipped_backward(rank, world, name)
            dist.barrier()  # rank 0 waits until the peer has timed out on the dK/dV it never sends
    return out


def _spawn(world: int) -> list[dict]:
    if "deepspeed" in INSTALLED:
        from dilated_attention.comm.deepspeed import prebuild_ops

        prebuild_ops()  # compiled here, not in a rank while the others wait
    return spawn_ranks(_scenarios, world, INSTALLED, env=UNINTERPRETED)


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return _spawn(2)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return _spawn(4)


@pytest.fixture(params=[2, 4])
def outcome(request):
    return request.param, request.getfixturevalue({2: "two", 4: "four"}[request.param])


def _by_case(got, key="drifts"):
    cases: dict[tuple[str, str], list[dict]] = {}
    for rank_result in got:
        for r in rank_result[key]:
            cases.setdefault((r["case"], r["backend"]), []).append(r)
    return cases


def test_every_rank_raises_for_every_drift_backend_and_strategy(outcome):
    world, got = outcome
    cases = _by_case(got)
    expected = {(f"out-of-step-{s}-{d.name}", b) for b in INSTALLED for s in drift_strategies(world)
                for d in drifts(world) if s in d.strategies}
    assert expected <= set(cases), sorted(expected - set(cases))
    bad = []
    for key in sorted(expected):
        ranks = cases[key]
        assert sorted(r["rank"] for r in ranks) == list(range(world)), key
        for r in ranks:
            # CPU tensors: raised by the call itself (not first by the verify() after it)
            if not (r["ok"] and r["message"].startswith("[call]")):
                bad.append(f"{key} rank {r['rank']}: {r['errors']} {r['message'][:300]}")
    assert not bad, "\n".join(bad)
    # at the exchange that carried the stamp: no rank waited out its timeout on a peer first
    assert [r["drift_timeouts"] for r in got] == [[]] * world, [r["drift_timeouts"] for r in got]


def test_messages_name_the_call_and_the_field(outcome):
    world, got = outcome
    ranks = _by_case(got)[("out-of-step-ring-causal", "collective")]  # rank 0 runs causal=False, the others True
    text = ranks[1]["message"]
    assert "in call 3 (forward), rank 1 received data from rank 0, whose configuration differs: causal: " \
           "rank 0=False, rank 1=True" in text, text
    if world == 4:  # rank 2 only exchanges with ranks 1 and 3 (which agree with it): it hears it from rank 1
        text = ranks[2]["message"]
        assert "rank 2 received data from rank 1, which had found ranks out of step earlier in this call" in text, text


def test_stamps_change_no_result_bit(outcome):
    world, got = outcome
    cases = _by_case(got)
    keys = [(f"stamps-change-nothing-{s}", b) for b in INSTALLED for s in drift_strategies(world)]
    for key in keys:
        assert [r["ok"] for r in cases[key]] == [True] * world, (key, [r["message"] for r in cases[key]])


def test_device_path_raises_at_verify_on_every_rank(outcome):
    world, got = outcome
    cases = _by_case(got, "deferred")
    expected = {(f"out-of-step-{s}-{d.name}-deferred", "collective") for s in drift_strategies(world)
                for d in drifts(world) if s in d.strategies}
    assert set(cases) == expected, sorted(set(cases) ^ expected)
    for key, ranks in cases.items():
        assert sorted(r["rank"] for r in ranks) == list(range(world)), key
        for r in ranks:
            assert r["ok"] and r["message"].startswith("[verify]"), (key, r["message"][:300])
            assert "found by verify() after call" in r["message"], r["message"]


def test_device_path_raises_at_the_periodic_check(two):
    for rank in range(2):
        res = two[rank]["periodic"]
        assert res["error"] == "ValueError", res
        assert "found by the cross-rank check of call 4" in res["message"] and "causal: rank 0=True" in res["message"]


def test_skipped_backward_raises_value_error_on_both_ranks(two):
    got = two
    for name in INSTALLED:
        zero, one = got[0]["skipped_backward"][name], got[1]["skipped_backward"][name]
        # rank 0 (forward of call 3) meets rank 1's backward of call 2: both see it at that exchange
        assert zero["error"] == "ValueError" and "call 3 (forward)" in zero["message"], zero
        assert "call 2 (backward)" in zero["message"], zero["message"]
        assert zero["timeouts"] == 0, zero  # seen at that exchange, not after waiting on the peer
        # rank 1's next exchange waits for a dK/dV that never comes: the mismatch, raised once that wait times out
        assert one["error"] == "ValueError" and "call 2 (backward)" in one["message"], one
        assert one["timeouts"] == 1, one


def test_check_every_must_be_a_positive_int():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="check_every"):
            get_backend("collective", check_every=bad)


def test_backend_set_up_prints_nothing_and_warns_once(two):
    for rank, got in enumerate(two):
        for name, seen in got["setup"].items():
            assert seen["printed"] == "", (rank, name, seen["printed"])
            expected = 1 if name == "fairscale" and rank == 0 else 0  # "initialised fairscale model parallel"
            assert len(seen["warnings"]) == expected, (rank, name, seen["warnings"])


def test_setup_prints_are_dropped_and_anything_else_kept(capsys):
    import warnings

    from dilated_attention.comm.base import without_setup_prints

    with pytest.warns(UserWarning, match="a real warning"), without_setup_prints("built successfully"):
        print("DeepSpeed op built successfully")
        print("something else")
        warnings.warn("a real warning")
    assert capsys.readouterr().out == "something else\n"
