"""Rings on compact rows run head-parallel where their ranks divide the heads (``ring/swapped.py``).

A spanning dilated pattern (every LongNet pattern longer than a rank's block) is dense attention on its compact
rows. Where the ring's ``G`` ranks divide the query and kv heads, one all-to-all gives each rank the whole
segment's compact rows of ``1 / G`` of the heads, the segment is computed there as one local pattern, and a second
all-to-all brings the results home (the backward likewise). Spawned gloo ranks run causal and non-causal cases
with the swap on and off against the float64 oracle, and count the exchanges that carry swapped rows; where the
ranks do not divide the heads, or the layout is zigzag, the ring runs as before. The harness battery in
``tests/comm/test_backends.py`` runs swapped patterns on every backend, bitwise across them.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention.kernels.chunk_loop import ChunkLoop
from dilated_attention.kernels.reference import ReferenceKernel
from dilated_attention.patterns import plan_patterns
from dilated_attention.ring import block, routes, swapped
from dilated_attention.ring.layout import RingLayout
from dilated_attention.ring.routes import Way, dense_ring, plan_ring
from dilated_attention.testing.spawn import spawn_ranks

KERNEL = ChunkLoop(ReferenceKernel())
Q, K = torch.empty(1, 16, 4, 8), torch.empty(1, 16, 2, 8)


class _Fake:
    """What the routes read of a backend."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world


def _members(plan, causal: bool, world: int, rank: int, layout: RingLayout = RingLayout(), q=Q, k=K,
             masked: bool = False):
    """The swapped ring's members where ``plan`` runs swapped (``Way.SWAPPED``), else ``None``."""
    ring = plan_ring([plan], KERNEL, causal=causal, scale=1.0, masked=masked, comm=_Fake(rank, world),
                     layout=layout)
    route = ring.routes(q, k)[0].routes[0]
    return route.members if route.way is Way.SWAPPED else None


@pytest.mark.parametrize("causal", [False, True])
def test_swap_applies_to_compact_rings_whose_ranks_divide_the_heads(causal):
    (local, spanning) = plan_patterns([16, 32], [1, 2], seq_len=32, local_len=16, num_heads=4, num_kv_heads=2)
    assert (_members(spanning, causal, 2, 1) is not None) == causal  # the default
    with routes.tuned(swapped_rings="all"):
        assert _members(spanning, causal, 2, 1) == (0, 1)
        assert _members(local, causal, 2, 1) is None  # a local pattern
        assert _members(spanning, causal, 2, 1, masked=True) is None  # a key mask: the ring
        assert _members(spanning, causal, 2, 1, RingLayout(zigzag=True)) is None
        (odd,) = plan_patterns([48], [2], seq_len=48, local_len=16, num_heads=4, num_kv_heads=2)
        assert _members(odd, causal, 3, 0) is None  # 3 ranks do not divide 4 heads
        (full,) = plan_patterns([32], [1], seq_len=32, local_len=16, num_heads=4, num_kv_heads=2)
        assert _members(full, causal, 2, 0) is None  # rate 1: the caller's rows
        # grouped mode: heads 3-5 only, reading both kv heads, whose other query heads it does not read
        grouped = plan_patterns([8, 32, 32], [1, 2, 4], seq_len=32, local_len=16, num_heads=8, num_kv_heads=2,
                                mode="grouped")[1]
        q8 = torch.empty(1, 16, 8, 8)
        assert dense_ring(grouped, False, RingLayout(), q8, K) is not None
        assert _members(grouped, causal, 2, 0, q=q8) is None


def test_swapped_patterns_run_where_the_routes_say():
    """A swapped pattern is computed after ``Tuning.swap_after`` of the others, in both directions."""
    plans = plan_patterns([8, 16, 32], [1, 1, 2], seq_len=32, local_len=16, num_heads=4, num_kv_heads=2)

    def orders(after: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        with routes.tuned(swap_after=after):
            forward, backward = plan_ring(plans, KERNEL, causal=True, scale=1.0, comm=_Fake(1, 2)).routes(Q, K)
        assert forward.routes[2].way is Way.SWAPPED
        return forward.order, backward.order

    assert orders(1) == ((0, 2, 1), (0, 2, 1))
    assert orders(0) == ((2, 0, 1), (2, 0, 1))
    assert orders(1 << 30) == ((0, 1, 2), (0, 1, 2))


def _schedules(rank: int, world: int) -> dict:
    """One LongNet call's output and gradients under each swap schedule (computed first, second or last; posted
    before the other patterns, or at its turn with its results awaited at once, as beside side streams): bitwise
    the same, since only the order of launches changes."""
    from dilated_attention import dilated_attention
    from dilated_attention.comm import get_backend

    comm = get_backend("collective")
    gen = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(2, 16, 4, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    results, kept, computed = [], swapped.at_turn, []
    original = block.swap_forward
    block.swap_forward = lambda swap: (computed.append(swap.route.plan.index), original(swap))[1]
    try:
        for after in (0, 1, 1 << 30):
            for at_turn in (False, True):
                swapped.at_turn = lambda sides, at_turn=at_turn: at_turn
                x = [t.clone().requires_grad_() for t in (q, k, v)]
                with routes.tuned(swap_after=after):
                    out = dilated_attention(*x, [8, 16, 16 * world], [1, 1, 2], causal=True, comm=comm,
                                            strategy="ring")
                    out.backward(dout)
                results.append([out.detach(), *(t.grad for t in x)])
    finally:
        block.swap_forward = original
        swapped.at_turn = kept
    return {"equal": all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r)),
            "swapped": computed}


