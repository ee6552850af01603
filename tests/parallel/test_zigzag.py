"""The zigzag shard layout: rank ``j`` of ``K`` holds chunks ``j`` and ``2K - 1 - j`` of ``2K``.

Spawned gloo ranks run the harness's zigzag cases (``testing.harness.zigzag_cases``: the float64 oracle
on the natural-order sequence, each rank's rows taken by ``shard_indices``) at ``K = 2`` and ``3``, the
sharding helpers and a module end to end; the schedule's balance and plans are checked without ranks.
(``tests/comm/test_backends.py`` runs the same cases at ``K = 2..4`` on every backend, bitwise across them.)
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import DilatedAttention, dilated_attention
from dilated_attention.distributed import shard_indices, shard_sequence
from dilated_attention.patterns import plan_patterns
from dilated_attention.ring.layout import RingLayout, step_calls
from dilated_attention.ring.routes import dense_ring
from dilated_attention.testing.harness import zigzag_cases
from dilated_attention.testing.spawn import spawn_ranks


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dilated_attention import MultiheadDilatedAttention
    from dilated_attention.comm import get_backend
    from dilated_attention.distributed import gather_sequence, shard_positions
    from dilated_attention.testing.harness import run_case

    comm = get_backend("collective")
    res: dict = {"cases": {}}
    for i, case in enumerate(zigzag_cases(world)):
        got, _ = run_case(case, "collective", dist.group.WORLD, torch.device("cpu"), 700 + i)
        res["cases"][case.name] = [got.ok, got.message, got.errors]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12 * world, 5, generator=g, dtype=torch.float64)
    mine = shard_sequence(x, comm, layout="zigzag")
    res["round_trip"] = torch.equal(gather_sequence(mine, comm, layout="zigzag"), x)
    res["round_trip_dim2"] = torch.equal(
        gather_sequence(shard_sequence(x.transpose(1, 2), comm, dim=2, layout="zigzag"), comm, dim=2,
                        layout="zigzag"), x.transpose(1, 2))
    res["indices_match"] = torch.equal(mine, x[:, shard_indices(12 * world, world, rank, "zigzag")])
    res["positions_match"] = torch.equal(shard_positions(12 * world, comm, layout="zigzag"),
                                         shard_indices(12 * world, world, rank, "zigzag"))
    # a module end to end: zigzag shards in, zigzag rows out, gathered equal to one device's result
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(32, 4, [8, 16 * world], [1, 2], causal=True, comm=comm, layout="zigzag",
                                      strategy="ring", dtype=torch.float64)
    single = MultiheadDilatedAttention(32, 4, [8, 16 * world], [1, 2], causal=True, dtype=torch.float64)
    single.load_state_dict(layer.state_dict())
    tokens = torch.randn(2, 16 * world, 32, generator=g, dtype=torch.float64)
    y = gather_sequence(layer(shard_sequence(tokens, comm, layout="zigzag")), comm, layout="zigzag")
    res["module_err"] = (y - single(tokens)).abs().max().item()
    # the layout is part of the call signature: ranks that disagree on it all raise, naming it
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64)
    try:
        dilated_attention(q, q, q, [8, 16 * world], [1, 2], comm=comm, layout="zigzag" if rank == 0 else "contiguous")
        res["disagreement"] = "no error"
    except ValueError as exc:
        res["disagreement"] = str(exc)
    return res


@pytest.fixture(scope="module", params=[2, 3])
def results(request) -> tuple[int, list[dict]]:
    return request.param, spawn_ranks(_worker, request.param)


def test_zigzag_cases_match_the_oracle(results):
    world, per_rank = results
    names = [c.name for c in zigzag_cases(world)]
    for rank, res in enumerate(per_rank):
        assert sorted(res["cases"]) == sorted(names)
        bad = {name: v for name, v in res["cases"].items() if not v[0]}
        assert not bad, f"rank {rank}: {bad}"


def test_shard_and_gather_invert_each_other(results):
    for res in results[1]:
        assert res["round_trip"] and res["round_trip_dim2"]
        assert res["indices_match"] and res["positions_match"]


def test_module_with_zigzag_shards_equals_one_device(results):
    for res in results[1]:
        assert res["module_err"] < 1e-12


def test_ranks_disagreeing_on_the_layout_raise(results):
    for res in results[1]:
        assert "ranks disagree" in res["disagreement"] and "layout: rank 0=zigzag, rank 1=contiguous" in \
            res["disagreement"], res["disagreement"]


def test_shard_indices_rule():
    assert shard_indices(16, 2, 0, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 2, 1, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_indices(12, 3, 1).tolist() == [4, 5, 6, 7]
    for world in (1, 2, 3, 4):
        every = torch.cat([shard_indices(24 * world, world, r, "zigzag") for r in range(world)])
        assert sorted(every.tolist()) == list(range(24 * world))


def _work(calls, rows_per_chunk: int) -> float:
    """Query-key pairs a step computes (a causal call: half its square)."""
    total = 0.0
    for c in calls:
        pairs = (c.rows.stop - c.rows.start) * (c.keys.stop - c.keys.start)
        total += pairs / 2 if c.causal else pairs
    return total


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_full_causal_ring_is_balanced(world):
    """A segment spanning the sequence: every rank does the same work, half a block's per step after its own."""
    local = 16
    (plan,) = plan_patterns([local * world], [1], seq_len=local * world, local_len=local, num_heads=2,
                            num_kv_heads=2, layout="zigzag")
    layout = RingLayout(zigzag=True)
    for rank in range(world):
        assert layout.members(rank, plan.ring_size, world) == tuple(range(world))
        steps = [step_calls(plan, layout, rank, src, world, local, True) for src in range(world)]
        assert _work(steps[rank], local) == local * local / 2  # its own block: one causal call
        assert len(steps[rank]) == 1 and steps[rank][0].causal
        for src in range(world):
            if src != rank:
                assert _work(steps[src], local) == local * local / 2
    contiguous = [sum(_work(step_calls(plan.with_local_segment(local), RingLayout(), rank, src, world, local, True),
                            local) for src in range(world)) for rank in range(world)]
    assert contiguous[-1] > contiguous[0]  # what zigzag fixes


