"""Head-parallel (Ulysses-style) exchange: swap sequence shards for head shards and back.

Inside a team of ``A`` ranks holding consecutive sequence shards, an all-to-all
gives each rank the team's whole block of ``A * L`` rows for ``H / A`` of the
query heads (and the kv heads those need), the attention runs on that block
(locally, or as a ring across teams: the hybrid strategy), and a second
all-to-all brings the output rows home. Each swap's gradient is the reverse swap
(``*_backward``; ``execution.py`` pairs them), so gradients are exact. Each tensor of a swap is one
all-to-all (``CommBackend.all_to_all``: a collective over the whole group on GPUs, else a batch of
transfers), the first carrying the call's stamp (``comm/stamps.py``). Going to heads, each transfer starts
as soon as its blocks are laid out (the next tensor's layout copy overlaps it); the gradients going home
travel one at a time, each merged and freed before the next is received: that is the peak of a head
call, and it holds one received gradient beside the head-layout ones, as DeepSpeed Ulysses does.

Copies: one per tensor and swap, where heads interleave (packing one member's heads,
merging every member's heads); the side where rows follow member blocks is a view at
batch size 1 (``_by_member_rows``, ``member_rows``), as in DeepSpeed Ulysses.

In the zigzag layout (``RingLayout``) member ``m`` holds two half-shard chunks; the team's rows are
put in the team's own zigzag order (``member_rows``, and back: ``_by_member_rows``): the members' first
halves in member order, then their second halves in reverse member order. For a team of the whole group
that is the natural order; for a team inside a ring it is the zigzag order of the ring's blocks. It is
the copy those functions make anyway above batch size 1, and one copy per tensor and swap at batch 1.

K/V heads travel no more than needed: with ``A | Hkv`` each rank gets its
``Hkv / A`` kv heads; with ``Hkv | A`` each rank gets the one kv head its query
heads read; otherwise kv heads are expanded to one per query head first.

Head chunks (``memory.py``): a swap of one ``HeadRange`` (``part``) moves only those local heads of every
member, and the swaps back write them into head slices of the sequence-layout result (``into``), so a call in
chunks holds one chunk's head-layout tensors at a time, the backward swapping q, k, v and out again
(``execution.forward``/``backward``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .comm.base import Blocks, CommBackend, Pending
from .memory import HeadRange
from .views import ALIGN_BYTES


@dataclass(frozen=True)
class HeadSplit:
    """How ``heads`` query heads and ``kv_heads`` kv heads are dealt over a team of ``team`` ranks."""

    heads: int
    kv_heads: int
    team: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.team

    @property
    def local_kv_heads(self) -> int:
        if self.kv_heads % self.team == 0:
            return self.kv_heads // self.team
        return 1 if self.team % self.kv_heads == 0 else self.local_heads

    def kv_sources(self, member: int) -> list[int]:
        """Global kv heads member ``member`` receives, in its local order (``expand``: one per query head)."""
        group = self.heads // self.kv_heads
        if self.kv_heads % self.team == 0:
            n = self.kv_heads // self.team
            return list(range(member * n, (member + 1) * n))
        first = member * self.local_heads
        if self.team % self.kv_heads == 0:
            return [first // group]
        return [h // group for h in range(first, first + self.local_heads)]

    def check(self) -> str | None:
        if self.heads % self.team:
            return (f"head-parallel needs the query heads ({self.heads}) to be divisible by the ranks "
                    f"that split them ({self.team})")
        return None


def _member_heads(x: torch.Tensor, a: int, h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """``(B, L, A h, ...)`` -> the ``(B, L, A, h1 - h0, ...)`` view of every member's local heads ``[h0, h1)``."""
    return _head_blocks(x, a, h0, h1).movedim(0, 2)


