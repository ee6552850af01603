"""``spawn_ranks``: a rank that crashes at interpreter exit after returning its value gets one more run of the
job; a crash that recurs, a crash before returning, and any crash with ``teardown_retry=False`` raise."""

from __future__ import annotations

import atexit
import os

import pytest
from torch.multiprocessing import ProcessExitedException

from dilated_attention.testing.spawn import spawn_ranks


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


def test_a_crash_at_exit_after_returning_runs_the_job_once_more(tmp_path):
    assert spawn_ranks(_abort_at_exit, 2, str(tmp_path), 1) == [{"rank": 0, "world": 2}, {"rank": 1, "world": 2}]
    assert len(os.listdir(tmp_path)) == 2


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
