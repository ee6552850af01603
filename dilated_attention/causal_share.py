"""Causal rings on contiguous blocks, balanced: later ranks' cross blocks shared with the earlier ranks.

A causal ring on contiguous blocks of the caller's rows (full attention) shares its cross blocks (``Share``):
each rank computes half of its rows against the earlier blocks and the other half of the later ranks' rows
against its own K/V, so the last rank no longer does all the cross work. ``ring.py`` runs the ring; this module
says who helps whom and carries the shared rows and their results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm.base import CommBackend, Pending
from .patterns import PatternPlan
from .ring_steps import RingLayout, call_mask, half_calls
from .views import pack_kv


# Causal rings share their cross blocks (``Share``) where a block has at least this many rows. Measured on 2 x H100
# (causal, 16 x 128 heads, bf16, flash-attn-4), shared / unshared time: full attention 0.73x at 32768 rows, 0.98x at
# 16384, 1.01x at 8192.
SHARE_MIN_ROWS = 16384
# ... and LongNet's rings on compact rows at least this many compact rows: never. Run eagerly, their extra calls
# and exchanges cost more than the balance saves; replayed in a CUDA graph it gains at most 3%. LongNet causal at
# 32768 / 131072 tokens per GPU (4096 / 8192 compact rows), shared / unshared: eager 1.20x / 1.12x (cuDNN only:
# 1.10x / 1.08x), graph 0.99x / 0.985x (cuDNN 0.98x / 0.97x).
SHARE_MIN_COMPACT_ROWS = 1 << 30
# ... and at most this many ranks: the first rank of a ring of G holds G - 1 later ranks' half rows (and their dQ),
# which grows with the ring; longer causal rings balance with zigzag shards.
SHARE_MAX_RANKS = 4


@dataclass(frozen=True)
class Share:
    """A causal ring on contiguous blocks, balanced: the ring position ``p`` sees ``p`` earlier blocks whole, so
    the last rank would do ``G - 1`` blocks of cross work while the first does none. Here each rank computes
    only its first ``half`` query rows against the earlier blocks; its second half goes to every earlier rank
    of the ring (its ``helpers``), which computes it against its own K/V and sends the result back (forward,
    at its first step: fp32 ``out``/``lse``; backward, one guest per idle step (``Helper``): fp32 dQ, the dK/dV
    of its own block kept apart until that block's accumulator is home). Every rank then does its causal block plus
    ``G - 1`` half blocks. ``guests``: the later ranks whose second halves this rank computes."""

    half: int
    helpers: tuple[int, ...]
    guests: tuple[int, ...]


def plan_share(reads: PatternPlan, layout: RingLayout, causal: bool, members: tuple[int, ...], rank: int,
           rows: int, compact: bool = False) -> Share | None:
    """How a ring of ``members`` on blocks of ``rows`` query rows, read with ``reads`` (a compact ring's dense
    view, else the pattern's plan), shares its cross blocks: causal rings on contiguous blocks of at least
    ``SHARE_MIN_ROWS`` rows (``SHARE_MIN_COMPACT_ROWS`` for ``compact`` ones), whole dilated rows per half, of at
    most ``SHARE_MAX_RANKS`` ranks; else ``None``."""
    least = SHARE_MIN_COMPACT_ROWS if compact else SHARE_MIN_ROWS
    if not causal or layout.zigzag or not 2 <= len(members) <= SHARE_MAX_RANKS or rows < least \
            or rows % (2 * reads.dilation):
        return None
    pos = members.index(rank)
    return Share(rows // 2, members[:pos], members[pos + 1:])


def _trade(comm: CommBackend, sends: list[tuple[int, tuple[torch.Tensor, ...]]], peers: tuple[int, ...],
           likes: tuple[torch.Tensor, ...], what: str, stamp) -> tuple[list[tuple[torch.Tensor, ...]], Pending]:
    """Post ``(group rank, tensors)`` sends and receive tensors shaped like ``likes`` from each of ``peers``, in
    one batch: ``(what each peer sent, pending)``."""
    got = [tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in likes) for _ in peers]
    pending = comm.exchange([(x, r) for r, xs in sends for x in xs],
                            [(x, r) for r, xs in zip(peers, got) for x in xs], what, stamp=stamp)
    return got, pending


def post_guests(comm: CommBackend, share: Share, tensors: tuple[torch.Tensor, ...], what: str, stamp
                 ) -> tuple[list[tuple[torch.Tensor, ...]], Pending]:
    """Our second half of each of ``tensors`` to every helper; the guests' halves received: ``(per guest, pending)``."""
    mine = tuple(x[:, share.half:].contiguous() for x in tensors) if share.helpers else ()
    return _trade(comm, [(h, mine) for h in share.helpers], share.guests,
                  tuple(x[:, share.half:] for x in tensors), what, stamp)


def return_results(comm: CommBackend, share: Share, results: list[tuple[torch.Tensor, ...]],
                    likes: tuple[torch.Tensor, ...], what: str, stamp) -> list[tuple[torch.Tensor, ...]]:
    """Each guest's results sent home; the helpers' results for our second half (shaped like ``likes``), in
    ring order, once they have arrived."""
    got, pending = _trade(comm, list(zip(share.guests, results)), share.helpers, likes, what, stamp)
    pending.wait()
    return got


class Helper:
    """A rank's work on its guests' backward: their second halves (read with ``reads``) against our own K/V
    (packed by ``plan`` again: the ring buffers hold other blocks by then), one guest per idle step of the ring
    (``step``); their dQ kept per guest (``results``), their dK/dV of our block added into the ``scratch`` the
    ring hands each step. A rank with ``n`` guests has ``n`` idle steps, the ring's last: at its first, ``scratch``
    is free from then on. One guest per step holds the dK/dV accumulator passing through back by one half block;
    every guest at the first idle step held it back by all of theirs (K = 4, full causal attention, 32768 rows per
    rank: 71% efficiency at once, 83% spread)."""

    order = "spread"  # (a scaling file's ``meta.share_guests``: the cost model replays the order it measured)

    def __init__(self, kernel, guests, arriving: Pending, k, v, plan: PatternPlan, reads: PatternPlan, own: int,
                 rows: int, key_mask, scale: float) -> None:
        self.kernel, self.guests, self.arriving = kernel, guests, arriving
        self.k, self.v, self.plan, self.reads, self.own, self.rows = k, v, plan, reads, own, rows
        self.key_mask, self.scale = key_mask, scale
        self.results: list[tuple[torch.Tensor]] = []
        self.mine: torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        return len(self.results) < len(self.guests)

    def step(self, scratch: torch.Tensor) -> None:
        """The next guest's backward; the first zeroes ``scratch``."""
        if self.mine is None:
            self.arriving.wait()
            self.mine = pack_kv(self.k, self.v, self.plan)
            scratch.zero_()
        gq, go, gl, gd = self.guests[len(self.results)]
        gdq = torch.zeros(gq.shape, dtype=scratch.dtype, device=gq.device)
        for c in half_calls(self.reads, self.own, self.rows):
            self.kernel.backward_pattern(gq, self.mine[0][:, c.keys], self.mine[1][:, c.keys], c.plan, go, gl, gd,
                                         gdq, scratch[0][:, c.keys], scratch[1][:, c.keys], packed=True,
                                         causal=False, scale=self.scale, **call_mask(self.key_mask, c))
        self.results.append((gdq,))
