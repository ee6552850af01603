"""The harness's run itself (``testing.harness.run_battery``) on gloo ranks: steps split by ``shard``/``only``, a
failing case reported by every rank while the run goes on, and a rank left waiting by peers that failed before a
transfer ends the run with the reason on every rank instead of hanging.

Failures are injected by wrapping ``harness.run_case`` inside the spawned ranks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

import pytest
import torch

from dilated_attention.testing import harness
from dilated_attention.testing.spawn import init_local_rank, spawn_ranks, write_result

FAIL_AT, STUCK_AT = 1, 1  # the case index whose step fails (below)


def _failing_run_case(failing_ranks: tuple[int, ...], after: bool):
    """``run_case`` raising in case ``FAIL_AT`` of each world size on ``failing_ranks``: after running it (its
    peers are not left waiting) or before (they wait in its first transfer)."""
    real = harness.run_case
    names = {}

    def run_case(case, backend_name, group, device, seed):
        index = names.setdefault(case.name, len(names))
        rank = torch.distributed.get_rank(group)
        if index == FAIL_AT and rank in failing_ranks and not after:
            raise RuntimeError(f"deliberate failure on rank {rank}")
        got = real(case, backend_name, group, device, seed)
        if index == FAIL_AT and rank in failing_ranks:
            raise RuntimeError(f"deliberate failure on rank {rank}")
        return got
    return run_case


def _run_goes_on(rank: int, world: int) -> list[dict]:
    harness.run_case = _failing_run_case((1,), after=True)
    first = _first(world, 4)
    results = harness.run_battery(["collective"], torch.device("cpu"), [world], progress=rank == 0,
                                  only=["cases"], select=lambda s: s.label.split(" ")[0] in first)
    return [asdict(r) for r in results]


def _first(world: int, n: int) -> set[str]:
    return {c.name for c in harness.cases(world)[:n]}


def test_a_failing_case_is_reported_on_every_rank_and_the_run_goes_on(capfd):
    got = spawn_ranks(_run_goes_on, 2)
    names = [c.name for c in harness.cases(2)[:4]]
    failed_case = names[FAIL_AT]
    for rank, results in enumerate(got):
        by_case = {}
        for r in results:
            by_case.setdefault(r["case"], []).append(r)
        for name in names:  # every step ran on every rank, the one after the failure too
            assert name in by_case, (rank, name, sorted(by_case))
        assert all(r["ok"] for n in names if n != failed_case for r in by_case[n]), rank
        failing = [r for r in results if not r["ok"]]
        assert failing, rank
        text = " ".join(r["message"] for r in failing)
        assert "deliberate failure on rank 1" in text, (rank, text)  # rank 0 reports rank 1's failure too
    out = capfd.readouterr().out
    assert f"{failed_case} [collective]: FAIL" in out and "rank 1:" in out, out[-3000:]
    assert "[harness 4/4" in out, out[-3000:]  # progress, to the last step


def test_shards_split_the_steps_and_only_selects_groups():
    cpu = torch.device("cpu")
    whole = [s.label for s in harness.battery_steps(["collective"], cpu, 3, None, out_of_step=True)]
    assert {s.group for s in harness.battery_steps(["collective"], cpu, 3, None, out_of_step=True)} == \
        {"cases", "checks", "out-of-step"}
    parts = [whole[i::3] for i in range(3)]
    assert sorted(sum(parts, [])) == sorted(whole) and all(parts)
    assert harness.parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "a/b", "1"):
        with pytest.raises(ValueError, match="--shard must be i/n"):
            harness.parse_shard(bad)


def _stuck_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Ranks 0 and 1 fail case ``STUCK_AT`` before its first transfer; rank 2 runs it and waits for them."""
    torch.set_num_threads(1)
    init_local_rank(rank, world, port)
    harness.run_case = _failing_run_case((0, 1), after=False)
    try:
        harness.run_battery(["collective"], torch.device("cpu"), [world], only=["cases"], case_timeout=4.0,
                            select=lambda s: s.label.split(" ")[0] in _first(world, 3))
        value = "finished"
    except harness.HarnessStopped as exc:
        value = f"stopped: {exc}"
    write_result(out_dir, rank, value)
    sys.stdout.flush()
    os._exit(0)  # a stuck peer would never reach the teardown's barrier


def test_a_rank_left_waiting_by_failed_peers_stops_the_run_on_every_rank(tmp_path, capfd):
    """Ranks 0 and 1 give up on rank 2 at the case timeout and stop with the reason; rank 2, waiting in the case's
    first transfer, then learns that they left (its transfer fails) and stops too, or its watchdog ends it."""
    import torch.multiprocessing as mp

    from dilated_attention.launch_utils import free_port

    try:
        mp.start_processes(_stuck_rank, args=(3, free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
        watchdog = False
    except mp.ProcessExitedException as exc:
        assert exc.error_index == 2 and exc.exit_code == 3, exc  # rank 2's watchdog ended it
        watchdog = True
    label = harness.cases(3)[STUCK_AT].name
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.json").read_text()
        assert "stopped" in text and label in text and "did not report" in text, (rank, text)
    if watchdog:
        err = capfd.readouterr().err
        assert f"rank 2: {label} [collective] did not finish within 6 s" in err, err[-3000:]
    else:
        text = (tmp_path / "rank2.json").read_text()
        assert "stopped" in text and label in text, text
