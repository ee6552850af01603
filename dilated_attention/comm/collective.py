"""torch.distributed backend: ``batch_isend_irecv`` on any process group (default: world)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import CommBackend, Pending, _Works

# torch >= 2.13 renames all_gather_into_tensor (same arguments); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveBackend(CommBackend):
    name = "collective"

    def _batch_send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> Pending:
        ops = [
            dist.P2POp(dist.isend, send, dst, self.group),
            dist.P2POp(dist.irecv, recv, src, self.group),
        ]
        return _Works(dist.batch_isend_irecv(ops))

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        _all_gather_single(out, inp, group=self.group)
