"""Rows moved between the caller's shards and padded shards the patterns tile (``layout.Padded``).

A sequence whose shards the segments do not tile runs padded at its end, as the single-device call pads it: every
rank's rows move to the padded shards (each rank's rows go to at most a few neighbours, in one batch of
point-to-point transfers carrying the call's stamp), pad rows are zeros whose keys are masked, and the results and
gradients move back, pad rows dropped. Moving rows is its own exact gradient's reverse.
"""

from __future__ import annotations

import torch

from ..comm.base import CommBackend
from .layout import Padded


def move_rows(x: torch.Tensor, padded: Padded, comm: CommBackend, to_padded: bool, what: str, stamp, fill=0
              ) -> torch.Tensor:
    """``x`` ``(B, rows, ...)`` of this rank moved to the padded shards (``to_padded``, pad rows ``fill``) or back."""
    sends, receives = padded.moves(comm.rank, to_padded)
    rows = padded.shard if to_padded else padded.local
    out = x.new_full((x.shape[0], rows, *x.shape[2:]), fill) if to_padded else x.new_empty((x.shape[0], rows,
                                                                                             *x.shape[2:]))
    outgoing, incoming, placed = [], [], []
    for peer, a, b, at in sends:
        if peer == comm.rank:
            out[:, at:at + b - a].copy_(x[:, a:b])
        else:
            outgoing.append((x[:, a:b].contiguous(), peer))  # (transfers move whole tensors)
    for peer, a, b in receives:
        if peer != comm.rank:
            buffer = x.new_empty((x.shape[0], b - a, *x.shape[2:]))
            incoming.append((buffer, peer))
            placed.append((a, b, buffer))
    if outgoing or incoming:
        comm.exchange(outgoing, incoming, what, stamp=stamp).wait()
    for a, b, buffer in placed:
        out[:, a:b].copy_(buffer)
    return out
