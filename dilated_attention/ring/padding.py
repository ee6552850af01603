"""Rows moved between the caller's shards and the rows a ring runs: padded shards the patterns tile
(``layout.Padded``), or packed documents each dealt over the ranks on its own (``documents.Documents``).

A sequence whose shards the segments do not tile runs padded at its end, as the single-device call pads it: every
rank's rows move to the padded shards (each rank's rows go to at most a few neighbours, in one batch of
point-to-point transfers carrying the call's stamp), pad rows are zeros whose keys are masked, and the results and
gradients move back, pad rows dropped. Moving rows is its own exact gradient's reverse. Documents move likewise,
every row to wherever its document runs: one gather, one batch of transfers and one scatter per direction.
"""

from __future__ import annotations

import torch

from ..comm.base import CommBackend
from .documents import Moves
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


def move_documents(xs: list[torch.Tensor], moves: Moves, comm: CommBackend, what: str, stamp, fills: tuple = (),
                   into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each ``x`` ``(1, rows, ...)`` of ``xs`` moved from the caller's shards to a unit's document rows (pad rows
    ``fills[i]``, 0 by default), or, given ``into`` (caller-layout tensors or views), back into them; every tensor
    in one batch of transfers."""
    sends, receives, sent, received = (moves.sends, moves.receives, moves.sent, moves.received) if into is None \
        else (moves.receives, moves.sends, moves.received, moves.sent)
    outgoing, incoming, landed = [], [], []
    for x in xs:  # (a head chunk of the caller's rows is a strided view: gathered from a contiguous copy)
        out = x[0].contiguous().index_select(0, sends).split(sent)
        got = x.new_empty((sum(received), *x.shape[2:]))
        for peer, (mine, theirs) in enumerate(zip(out, got.split(received))):
            if peer == comm.rank:
                theirs.copy_(mine)
            else:
                if len(mine):
                    outgoing.append((mine, peer))
                if len(theirs):
                    incoming.append((theirs, peer))
        landed.append(got)
    if outgoing or incoming:
        comm.exchange(outgoing, incoming, what, stamp=stamp).wait()
    if into is None:
        into = [x.new_full((1, moves.rows, *x.shape[2:]), fills[i] if i < len(fills) else 0)
                for i, x in enumerate(xs)]
    return [out.index_copy_(1, receives, got.unsqueeze(0)) for out, got in zip(into, landed)]
