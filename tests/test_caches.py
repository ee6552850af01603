"""Per-process caches: every one listed by ``cache_info()``, bounded, and emptied by ``clear_caches()``
without changing any result."""

from __future__ import annotations

import torch

import dilated_attention
from dilated_attention import cache_info, clear_caches, dilated_attention as attention
from dilated_attention.caches import KeySet, Table


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 32, 4, 8, generator=gen, requires_grad=True) for _ in range(3)]


def _run(q, k, v, kernel="auto"):
    out = attention(q, k, v, [8, 16, 32], [1, 2, 4], causal=True, kernel=kernel)
    return [out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))]


def test_a_call_fills_caches_that_clear_caches_empties_and_the_next_call_refills():
    q, k, v = _inputs()
    first = _run(q, k, v)
    filled = cache_info()
    for name in ("planning.schedules", "patterns.plans", "dispatch.kernels"):
        assert filled[name].size >= 1, (name, filled[name])
    clear_caches()
    emptied = cache_info()
    assert set(emptied) == set(filled)
    assert all(info.size == 0 for info in emptied.values() if info.bound is not None), emptied
    again = _run(q, k, v)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert cache_info()["planning.schedules"].size >= 1


def test_every_cache_is_listed_with_its_bound():
    info = cache_info()
    assert dilated_attention.cache_info is cache_info and dilated_attention.clear_caches is clear_caches
    expected = {"planning.schedules", "patterns.plans", "patterns.head_offsets", "merge.launch_plans",
                "merge.combine_tables", "triton_support.jitted", "fused.head_tables", "fused.shared_memory_reason",
                "cudnn.forward_calls", "cudnn.backward_calls", "cudnn.refused", "dispatch.kernels",
                "dispatch.auto_kernels", "guard.fallen_back", "guard.proven", "custom_ops.objects", "custom_ops.call_numbers",
                "planning.backend_schedules", "caches.kept_pools", "caches.pools_nest"}
    assert expected <= set(info), sorted(expected - set(info))
    for name, (size, bound) in info.items():
        assert bound is None or (isinstance(bound, int) and bound > 0), (name, bound)
        assert bound is None or 0 <= size <= bound, (name, size, bound)
    held = {name for name, i in info.items() if i.bound is None}  # never emptied: what refers to them lives on
    assert "custom_ops.objects" in held and held <= {
        "custom_ops.objects", "models.lm.data_parallel_groups", "side_streams.pools", "huggingface.mask_codes",
        "caches.held_for_graphs", "caches.kept_pools", "comm.live_backends", "comm.named_backends",
        "fairscale.announced"}, held


def test_a_capture_holds_the_cached_tables_it_reads(monkeypatch):
    """Tables an eager call cached (a warm-up) and a capture then reads are held for good: a live graph keeps
    reading them after ``clear_caches``."""
    from dilated_attention import caches
    from dilated_attention.kernels import fused

    q, k, v = _inputs(4)
    clear_caches()
    expected = _run(q, k, v, "fused")
    cached = dict(fused._TABLES)
    assert cached
    monkeypatch.setattr(caches, "capturing", lambda: True)
    got = _run(q, k, v, "fused")
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    held = {key[1]: value for key, value in caches._HELD_FOR_GRAPHS.items() if key[0] == "fused.head_tables"}
    assert held.keys() >= cached.keys()
    assert all(held[key] is value for key, value in cached.items())
    clear_caches()
    assert not fused._TABLES and all(caches._HELD_FOR_GRAPHS[("fused.head_tables", key)] is held[key] for key in held)


def test_a_full_table_starts_over():
    table, seen = Table(3), KeySet(2)
    for i in range(3):
        table[i] = i
    table[0] = "again"  # a key already held: nothing dropped
    assert dict(table) == {0: "again", 1: 1, 2: 2}
    table[3] = 3
    assert dict(table) == {3: 3}
    seen.add("a")
    seen.add("b")
    seen.add("b")
    assert seen == {"a", "b"}
    seen.add("c")
    assert seen == {"c"}


def test_what_a_capture_reads_is_held_for_good_and_equal(monkeypatch):
    """Inside a CUDA graph capture (simulated: ``capturing`` patched) the merge's combine table and the fused
    kernel's head tables are the call's own, made from host copies held for good (the captured copy re-reads
    them at every replay), and no cache keeps them, so ``clear_caches`` cannot free what a graph reads. Results
    equal the uncaptured call's."""
    from dilated_attention import caches, merge
    from dilated_attention.kernels import fused

    q, k, v = _inputs(3)
    expected = _run(q, k, v, "fused")
    clear_caches()
    monkeypatch.setattr(caches, "capturing", lambda: True)
    held_before = cache_info()["caches.held_for_graphs"].size
    got = _run(q, k, v, "fused")
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert len(merge._TABLES) == len(fused._TABLES) == 0  # nothing made in a capture is left in a table
    held = dict(caches._HELD_FOR_GRAPHS)
    assert len(held) > held_before
    assert any(key[0] == "merge.combine_table" for key in held), sorted(k[0] for k in held)
    assert any(key[0] == "fused.head_table_host" for key in held), sorted(k[0] for k in held)
    rows = [[1, 2, 3], [4, 5, 6]]
    first, second = merge.device_table(rows, torch.device("cpu")), merge.device_table(rows, torch.device("cpu"))
    assert first.tolist() == rows and torch.equal(first, second)
    assert caches._HELD_FOR_GRAPHS[("merge.combine_table", ((1, 2, 3), (4, 5, 6)))].tolist() == rows
    clear_caches()
    assert dict(caches._HELD_FOR_GRAPHS).keys() == caches._HELD_FOR_GRAPHS.keys() >= held.keys()
    again = _run(q, k, v, "fused")  # after clear_caches, in a capture: the held tables answer
    for a, b in zip(expected, again):
        assert torch.equal(a, b)
