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
    """Documents run as the batch rows of one call: dealt over the ranks, each padded to ``world * shard`` rows (a
    ring call), or (``alone``) whole on this rank, each padded to ``shard`` rows (a call of this rank alone)."""

    shard: int  # rows per rank of each document (``alone``: all its rows)
    zigzag: bool  # documents dealt in zigzag halves
    spans: tuple[tuple[int, int], ...]  # the documents, as packed rows ``[start, end)``
    first: int  # the group's first row in a rank's document rows (``Documents.rows``)
    pads: bool  # some document is shorter than its rows
    bucket: int  # which unit moves it (the same on every rank): a dealt group's index; whole documents', per padded
    # length, after
    alone: bool = False

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
    rows: int


@dataclass(frozen=True, eq=False)
class Documents:
    """How one rank's rows move between the caller's shards and the groups' rows.

    ``sends[p]``: this rank's caller rows that go to rank ``p``, ascending, ``buckets[p]`` the bucket of each one's
    group (``Group.bucket``); ``receives[p]``: this rank's document rows that arrive from ``p``, in the order ``p``
    sends them. The same lists read backwards move the results back (pad rows stay behind). ``units``: the buckets
    moved together, ``(first, end)`` ranges (all at once, or a bucket at a time to bound the memory), each in the
    head ranges ``heads``.
    """

    local: int  # the caller's rows per rank
    groups: tuple[Group, ...]
    sends: tuple[torch.Tensor, ...]
    buckets: tuple[torch.Tensor, ...]
    receives: tuple[torch.Tensor, ...]
    pad_rows: torch.Tensor  # bool ``(rows,)``: this rank's document rows that are padding
    buckets_count: int = 1  # the dealt groups' and the whole documents' (per padded length; the same on every rank)
    widest: int = 0  # the most rows of one bucket of whole documents any rank holds (the same on every rank)
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
            mine = [g for g in self.groups if g0 <= g.bucket < g1]  # (consecutive in this rank's rows)
            lo = mine[0].first if mine else 0
            hi = lo + sum(g.rows for g in mine)
            sends = [s[(b >= g0) & (b < g1)] for s, b in zip(self.sends, self.buckets)]
            receives = [r[(r >= lo) & (r < hi)] - lo for r in self.receives]
            self._on[unit, device] = Moves(torch.cat(sends).to(device), torch.cat(receives).to(device),
                                           [len(x) for x in sends], [len(x) for x in receives],
                                           self.pad_rows[lo:hi].to(device).unsqueeze(0), hi - lo)
        return self._on[unit, device]


def place_whole(lengths: Sequence[int], world: int, local: int, dealt_cost: Callable[[int], float],
                alone: tuple[Callable[[int], int], Callable[[int], float]]) -> list[int]:
    """The rank each document runs whole on, ``-1`` for one dealt over the ranks. ``alone``: ``(padded, cost)``, a
    document's rows on one rank and the work of that many rows; ``dealt_cost(rows)``: a dealt document's work, the
    same on every rank. Documents of at most ``limit`` padded rows (at first ``local``) go whole, longest first, to
    the least loaded rank; where that leaves the heaviest rank above 1.10 of the mean, the limit halves (the
    longer documents dealt), down to none."""
    padded, cost = alone
    rows = [padded(n) for n in lengths]
    limit = local
    while limit >= 1:
        whole = sorted((i for i in range(len(lengths)) if rows[i] <= limit), key=lambda i: -cost(rows[i]))
        if not whole:
            break
        dealt = sum(dealt_cost(lengths[i]) for i in range(len(lengths)) if rows[i] > limit)
        loads, owner = [dealt] * world, [-1] * len(lengths)
        for i in whole:
            r = min(range(world), key=loads.__getitem__)
            loads[r] += cost(rows[i])
            owner[i] = r
        if max(loads) <= 1.10 * sum(loads) / world:
            return owner
        limit //= 2
    return [-1] * len(lengths)


