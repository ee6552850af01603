"""The common battery for every installed backend (collective, fairscale, deepspeed) on 1-4 gloo ranks.

One spawn of 4 ranks runs every case with every backend; each test asserts one
case (per backend, then bitwise identity across backends), so a failure names it.
DeepSpeed's first use JIT-builds its shm op (~1 min, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import importlib.util

import pytest

from dilated_attention.comm import BACKEND_NAMES, get_backend
from dilated_attention.testing.harness import cases, spawn_battery
from dilated_attention.testing.spawn import UNINTERPRETED

# collective needs nothing beyond torch; the others run where their package is installed (CI installs both)
INSTALLED = [n for n in BACKEND_NAMES if n == "collective" or importlib.util.find_spec(n) is not None]

WORLD = 4
CASES = [c.name for p in range(1, WORLD + 1) for c in cases(p)]
CHECKS = [
    f"{check}@P{p}"
    for p in range(2, WORLD + 1)
    for check in ("disagreeing-ranks", "one-rank-invalid", "unchecked-calls")
]


def _world(name: str) -> int:
    return int(name.split("P")[-1].split("-")[0])


@pytest.fixture(scope="module")
def results():
    if "deepspeed" in INSTALLED:
        from dilated_attention.comm.deepspeed import prebuild_ops

        prebuild_ops()  # compile DeepSpeed's CPU op here, not in rank 0 while the others wait in new_group
    by_key: dict[tuple[str, str], list] = {}
    for r in spawn_battery(INSTALLED, WORLD, env=UNINTERPRETED):  # (the merges' kernels: tests/test_combine.py)
        case = r.case if r.case.startswith("P") else f"{r.case}@P{r.world}"
        by_key.setdefault((case, r.backend), []).append(r)
    return by_key


def _assert_all_ranks_ok(got, name, world):
    assert sorted(r.rank for r in got) == list(range(world)), f"missing ranks for {name}: {[r.rank for r in got]}"
    bad = [f"rank {r.rank}: {r.message or r.errors}" for r in got if not r.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("backend", INSTALLED)
@pytest.mark.parametrize("name", CASES)
def test_case(results, name, backend):
    _assert_all_ranks_ok(results.get((name, backend), []), f"{name} [{backend}]", _world(name))


@pytest.mark.skipif(len(INSTALLED) < 2, reason="only one backend installed")
@pytest.mark.parametrize("name", CASES)
def test_bitwise_identical_across_backends(results, name):
    """Outputs and q/k/v grads of the installed backends are torch.equal on every rank."""
    got = results.get((name + "[bitwise]", "+".join(INSTALLED)), [])
    _assert_all_ranks_ok(got, name + "[bitwise]", _world(name))


@pytest.mark.parametrize("backend", INSTALLED)
@pytest.mark.parametrize("name", CHECKS)
def test_error_checks(results, name, backend):
    """Disagreeing ranks / one invalid rank: every rank raises ValueError, none hangs."""
    _assert_all_ranks_ok(results.get((name, backend), []), f"{name} [{backend}]", _world(name))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backend_needs_initialised_process_group(backend):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        get_backend(backend)


@pytest.mark.skipif(INSTALLED != list(BACKEND_NAMES), reason="the ring benchmark compares all three backends")
def test_bench_ring_smoke(tmp_path):
    """benchmarks/bench_ring.py --smoke on 2 gloo ranks writes a report with all three backends."""
    import json
    import os

    from dilated_attention.testing.spawn import run_torchrun

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = run_torchrun(["benchmarks/bench_ring.py", "--smoke", "--out", str(tmp_path), "--tag", "smoke"], cwd=root,
                        done=f"wrote {tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "ring_smoke.json").read_text())
    assert set(report["median_ms"]) == set(BACKEND_NAMES)
    assert report["ratio_vs_collective"]["collective"] == 1.0
    assert all(len(t) == report["config"]["iters"] for t in report["times_ms"].values())


# -- warnings through the backends: no FutureWarning from our calls, one message per job --------


def _warnings_worker(rank: int, world: int, backend: str) -> list[dict]:
    """Forward+backward through ``backend`` (ring and head, twice each) on this rank; every warning raised."""
    import os
    import warnings

    import torch

    from dilated_attention import dilated_attention

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every occurrence, not once per location
        for strategy in ("ring", "head", "ring", "head"):
            g = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(1, 16, 4, 8, generator=g, requires_grad=True) for _ in range(3))
            out = dilated_attention(q, k, v, [8, 32], [1, 2], comm=backend, strategy=strategy)
            out.sum().backward()
    return [{"category": w.category.__name__, "message": str(w.message),
             "file": os.path.basename(w.filename), "line": w.lineno} for w in caught]


@pytest.fixture(scope="module", params=[n for n in ("deepspeed", "fairscale") if n in INSTALLED])
def warned(request):
    """(backend, per-rank warnings) of ``_warnings_worker`` on 2 gloo ranks."""
    from dilated_attention.testing.spawn import spawn_ranks

    if request.param == "deepspeed":
        from dilated_attention.comm.deepspeed import prebuild_ops

        prebuild_ops()  # the CPU op is compiled once (cached), not inside a rank
    return request.param, spawn_ranks(_warnings_worker, 2, request.param)


def test_no_future_warning_from_our_calls(warned):
    """deepspeed.comm.all_gather_into_tensor would raise torch's deprecation FutureWarning; we avoid that API."""
    backend, per_rank = warned
    for rank, caught in enumerate(per_rank):
        future = [w for w in caught if w["category"] == "FutureWarning"]
        assert not future, f"{backend} rank {rank}: {future}"


def test_fairscale_warning_once_per_job_at_the_callers_line(warned):
    """fairscale's implicit initialisation is announced by rank 0 only, pointing at the user's call."""
    backend, per_rank = warned
    said = [[w for w in caught if "initialize_model_parallel" in w["message"]] for caught in per_rank]
    if backend != "fairscale":
        assert said == [[], []]
        return
    assert len(said[0]) == 1 and said[1] == [], said
    assert said[0][0]["category"] == "RuntimeWarning"
    assert said[0][0]["file"] == "test_backends.py", said  # the dilated_attention(...) line, not library code
