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
from typing import NamedTuple

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


class Moves(NamedTuple):
    """One unit's row moves on a device: this rank's caller rows sent and document rows received (the unit's own
    numbering), each concatenated over the peers in rank order, with each peer's count."""

    sends: torch.Tensor
    receives: torch.Tensor
    sent: list[int]
    received: list[int]
    pads: torch.Tensor  # bool ``(1, rows)``: the unit's document rows that are padding
    first: int  # the unit's first row of this rank's document rows
    rows: int


@dataclass(frozen=True, eq=False)
class Documents:
    """How one rank's rows move between the caller's shards and the groups' rows.

    ``sends[p]``: this rank's caller rows that go to rank ``p``, ascending, and ``targets[p]`` the document rows
    (of ``p``) they land on; ``receives[p]``: this rank's document rows that arrive from ``p``, in the order ``p``
    sends them. The same lists read backwards move the results back (pad rows stay behind). ``units``: the groups
    moved together, ``(first, end)`` group ranges (all at once, or a group at a time to bound the memory), each in
    the head ranges ``heads``.
    """

    local: int  # the caller's rows per rank
    groups: tuple[Group, ...]
    sends: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    receives: tuple[torch.Tensor, ...]
    pad_rows: torch.Tensor  # bool ``(rows,)``: this rank's document rows that are padding
    units: tuple[tuple[int, int], ...] = ()
    heads: tuple = ()  # the head ranges (``memory.HeadRange``) each unit moves in turn; () for all at once
    _on: dict = field(default_factory=dict, repr=False)  # ``Moves`` per unit and device

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def moves(self, unit: int, device: torch.device) -> Moves:
        """Unit ``unit``'s ``Moves`` on ``device`` (made once)."""
        if (unit, device) not in self._on:
            g0, g1 = self.units[unit]
            lo, hi = self.groups[g0].first, self.groups[g1 - 1].first + self.groups[g1 - 1].rows
            sends = [s[(t >= lo) & (t < hi)] for s, t in zip(self.sends, self.targets)]
            receives = [r[(r >= lo) & (r < hi)] - lo for r in self.receives]
            self._on[unit, device] = Moves(torch.cat(sends).to(device), torch.cat(receives).to(device),
                                           [len(x) for x in sends], [len(x) for x in receives],
                                           self.pad_rows[lo:hi].to(device).unsqueeze(0), lo, hi - lo)
        return self._on[unit, device]


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
    targets = tuple(target[x] % rows for x in sends)
    real = torch.nonzero(source >= 0).flatten()
    arriving = real[torch.argsort(source[real])]  # by sender, then by the sender's row: the order it sends in
    receives = arriving.split(torch.bincount(source[real] // local, minlength=world).tolist())
    return Documents(local, tuple(groups), sends, targets, receives, source < 0, ((0, len(groups)),))
