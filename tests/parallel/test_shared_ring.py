"""Causal rings on contiguous blocks share their cross blocks (``ring/cross_share.py``).

Without sharing, ring position ``p`` computes ``p`` earlier blocks whole and the last rank does all the cross
work. Shared, each rank computes the first half of its rows against earlier blocks and the second half of every
later rank's rows against its own K/V. The schedule's balance is checked without ranks; spawned gloo ranks run
causal cases (full attention, key padding, GQA, LongNet's compact rings) with sharing on and off against the float64
oracle, and count the exchanges that carry the shared rows (sharing forced at these short lengths:
``routes.tuned(share_min_rows=0, share_min_compact_rows=0)``).
The harness battery in ``tests/comm/test_backends.py`` runs shared rings at
``K = 2..4`` on every backend, bitwise across them.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention.patterns import plan_patterns
from dilated_attention.ring import routes
from dilated_attention.ring.layout import RingLayout, half_calls, step_calls
from dilated_attention.ring.routes import dense_view, plan_share
from dilated_attention.testing.spawn import spawn_ranks


def _work(calls) -> float:
    """Query-key pairs of some calls (a causal call: half its square)."""
    return sum((c.rows.stop - c.rows.start) * (c.keys.stop - c.keys.start) / (2 if c.causal else 1) for c in calls)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_shared_causal_ring_is_balanced(world):
    with routes.tuned(share_min_rows=0, share_max_ranks=world):
        _balanced(world)


def _balanced(world: int) -> None:
    local = 16
    (plan,) = plan_patterns([local * world], [1], seq_len=local * world, local_len=local, num_heads=2, num_kv_heads=2)
    members = tuple(range(world))
    work, unshared = [], []
    for rank in range(world):
        share = plan_share(plan, RingLayout(), True, members, rank, local)
        assert share is not None and share.half == local // 2
        assert share.helpers == members[:rank] and share.guests == members[rank + 1:]
        steps = [step_calls(plan, RingLayout(), rank, src, world, local, True, True) for src in range(world)]
        helping = len(share.guests) * _work(half_calls(plan, rank, local))
        work.append(sum(_work(s) for s in steps) + helping)
        unshared.append(sum(_work(step_calls(plan, RingLayout(), rank, src, world, local, True))
                            for src in range(world)))
    # its own causal block, then half a block for each other rank: the same on every rank
    assert work == [local * local / 2 + (world - 1) * local * local / 2] * world
    assert unshared[-1] == local * local / 2 + (world - 1) * local * local > unshared[0] == local * local / 2
    assert sum(work) == sum(unshared)  # the same pairs, moved


def test_share_applies_to_long_causal_contiguous_rings_on_the_callers_rows():
    (plan,) = plan_patterns([64], [4], seq_len=64, local_len=32, num_heads=4, num_kv_heads=4)
    ranks = (0, 1)
    with routes.tuned(share_min_rows=0):
        _shares(plan, ranks)
    with routes.tuned(share_min_rows=64):
        assert plan_share(plan, RingLayout(), True, ranks, 1, 32) is None  # a short block: not worth it
        assert plan_share(plan, RingLayout(), True, ranks, 1, 64) is not None
    # LongNet's compact rows: their own length, read on the dense view (whole rows at any even count)
    dense = dense_view(plan)
    with routes.tuned(share_min_compact_rows=10):
        assert plan_share(dense, RingLayout(), True, ranks, 1, 10, compact=True) is not None
        assert plan_share(dense, RingLayout(), True, ranks, 1, 8, compact=True) is None


def _shares(plan, ranks) -> None:
    assert plan_share(plan, RingLayout(), True, ranks, 1, 32) is not None
    assert plan_share(plan, RingLayout(), False, ranks, 1, 32) is None  # non-causal rings are balanced already
    assert plan_share(plan, RingLayout(zigzag=True), True, ranks, 1, 32) is None  # zigzag balances by its layout
    assert plan_share(plan, RingLayout(), True, (1,), 1, 32) is None  # a ring of one rank
    long_ring = tuple(range(routes.TUNING.share_max_ranks + 1))
    assert plan_share(plan, RingLayout(), True, long_ring, 1, 32) is None  # a long ring
    assert plan_share(plan, RingLayout(), True, ranks, 1, 36) is None  # half a block is not whole dilated rows


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dilated_attention.testing.harness import Case, recorded_exchanges, run_case

    n = 16 * world
    cases = [Case("full", world, (n,), (1,), causal=True),  # full attention
             Case("gqa-padding", world, (8, n), (1, 2), causal=True, heads=6, kv_heads=2, masked=True,
                  layout="transposed"),  # a dilated ring on the caller's rows: key padding keeps it whole
             Case("bfloat16", world, (8, 16, n), (1, 2, 4), causal=True, heads=4, kv_heads=2, dim=16,
                  dtype="bfloat16", masked=True),
             Case("longnet", world, (8, 16, n), (1, 2, 4), causal=True),  # compact rings
             Case("longnet-gqa", world, (8, n), (2, 4), causal=True, heads=8, kv_heads=2, dim=16)]
    res: dict = {}
    with recorded_exchanges("shared cross blocks") as shared:
        for on in (True, False):
            least = 0 if on else 1 << 30
            # compact rings stay rings (tests/parallel/test_swapped_ring.py swaps them)
            with routes.tuned(share_min_rows=least, share_min_compact_rows=least, swapped_rings="none"):
                for i, case in enumerate(cases):
                    before = len(shared)
                    got, _ = run_case(case, "collective", dist.group.WORLD, torch.device("cpu"), 900 + i)
                    res[f"{case.name}-{'shared' if on else 'unshared'}"] = (got.ok, got.message,
                                                                            len(shared) - before)
    return res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_rings_match_the_oracle(world):
    for rank, res in enumerate(spawn_ranks(_worker, world)):
        for name, (ok, message, exchanges) in res.items():
            assert ok, f"rank {rank}, {name}: {message}"
            # forward: rows out, results back; backward: the same again
            assert exchanges == (4 if name.endswith("-shared") else 0), (rank, name, exchanges)


def _order_worker(rank: int, world: int) -> list[str]:
    """This rank's backward as events: each ring step's block arriving, each guest helped."""
    import torch.distributed as dist

    from dilated_attention.ring import cross_share, kv_ring
    from dilated_attention.testing.harness import Case, run_case

    events: list[str] = []
    blocks, step = kv_ring._ring_blocks, cross_share.Helper.step

    def recorded_blocks(*args):
        for item in blocks(*args):
            events.append(f"{args[-1]} step {item[0]}")
            yield item

    def recorded_step(self, scratch):
        events.append("help")
        return step(self, scratch)

    kv_ring._ring_blocks, cross_share.Helper.step = recorded_blocks, recorded_step
    try:
        with routes.tuned(share_min_rows=0):
            got, _ = run_case(Case("full", world, (16 * world,), (1,), causal=True), "collective", dist.group.WORLD,
                              torch.device("cpu"), 950)
    finally:
        kv_ring._ring_blocks, cross_share.Helper.step = blocks, step
    assert got.ok, got.message
    return [e for e in events if not e.startswith("forward")]


def test_a_helper_runs_one_guest_per_idle_step():
    """On a ring of 4, rank ``p`` helps its ``3 - p`` guests one per idle step, each at a step of its own (every
    guest at the first idle step held back the accumulator passing through by all of their work)."""
    world = 4
    for rank, events in enumerate(spawn_ranks(_order_worker, world)):
        steps = [e for e in events if e != "help"]
        assert steps == [f"backward step {s}" for s in range(world)], (rank, events)
        helped_after = [events[i - 1] for i, e in enumerate(events) if e == "help"]
        # rank p's idle steps are the ring's last (blocks of later ranks): one guest after each
        assert helped_after == [f"backward step {s}" for s in range(rank + 1, world)], (rank, events)