def plan_documents(docs: Sequence[int], local: int, rank: int, world: int, caller_zigzag: bool,
                   shard: Callable[[int], tuple[int, bool]],
                   alone: tuple[Callable[[int], int], Callable[[int], float]] | None = None) -> Documents:
    """Rank ``rank``'s ``Documents`` of the packed row ``docs`` (cu_seqlens) held in shards of ``local`` rows
    (``caller_zigzag``: the caller's zigzag layout); ``shard(rows)``: the rows per rank that a document of ``rows``
    rows runs on dealt, and whether in zigzag halves. ``alone``: ``(padded, cost)`` (``place_whole``) to run short
    documents whole on one rank each, balanced, where their rings would move more than their work."""
    spans = [(a, b) for a, b in zip(docs, docs[1:]) if b > a]
    lengths = [b - a for a, b in spans]
    owner = [-1] * len(spans)
    if alone is not None and world > 1:
        owner = place_whole(lengths, world, local, lambda n: alone[1](shard(n)[0] * world) / world, alone)
    by_shard: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    for (a, b), o in zip(spans, owner):
        if o < 0:
            by_shard.setdefault(shard(b - a), []).append((a, b))
    groups, first = [], 0
    for i, ((s, zigzag), members) in enumerate(sorted(by_shard.items())):
        groups.append(Group(s, zigzag, tuple(members), first, any(b - a != s * world for a, b in members), i))
        first += len(members) * s
    dealt_rows, count = first, len(groups)
    # every rank's whole documents, by padded rows (a rank's after the dealt groups)
    kept: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(world)]
    for (a, b), o in zip(spans, owner):
        if o >= 0:
            kept[o].setdefault(alone[0](b - a), []).append((a, b))
    at = {a: (g.shard, g.zigzag, g.first + j * g.shard, -1) for g in groups for j, (a, _) in enumerate(g.spans)}
    # a bucket per padded length of whole documents, after the dealt groups' (the same on every rank)
    classes = sorted({p for held in kept for p in held})
    bucket_of = {a: g.bucket for g in groups for a, _ in g.spans}
    widest, most = dealt_rows, 0  # the most document rows any rank holds, and of one class of whole documents
    for r in range(world):
        first = dealt_rows
        for p, members in sorted(kept[r].items()):
            if r == rank:
                groups.append(Group(p, False, tuple(members), first, any(b - a != p for a, b in members),
                                    count + classes.index(p), alone=True))
            at.update({a: (p, False, first + j * p, r) for j, (a, _) in enumerate(members)})
            bucket_of.update({a: count + classes.index(p) for a, _ in members})
            first += len(members) * p
            most = max(most, len(members) * p)
        widest = max(widest, first)
    rows = sum(g.rows for g in groups)
    # per document, in packed order: first packed row, length, rows per rank, zigzag, first row, owner (-1: dealt)
    start, end = torch.tensor(spans).T.contiguous()
    length = end - start
    size, zigzag, place, whole = torch.tensor([at[a] for a, _ in spans]).T.contiguous()
    zigzag = zigzag.bool()
    bucket = torch.tensor([bucket_of[a] for a, _ in spans])
    # this rank's caller rows: each one's receiver * widest + document row there
    mine = undeal(rank, torch.arange(local), local, world, caller_zigzag)  # their packed positions
    of = torch.searchsorted(start, mine, right=True) - 1  # each caller row's document
    owner_rank, row = deal(mine - start[of], size[of], world, zigzag[of])
    alone_here = whole[of] >= 0
    owner_rank = torch.where(alone_here, whole[of], owner_rank)
    row = torch.where(alone_here, mine - start[of], row)
    target = owner_rank * widest + place[of] + row
    # this rank's document rows: each one's sender * local + caller row, or -1 for a pad row
    visible = torch.nonzero((whole < 0) | (whole == rank)).flatten()
    order = visible[torch.argsort(place[visible])]
    doc = torch.repeat_interleave(order, size[order])
    offset = torch.arange(rows) - place[doc]
    offset = torch.where(whole[doc] >= 0, offset, undeal(rank, offset, size[doc], world, zigzag[doc]))
    sender, held = deal(start[doc] + offset, local, world, caller_zigzag)
    source = torch.where(offset < length[doc], sender * local + held, -1)
    receiver = target // widest  # (a stable sort keeps each peer's rows ascending, the order it expects them in)
    sends = torch.argsort(receiver, stable=True).split(torch.bincount(receiver, minlength=world).tolist())
    buckets = tuple(bucket[of[x]] for x in sends)
    real = torch.nonzero(source >= 0).flatten()
    arriving = real[torch.argsort(source[real])]  # by sender, then by the sender's row: the order it sends in
    receives = arriving.split(torch.bincount(source[real] // local, minlength=world).tolist())
    return Documents(local, tuple(groups), sends, buckets, receives, source < 0, count + len(classes),
                     most, ((0, count + len(classes)),))
