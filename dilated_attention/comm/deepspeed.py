"""DeepSpeed backend: bytes move through ``deepspeed.comm``.

Group, first match wins:

1. an explicit ``group=``;
2. DeepSpeed's sequence-parallel group when one is configured:
   ``deepspeed.utils.groups._get_sequence_parallel_group()`` (the ``mpu`` given
   to ``deepspeed.initialize`` exposing ``get_sequence_parallel_group``, or the
   ``(data_parallel, sequence_parallel)`` device mesh from the config), or
   ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` once
   ``initialize_sequence_parallel(k)`` has run (before ``deepspeed.initialize``);
3. the world group.

``deepspeed.init_distributed`` is called when ``deepspeed.comm`` is not yet set
up; with torch.distributed already initialised it only wraps the existing
process group, so ``comm="deepspeed"`` works right after ``init_process_group``.
P2P goes through ``deepspeed.comm.P2POp`` + ``batch_isend_irecv`` (global peer
ranks; DeepSpeed >= 0.14 has both); the all-gather through ``deepspeed.comm.all_gather``
(list form: its ``all_gather_into_tensor`` calls an API torch >= 2.13 deprecates).

On the CPU accelerator DeepSpeed's first ``init_distributed`` JIT-builds a shared-memory op (1-3 min on a
few cores, once per machine; torch caches it under ``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``). Rank 0 says so before the build starts. torch serialises the build with a
``lock`` file in the op's folder and waits, without a word or a time limit, while that file exists; a process
killed mid-build leaves it behind. So before a build the lock is inspected: one that no process of this host
holds open (torch's builder keeps it open while it builds) and that stays ``STALE_LOCK_GRACE_S`` seconds is
reported as an error naming the file and the command that removes it. A build cut short in this process (a
tool's timeout, Ctrl-C, SIGTERM from torchrun) removes the lock it holds.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from .base import CommBackend, install_hint, without_setup_prints

_BUILT = "built successfully"  # DeepSpeed prints this from every rank that loads its CPU communication op
_SHM_OP = "deepspeed_shm_comm"  # the name of DeepSpeed's CPU shared-memory op (its builder's NAME)
STALE_LOCK_GRACE_S = 20.0  # how long a lock no process of this host holds may stay before it is called stale
_UNSEEN_LOCK_S = 600.0  # where /proc cannot tell who holds a lock: its age at which it is called stale


def _ds_comm():
    try:
        import deepspeed.comm as ds_comm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"comm='deepspeed' needs deepspeed: {install_hint('deepspeed')}") from exc
    return ds_comm


def ensure_initialized() -> None:
    """Make ``deepspeed.comm`` usable on top of an initialised torch.distributed (no-op if it is)."""
    ds_comm = _ds_comm()
    if ds_comm.is_initialized():
        return
    # init_distributed only checks these to decide whether to run MPI discovery; torch is already
    # initialised, so fill them from the process group (torchrun sets them anyway).
    defaults = {"RANK": dist.get_rank(), "WORLD_SIZE": dist.get_world_size(), "LOCAL_RANK": 0,
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}
    for key, value in defaults.items():
        os.environ.setdefault(key, str(value))
    import deepspeed

    with _op_build(), without_setup_prints(_BUILT):
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)


def prebuild_ops() -> None:
    """JIT-build (or load from ~/.cache/torch_extensions) the op ``init_distributed`` compiles on CPU.

    On the CPU accelerator DeepSpeed's first ``init_distributed`` compiles a shared-memory op
    (about a minute). Call this once in the launching process before spawning ranks, so no rank
    compiles while the others wait in a collective with a timeout.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    from deepspeed.comm.torch import build_shm_op

    with _op_build(), without_setup_prints(_BUILT):
        build_shm_op()


