"""Causal local patterns on side streams, so that the tails of their small kernel calls overlap."""

from __future__ import annotations

import torch

from .. import caches
from ..triton_support import other_device
from . import routes


_STREAM_POOLS: dict[int, tuple[torch.cuda.Stream, ...]] = {}
caches.register("side_streams.pools", _STREAM_POOLS.__len__)  # held: one pool per device, reused by every call


class SideStreams:
    """Causal local patterns issued round-robin on side streams, joined before the combine.

    A causal LongNet pattern's calls are small (r = 16: one call of 256 query tiles, most of them short),
    so one after another the GPU idles in each call's tail. On side streams the tails overlap: measured on
    an H200 with LongNet's ten cuDNN calls per direction, causal
    forward 1.30 -> 1.08 ms and backward 3.64 -> 3.38 ms on two streams; non-causal calls are long enough
    that it does not pay (forward 1.68 -> 1.82 ms), so they stay on the caller's stream. Each pattern writes
    tensors of its own (parts), so the order of the streams' work does not change a bit of the result. The
    parts are handed to the caller's stream (``record_stream``): the allocator then keeps their memory until
    the caller's stream is done with them."""

    def __init__(self, q: torch.Tensor, causal: bool) -> None:
        """Side streams for a call on ``q`` if it is causal on CUDA (not under CUDA-graph capture); else none,
        and ``issue`` runs inline."""
        self.pool: tuple[torch.cuda.Stream, ...] = ()
        self.turn = 0
        streams = routes.TUNING.causal_part_streams
        if not (causal and q.is_cuda and streams > 1) or torch.cuda.is_current_stream_capturing():
            return
        self.main = torch.cuda.current_stream(q.device)
        # q's device current: switch streams with set_stream (torch.cuda.stream looks the current device up on
        # every enter and exit, as much host time as a kernel launch); else through torch.cuda.stream's guard
        self.guarded = other_device(q.device)
        index = q.device.index
        if index not in _STREAM_POOLS:
            _STREAM_POOLS[index] = tuple(torch.cuda.Stream(q.device) for _ in range(streams))
        self.pool = _STREAM_POOLS[index]
        made = self.main.record_event()  # the inputs were made on the caller's stream (one event for every side)
        for side in self.pool:
            side.wait_event(made)

    def issue(self, fn, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        """``fn``'s tensors, computed on the next side stream and handed to the caller's stream."""
        if not self.pool:
            return fn(*args, **kwargs)
        side = self.pool[self.turn % len(self.pool)]
        self.turn += 1
        if self.guarded:
            with torch.cuda.stream(side):
                result = fn(*args, **kwargs)
        else:
            torch.cuda.set_stream(side)
            try:
                result = fn(*args, **kwargs)
            finally:
                torch.cuda.set_stream(self.main)
        for t in result:
            t.record_stream(self.main)
        return result

    def join(self) -> None:
        for side in self.pool:
            self.main.wait_stream(side)
