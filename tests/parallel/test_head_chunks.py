"""The head strategy in head chunks (``memory.py``): each chunk's heads are swapped alone, forward and backward.

A call whose scratch the memory rule bounds runs its heads in chunks; with the head strategy every swap then
moves one chunk's heads (``head_parallel.py``'s ``part``), the results are written into head slices of the
sequence-layout output and gradients, and the forward keeps none of the head-layout q, k, v, out for the
backward, which swaps them again. Spawned gloo ranks compare such calls, and the whole-heads call, with the
float64 oracle on the whole sequence, and count the all-to-alls; ``tests/comm/test_backends.py`` runs the
harness's head-chunk cases on every backend, bitwise across them.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import memory
from dilated_attention.head_parallel import HeadSplit, _by_member_heads, _kv_by_member
from dilated_attention.memory import head_ranges
from dilated_attention.testing.spawn import spawn_ranks


@pytest.mark.parametrize("heads, kv_heads, team", [(8, 4, 2), (12, 3, 2), (6, 3, 3), (8, 1, 2)])
def test_a_chunk_swaps_every_members_slice_of_its_heads(heads, kv_heads, team):
    split = HeadSplit(heads, kv_heads, team)
    gen = torch.Generator().manual_seed(heads + kv_heads + team)
    q, k = torch.randn(2, 5, heads, 4, generator=gen), torch.randn(2, 5, kv_heads, 4, generator=gen)
    whole_q, whole_k = _by_member_heads(q, team), _kv_by_member(k, split)
    for part in head_ranges(0, 1, split.local_heads, split.local_kv_heads):  # as finely as kv groups allow
        assert torch.equal(_by_member_heads(q, team, part.h0, part.h1), whole_q[..., part.h0:part.h1, :])
        assert torch.equal(_kv_by_member(k, split, part), whole_k[..., part.k0:part.k1, :])


def _calls(rank: int, world: int) -> dict:
    from dilated_attention import dilated_attention
    from dilated_attention.comm import get_backend
    from dilated_attention.testing.harness import recorded_exchanges
    from dilated_attention.testing.oracle import oracle_rows

    comm = get_backend("collective")
    results = {}
    expanded = 3 if world % 3 else 2  # kv heads that neither divide nor are divided by the world: one per query head
    for heads, kv_heads, causal in ((4 * world, 2 * world, False), (6 * world, expanded, True)):
        gen = torch.Generator().manual_seed(heads)  # the whole sequence, the same on every rank
        full = [torch.randn(2, 16 * world, h, 8, generator=gen, dtype=torch.float64)
                for h in (heads, kv_heads, kv_heads, heads)]
        q, k, v, dout = (t[:, rank * 16:(rank + 1) * 16] for t in full)
        want = oracle_rows(*full, rank, world, [8, 16 * world], [1, 2], causal=causal)
        runs = {}
        for bound in ((memory.DEFAULT_SCRATCH_SHARE, memory.DEFAULT_SCRATCH_FLOOR), (0.0, 0)):
            previous = memory.set_memory_bound(*bound)
            try:
                with recorded_exchanges("heads") as swaps:
                    x = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = dilated_attention(*x, [8, 16 * world], [1, 2], causal=causal, comm=comm, strategy="head")
                    kept = [tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None]
                    forward = len(swaps)
                    out.backward(dout)
            finally:
                memory.set_memory_bound(*previous)
            runs[bound[1]] = ([out.detach(), *(t.grad for t in x)], forward, len(swaps) - forward, kept)
        (whole, *counts_whole), (chunked, *counts) = runs[memory.DEFAULT_SCRATCH_FLOOR], runs[0]
        results[f"{heads}/{kv_heads}"] = {
            "close": [torch.allclose(a, b, rtol=1e-10, atol=1e-10) for got in (whole, chunked)
                      for a, b in zip(got, want)],  # out, dq, dk, dv: whole, then chunked
            "whole": counts_whole, "chunked": counts,
            "chunks": HeadSplit(heads, kv_heads, world).local_kv_heads}  # share 0: one chunk per local kv head
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_head_calls_swap_each_chunk_and_keep_no_head_layout(world):
    for res in spawn_ranks(_calls, world):
        for name, r in res.items():
            heads, kv_heads = map(int, name.split("/"))
            c = r["chunks"]
            assert c > 1, (heads, kv_heads)
            assert r["close"] == [True] * 8, (world, heads, kv_heads, "against the oracle", r["close"])
            # one all-to-all per tensor; whole: q, k, v to heads, out home; backward: dout to heads, dq, dk, dv home
            assert r["whole"][:2] == [4, 4]
            # chunked: per chunk the same forward, and the backward swaps q, k, v, out, dout again
            assert r["chunked"][:2] == [4 * c, 8 * c], (world, heads, kv_heads, r["chunked"])
            head_layout = (2, 16 * world, heads // world, 8)
            assert head_layout in map(tuple, r["whole"][2]) and head_layout not in map(tuple, r["chunked"][2])
