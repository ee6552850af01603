"""Packed documents on a ring: every document dealt over the ranks on its own.

The caller holds a packed row (``cu_seqlens``) as shards, so documents cross shard boundaries, while each
document must run alone, its segments starting at its first row, exactly as on one device. The ring runs
them laid out as ``Documents`` says: a document is padded to ``world * shard`` rows (the fewest the patterns
tile, ``layout.padded_shard``) and dealt over the ranks like a sequence of its own, in zigzag halves when the
call is causal, so that every rank gets the same share of every document's work whatever the documents'
lengths. Documents of one padded shard are a ``Group``: the batch rows of one ordinary ring call. Rows move
from the caller's shards to the groups and back in one batch of point-to-point transfers per direction
(``padding.move_documents``); pad rows are zeros whose keys are masked.

::

    caller's shards  | a a a b | b b c c |          documents a (3 rows), b (3), c (2); 2 ranks
    group of shard 2 | a a | b b |  | a . | b . |    rank 0 holds rows 0-1 of each, rank 1 rows 2-3
    group of shard 1 | c |         | c |              (``.``: pad rows, their keys masked)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


def deal(position: torch.Tensor, shard, world: int, zigzag) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank, row)`` holding each ``position`` of a sequence dealt in shards of ``shard`` rows over ``world``
    ranks: consecutive blocks, or (``zigzag``) chunks ``j`` and ``2 world - 1 - j`` of ``2 world`` on rank ``j``.
    ``shard`` and ``zigzag``: one for all, or one per position (a tensor)."""
    rank, row = position // shard, position % shard
    if zigzag is False:
        return rank, row
    zigzag = torch.as_tensor(zigzag)
    half = torch.clamp(torch.as_tensor(shard) // 2, min=1)
    chunk = position // half
    first = chunk < world
    zigzag_rank, zigzag_row = torch.where(first, chunk, 2 * world - 1 - chunk), position % half + ~first * half
    return torch.where(zigzag, zigzag_rank, rank), torch.where(zigzag, zigzag_row, row)


def undeal(rank: int, row: torch.Tensor, shard, world: int, zigzag) -> torch.Tensor:
    """The position of ``rank``'s ``row`` (the inverse of ``deal``)."""
    position = rank * shard + row
    if zigzag is False:
        return position
    zigzag = torch.as_tensor(zigzag)
    half = torch.clamp(torch.as_tensor(shard) // 2, min=1)
    return torch.where(zigzag, torch.where(row < half, rank, 2 * world - 1 - rank) * half + row % half, position)


@dataclass(frozen=True)
class Group:
    """Documents run as the batch rows of one ring call: each padded to ``world * shard`` rows."""

    shard: int  # rows per rank of each document
    zigzag: bool  # documents dealt in zigzag halves
    spans: tuple[tuple[int, int], ...]  # the documents, as packed rows ``[start, end)``
    first: int  # the group's first row in a rank's document rows (``Documents.rows``)
    pads: bool  # some document is shorter than ``world * shard`` rows

    @property
    def rows(self) -> int:
        return len(self.spans) * self.shard


@dataclass(frozen=True, eq=False)
class Documents:
    """How one rank's rows move between the caller's shards and the groups' rows.

    ``sends[p]``: this rank's caller rows that go to rank ``p``, ascending; ``receives[p]``: the document rows
    (of this rank's ``rows``) they land on, in the order ``p`` sends them. The same lists read backwards move the
    results back (pad rows stay behind).
    """

    local: int  # the caller's rows per rank
    groups: tuple[Group, ...]
    sends: tuple[torch.Tensor, ...]
    receives: tuple[torch.Tensor, ...]
    pad_rows: torch.Tensor  # bool ``(rows,)``: this rank's document rows that are padding
    _on: dict = field(default_factory=dict, repr=False)  # the index tensors per device

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sends, receives, pad_rows)`` on ``device``, sends and receives concatenated over the peers."""
        if device not in self._on:
            self._on[device] = tuple(x.to(device) for x in (torch.cat(self.sends), torch.cat(self.receives),
                                                            self.pad_rows))
        return self._on[device]


def plan_documents(docs: Sequence[int], local: int, rank: int, world: int, caller_zigzag: bool,
                   shard: Callable[[int], tuple[int, bool]]) -> Documents:
    """Rank ``rank``'s ``Documents`` of the packed row ``docs`` (cu_seqlens) held in shards of ``local`` rows
    (``caller_zigzag``: the caller's zigzag layout); ``shard(rows)``: the rows per rank that a document of ``rows``
    rows runs on, and whether it is dealt in zigzag halves."""
    spans = [(a, b) for a, b in zip(docs, docs[1:]) if b > a]
    by_shard: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    for a, b in spans:
        by_shard.setdefault(shard(b - a), []).append((a, b))
    groups, first = [], 0
    for (s, zigzag), members in sorted(by_shard.items()):
        groups.append(Group(s, zigzag, tuple(members), first, any(b - a != s * world for a, b in members)))
        first += len(members) * s
    rows = first
    # per document, in packed order: first packed row, length, shard, zigzag, first document row
    at = {a: (g.shard, g.zigzag, g.first + j * g.shard) for g in groups for j, (a, _) in enumerate(g.spans)}
    start, end = torch.tensor(spans).T.contiguous()
    length = end - start
    size, zigzag, place = torch.tensor([at[a] for a, _ in spans]).T.contiguous()
    zigzag = zigzag.bool()
    # this rank's caller rows: each one's receiver * rows + document row there
    mine = undeal(rank, torch.arange(local), local, world, caller_zigzag)  # their packed positions
    doc = torch.searchsorted(start, mine, right=True) - 1
    owner, row = deal(mine - start[doc], size[doc], world, zigzag[doc])
    target = owner * rows + place[doc] + row
    # this rank's document rows: each one's sender * local + caller row, or -1 for a pad row
    order = torch.argsort(place)
    doc = torch.repeat_interleave(order, size[order])
    offset = undeal(rank, torch.arange(rows) - place[doc], size[doc], world, zigzag[doc])
    sender, held = deal(start[doc] + offset, local, world, caller_zigzag)
    source = torch.where(offset < length[doc], sender * local + held, -1)
    receiver = target // rows  # (a stable sort keeps each peer's rows ascending, the order it expects them in)
    sends = torch.argsort(receiver, stable=True).split(torch.bincount(receiver, minlength=world).tolist())
    real = torch.nonzero(source >= 0).flatten()
    arriving = real[torch.argsort(source[real])]  # by sender, then by the sender's row: the order it sends in
    receives = arriving.split(torch.bincount(source[real] // local, minlength=world).tolist())
    return Documents(local, tuple(groups), sends, receives, source < 0)
