"""``spawn_ranks``: a rank that crashes at interpreter exit after returning its value gets one more run of the
job; a crash that recurs, a crash before returning, and any crash with ``teardown_retry=False`` raise.
An exception on one rank raises at once, without waiting for the others.
``run_torchrun``: the same rule, with "returned" read as "the job printed its last line". ``env=``: the
processes' environment changes, the caller's environment untouched."""

from __future__ import annotations

import atexit
import os
import socket
import time

import pytest
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from dilated_attention.testing.spawn import UNINTERPRETED, environ_with, environment, spawn_ranks


def _abort_at_exit(rank: int, world_size: int, folder: str, crashes: int) -> dict:
    """Rank 1 aborts at exit in its first ``crashes`` runs; each run leaves a file, so the test counts runs."""
    if rank == 1:
        runs = len(os.listdir(folder))
        open(os.path.join(folder, f"run{runs}"), "w").close()
        if runs < crashes:
            atexit.register(os.abort)  # after the group is destroyed and the value written: the teardown
    return {"rank": rank, "world": world_size}


def _abort_before_returning(rank: int, world_size: int, folder: str) -> dict:
    if rank == 1:
        open(os.path.join(folder, f"run{len(os.listdir(folder))}"), "w").close()
        os.abort()
    return {"rank": rank}


def _raise_on_one_rank(rank: int, world_size: int) -> dict:
    if rank == 1:
        raise RuntimeError("rank 1 failed alone")
    # rank 0 waits for a peer that never comes; not in an exchange, which fails by itself once rank 1's
    # connection closes and would race rank 1's error to be the one reported
    time.sleep(120)
    return {"rank": rank}


def test_an_exception_on_one_rank_raises_without_waiting_for_the_others():
    """The failing rank exits at once (no leaving barrier), so the job ends well inside the group's 120 s timeout."""
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 failed alone"):
        spawn_ranks(_raise_on_one_rank, 2)
    assert time.monotonic() - start < 60


def test_a_crash_at_exit_after_returning_runs_the_job_once_more(tmp_path, monkeypatch):
    import tempfile

    runs, scratch = tmp_path / "runs", tmp_path / "scratch"
    runs.mkdir()
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the ranks' results are collected
    assert spawn_ranks(_abort_at_exit, 2, str(runs), 1) == [{"rank": 0, "world": 2}, {"rank": 1, "world": 2}]
    assert len(os.listdir(runs)) == 2
    assert os.listdir(scratch) == []  # both runs' result folders removed


def test_a_crash_at_exit_that_recurs_raises(tmp_path):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_at_exit, 2, str(tmp_path), 2)
    assert len(os.listdir(tmp_path)) == 2


def test_without_teardown_retry_a_crash_at_exit_raises_at_once(tmp_path):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_at_exit, 2, str(tmp_path), 1, teardown_retry=False)
    assert len(os.listdir(tmp_path)) == 1


def test_a_crash_before_returning_raises_at_once(tmp_path):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_before_returning, 2, str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1


_SCRIPT = '''
import atexit, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
print("job done", flush=True)
folder, crashes = sys.argv[1], int(sys.argv[2])
if os.environ["RANK"] == "1":
    runs = len(os.listdir(folder))
    open(os.path.join(folder, f"run{runs}"), "w").close()
    if runs < crashes:
        atexit.register(os.abort)
'''


@pytest.mark.parametrize("crashes, done, ok, runs", [(1, "job done", True, 2), (2, "job done", False, 2),
                                                     (1, "not printed", False, 1)])
def test_run_torchrun_runs_once_more_after_a_crash_at_exit_past_done(tmp_path, crashes, done, ok, runs):
    from dilated_attention.testing.spawn import run_torchrun

    script, folder = tmp_path / "job.py", tmp_path / "runs"
    script.write_text(_SCRIPT)
    folder.mkdir()
    proc = run_torchrun([str(script), str(folder), str(crashes)], cwd=str(tmp_path), done=done, timeout=120)
    assert (proc.returncode == 0) == ok, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(os.listdir(folder)) == runs


def _environ(rank: int, world_size: int) -> dict:
    return {"interpret": os.environ.get("TRITON_INTERPRET"), "extra": os.environ.get("DILATED_ATTENTION_TEST_VAR")}


def test_env_reaches_the_ranks_and_leaves_the_caller_as_it_was(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("DILATED_ATTENTION_TEST_VAR", raising=False)
    env = {**UNINTERPRETED, "DILATED_ATTENTION_TEST_VAR": "set"}
    assert spawn_ranks(_environ, 2, env=env) == [{"interpret": None, "extra": "set"}] * 2
    assert os.environ["TRITON_INTERPRET"] == "1" and "DILATED_ATTENTION_TEST_VAR" not in os.environ
    made = environ_with(env)
    assert "TRITON_INTERPRET" not in made and made["DILATED_ATTENTION_TEST_VAR"] == "set"
    with pytest.raises(RuntimeError), environment(env):  # restored when the body raises too
        assert "TRITON_INTERPRET" not in os.environ
        raise RuntimeError
    assert os.environ["TRITON_INTERPRET"] == "1" and "DILATED_ATTENTION_TEST_VAR" not in os.environ


def _rank_of(rank: int, world_size: int) -> int:
    return rank


def test_a_rendezvous_port_taken_before_rank_0_listens_starts_the_ranks_on_another(monkeypatch, capfd):
    from dilated_attention.launch_utils import free_port
    from dilated_attention.testing import spawn

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])  # the first port handed out is held by another process's listener
        monkeypatch.setattr(spawn, "free_port", lambda: next(ports, None) or free_port())
        assert spawn_ranks(_rank_of, 2) == [0, 1]
    assert "rendezvous port was taken" in capfd.readouterr().err
    monkeypatch.setattr(spawn, "PORT_ATTEMPTS", 1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(spawn, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(ProcessRaisedException, match="EADDRINUSE"):  # attempts spent: the error itself
            spawn_ranks(_rank_of, 2)
