"""FairScale backend: the ring runs over fairscale's model-parallel group.

FairScale (``fairscale.nn.model_parallel``) organises ranks into model-, data-
and pipeline-parallel groups but has no point-to-point layer of its own: its
tensor-parallel layers use ``torch.distributed`` collectives on those groups.
So this adapter takes its *group* from fairscale (the model-parallel group is
used as the sequence-parallel group) and moves bytes with ``torch.distributed``
primitives on that group. P2P peers are global ranks.

If fairscale's model parallel is not initialised yet, it is initialised over the
whole world (``initialize_model_parallel(world_size)``), which is a collective
call: every rank must build the backend; rank 0 then warns once (pointing at the
caller's line). An explicit ``group=`` overrides all of this (no fairscale state is
touched then).
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from ..caches import register
from ..callers import user_stacklevel
from .base import group_timeout, install_hint, without_setup_prints
from .collective import CollectiveBackend

_announced: set[str] = set()  # said once per process: that we initialised fairscale ourselves
register("fairscale.announced", _announced.__len__)  # held: once per process


def _fairscale_mp():
    try:
        from fairscale.nn.model_parallel import initialize as mp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"comm='fairscale' needs fairscale: {install_hint('fairscale')}") from exc
    return mp


def sequence_parallel_group() -> dist.ProcessGroup:
    """fairscale's model-parallel group, initialising model parallel over the world if needed."""
    mp = _fairscale_mp()
    if not mp.model_parallel_is_initialized():
        world = dist.get_world_size()
        with without_setup_prints("> initializing "):  # fairscale's rank-0 lines; our warning below says it
            mp.initialize_model_parallel(world)
        _inherit_world_timeout(mp.get_model_parallel_group(), mp.get_data_parallel_group())
        if "initialised" not in _announced:
            _announced.add("initialised")
            if dist.get_rank() == 0:  # every rank initialises; one message per job
                warnings.warn(
                    f"comm='fairscale': fairscale model parallel was not initialised; initialised it with "
                    f"initialize_model_parallel({world}) (sequence parallel over all {world} ranks). "
                    "Call fairscale.nn.model_parallel.initialize.initialize_model_parallel(k) first to choose k.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
    return mp.get_model_parallel_group()


def _inherit_world_timeout(*groups: dist.ProcessGroup) -> None:
    """fairscale creates its groups with torch's default timeout; give ours the user's instead."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    limit = timedelta(seconds=group_timeout(dist.group.WORLD))
    for group in groups:
        _set_pg_timeout(limit, group)


class FairscaleBackend(CollectiveBackend):
    """Sequence parallel over fairscale's model-parallel group (or an explicit ``group``).

    Only the group differs from ``CollectiveBackend``: bytes move with the same
    ``torch.distributed`` calls, since fairscale has no P2P layer of its own.
    """

    name = "fairscale"

    def _resolve_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        return group if group is not None else sequence_parallel_group()
