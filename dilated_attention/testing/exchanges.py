"""Recording the exchanges a call makes: which transfers ran, and a check on what each one sends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..comm.base import CommBackend


@contextlib.contextmanager
def recorded_exchanges(phrase: str, check: Callable[[list, list, str], None] | None = None):
    """This process's exchanges (``CommBackend.exchange``) and all-to-alls (``CommBackend.all_to_all``, however it
    moves its blocks) whose ``what`` names ``phrase`` are recorded into the list it yields, and
    ``check(sends, recvs, what)`` runs on each (an all-to-all's as the ``(block, rank)`` pairs it sends and
    receives); restored on exit."""
    seen: list[str] = []
    exchange, all_to_all = CommBackend.exchange, CommBackend.all_to_all
    inside = [0]  # an all-to-all over part of the group runs as an exchange: recorded once

    def note(sends, recvs, what):
        if phrase in what:
            seen.append(what)
            if check is not None:
                check(sends, recvs, what)

    def recording_exchange(self, sends, recvs, what="exchange", **kwargs):
        if not inside[0]:
            note(sends, recvs, what)
        return exchange(self, sends, recvs, what, **kwargs)

    def recording_all_to_all(self, sends, ranks, what="all-to-all", **kwargs):
        me = ranks.index(self.rank)
        pairs = [(x[m], r) for m, r in enumerate(ranks) if m != me for x in sends]
        note(pairs, pairs, what)
        inside[0] += 1
        try:
            return all_to_all(self, sends, ranks, what, **kwargs)
        finally:
            inside[0] -= 1

    CommBackend.exchange, CommBackend.all_to_all = recording_exchange, recording_all_to_all
    try:
        yield seen
    finally:
        CommBackend.exchange, CommBackend.all_to_all = exchange, all_to_all