def _head_blocks(x: torch.Tensor, a: int, h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """``(B, L, A h, ...)`` -> the ``(A, B, L, h1 - h0, ...)`` view: block ``m`` is member ``m``'s local heads (one
    ``as_strided``: per call and tensor, on the host of every swap)."""
    bsz, rows, heads, *rest = x.shape
    h = heads // a
    local = range(h)[h0:h1]  # (``None`` and negative bounds as a slice takes them)
    s_b, s_l, s_h, *s_rest = x.stride()
    return x.as_strided((a, bsz, rows, len(local), *rest), (h * s_h, s_b, s_l, s_h, *s_rest),
                        x.storage_offset() + local.start * s_h)


def _by_member_heads(x: torch.Tensor, a: int, h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """``_head_blocks`` as a new contiguous tensor (one copy)."""
    return _head_blocks(x, a, h0, h1).contiguous()


def _row_blocks(x: torch.Tensor, a: int) -> torch.Tensor:
    """``(B, A L, ...)`` the team's rows -> the ``(A, B, L, ...)`` view: block ``m`` is member ``m``'s rows."""
    return x.unflatten(1, (a, x.shape[1] // a)).movedim(1, 0)


def _by_member_rows(x: torch.Tensor, a: int, zigzag: bool = False) -> torch.Tensor:
    """``(B, A L, h, D)`` the team's rows -> ``(A, B, L, h, D)``: block ``m`` holds member ``m``'s rows (a view
    at batch 1; ``zigzag``: one copy). The inverse of ``member_rows``."""
    if not zigzag:
        return _row_blocks(x, a).contiguous()
    bsz, rows, *rest = x.shape
    n = rows // a
    half = n // 2
    blocks = x.new_empty((a, bsz, n, *rest))
    blocks[:, :, :half].copy_(x[:, :a * half].unflatten(1, (a, half)).transpose(0, 1))
    for m in range(a):  # member m's second half is the team's chunk 2A - 1 - m
        blocks[m, :, half:].copy_(x[:, (2 * a - 1 - m) * half:(2 * a - m) * half])
    return blocks


def member_rows(recv: torch.Tensor, zigzag: bool = False) -> torch.Tensor:
    """``(A, B, L, *rest)`` with member ``m``'s rows in block ``m`` -> the team's ``(B, A L, *rest)`` rows: the
    members' in order (a view at batch 1), or ``zigzag`` (module doc; one copy)."""
    a, bsz, n, *rest = recv.shape
    if not zigzag:
        return recv.transpose(0, 1).reshape(bsz, a * n, *rest).contiguous()
    half = n // 2
    rows = recv.new_empty((bsz, a * n, *rest))
    rows[:, :a * half].unflatten(1, (a, half)).copy_(recv[:, :, :half].transpose(0, 1))
    for m in range(a):  # member m's second half is the team's chunk 2A - 1 - m
        rows[:, (2 * a - 1 - m) * half:(2 * a - m) * half].copy_(recv[m, :, half:])
    return rows


def _merge_heads(recv: torch.Tensor, into: torch.Tensor | None = None, h0: int = 0, h1: int | None = None
                 ) -> torch.Tensor:
    """``(A, B, L, h, ...)`` with member ``m``'s heads in block ``m`` -> ``(B, L, A h, ...)`` (one copy); ``into``:
    written into every member's local heads ``[h0, h1)`` of ``into``, which is returned."""
    if into is None:
        return recv.movedim(0, 2).flatten(2, 3)
    _member_heads(into, recv.shape[0], h0, h1).copy_(recv.movedim(0, 2))
    return into


def _kv_by_member(x: torch.Tensor, split: HeadSplit, part: HeadRange | None = None) -> torch.Tensor:
    """``(B, L, Hkv, D)`` -> ``(A, B, L, hk, D)``: block ``m`` holds the kv heads member ``m`` reads (``part``:
    its local kv heads ``[k0, k1)``)."""
    k0, k1 = (part.k0, part.k1) if part is not None else (0, None)
    if split.kv_heads % split.team == 0:  # kv heads split evenly: one strided copy, no loop
        return _by_member_heads(x, split.team, k0, k1)
    return torch.stack([x[:, :, split.kv_sources(m)[k0:k1]] for m in range(split.team)])


def _swap(sends: Iterable[torch.Tensor], swap: HeadSwap, direction: str, what: str, ahead: bool = True
          ) -> Iterator[torch.Tensor]:
    """The team's all-to-all of each tensor of ``sends`` (each ``(A, ...)``, block ``m`` to member ``m``): the
    received tensors (block ``m`` from member ``m``) one at a time, each once its own transfer is done. The first
    all-to-all carries the call's stamp. ``ahead``: every transfer starts at once, each as ``sends`` makes its
    tensor (from a generator, the next tensor's layout copy overlaps this one's transfer); else each starts when
    the one before has been read, so that one received tensor is alive at a time (and, ``sends`` a generator,
    one sent tensor): the backward's gradients, which are merged and freed in turn."""
    stamp = swap.comm.stamp(swap.call, direction)
    started = (swap.comm.all_to_all([x], swap.team, f"{swap.what}, {what}", stamp=None if i else stamp)
               for i, x in enumerate(sends))
    return _landed(list(started) if ahead else started)


def _landed(arrivals: Iterable[tuple[list[torch.Tensor], Pending]]) -> Iterator[torch.Tensor]:
    for (got,), pending in arrivals:
        pending.wait()
        yield got
        del got, pending  # (the reader's tensor dies before the next transfer allocates its own)


@dataclass(frozen=True)
class HeadSwap:
    """One call's swaps: the team's group ranks (consecutive, this rank among them), how heads are dealt,
    what timeout messages name, the call number its exchanges' stamps carry, and the shard layout."""

    comm: CommBackend
    team: tuple[int, ...]
    split: HeadSplit
    what: str
    call: int = 0
    zigzag: bool = False  # members hold zigzag shards (module doc)


def sequence_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, swap: HeadSwap,
                      part: HeadRange | None = None, more: tuple[torch.Tensor, ...] = (),
                      direction: str = "forward") -> tuple[torch.Tensor, ...]:
    """``(B, L, H, D)`` q/k/v shards of the team -> ``(B, A L, H/A, D)`` q and the kv heads it reads, then
    ``more`` query-side tensors (a chunk's backward: out, dout) as q; ``part``: only those local heads."""
    h0, h1 = (part.h0, part.h1) if part is not None else (0, None)
    team = swap.split.team

    def query_side(x: torch.Tensor) -> torch.Tensor:
        return _by_member_heads(x, team, h0, h1)

    def kv_side(x: torch.Tensor) -> torch.Tensor:
        return _kv_by_member(x, swap.split, part)

    sends = (lay(x) for lay, x in ((query_side, q), (kv_side, k), (kv_side, v), *((query_side, x) for x in more)))
    return tuple(member_rows(x, swap.zigzag) for x in _swap(sends, swap, direction, "sequence-to-heads all-to-all"))


def sequence_to_heads_backward(grads: list[torch.Tensor], swap: HeadSwap, kv_shape: torch.Size,
                               part: HeadRange | None = None,
                               into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``sequence_to_heads`` for ``grads = [dq, dk, dv]``: the reverse swap (kv heads several
    members read add up). ``grads`` is emptied: one gradient at a time is sent, received and merged, each
    head-layout gradient freed once sent and each received one once merged, so one received tensor is alive
    beside the gradients at the peak of a head call (as in DeepSpeed Ulysses).
    ``part``: the swap of those local heads, written into their heads of ``into`` (``dk``/``dv`` zeroed by the
    caller where several members read one kv head: every chunk adds)."""
    team, split = len(swap.team), swap.split
    sends = (_by_member_rows(grads.pop(0), team, swap.zigzag) for _ in range(len(grads)))
    got = _swap(sends, swap, "backward", "backward of sequence-to-heads all-to-all", ahead=False)
    heads = [(part.h0, part.h1), (part.k0, part.k1), (part.k0, part.k1)] if part is not None else [(0, None)] * 3

    def merge(i: int, blocks: torch.Tensor, h0: int, h1: int | None, target: torch.Tensor | None) -> torch.Tensor:
        """``blocks`` ``(A, B, L, h, D)``: member ``m``'s rows of its heads, into the sequence layout."""
        if i == 0 or split.kv_heads % team == 0:  # each head came from exactly one member
            return _merge_heads(blocks, target, h0, h1)
        if target is None:
            target = torch.zeros(kv_shape, dtype=blocks.dtype, device=blocks.device)
        for m in range(team):  # several members may have read one kv head: their gradients add
            for j, src in enumerate(split.kv_sources(m)[h0:h1]):
                target[:, :, src].add_(blocks[m, :, :, j])
        return target

    return tuple(merge(i, next(got), h0, h1, target)
                 for i, ((h0, h1), target) in enumerate(zip(heads, into if into is not None else (None,) * 3)))


def heads_to_sequence(out: torch.Tensor, swap: HeadSwap, part: HeadRange | None = None,
                      into: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, A L, H/A, D)`` output of a team rank -> this rank's ``(B, L, H, D)`` rows, all heads; ``part``: the
    output of those local heads, written into their heads of ``into`` (returned)."""
    (got,) = _swap([_by_member_rows(out, len(swap.team), swap.zigzag)], swap, "forward",
                   "heads-to-sequence all-to-all")
    return _merge_heads(got, into, *((part.h0, part.h1) if part is not None else (0, None)))


def heads_to_sequence_backward(dout: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """The gradient of ``heads_to_sequence``: the reverse swap."""
    (got,) = _swap([_by_member_heads(dout, len(swap.team))], swap, "backward",
                   "backward of heads-to-sequence all-to-all")
    return member_rows(got, swap.zigzag)


def _packed(buffer: torch.Tensor, views: list[tuple[int, torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """The tensors packed in ``buffer`` (``(A, bytes)`` uint8), each ``(at, shape, dtype)``: member ``m``'s row
    holds, from byte ``at``, the contiguous ``shape[1:]`` block of that dtype. One dtype view of the buffer per
    dtype and one ``as_strided`` per tensor (slicing, viewing and unflattening each cost the host three ops)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for at, shape, dtype in views:
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer.view(dtype)
        inner = [1]
        for n in reversed(shape[2:]):
            inner.insert(0, inner[0] * n)
        out.append(whole.as_strided(shape, (whole.stride(0), *inner), whole.storage_offset() + at // dtype.itemsize))
    return out


class PackedSwap:
    """A swap of several tensors in one all-to-all: each member's blocks of every tensor packed into one buffer
    row, the call's stamp in its last 16 bytes (one transfer per peer and direction: each all-to-all costs the
    host a launch). The ring's swapped patterns (``ring/swapped.py``) send compact rows of every head out
    (``post``), compute the whole segment on ``1 / G`` of the heads (``heads``) and send the results home
    (``send_home``, ``home``); the layouts are the head strategy's (``_head_blocks``, ``member_rows``,
    ``_row_blocks``, ``_merge_heads``), for tensors of any trailing dims."""

    def __init__(self, comm: CommBackend, members: tuple[int, ...], call: int, direction: str, what: str) -> None:
        """``what``: the call, direction and pattern, as timeout messages name them."""
        self.comm, self.members, self.direction = comm, members, direction
        self.what = f"{what}, head swap of ranks {list(members)}"
        self.stamp = comm.stamp(call, direction)
        self.pending = None

    def post(self, sends: list[torch.Tensor]) -> None:
        """The first all-to-all, of ``sends``: ``(B, rows, heads, ...)`` tensors, heads divisible by ``G``."""
        g = len(self.members)
        self._post([_head_blocks(x, g) for x in sends], "rows out")

    def _post(self, blocks: list[torch.Tensor], what: str) -> None:
        """An all-to-all of ``blocks`` (each ``(G, ...)``, any strides: block ``m`` to member ``m``), packed."""
        g = len(self.members)
        sizes = [-(-x.numel() // g * x.element_size() // ALIGN_BYTES) * ALIGN_BYTES for x in blocks]
        # (each member's block, the stamp after it: one transfer per peer, stamp included)
        buffer = Blocks((g, sum(sizes)), torch.uint8, blocks[0].device).raw
        self.views = [(at, x.shape, x.dtype) for x, at in zip(blocks, itertools.accumulate([0, *sizes[:-1]]))]
        for x, view in zip(blocks, _packed(buffer, self.views)):
            view.copy_(x)
        blocks.clear()  # packed: each goes before the receiving buffer comes (its caller holds none)
        (self.got,), self.pending = self.comm.all_to_all([buffer], self.members, f"{self.what}, {what}",
                                                         stamp=self.stamp, stamp_room=True)

    def land(self) -> None:
        """Orders the caller's stream after the posted all-to-all (no host sync) and lets go of the sent buffer,
        which the wait holds: called early where that stream has nothing else to run meanwhile."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def _received(self) -> list[torch.Tensor]:
        """The landed blocks, views of the receiving buffer, which the swap lets go of: the rows' copies that
        ``heads`` and ``home`` make free it, not the swap's end."""
        self.land()
        got, self.got = self.got, None
        return _packed(got, self.views)

    def heads(self) -> list[torch.Tensor]:
        """The team's rows of this rank's heads, ``(B, G rows, heads / G, ...)`` each (waits for them)."""
        return [member_rows(x) for x in self._received()]

    def send_home(self, results: list[torch.Tensor]) -> None:
        """Results ``(B, G rows, heads / G, ...)`` of ``heads()``' rows, each member's rows to it. ``results``
        is emptied: each result is freed once packed."""
        g = len(self.members)
        blocks = [_row_blocks(x, g) for x in results]
        results.clear()
        self._post(blocks, "results home")

    def home(self) -> list[torch.Tensor]:
        """This rank's rows of the results, every head (waits for them)."""
        return [_merge_heads(x) for x in self._received()]
