"""torchrun set-up in one call: process group from the environment, device, threads, seed.

Every script that runs under ``torchrun`` (benchmarks, launch/, scripts/) starts
with the same steps; doing them in one place keeps the order right (the device is
selected before NCCL starts, ``DS_ACCELERATOR`` is set before DeepSpeed is
imported, CPU ranks sharing a host do not oversubscribe its cores)::

    from dilated_attention.launch_utils import init_distributed

    env = init_distributed("auto", seed=0)       # torchrun --nproc_per_node=K script.py
    x = torch.randn(..., device=env.device)
    ...
    env.shutdown()

Run without ``torchrun`` (no ``WORLD_SIZE`` in the environment) it makes a world
of one on 127.0.0.1, so the same script also runs as plain ``python script.py``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICES = ("auto", "cuda", "cpu")


def say(text: str, rank: int | None = None, file=None) -> None:
    """Write ``text``, each of its lines prefixed ``[rank r]`` when ``rank`` is given, in one write, flushed
    (``file``: default ``sys.stdout``): the lines of ranks sharing a terminal never cut into one another."""
    stream = sys.stdout if file is None else file
    prefix = "" if rank is None else f"[rank {rank}] "
    stream.flush()  # what was written before goes first, on its own
    stream.write("".join(f"{prefix}{line}\n" for line in (str(text).splitlines() or [""])))
    stream.flush()


def int_list(text: str) -> list[int]:
    """argparse type for comma-separated integers (``--segments 2048,8192``)."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _number(kind: type, text: str, ok, rule: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer above 0 (a count)."""
    return _number(int, text, lambda x: x > 0, "a positive integer")


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (seconds, sizes)."""
    return _number(float, text, lambda x: 0 < x < float("inf"), "a positive number")


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1] (a rate)."""
    return _number(float, text, lambda x: 0 <= x <= 1, "a fraction in [0, 1]")


def positive_list(kind: type):
    """argparse type: comma-separated numbers above 0 (``--world-sizes 1,2,4``)."""
    one = positive_int if kind is int else positive_float

    def parse(text: str) -> list:
        values = [one(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"must be comma-separated positive numbers, got {text!r}")
        return values

    return parse


class RankZeroParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line, printed by rank 0 only (torchrun's ``RANK``); every rank exits 2."""

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: error: {message} (--help lists the options)", file=sys.stderr, flush=True)
        sys.exit(2)


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str  # "nccl" or "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shutdown(self) -> None:
        """Leave the process group (after a barrier, so no rank exits while others still talk)."""
        leave_process_group()


def leave_process_group(barrier: bool = True) -> None:
    """Destroy the default process group (after a barrier unless ``barrier=False``), first releasing what
    ``torch.compile`` captured: a CUDA graph still alive with NCCL kernels in it keeps NCCL's finalize
    waiting forever, so ``destroy_process_group`` hangs after ``mode="reduce-overhead"`` (pytorch/pytorch#115388).
    Does nothing outside a process group."""
    if not dist.is_initialized():
        return
    if "torch._dynamo" in sys.modules:  # something was compiled: its cudagraph trees may hold NCCL work
        torch.compiler.reset()
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for single-host rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_distributed(device: str = "auto", *, seed: int | None = None,
                     timeout: float | datetime.timedelta | None = None) -> DistEnv:
    """Initialise torch.distributed from torchrun's environment and pick this rank's device.

    ``device``: ``"cuda"`` (NCCL, GPU ``LOCAL_RANK``), ``"cpu"`` (gloo) or ``"auto"``
    (CUDA when available). ``seed`` seeds torch's CPU and CUDA generators with the
    same value on every rank (add ``env.rank`` yourself for per-rank streams).
    ``timeout`` (seconds or timedelta) bounds every collective of the default group;
    None keeps torch's default. If the default group already exists it is reused.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError('device="cuda" but torch.cuda.is_available() is False')
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    # DeepSpeed picks its accelerator when first imported: tell it before anyone imports it.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_cuda else "cpu")
    if "WORLD_SIZE" not in os.environ:  # plain `python script.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible "
                             "(more processes per node than GPUs? check --nproc_per_node and CUDA_VISIBLE_DEVICES)")
        torch.cuda.set_device(local_rank)  # before NCCL starts, or every rank's communicator lands on GPU 0
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # ranks on one host share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        kwargs = {}
        if timeout is not None:
            kwargs["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else \
                datetime.timedelta(seconds=float(timeout))
        dist.init_process_group(backend, **kwargs)
    else:
        backend = dist.get_backend()
    if seed is not None:
        torch.manual_seed(seed)  # also seeds every CUDA device
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, local_world, dev, backend)


__all__ = ["DistEnv", "free_port", "init_distributed", "leave_process_group"]
