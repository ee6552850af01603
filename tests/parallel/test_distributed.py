"""Sequence-parallel helpers (dilated_attention.distributed) on 2 spawned gloo ranks, plus their argument checks."""

from __future__ import annotations

import pytest
import torch

from dilated_attention.distributed import all_reduce_gradients, gather_sequence, shard_positions, shard_sequence
from dilated_attention.testing.spawn import spawn_ranks

WORLD = 2


def _worker(rank: int, world_size: int) -> dict:
    from dilated_attention.comm import get_backend

    res: dict = {}
    comm = get_backend("collective")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 8 * world_size, 5, generator=g)  # same on every rank
    y = torch.randn(4, 6, 2 * world_size, generator=g)
    # shard -> gather is the identity, along the sequence dim and along another dim
    res["gather_dim1"] = torch.equal(gather_sequence(shard_sequence(x, comm), comm), x)
    res["gather_dim2"] = torch.equal(gather_sequence(shard_sequence(y, comm, dim=2), comm, dim=2), y)
    res["shard_rows"] = torch.equal(shard_sequence(x, comm), x[:, 8 * rank:8 * (rank + 1)])
    # positions are the global indices of this rank's tokens: sharding arange gives them back
    pos = shard_positions(8 * world_size, comm)
    res["positions"] = pos.tolist()
    res["positions_match_tokens"] = torch.equal(shard_sequence(torch.arange(8 * world_size)[None], comm)[0], pos)
    # gradients: each rank's grads differ; the sum over ranks lands on every rank
    torch.manual_seed(0)  # same weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1, bias=False)).double()
    frozen = torch.nn.Linear(1, 1).double().requires_grad_(False)  # grad None on every rank: skipped
    model.append(frozen)
    local_x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    model[:2](local_x).pow(2).sum().backward()
    mine = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    all_reduce_gradients(model, comm)
    everyone = [comm.all_gather(g_) for g_ in mine]  # (world, *shape): every rank's own gradient
    reduced = [p.grad for p in model.parameters() if p.grad is not None]
    res["grad_sum_err"] = max((g_ - e.sum(0)).abs().max().item() for g_, e in zip(reduced, everyone))
    res["ranks_differ"] = all(not torch.equal(e[0], e[1]) for e in everyone)
    res["frozen_grad_none"] = frozen.weight.grad is None
    return res


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_ranks(_worker, WORLD)


def test_gather_sequence_inverts_shard_sequence(results):
    for res in results:
        assert res["gather_dim1"] and res["gather_dim2"] and res["shard_rows"]


def test_shard_positions_are_the_global_positions_of_the_shard(results):
    for rank, res in enumerate(results):
        assert res["positions"] == list(range(8 * rank, 8 * (rank + 1)))
        assert res["positions_match_tokens"]


def test_all_reduce_gradients_sums_over_the_group(results):
    for res in results:
        assert res["ranks_differ"], "the check needs different per-rank gradients"
        assert res["grad_sum_err"] < 1e-12
        assert res["frozen_grad_none"]


def test_helpers_reject_bad_arguments():
    with pytest.raises(ValueError, match="comm must name a backend"):
        shard_sequence(torch.ones(1, 4), None)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        shard_positions(0, None)
    with pytest.raises(ValueError, match="comm must name a backend"):
        all_reduce_gradients(torch.nn.Linear(1, 1), None)