def test_zigzag_ring_members():
    # K = 3, segments of 2 chunks: chunks 0-1 (and mirror 4-5) on ranks 0 and 1; chunks 2-3 whole on rank 2
    layout = RingLayout(zigzag=True)
    assert [layout.members(r, 2, 3) for r in range(3)] == [(0, 1), (0, 1), (2,)]
    # K = 4, segments of 4 chunks: ranks 0-3 hold chunks 0-3 and their mirrors 4-7
    assert layout.members(2, 4, 4) == (0, 1, 2, 3)
    # K = 4, segments of 2 chunks: two rings of two
    assert [layout.members(r, 2, 4) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    # hybrid: stride 2 (two ranks share a block), lane kept
    assert RingLayout(2, zigzag=True).members(3, 4, 2) == (1, 3)


def test_zigzag_plans():
    plans = plan_patterns([8, 16, 64], [1, 2, 4], seq_len=64, local_len=16, num_heads=4, num_kv_heads=4,
                          layout="zigzag")
    assert [(p.ring_size, p.local_segment) for p in plans] == [(1, 8), (2, 16), (8, 16)]
    plan_patterns([8], [1], seq_len=48, local_len=24, num_heads=2, num_kv_heads=2)  # tiles a contiguous shard
    with pytest.raises(ValueError, match=r"does not tile half the local shard \(12 of 24 rows, layout='zigzag'\)"):
        plan_patterns([8], [1], seq_len=48, local_len=24, num_heads=2, num_kv_heads=2, layout="zigzag")
    with pytest.raises(ValueError, match="must be even"):
        plan_patterns([9], [1], seq_len=18, local_len=9, num_heads=2, num_kv_heads=2, layout="zigzag")
    with pytest.raises(ValueError, match="zigzag half-shard length 8 must be divisible by dilation_rates"):
        plan_patterns([32], [16], seq_len=32, local_len=16, num_heads=2, num_kv_heads=2, layout="zigzag")


@pytest.mark.parametrize("call", [
    lambda: dilated_attention(*(torch.randn(1, 8, 2, 4),) * 3, [8], [1], layout="zig-zag"),
    lambda: shard_indices(8, 2, 0, "Zigzag"),
    lambda: DilatedAttention([8], [1], layout=None),
    lambda: plan_patterns([8], [1], seq_len=8, local_len=8, num_heads=2, num_kv_heads=2, layout="striped"),
])
def test_bad_layout_raises_naming_the_argument(call):
    with pytest.raises(ValueError, match=r"layout must be one of \('contiguous', 'zigzag'\)"):
        call()


def test_shard_helpers_reject_lengths_that_do_not_cut():
    with pytest.raises(ValueError, match="not divisible by 4"):
        shard_indices(10, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="rank must be below"):
        shard_indices(8, 2, 2)


def test_one_device_zigzag_is_the_natural_order():
    q, k, v = (torch.randn(2, 32, 4, 8, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
               for s in (1, 2, 3))
    a = dilated_attention(q, k, v, [8, 32], [1, 2], causal=True, layout="zigzag")
    assert torch.equal(a, dilated_attention(q, k, v, [8, 32], [1, 2], causal=True))


def _ring_order_worker(rank: int, world: int) -> dict:
    """Gradients of a LongNet ring call (a compact ring among local patterns that leave parts) with the
    backward's rings run at every position among the other patterns: bitwise the same (``Tuning.ring_after``)."""
    from dilated_attention.comm import get_backend
    from dilated_attention.ring import routes

    comm = get_backend("collective")
    g = torch.Generator().manual_seed(40 + rank)
    q, k, v, dout = (torch.randn(2, 32, 4, 8, generator=g) for _ in range(4))
    grads = {}
    for at in (0, 1, 2, 1 << 30):
        for causal in (False, True):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            with routes.tuned(ring_after=(at, at)):
                dilated_attention(*x, [8, 16, 64], [1, 2, 4], causal=causal, comm=comm,
                                  strategy="ring").backward(dout)
            grads[(at, causal)] = [t.grad for t in x]
    plans = plan_patterns([8, 16, 64], [1, 2, 4], seq_len=64, local_len=32, num_heads=4, num_kv_heads=4)
    return {"compact_rings": sum(dense_ring(p, False, RingLayout(), q, k) is not None for p in plans),
            "equal": all(torch.equal(a, b) for (at, c), got in grads.items()
                         for a, b in zip(got, grads[(1 << 30, c)])),
            "nonzero": all(bool(t.abs().sum() > 0) for got in grads.values() for t in got)}


def test_backward_ring_position_changes_no_bit():
    for res in spawn_ranks(_ring_order_worker, 2):
        assert res["compact_rings"] == 1 and res["nonzero"] and res["equal"]
