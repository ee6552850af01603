"""Communication backends: ``get_backend("collective" | "fairscale" | "deepspeed")``."""

from __future__ import annotations

import atexit
from datetime import timedelta

import torch.distributed as dist

from ..caches import register
from .base import CommBackend, PeerTimeoutError

BACKEND_NAMES = ("collective", "fairscale", "deepspeed")


def check_comm(comm: object) -> None:
    """Raise unless ``comm`` is ``None``, a backend name or a ``CommBackend`` (creates nothing)."""
    if isinstance(comm, str):
        if comm not in BACKEND_NAMES:  # (get_backend's message)
            raise ValueError(f"comm must be one of {BACKEND_NAMES}, a CommBackend or None, got {comm!r}")
    elif comm is not None and not isinstance(comm, CommBackend):
        raise TypeError(f"comm must be None, a backend name {BACKEND_NAMES} or a CommBackend, "
                        f"got {type(comm).__name__}")


def get_backend(name: str, group: dist.ProcessGroup | None = None, *, timeout: float | timedelta | None = None,
                check_calls: bool | str = True, check_every: int = 64) -> CommBackend:
    """Build a backend by name on ``group`` (each backend has its own default group).

    ``timeout``: seconds every wait on a peer may take (default ``DILATED_ATTENTION_TIMEOUT``,
    else the process group's own timeout). ``check_calls``, ``check_every``: see ``CommBackend``.
    """
    if name == "collective":
        from .collective import CollectiveBackend as backend
    elif name == "fairscale":
        from .fairscale import FairscaleBackend as backend
    elif name == "deepspeed":
        from .deepspeed import DeepSpeedBackend as backend
    else:
        raise ValueError(f"comm must be one of {BACKEND_NAMES}, a CommBackend or None, got {name!r}")
    return backend(group, timeout=timeout, check_calls=check_calls, check_every=check_every)


_by_name: dict[str, tuple[object, CommBackend]] = {}  # name -> (the process group set-up, its backend)
register("comm.named_backends", _by_name.__len__)  # held: a name keeps its backend's agreed calls


@atexit.register
def _release_named_backends() -> None:
    """At exit, while the interpreter is whole: a process group the caller destroyed then dies with its named
    backend here, not in the interpreter's teardown (where gloo's worker threads can abort the process)."""
    _by_name.clear()


def resolve_comm(comm: str | CommBackend | None) -> CommBackend | None:
    """A backend object; a name maps to one backend per process group set-up (so its agreed-call cache persists)."""
    check_comm(comm)
    if comm is None or isinstance(comm, CommBackend):
        return comm
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    hit = _by_name.get(comm)
    if hit is None or hit[0] is not world:
        hit = (world, get_backend(comm))
        _by_name[comm] = hit
    return hit[1]


__all__ = ["BACKEND_NAMES", "CommBackend", "PeerTimeoutError", "get_backend", "resolve_comm"]
