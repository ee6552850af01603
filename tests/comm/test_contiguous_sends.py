"""Every tensor the library hands a backend to move is contiguous: checked where the bytes leave, in each installed
backend's ``_batch_p2p``, ``_all_gather`` and ``_all_to_all``, on two gloo ranks, over the calls that reach them
(ring steps and causal shares, head swaps by exchange and as collectives, key-mask and signature gathers).

A transfer of a strided view fails late and far from its cause: gloo refuses it on one rank while its peer waits
out the timeout, and DeepSpeed's send of one hangs until the battery's case timeout. Here each such tensor is
recorded (the primitive, its role, shape, strides and the library line that posted it) and a contiguous copy
moves instead, so the ranks stay in step and the test fails in seconds, naming the line. A short peer timeout
bounds any wait that goes wrong anyway.
"""

from __future__ import annotations

import importlib.util

import pytest

from dilated_attention.comm import BACKEND_NAMES
from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks

INSTALLED = [n for n in BACKEND_NAMES if n == "collective" or importlib.util.find_spec(n) is not None]
# cases of the battery (testing/cases.py) at two ranks that reach every kind of transfer
CASES = ("P2-longnet-full", "P2-longnet-causal-gqa-transposed", "P2-ring-key-padding-full",
         "P2-ring-shared-dilated-causal", "P2-ring-head-chunks-causal", "P2-zigzag-ring-longnet-causal",
         "P2-head-longnet-causal-gqa", "P2-head-docs-causal", "P2-head-chunks-longnet-causal")
COLLECTIVE_CASE = "P2-head-longnet-causal-gqa"  # again with whole-group all-to-alls as collectives (GPUs' way)
TIMEOUT_S = "30"  # a peer waiting on a rank that failed gives up after this long


def _primitives(backend_class: type) -> list[tuple[type, str]]:
    """``(class, name)`` of each transfer primitive where ``backend_class`` gets it from."""
    owners = []
    for name in ("_batch_p2p", "_all_gather", "_all_to_all"):
        owner = next(c for c in backend_class.__mro__ if name in vars(c))
        owners.append((owner, name))
    return owners


def _checked(original, name: str, found: list[str], seen: dict[str, int]):
    """``original`` (a primitive) that records every non-contiguous tensor it is given and moves a contiguous copy
    of it (a received one lands in the copy: the values are lost, the failure is recorded)."""
    import traceback

    def fix(t, role: str):
        seen[name] = seen.get(name, 0) + 1
        if t.is_contiguous():
            return t
        caller = next((f for f in reversed(traceback.extract_stack()) if "dilated_attention" in f.filename
                       and "/comm/" not in f.filename), None)
        where = f"{caller.filename.split('dilated_attention/')[-1]}:{caller.lineno}" if caller else "?"
        found.append(f"{name} {role}: shape {tuple(t.shape)}, stride {t.stride()} (posted from {where})")
        return t.contiguous()

    if name == "_batch_p2p":
        def primitive(self, sends, recvs):
            return original(self, [(fix(t, "send"), r) for t, r in sends], [(fix(t, "receive"), r) for t, r in recvs])
    else:
        def primitive(self, out, inp):
            return original(self, fix(out, "output"), fix(inp, "input"))
    return primitive


def _contiguity_worker(rank: int, world: int, backend_name: str) -> dict:
    import torch

    from dilated_attention.comm import get_backend
    from dilated_attention.testing.cases import cases, run_case

    if backend_name == "deepspeed":  # (its CPU op, compiled at first use for a minute or more, serves only
        import deepspeed.comm.torch  # inference_all_reduce: none of the transfers checked here)

        deepspeed.comm.torch.build_shm_op = lambda: None
    found: list[str] = []
    seen: dict[str, int] = {}
    backend_class = type(get_backend(backend_name))
    for owner, name in _primitives(backend_class):
        setattr(owner, name, _checked(vars(owner)[name], name, found, seen))
    battery = {c.name: (i, c) for i, c in enumerate(cases(world))}
    results = {}
    for label, collective in [*((name, None) for name in CASES), (COLLECTIVE_CASE + "[collective]", True)]:
        index, case = battery[label.split("[")[0]]
        before = len(found)
        backend_class.collective_all_to_all = collective
        try:
            result, _ = run_case(case, backend_name, None, torch.device("cpu"), 1000 * world + index)
            results[label] = [result.ok, result.message, found[before:]]
        except Exception as exc:  # (reported with what the check found: often its consequence)
            results[label] = [False, f"{type(exc).__name__}: {exc}"[:300], found[before:]]
    comm = get_backend(backend_name)
    before = len(found)
    comm.verify()  # the stamps' verdict: a gather of every rank's count
    results["verify"] = [True, "", found[before:]]
    return {"results": results, "seen": seen}


@pytest.fixture(scope="module", params=INSTALLED)
def checked(request):
    env = {**UNINTERPRETED, "DILATED_ATTENTION_TIMEOUT": TIMEOUT_S}
    return request.param, spawn_ranks(_contiguity_worker, 2, request.param, env=env)


def test_every_tensor_a_backend_moves_is_contiguous(checked):
    backend, per_rank = checked
    for rank, got in enumerate(per_rank):
        bad = [f"{label}: {f}" for label, (_, _, found) in got["results"].items() for f in found]
        assert not bad, f"{backend}, rank {rank}: non-contiguous tensors reached the backend:\n" + "\n".join(bad)
        failed = {label: message for label, (ok, message, _) in got["results"].items() if not ok}
        assert not failed, f"{backend}, rank {rank}: cases off the oracle: {failed}"
        # the check saw every primitive at work (the collective all-to-all: the case run with collectives)
        assert {"_batch_p2p", "_all_gather", "_all_to_all"} <= set(got["seen"]), got["seen"]