def test_swap_schedules_are_bitwise_equal():
    for r in spawn_ranks(_schedules, 2):
        assert r["swapped"] == [2] * 6  # the spanning pattern swapped under every schedule
        assert r["equal"]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dilated_attention.testing.harness import Case, recorded_exchanges, run_case

    def packed(sends, recvs, what):  # one transfer per peer and direction
        assert len(sends) == len(recvs) == len({r for _, r in sends}), what

    n = 16 * world
    cases = [Case("longnet-causal", world, (8, 16, n), (1, 2, 4), causal=True),
             Case("longnet", world, (8, 16, n), (1, 2, 4)),
             Case("gqa", world, (8, n), (2, 4), causal=True, heads=8, kv_heads=4, dim=16),
             Case("bfloat16-transposed", world, (16, n), (1, 2), causal=True, dtype="bfloat16", dim=16,
                  layout="transposed"),
             Case("head-chunks", world, (8, n), (1, 4), heads=8, kv_heads=4, head_chunks=True),
             Case("zigzag", world, (8, n), (1, 2), causal=True, shards="zigzag"),
             Case("grouped-gqa", world, (8, n, n), (1, 2, 4), mode="grouped", causal=True, heads=8, kv_heads=2)]
    if world == 4:  # a pattern spanning 2 of the 4 ranks beside one spanning all 4
        cases.append(Case("two-rings", world, (8, 32, n), (1, 2, 4), causal=True))
    res: dict = {}
    with recorded_exchanges("head swap", packed) as swaps_seen:
        for on in (True, False):
            with routes.tuned(swapped_rings="all" if on else "none"):
                for i, case in enumerate(cases):
                    before = len(swaps_seen)
                    got, _ = run_case(case, "collective", dist.group.WORLD, torch.device("cpu"), 950 + i)
                    chunks = case.kv_heads if case.head_chunks else 1
                    # per spanning pattern on compact rows whose ring divides the heads of each of `chunks` head
                    # chunks: forward rows out, results home; backward the same
                    rings = [w // case.local_len for w, r in zip(case.segment_lengths, case.dilation_rates)
                             if w > case.local_len and r > 1]
                    swaps = sum(on and case.shards == "contiguous" and case.mode == "longnet"
                                and (case.heads // chunks) % g == 0 and (case.kv_heads // chunks) % g == 0
                                for g in rings)
                    res[f"{case.name}, swap {'on' if on else 'off'}"] = (got.ok, got.message,
                                                                         len(swaps_seen) - before, 4 * chunks * swaps)
    return res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_swapped_rings_match_the_oracle(world):
    for rank, res in enumerate(spawn_ranks(_worker, world)):
        for name, (ok, message, exchanges, expected) in res.items():
            assert ok, f"rank {rank}, {name}: {message}"
            assert exchanges == expected, (rank, name, exchanges)
        assert any(expected for *_, expected in res.values()) == (world != 3)  # 3 ranks divide no case's heads


def test_travelling_results_are_awaited_once_the_next_pattern_is_issued():
    landed = []

    class Swap:
        def __init__(self, name):
            self.name = name

        def land(self):
            landed.append(self.name)

    travelling, a, b = swapped.Travelling(), Swap("a"), Swap("b")
    for swap in (None, a, b):  # a pattern, then two swaps: nothing awaited yet
        travelling.turn(swap)
    assert landed == []
    travelling.turn(None)  # the next pattern's turn: issued after it, the swaps' results still travel
    assert landed == []
    travelling.turn(None)  # the one after: that pattern is issued, so the swaps are awaited (once)
    assert landed == ["a", "b"]
    travelling.turn(None)
    assert landed == ["a", "b"]
