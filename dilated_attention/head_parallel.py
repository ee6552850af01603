"""Head-parallel (Ulysses-style) exchange: swap sequence shards for head shards and back.

Inside a team of ``A`` ranks holding consecutive sequence shards, an all-to-all
gives each rank the team's whole block of ``A * L`` rows for ``H / A`` of the
query heads (and the kv heads those need), the attention runs on that block
(locally, or as a ring across teams: the hybrid strategy), and a second
all-to-all brings the output rows home. Each swap's gradient is the reverse swap
(``*_backward``; ``functional.py`` pairs them), so gradients are exact. Each block
sent carries the call's stamp after it (``CommBackend.blocks``, ``comm/stamps.py``).

K/V heads travel no more than needed: with ``A | Hkv`` each rank gets its
``Hkv / A`` kv heads; with ``Hkv | A`` each rank gets the one kv head its query
heads read; otherwise kv heads are expanded to one per query head first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm.base import Blocks, CommBackend
from .comm.stamps import Stamp


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


def _send_buffer(q, k, v, swap: HeadSwap, stamp: Stamp | None) -> Blocks:
    """``(A, B, L, h + 2 hk, D)`` blocks: block ``m`` holds member ``m``'s query heads and kv heads of our rows."""
    split = swap.split
    bsz, n, _, dim = q.shape
    hl, hk = split.local_heads, split.local_kv_heads
    blocks = swap.comm.blocks((split.team, bsz, n, hl + 2 * hk, dim), q.dtype, q.device, stamp)
    buf = blocks.data
    buf[:, :, :, :hl].copy_(q.unflatten(2, (split.team, hl)).permute(2, 0, 1, 3, 4))
    if split.kv_heads % split.team == 0:  # kv heads split evenly: two strided copies, no loop
        buf[:, :, :, hl:hl + hk].copy_(k.unflatten(2, (split.team, hk)).permute(2, 0, 1, 3, 4))
        buf[:, :, :, hl + hk:].copy_(v.unflatten(2, (split.team, hk)).permute(2, 0, 1, 3, 4))
        return blocks
    for m in range(split.team):
        for i, src in enumerate(split.kv_sources(m)):
            buf[m, :, :, hl + i].copy_(k[:, :, src])
            buf[m, :, :, hl + hk + i].copy_(v[:, :, src])
    return blocks


def _exchange(send: Blocks, swap: HeadSwap, stamp: Stamp | None, what: str) -> torch.Tensor:
    """The team's all-to-all of ``send``: the received ``(A, ...)`` blocks, block ``m`` from member ``m``
    (a view past the stamps, which have been checked)."""
    got, pending = swap.comm.all_to_all(send, swap.team, what, stamp=stamp)
    pending.wait()
    return got.data


def _member_rows(recv: torch.Tensor) -> torch.Tensor:
    """``(A, B, L, c, D)``, member ``m``'s rows in block ``m`` -> ``(B, A L, c, D)``, contiguous (one copy)."""
    a, bsz, n, c, dim = recv.shape
    return recv.permute(1, 0, 2, 3, 4).reshape(bsz, a * n, c, dim).contiguous()


def _to_sequence(parts: list[torch.Tensor], swap: HeadSwap, direction: str, what: str) -> torch.Tensor:
    """``parts`` ``(B, A L, c_i, D)`` (our heads, every member's rows, side by side) -> ``(A, B, L, c, D)``:
    block ``m`` is member ``m``'s heads of our rows."""
    a = len(swap.team)
    bsz, rows, _, dim = parts[0].shape
    dtype = parts[0].dtype
    for part in parts[1:]:
        dtype = torch.promote_types(dtype, part.dtype)
    stamp = swap.comm.stamp(swap.call, direction)
    send = swap.comm.blocks((a, bsz, rows // a, sum(p.shape[2] for p in parts), dim), dtype, parts[0].device, stamp)
    start = 0
    for part in parts:  # each straight into its heads of the send buffer
        send.data[:, :, :, start:start + part.shape[2]].copy_(part.unflatten(1, (a, rows // a)).transpose(0, 1))
        start += part.shape[2]
    return _exchange(send, swap, stamp, what)


def _merge_heads(recv: torch.Tensor) -> torch.Tensor:
    """``(A, B, L, c, D)`` with member ``m``'s heads in block ``m`` -> ``(B, L, A c, D)``."""
    a, bsz, n, c, dim = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(bsz, n, a * c, dim)


@dataclass(frozen=True)
class HeadSwap:
    """One call's swaps: the team's group ranks (consecutive, this rank among them), how heads are dealt,
    what timeout messages name, and the call number its exchanges' stamps carry."""

    comm: CommBackend
    team: tuple[int, ...]
    split: HeadSplit
    what: str
    call: int = 0


def sequence_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, swap: HeadSwap
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, L, H, D)`` q/k/v shards of the team -> ``(B, A L, H/A, D)`` q and the kv heads it reads."""
    stamp = swap.comm.stamp(swap.call, "forward")
    recv = _exchange(_send_buffer(q, k, v, swap, stamp), swap, stamp, swap.what + ", sequence-to-heads all-to-all")
    hl, hk = swap.split.local_heads, swap.split.local_kv_heads
    return (_member_rows(recv[:, :, :, :hl]), _member_rows(recv[:, :, :, hl:hl + hk]),
            _member_rows(recv[:, :, :, hl + hk:]))


def sequence_to_heads_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, swap: HeadSwap,
                               kv_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``sequence_to_heads``: the reverse swap (kv heads several members read add up)."""
    team, split = swap.team, swap.split
    recv = _to_sequence([dq, dk, dv], swap, "backward", swap.what + ", backward of sequence-to-heads all-to-all")
    hl, hk = split.local_heads, split.local_kv_heads
    gq = _merge_heads(recv[:, :, :, :hl])
    if split.kv_heads % len(team) == 0:  # each kv head came from exactly one member
        return gq, _merge_heads(recv[:, :, :, hl:hl + hk]), _merge_heads(recv[:, :, :, hl + hk:])
    gk = torch.zeros(kv_shape, dtype=dq.dtype, device=dq.device)
    gv = torch.zeros(kv_shape, dtype=dq.dtype, device=dq.device)
    for m in range(len(team)):  # several members may have read one kv head: their gradients add
        for i, src in enumerate(split.kv_sources(m)):
            gk[:, :, src].add_(recv[m, :, :, hl + i])
            gv[:, :, src].add_(recv[m, :, :, hl + hk + i])
    return gq, gk, gv


def heads_to_sequence(out: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """``(B, A L, H/A, D)`` output of a team rank -> this rank's ``(B, L, H, D)`` rows, all heads."""
    return _merge_heads(_to_sequence([out], swap, "forward", swap.what + ", heads-to-sequence all-to-all"))


def heads_to_sequence_backward(dout: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """The gradient of ``heads_to_sequence``: the reverse swap."""
    a = len(swap.team)
    bsz, n, heads, dim = dout.shape
    stamp = swap.comm.stamp(swap.call, "backward")
    send = swap.comm.blocks((a, bsz, n, heads // a, dim), dout.dtype, dout.device, stamp)
    send.data.copy_(dout.unflatten(2, (a, heads // a)).permute(2, 0, 1, 3, 4))  # block m: member m's heads
    recv = _exchange(send, swap, stamp, swap.what + ", backward of heads-to-sequence all-to-all")
    return recv.permute(1, 0, 2, 3, 4).reshape(bsz, a * n, heads // a, dim)
