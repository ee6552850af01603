"""Causal rings on contiguous blocks share their cross blocks (``causal_share.py``).

Without sharing, ring position ``p`` computes ``p`` earlier blocks whole and the last rank does all the cross
work. Shared, each rank computes the first half of its rows against earlier blocks and the second half of every
later rank's rows against its own K/V. The schedule's balance is checked without ranks; spawned gloo ranks run
causal cases (full attention, key padding, GQA, LongNet's compact rings) with sharing on and off against the float64
oracle, and count the exchanges that carry the shared rows (sharing forced at these short lengths:
``causal_share.SHARE_MIN_ROWS``, ``causal_share.SHARE_MIN_COMPACT_ROWS``).
The harness battery in ``tests/comm/test_backends.py`` runs shared rings at
``K = 2..4`` on every backend, bitwise across them.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import causal_share, ring_swaps
from dilated_attention.patterns import plan_patterns
from dilated_attention.causal_share import plan_share
from dilated_attention.ring_steps import RingLayout, dense_view, half_calls, step_calls
from dilated_attention.testing.spawn import spawn_ranks


def _work(calls) -> float:
    """Query-key pairs of some calls (a causal call: half its square)."""
    return sum((c.rows.stop - c.rows.start) * (c.keys.stop - c.keys.start) / (2 if c.causal else 1) for c in calls)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_shared_causal_ring_is_balanced(world, monkeypatch):
    monkeypatch.setattr(causal_share, "SHARE_MIN_ROWS", 0)
    monkeypatch.setattr(causal_share, "SHARE_MAX_RANKS", world)
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


def test_share_applies_to_long_causal_contiguous_rings_on_the_callers_rows(monkeypatch):
    (plan,) = plan_patterns([64], [4], seq_len=64, local_len=32, num_heads=4, num_kv_heads=4)
    ranks = (0, 1)
    monkeypatch.setattr(causal_share, "SHARE_MIN_ROWS", 0)
    assert plan_share(plan, RingLayout(), True, ranks, 1, 32) is not None
    assert plan_share(plan, RingLayout(), False, ranks, 1, 32) is None  # non-causal rings are balanced already
    assert plan_share(plan, RingLayout(zigzag=True), True, ranks, 1, 32) is None  # zigzag balances by its layout
    assert plan_share(plan, RingLayout(), True, (1,), 1, 32) is None  # a ring of one rank
    long_ring = tuple(range(causal_share.SHARE_MAX_RANKS + 1))
    assert plan_share(plan, RingLayout(), True, long_ring, 1, 32) is None  # a long ring
    assert plan_share(plan, RingLayout(), True, ranks, 1, 36) is None  # half a block is not whole dilated rows
    monkeypatch.setattr(causal_share, "SHARE_MIN_ROWS", 64)
    assert plan_share(plan, RingLayout(), True, ranks, 1, 32) is None  # a short block: not worth it
    assert plan_share(plan, RingLayout(), True, ranks, 1, 64) is not None
    # LongNet's compact rows: their own length, read on the dense view (whole rows at any even count)
    dense = dense_view(plan)
    monkeypatch.setattr(causal_share, "SHARE_MIN_COMPACT_ROWS", 10)
    assert plan_share(dense, RingLayout(), True, ranks, 1, 10, compact=True) is not None
    assert plan_share(dense, RingLayout(), True, ranks, 1, 8, compact=True) is None


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
    kept = causal_share.SHARE_MIN_ROWS, causal_share.SHARE_MIN_COMPACT_ROWS, ring_swaps.SWAPPED_RINGS
    ring_swaps.SWAPPED_RINGS = "none"  # compact rings stay rings (tests/parallel/test_swapped_ring.py swaps them)
    try:
        with recorded_exchanges("shared cross blocks") as shared:
            for on in (True, False):
                causal_share.SHARE_MIN_ROWS = causal_share.SHARE_MIN_COMPACT_ROWS = 0 if on else 1 << 30
                for i, case in enumerate(cases):
                    before = len(shared)
                    got, _ = run_case(case, "collective", dist.group.WORLD, torch.device("cpu"), 900 + i)
                    res[f"{case.name}-{'shared' if on else 'unshared'}"] = (got.ok, got.message,
                                                                            len(shared) - before)
    finally:
        causal_share.SHARE_MIN_ROWS, causal_share.SHARE_MIN_COMPACT_ROWS, ring_swaps.SWAPPED_RINGS = kept
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

    from dilated_attention import ring
    from dilated_attention.testing.harness import Case, run_case

    events: list[str] = []
    blocks, step = ring._ring_blocks, causal_share.Helper.step

    def recorded_blocks(*args):
        for item in blocks(*args):
            events.append(f"{args[-1]} step {item[0]}")
            yield item

    def recorded_step(self, scratch):
        events.append("help")
        return step(self, scratch)

    ring._ring_blocks, causal_share.Helper.step = recorded_blocks, recorded_step
    kept = causal_share.SHARE_MIN_ROWS
    causal_share.SHARE_MIN_ROWS = 0
    try:
        got, _ = run_case(Case("full", world, (16 * world,), (1,), causal=True), "collective", dist.group.WORLD,
                          torch.device("cpu"), 950)
    finally:
        ring._ring_blocks, causal_share.Helper.step = blocks, step
        causal_share.SHARE_MIN_ROWS = kept
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
