"""``CommBackend.exchange``: one batch of point-to-point transfers to and from any ranks, with stamps.

Ring steps, all-to-alls and the shared rows of causal rings all go through it; three gloo ranks check
that every tensor lands where it was sent (two per peer, in posting order), one-sided batches (a rank
that only receives, ranks that only send), and the errors raised before anything is posted.
"""

from __future__ import annotations

import torch

from dilated_attention.testing.spawn import spawn_ranks


def _worker(rank: int, world: int) -> dict:
    from dilated_attention.comm import get_backend

    comm = get_backend("collective")
    others = [r for r in range(world) if r != rank]
    stamp = comm.stamp(1, "forward")
    # to every other rank: a (2, 3) block and a length-4 row, both naming sender and receiver
    sends = [(torch.full((2, 3), float(10 * rank + r)), r) for r in others]
    sends += [(torch.arange(4.0) + 100 * rank + r, r) for r in others]
    blocks, rows = {r: torch.empty(2, 3) for r in others}, {r: torch.empty(4) for r in others}
    recvs = [(blocks[r], r) for r in others] + [(rows[r], r) for r in others]
    comm.exchange(sends, recvs, "every peer, two tensors each", stamp=stamp).wait()
    res = {"blocks": all(torch.equal(blocks[r], torch.full((2, 3), float(10 * r + rank))) for r in others),
           "rows": all(torch.equal(rows[r], torch.arange(4.0) + 100 * r + rank) for r in others)}
    # one-sided: rank 0 receives one row from each other rank, which only sends
    if rank == 0:
        got = {r: torch.empty(5) for r in others}
        comm.exchange([], [(got[r], r) for r in others], "gather", stamp=stamp).wait()
        res["one_sided"] = all(torch.equal(got[r], torch.full((5,), float(r))) for r in others)
    else:
        comm.exchange([(torch.full((5,), float(rank)), 0)], [], "gather", stamp=stamp).wait()
        res["one_sided"] = True
    comm.exchange([], [], "nothing").wait()  # a batch without transfers: nothing to wait for
    try:
        comm.exchange([(torch.zeros(4, 4).t(), others[0])], [], "strided")
        res["strided"] = "no error"
    except ValueError as exc:
        res["strided"] = str(exc)
    return res


def test_exchange_delivers_every_tensor_to_its_peer():
    for rank, res in enumerate(spawn_ranks(_worker, 3)):
        assert res["blocks"] and res["rows"], rank
        assert res["one_sided"], rank
        assert "contiguous" in res["strided"], res["strided"]