def shm_op_dir() -> str | None:
    """The folder where torch JIT-builds DeepSpeed's shared-memory op, or None where this DeepSpeed does not
    build it (another accelerator, or the op came prebuilt with DeepSpeed's installation)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False) \
            or installed_ops.get(builder.NAME, False):
        return None
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:  # torch's own rule (cpp_extension._get_build_directory) for a CPU build
        tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"{tag}_{device}")
    return os.path.join(root, builder.NAME)


def _holds(pid: int | str, target: str) -> bool:
    """Whether process ``pid`` has the file ``target`` (a real path) open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def _lock_holders(lock: str) -> list[int] | None:
    """Process ids of this host that have ``lock`` open (torch's FileBaton keeps it open while it builds);
    None where ``/proc`` cannot tell."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(lock)
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if _holds(pid, target)]


def _stale_lock_error(lock: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"comm='deepspeed': DeepSpeed's CPU op cannot be built: the build lock {lock} {why}, so no build holds "
        f"it (a build killed before it finished leaves it). If no build of the op is running (on this host or "
        f"another sharing the folder), remove it and run again: rm -f {lock}")


def check_build_lock(build_dir: str, grace: float | None = None, poll: float = 0.5) -> None:
    """Return once ``build_dir`` has no build lock; wait while a live build holds it; raise ``RuntimeError``
    naming the lock and the command that removes it when no process of this host holds it for ``grace``
    seconds (default ``STALE_LOCK_GRACE_S``; where ``/proc`` is missing: when the lock is older than 10 min)."""
    lock = os.path.join(build_dir, "lock")
    grace = STALE_LOCK_GRACE_S if grace is None else grace
    unheld_since, builder = None, None
    while os.path.exists(lock):
        if builder is not None and _holds(builder, os.path.realpath(lock)):
            time.sleep(poll)  # the build seen last still runs (one process's files to look at, not the host's)
            continue
        holders = _lock_holders(lock)
        now = time.monotonic()
        if holders is None:
            try:
                age = time.time() - os.path.getmtime(lock)
            except OSError:  # released meanwhile
                continue
            if age > _UNSEEN_LOCK_S:
                raise _stale_lock_error(lock, f"is {age / 60:.0f} min old")
        elif holders:
            unheld_since, builder = None, holders[0]  # a live build: torch waits for it
        elif unheld_since is None:
            unheld_since = now
        elif now - unheld_since >= grace:
            raise _stale_lock_error(lock, f"exists and no process of this host has had it open for {grace:g} s")
        time.sleep(poll)


def release_build_lock(build_dir: str | None = None) -> bool:
    """Remove the build lock this process holds (a build cut short: call it before ``os._exit``, which skips
    torch's own release); a lock held by another process is left alone. Returns whether one was removed."""
    if build_dir is None:
        build_dir = _building_in
    if build_dir is None:
        return False
    lock = os.path.join(build_dir, "lock")
    holders = _lock_holders(lock) if os.path.exists(lock) else []
    if not holders or os.getpid() not in holders:
        return False
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return True


_building_in: str | None = None  # the op folder of a build under way in this process
_announced = False


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def _op_build():
    """Around a step that loads (and may first JIT-build) the shared-memory op: a stale lock raises first; rank 0
    says that a build starts (once per process); a build cut short leaves no lock (at exit, on SIGTERM)."""
    global _building_in, _announced
    try:
        build_dir = shm_op_dir()
    except Exception:  # an accelerator or release this cannot read: DeepSpeed goes its own way
        build_dir = None
    if build_dir is None:
        yield
        return
    check_build_lock(build_dir)  # (torch takes the lock to load a built op too)
    built = os.path.isdir(build_dir) and any(f.endswith(".so") for f in os.listdir(build_dir))
    if not built and not _announced and _rank() == 0:
        print(f"DeepSpeed is building its shared-memory communication op for CPU: usually 1-3 min, once per "
              f"machine (cached in {build_dir})", file=sys.stderr, flush=True)
        _announced = True
    _building_in = build_dir
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _release_then_terminate) if on_main else None
    try:
        yield
    finally:
        _building_in = None
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _release_then_terminate(signum, frame) -> None:
    release_build_lock()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


atexit.register(release_build_lock)  # a build still running on another thread when the interpreter exits


def deepspeed_sequence_parallel_group() -> dist.ProcessGroup | None:
    """DeepSpeed's configured sequence-parallel group, or None when there is none."""
    from deepspeed.utils import groups

    try:
        return groups._get_sequence_parallel_group()
    except (KeyError, AssertionError):  # no mpu/mesh with a sequence-parallel group
        pass
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
    except ImportError:  # older releases
        return None
    return getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None)


class DeepSpeedBackend(CommBackend):
    """Sequence parallel through ``deepspeed.comm`` on DeepSpeed's sequence-parallel group."""

    name = "deepspeed"

    def _resolve_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        ensure_initialized()
        self._ds = _ds_comm()
        if group is not None:
            return group
        sp = deepspeed_sequence_parallel_group()
        return sp if sp is not None else dist.group.WORLD

    def _batch_p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
        ds = self._ds
        ops = [ds.P2POp(ds.isend, t, dst, self.group) for t, dst in sends]
        ops += [ds.P2POp(ds.irecv, t, src, self.group) for t, src in recvs]
        return ds.batch_isend_irecv(ops)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        # deepspeed.comm.all_gather_into_tensor calls torch.distributed.all_gather_into_tensor, which
        # torch >= 2.13 deprecates (a FutureWarning per process, pointing into torch). The list form
        # goes through deepspeed.comm as well and is not deprecated: the blocks are views of ``out``.
        blocks = list(out.view(-1).split(inp.numel()))
        return self._ds.all_gather(blocks, inp, group=self.group, async_op=True)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor):
        return self._ds.all_to_all_single(out, inp, group=self.group, async_op=True)
