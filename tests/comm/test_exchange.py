"""``CommBackend.exchange``: one batch of point-to-point transfers to and from any ranks, with stamps; and
``CommBackend.all_to_all``, a collective over the whole group (on GPUs) and such a batch otherwise.

Ring steps, all-to-alls of part of the group and the shared rows of causal rings go through ``exchange``;
three gloo ranks check that every tensor lands where it was sent (two per peer, in posting order), one-sided
batches (a rank that only receives, ranks that only send), the errors raised before anything is posted, and
that both kinds of all-to-all deliver each block to its member with the stamps checked, beside the blocks or
inside them.
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
    # all-to-alls: block m of each tensor to member m; over the whole group (on CPU tensors a batch, unless
    # collectives are asked for) and over ranks 0, 1
    collectives, posted = [], comm._all_to_all
    comm._all_to_all = lambda out, inp: (collectives.append(inp.shape), posted(out, inp))[1]
    # (``_room``: the stamp inside the first tensor's blocks, in 16 bytes left free after the data)
    for name, ranks, collective in (("a2a_group", tuple(range(world)), None),
                                    ("a2a_collective", tuple(range(world)), True), ("a2a_part", (0, 1), True),
                                    ("a2a_collective_room", tuple(range(world)), True),
                                    ("a2a_part_room", (0, 1), True)):
        comm.collective_all_to_all = collective
        if rank not in ranks:
            res[name] = True
            continue
        a, room = len(ranks), name.endswith("_room")
        first = torch.arange(a * 8.0, dtype=torch.float64).view(a, 8) + 1000 * rank  # (room: its last two)
        sends = [first, torch.full((a, 5), rank, dtype=torch.int64)]
        before = len(collectives)
        got, pending = comm.all_to_all(sends, ranks, name, stamp=comm.stamp(2, "forward"), stamp_room=room)
        pending.wait()
        me = ranks.index(rank)
        data = 6 if room else 8
        sent = torch.arange(8.0, dtype=torch.float64)
        res[name] = all(torch.equal(got[0][m, :data], (sent + 8 * me + 1000 * r)[:data])
                        and torch.equal(got[1][m], torch.full((5,), r)) for m, r in enumerate(ranks))
        res[name + "_collectives"] = len(collectives) - before
    comm.collective_all_to_all, comm._all_to_all = None, posted
    res["mismatch"] = comm.ledger.mismatch
    # a stamp inside the blocks still tells ranks out of step: each rank sends another call number
    first = torch.zeros(world, 8, dtype=torch.float64)
    comm.all_to_all([first], tuple(range(world)), "drift", stamp=comm.stamp(10 + rank, "forward"),
                    stamp_room=True)[1].wait()
    error = comm.ledger.error()
    res["drift"] = "" if error is None else str(error)
    comm.ledger.defer = True  # the device path on CPU: logged on arrival, raised by the next verdict
    comm.all_to_all([first], tuple(range(world)), "drift", stamp=comm.stamp(20 + rank, "forward"),
                    stamp_room=True)[1].wait()
    try:
        comm.verify()
        res["deferred_drift"] = ""
    except ValueError as exc:
        res["deferred_drift"] = str(exc)
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
        assert all(res[n] for n in ("a2a_group", "a2a_collective", "a2a_part", "a2a_collective_room",
                                    "a2a_part_room")), (rank, res)
        # CPU tensors: a batch by default; asked for, two collectives and one for the stamps (none with the stamp
        # inside); part of the group: a batch whatever is asked
        assert (res["a2a_group_collectives"], res["a2a_collective_collectives"]) == (0, 3), res
        assert res["a2a_collective_room_collectives"] == 2, res
        assert res.get("a2a_part_collectives", 0) == res.get("a2a_part_room_collectives", 0) == 0, res
        assert res["mismatch"] is None, res["mismatch"]
        assert "ranks out of step" in res["drift"] and f"call {10 + rank}" in res["drift"], res["drift"]
        assert "ranks out of step" in res["deferred_drift"], res["deferred_drift"]


def test_header_templates_make_each_calls_words():
    """On a GPU a call's stamp is ``base + call * unit`` (one kernel, no host copy): the words it must be."""
    from dilated_attention.comm.stamps import Ledger

    base, unit = Ledger().template(torch.device("cpu"), -5, 2, 3, 4)
    assert torch.add(base, unit, alpha=2**31 - 1).tolist() == [[-5, 2**31 - 1, 2, 3]] * 4
    base, unit = Ledger().template(torch.device("cpu"), 77, 1, 0, 0)
    assert torch.add(base, unit, alpha=9).tolist() == [77, 9, 1, 0]
