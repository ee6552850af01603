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


def _run(q, k, v):
    out = attention(q, k, v, [8, 16, 32], [1, 2, 4], causal=True)
    return [out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))]


def test_a_call_fills_caches_that_clear_caches_empties_and_the_next_call_refills():
    q, k, v = _inputs()
    first = _run(q, k, v)
    filled = cache_info()
    for name in ("functional.schedules", "patterns.plans", "dispatch.kernels"):
        assert filled[name].size >= 1, (name, filled[name])
    clear_caches()
    emptied = cache_info()
    assert set(emptied) == set(filled)
    assert all(info.size == 0 for info in emptied.values() if info.bound is not None), emptied
    again = _run(q, k, v)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert cache_info()["functional.schedules"].size >= 1


def test_every_cache_is_listed_with_its_bound():
    info = cache_info()
    assert dilated_attention.cache_info is cache_info and dilated_attention.clear_caches is clear_caches
    expected = {"functional.schedules", "patterns.plans", "patterns.head_offsets", "merge.launch_plans",
                "merge.combine_tables", "triton_support.jitted", "fused.head_tables", "fused.shared_memory_reason",
                "cudnn.forward_calls", "cudnn.backward_calls", "cudnn.refused", "dispatch.kernels",
                "dispatch.auto_kernels", "guard.fallen_back", "guard.proven", "custom_ops.objects", "comm.schedules"}
    assert expected <= set(info), sorted(expected - set(info))
    for name, (size, bound) in info.items():
        assert bound is None or (isinstance(bound, int) and bound > 0), (name, bound)
        assert bound is None or 0 <= size <= bound, (name, size, bound)
    held = {name for name, i in info.items() if i.bound is None}  # never emptied: what refers to them lives on
    assert "custom_ops.objects" in held and held <= {"custom_ops.objects", "models.lm.data_parallel_groups",
                                                   "ring.side_streams", "huggingface.mask_codes"}, held


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
