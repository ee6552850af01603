"""Communication backends: ``get_backend("collective" | "fairscale" | "deepspeed")``."""

from __future__ import annotations

import torch.distributed as dist

from .base import CommBackend

BACKEND_NAMES = ("collective", "fairscale", "deepspeed")


def get_backend(name: str, group: dist.ProcessGroup | None = None, *, check_calls: bool = True) -> CommBackend:
    """Build a backend by name on ``group`` (each backend has its own default group)."""
    if name == "collective":
        from .collective import CollectiveBackend

        return CollectiveBackend(group, check_calls=check_calls)
    if name == "fairscale":
        from .fairscale import FairscaleBackend

        return FairscaleBackend(group, check_calls=check_calls)
    if name == "deepspeed":
        from .deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(group, check_calls=check_calls)
    raise ValueError(f"comm must be one of {BACKEND_NAMES}, a CommBackend or None, got {name!r}")


def resolve_comm(comm: str | CommBackend | None) -> CommBackend | None:
    if comm is None or isinstance(comm, CommBackend):
        return comm
    if isinstance(comm, str):
        return get_backend(comm)
    raise TypeError(f"comm must be None, a backend name {BACKEND_NAMES} or a CommBackend, got {type(comm).__name__}")


__all__ = ["BACKEND_NAMES", "CommBackend", "get_backend", "resolve_comm"]
