"""Causal rings on contiguous blocks, balanced: later ranks' cross blocks shared with the earlier ranks.

A causal ring on contiguous blocks of the caller's rows (full attention) shares its cross blocks
(``routes.Share``, decided with the routes: ``routes.plan_share``): each rank computes half of its rows against the
earlier blocks and the other half of the later ranks' rows against its own K/V, so the last rank no longer does all
the cross work. ``kv_ring.py`` runs the ring; this module carries the shared rows and their results.
"""

from __future__ import annotations

import torch

from ..comm.base import CommBackend, Pending
from ..kernels.protocol import CallSpec
from ..views import pack_kv
from .layout import call_mask, half_calls
from .routes import RingCall, Route, Share


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

    def __init__(self, ring: RingCall, route: Route, posted: tuple[list[tuple[torch.Tensor, ...]], Pending],
                 kv: tuple[torch.Tensor, torch.Tensor], own: int, rows: int, key_mask: torch.Tensor | None) -> None:
        """``posted``: ``post_guests``' answer (the guests' rows, their pending receive); ``kv``: our own ``k``, ``v``
        (local rows); ``own``: our sequence block of ``rows`` rows."""
        self.kernel, self.scale = ring.plan.kernel, ring.plan.scale
        self.plan, self.reads = route.plan, route.dense or route.plan  # (the ring's packing, its calls' view)
        self.guests, self.arriving = posted
        (self.k, self.v), self.own, self.rows, self.key_mask = kv, own, rows, key_mask
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
            self.kernel.backward_pattern(gq, self.mine[0][:, c.keys], self.mine[1][:, c.keys], c.plan,
                                         CallSpec(False, self.scale, packed=True, **call_mask(self.key_mask, c)),
                                         (go, gl, gd), (gdq, scratch[0][:, c.keys], scratch[1][:, c.keys]))
        self.results.append((gdq,))
