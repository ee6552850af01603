"""``strategy="auto"`` resolved differently on two ranks (as on two GPU models whose measured choices differ):
the cross-rank agreement compares the resolved team, so every rank raises a ``ValueError`` naming it, instead
of one rank swapping heads while the other runs a ring. Two spawned gloo ranks."""

from __future__ import annotations

import torch

from dilated_attention.testing.spawn import spawn_ranks


def _worker(rank: int, world_size: int) -> dict:
    from dilated_attention import auto_strategy as strategy, dilated_attention

    if rank == 1:  # this rank's "GPU model" (none on CPU) measured the head strategy fastest for causal LongNet
        strategy.MEASURED_ON[None] = {**strategy.MEASURED, (False, True, "contiguous"): "head"}
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 32, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    try:
        dilated_attention(q, k, v, [8, 64], [1, 2], causal=True, comm="collective", strategy="auto")
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_ranks_resolving_auto_differently_all_raise():
    results = spawn_ranks(_worker, 2)
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} did not raise"
        assert "strategy's team (1: ring, the world: head): rank 0=1, rank 1=2" in res["error"], res["error"]
