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
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .base import CommBackend, without_setup_prints

_BUILT = "built successfully"  # DeepSpeed prints this from every rank that loads its CPU communication op


def _ds_comm():
    try:
        import deepspeed.comm as ds_comm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("comm='deepspeed' needs deepspeed (pip install deepspeed)") from exc
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

    with without_setup_prints(_BUILT):
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)


def prebuild_ops() -> None:
    """JIT-build (or load from ~/.cache/torch_extensions) the op ``init_distributed`` compiles on CPU.

    On the CPU accelerator DeepSpeed's first ``init_distributed`` compiles a shared-memory op
    (about a minute). Call this once in the launching process before spawning ranks, so no rank
    compiles while the others wait in a collective with a timeout.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    from deepspeed.comm.torch import build_shm_op

    with without_setup_prints(_BUILT):
        build_shm_op()


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
