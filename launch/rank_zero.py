"""Rank 0 speaks for a torchrun job: one copy of each message, argument errors as one line.

Imported by the scripts in launch/ (their directory is on ``sys.path`` when run).
Both helpers read torchrun's ``RANK`` from the environment, so they work before
the process group exists.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

from dilated_attention.launch_utils import RankZeroParser  # noqa: F401 (the launch scripts import it from here)


def job_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def quiet_other_ranks() -> bool:
    """Silence stdout and Python warnings on ranks other than 0 (stderr stays: errors still show).

    Every rank runs the same code, so every warning and library banner (fairscale's
    and DeepSpeed's included) would otherwise appear once per rank. Also hides, on
    every rank, torch's FutureWarning for ``all_gather_into_tensor``, which
    ``deepspeed.comm`` still calls on our behalf. Returns whether this is rank 0.
    """
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    if job_rank() == 0:
        return True
    warnings.simplefilter("ignore")
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    return False


def run_job(prog: str, env, body: Callable[[], None]) -> int:
    """Run ``body`` and leave the process group (``env`` from ``launch_utils.init_distributed``).

    A ``ValueError`` is the library rejecting the configuration, raised alike on every
    rank (its cross-rank check makes them agree): rank 0 says it in one line and the
    job exits with status 2. Any other exception may be this rank's alone (out of memory,
    a data error) while the others wait in an exchange it will never join: it propagates
    without the leaving barrier, so this process exits at once and torchrun stops the
    others, instead of every rank waiting out the process group's timeout. Returns the exit status.
    """
    status = 0
    try:
        body()
    except ValueError as exc:
        if job_rank() == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        status = 2
    env.shutdown()
    return status
