"""Run a function on spawned gloo ranks of this machine and collect what each rank returns.

``spawn_ranks(fn, world, *args)`` starts ``world`` CPU processes in one gloo
group, calls ``fn(rank, world, *args)`` on each, and returns the per-rank return
values (JSON round-tripped: dicts, lists, numbers, strings). ``fn`` must be a
module-level function (it is pickled by name). A rank that exits non-zero (an
exception, or a signal such as SIGABRT at exit) makes ``spawn_ranks`` raise, with two
exceptions. A rank killed by a signal after it destroyed its group and returned its value
died in the interpreter's teardown (a gloo worker thread releasing a tensor while Python
shuts down, seen rarely on loaded machines): the job runs once more and raises if it
recurs. A rendezvous port that another process took between its choice and rank 0's
listening on it: the ranks start again on another. ``run_spawned`` is the same for a worker
that joins its own group and writes its result (``write_result``); ``run_torchrun`` runs a
script under torchrun by the teardown rule.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, MutableMapping

import torch
import torch.distributed as dist

from ..launch_utils import free_port, leave_process_group


def init_local_rank(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """Join a ``world_size``-rank group on 127.0.0.1 (torchrun's environment variables set as it would)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.json")


def write_result(out_dir: str, rank: int, value: Any) -> None:
    """A spawned rank's result (JSON) where ``run_spawned`` collects it."""
    with open(_result_path(out_dir, rank), "w") as f:
        json.dump(value, f)


# The environment of a user's CPU process: Triton's kernels not interpreted, so the merges take their torch path (a
# test process interprets them to check the kernels' code; ranks that only run the library around them would spend
# most of their time in the interpreter)
UNINTERPRETED: Mapping[str, str | None] = {"TRITON_INTERPRET": None}


def _apply(target: MutableMapping[str, str], env: Mapping[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value


def environ_with(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """A copy of ``os.environ`` with ``env`` applied (``None``: the variable removed), for a subprocess."""
    out = dict(os.environ)
    _apply(out, env or {})
    return out


@contextmanager
def environment(env: Mapping[str, str | None] | None) -> Iterator[None]:
    """``os.environ`` with ``env`` applied (``None``: the variable removed), restored after: what processes started
    inside inherit."""
    saved = {name: os.environ.get(name) for name in env or {}}
    try:
        _apply(os.environ, env or {})
        yield
    finally:
        _apply(os.environ, saved)


def run_spawned(fn: Callable[..., None], world_size: int, *args: Any, teardown_retry: bool = True,
                env: Mapping[str, str | None] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, port, *args, out_dir)`` on ``world_size`` spawned processes, each ending with
    ``write_result(out_dir, rank, value)``; returns the values in rank order (``out_dir`` is then removed).
    ``teardown_retry=False``: a crash at exit raises at once (for tests of clean exits). ``env``: the processes'
    environment changes (``environment``; e.g. ``UNINTERPRETED``)."""
    with environment(env):
        results = _spawn_once(fn, world_size, args, teardown_retry)
        return _spawn_once(fn, world_size, args, False) if results is None else results


def _spawn_once(fn: Callable[..., None], world_size: int, args: tuple, teardown_retry: bool) -> list[Any] | None:
    """The ranks' results; None where a rank died of a signal after writing its result and ``teardown_retry``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dilated_attention_") as out_dir:
        try:
            _start_on_a_free_port(fn, world_size, args, out_dir)
        except mp.ProcessExitedException as exc:
            returned = os.path.exists(_result_path(out_dir, exc.error_index))
            if not (teardown_retry and exc.signal_name and returned):
                raise
            print(f"run_spawned: rank {exc.error_index} died of {exc.signal_name} at interpreter exit, after writing "
                  "its result; running the job once more", file=sys.stderr, flush=True)
            return None
        results = []
        for rank in range(world_size):
            with open(_result_path(out_dir, rank)) as f:
                results.append(json.load(f))
        return results


PORT_ATTEMPTS = 3


def _start_on_a_free_port(fn: Callable[..., None], world_size: int, args: tuple, out_dir: str) -> None:
    """``fn``'s ranks started on a port that was free a moment ago, and again on another where some other process
    took it in between (rank 0's store then cannot listen, before any rank ran past joining its group)."""
    import torch.multiprocessing as mp

    for attempt in range(PORT_ATTEMPTS):
        try:
            mp.start_processes(fn, args=(world_size, free_port(), *args, out_dir), nprocs=world_size,
                               start_method="spawn")
            return
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                raise
            print("run_spawned: the rendezvous port was taken before rank 0 listened on it; starting the ranks on "
                  "another", file=sys.stderr, flush=True)


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    init_local_rank(rank, world_size, port)
    result = fn(rank, world_size, *args)  # raising, this rank exits at once (no barrier its peers may never reach)
    leave_process_group()
    write_result(out_dir, rank, result)


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, teardown_retry: bool = True,
                env: Mapping[str, str | None] | None = None) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each run on its own gloo rank
    (``teardown_retry``, ``env``: see ``run_spawned``)."""
    return run_spawned(_entry, world_size, fn, args, teardown_retry=teardown_retry, env=env)


_SIGNAL_DEATH = re.compile(r"Signal \d+ \(SIG\w+\) received")  # torchrun's summary of a rank killed by a signal


def run_torchrun(args: list[str], *, cwd: str, done: str, nproc: int = 2, timeout: float = 240,
                 env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=nproc *args`` in ``cwd`` on CPU ranks
    (gloo, DeepSpeed's CPU accelerator, one thread a rank; ``env``: changes, as ``run_spawned``'s), output
    captured. Runs once more when a rank died of a signal after the job printed ``done`` (a crash in the
    interpreter's teardown: ``spawn_ranks``'s rule)."""
    full_env = environ_with({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)

    proc = run()
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and done in output and _SIGNAL_DEATH.search(output):
        print(f"run_torchrun: a rank died of a signal after {done!r}; running the job once more", file=sys.stderr,
              flush=True)
        proc = run()
    return proc
