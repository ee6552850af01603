"""torch.distributed backend: ``batch_isend_irecv`` and collectives on any process group (default: world)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import CommBackend

# torch >= 2.13 renames all_gather_into_tensor (same arguments); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveBackend(CommBackend):
    name = "collective"

    def _batch_p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
        ops = [dist.P2POp(dist.isend, t, dst, self.group) for t, dst in sends]
        ops += [dist.P2POp(dist.irecv, t, src, self.group) for t, src in recvs]
        return dist.batch_isend_irecv(ops)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        return _all_gather_single(out, inp, group=self.group, async_op=True)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor):
        return dist.all_to_all_single(out, inp, group=self.group, async_op=True)
