"""The head strategy's swaps (``head_parallel.py``): one all-to-all per tensor, the first of each swap stamped, and
the gradients going home one at a time.

Spawned gloo ranks wrap ``CommBackend.all_to_all`` to see every all-to-all a head call starts: what it names,
whether it carries the stamp, and how many received gradients of the same swap are still alive when the next
one starts (the peak of a head call holds one), and compare each call's rows and gradients with the float64
oracle's on the whole sequence (kv heads split, and expanded to one per query head).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from dilated_attention.testing.spawn import spawn_ranks

HOME = "backward of sequence-to-heads"


def _swaps(rank: int, world: int) -> dict:
    from dilated_attention import dilated_attention
    from dilated_attention.comm import get_backend
    from dilated_attention.comm.base import CommBackend
    from dilated_attention.testing.oracle import oracle_rows

    comm = get_backend("collective")
    original = CommBackend.all_to_all
    results = {}
    expanded = 3 if world % 3 else 2  # kv heads that neither divide nor are divided by the world: one per query head
    for heads, kv_heads in ((4 * world, 2 * world), (6, expanded)):  # (expanded: received dk/dv added, not copied)
        started, received = [], []

        def tracking(self, sends, ranks, what="all-to-all", **kwargs):
            alive = sum(r() is not None for r in received) if HOME in what else None
            got, pending = original(self, sends, ranks, what, **kwargs)
            started.append((what.split(", ")[-1], len(sends), kwargs.get("stamp") is not None, alive))
            if HOME in what:
                received.extend(weakref.ref(g) for g in got)
            return got, pending

        gen = torch.Generator().manual_seed(heads)  # the whole sequence, the same on every rank
        n, segs, rates = 16 * world, [8, 16 * world], [1, 2]
        full = [torch.randn(1, n, h, 8, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads)]
        q, k, v, dout = (t[:, rank * 16:(rank + 1) * 16] for t in full)
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        CommBackend.all_to_all = tracking
        try:
            out = dilated_attention(*x, segs, rates, comm=comm, strategy="head", causal=True)
            out.backward(dout)
        finally:
            CommBackend.all_to_all = original
        want = oracle_rows(*full, rank, world, segs, rates, causal=True)
        got = [out.detach(), *(t.grad for t in x)]
        results[f"{heads}/{kv_heads}"] = {"started": started, "close": [
            torch.allclose(a, b, rtol=1e-10, atol=1e-10) for a, b in zip(got, want)]}
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_one_all_to_all_per_tensor_and_gradients_home_one_at_a_time(world):
    for rank, res in enumerate(spawn_ranks(_swaps, world)):
        for name, r in res.items():
            assert r["close"] == [True] * 4, (world, rank, name, "out, dq, dk, dv against the oracle", r["close"])
            started = r["started"]
            what = [w for w, _, _, _ in started]
            assert what == ["sequence-to-heads all-to-all"] * 3 + ["heads-to-sequence all-to-all"] + \
                ["backward of heads-to-sequence all-to-all"] + [f"{HOME} all-to-all"] * 3, (name, what)
            assert all(n == 1 for _, n, _, _ in started), (name, started)
            # each swap's first all-to-all carries the call's stamp, the others none
            assert [s for _, _, s, _ in started] == [True, False, False, True, True, True, False, False], name
            # no received gradient of the swap is alive when the next one starts: each was merged and freed
            assert [a for _, _, _, a in started[-3:]] == [0, 0, 0], (name, started)
