"""Head chunks (dilated_attention/memory.py): the rule, and chunked calls against the float64 oracle."""

import pytest
import torch

from dilated_attention import dilated_attention, memory, set_memory_bound
from dilated_attention.memory import HeadRange, head_ranges, own_bytes, scratch_bytes
from dilated_attention.ring import block
from dilated_attention.ring.routes import Route, Routes, Way
from dilated_attention.patterns import plan_patterns
from dilated_attention.testing.compare import LAYOUTS, as_layout, assert_within_rule
from dilated_attention.testing.oracle import dense_dilated_attention


@pytest.fixture
def bound():
    """``set_memory_bound`` as a test sets it, restored after the test."""
    previous = memory.BOUND.key
    yield set_memory_bound
    set_memory_bound(*previous)


@pytest.fixture
def forced(bound):
    """Every call chunked as finely as its kv heads allow."""
    bound(0.0, 0)
    return bound


def test_ranges_hold_whole_kv_groups_and_cover_every_head(forced):
    assert head_ranges(10, 1, heads=8, kv_heads=4) == (HeadRange(0, 2, 0, 1), HeadRange(2, 4, 1, 2),
                                                       HeadRange(4, 6, 2, 3), HeadRange(6, 8, 3, 4))
    assert head_ranges(10, 1, heads=6, kv_heads=1) == (HeadRange(0, 6, 0, 1),)  # MQA: one kv group, one range


def test_fewest_chunks_within_the_share(bound):
    bound(memory.DEFAULT_SCRATCH_SHARE, 0)
    own = 1000
    assert len(head_ranges(400, own, 16, 16)) == 1  # 0.4 of own: whole
    assert len(head_ranges(401, own, 16, 16)) == 2
    assert len(head_ranges(1500, own, 16, 16)) == 4  # 1.5 / 4 <= 0.4 < 1.5 / 2
    assert len(head_ranges(1500, own, 12, 6)) == 6  # divisors of 6: 1, 2, 3, 6 (3 gives 0.5)
    assert len(head_ranges(10**9, own, 16, 16)) == 16  # never finer than one kv head


def test_small_calls_run_whole():
    assert memory.BOUND.floor > 0
    assert len(head_ranges(10**12, memory.BOUND.floor - 1, 16, 16)) == 1
    assert len(head_ranges(10**12, memory.BOUND.floor, 16, 16)) == 16


def _routes(plans, leaves_part) -> Routes:
    """Routes that leave parts where ``leaves_part(plan)`` says, else merge in place."""
    return Routes(tuple(Route(i, p, Way.PART if leaves_part(p) else Way.MERGED) for i, p in enumerate(plans)),
                  tuple(range(len(plans))))


def test_scratch_estimate_counts_running_parts_and_ring():
    plans = plan_patterns([8, 32], [1, 2], seq_len=64, local_len=16, num_heads=4, num_kv_heads=2)
    local, spanning = plans
    assert local.ring_size == 1 and spanning.ring_size > 1
    rows, dim, elem = 16, 8, 2
    per_row = (4 + 2 * 2) * dim
    # the ring pattern merges in place (fp32, full shape); the local one leaves a part
    running = 4 * rows * per_row
    part = elem * rows * per_row
    ring_bytes = 2 * (rows // 2) * spanning.packed_heads * dim * (2 * elem + 3 * 4)
    got = scratch_bytes(_routes(plans, lambda p: p.ring_size == 1), rows, 4, 2, dim, elem)
    assert got == running + part + ring_bytes
    # a ring on compact rows (Way.COMPACT_RING) leaves parts too: no full-shape fp32 accumulators at all
    ring_part = elem * (rows // 2) * per_row
    assert scratch_bytes(_routes(plans, lambda p: True), rows, 4, 2, dim, elem) == part + ring_part + ring_bytes
    # a kernel without parts: both patterns merge in place
    assert scratch_bytes(_routes(plans[:1], lambda p: False), rows, 4, 2, dim, elem) == running
    # causal: a ring on the full rows shares its cross blocks: its first rank holds the later ranks' half rows
    # (q, out, dout; lse and dQ in fp32) and its own K/V packed again; a ring on compact rows does not share
    repacked = 2 * (rows // 2) * spanning.packed_heads * dim * elem
    guests = repacked + (spanning.ring_size - 1) * (rows // 2) * 4 * (3 * elem * dim + 4 * (dim + 1))
    assert scratch_bytes(_routes(plans, lambda p: p.ring_size == 1), rows, 4, 2, dim, elem, causal=True) \
        == running + part + ring_bytes + guests
    assert scratch_bytes(_routes(plans, lambda p: True), rows, 4, 2, dim, elem, causal=True) == part + ring_part + ring_bytes
    assert own_bytes(rows, 4, 2, dim, elem) == 4 * elem * rows * 6 * dim


def _run(fn, q, k, v, dout, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    return [out, *torch.autograd.grad(out, leaves, dout)]


CONFIGS = [  # (heads, kv_heads, N, segments, rates)
    (8, 4, 64, [16, 32, 64], [1, 2, 4]),
    (6, 3, 48, [12, 48], [1, 4]),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"H{c[0]}kv{c[1]}")
@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_chunked_call_matches_oracle(forced, monkeypatch, causal, config, kernel):
    heads, kv_heads, n, segs, rates = config
    seed = 100 + CONFIGS.index(config) * 4 + 2 * causal + (kernel == "sdpa")
    gen = torch.Generator().manual_seed(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    q = as_layout(torch.randn(2, n, heads, 8, generator=gen, dtype=torch.float64), layout, generator=gen)
    k, v = (as_layout(torch.randn(2, n, kv_heads, 8, generator=gen, dtype=torch.float64), layout, generator=gen)
            for _ in range(2))
    dout = torch.randn(2, n, heads, 8, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=segs, dilation_rates=rates, causal=causal, softmax_scale=0.3)
    seen = []
    real = block.block_forward

    def spy(q_, *args, **kwargs):
        seen.append(q_.shape[2])
        return real(q_, *args, **kwargs)

    monkeypatch.setattr("dilated_attention.execution.block_forward", spy)
    got = _run(dilated_attention, q, k, v, dout, kernel=kernel, **kw)
    assert seen == [heads // kv_heads] * kv_heads  # one block_forward per kv group, on its query heads
    want = _run(dense_dilated_attention, q, k, v, dout, **kw)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_within_rule(name, g, w, context=f"seed {seed}, layout {layout}")


def test_chunked_packed_documents_match_whole(forced):
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 40, 4, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    docs = torch.tensor([0, 9, 24, 40], dtype=torch.int32)
    kw = dict(segment_lengths=[4, 16], dilation_rates=[1, 2], causal=True, cu_seqlens=docs)
    chunked = _run(dilated_attention, q, k, v, dout, **kw)
    forced(0.0, 1 << 62)  # (restored by the fixture) whole again
    whole = _run(dilated_attention, q, k, v, dout, **kw)
    for name, c, w in zip(("out", "dq", "dk", "dv"), chunked, whole):
        torch.testing.assert_close(c, w, rtol=1e-12, atol=1e-12, msg=name)


def test_set_memory_bound_moves_the_rule_and_checks_its_arguments():
    default = memory.BOUND.key
    assert default == (memory.DEFAULT_SCRATCH_SHARE, memory.DEFAULT_SCRATCH_FLOOR)
    try:
        assert memory.set_memory_bound(0.0, 0) == default
        assert len(head_ranges(10, 1, heads=8, kv_heads=4)) == 4  # every call chunked, as finely as needed
        assert memory.set_memory_bound() == (0.0, 0)
        assert len(head_ranges(10, 1, heads=8, kv_heads=4)) == 1  # small calls run whole again
        for bad in (-0.1, "0.4", True, None):
            with pytest.raises(ValueError, match="scratch_share"):
                memory.set_memory_bound(bad)
        for bad in (-1, 1.5, False):
            with pytest.raises(ValueError, match="from_bytes"):
                memory.set_memory_bound(0.4, bad)
    finally:
        memory.set_memory_bound(*default)


def test_a_rule_is_a_value_that_set_memory_bound_replaces(bound):
    """``memory.BOUND`` is immutable: a reader holding the rule keeps it, the next reader gets the new one."""
    held = memory.BOUND
    assert bound(0.25, 7) == held.key
    assert memory.BOUND is not held and memory.BOUND.key == (0.25, 7) and memory.BOUND.floor == 7
    assert held.key == (held.share, held.floor) == (memory.DEFAULT_SCRATCH_SHARE, memory.DEFAULT_SCRATCH_FLOOR)
    with pytest.raises(AttributeError):  # (dataclasses.FrozenInstanceError)
        memory.BOUND.share = 0.5


def test_a_bound_call_matches_the_oracle_and_the_whole_call():
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(1, 64, 8, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 64, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, 64, 8, 8, generator=gen, dtype=torch.float64)
    kw = dict(segment_lengths=[16, 64], dilation_rates=[1, 4], causal=True)
    whole = _run(dilated_attention, q, k, v, dout, **kw)
    previous = set_memory_bound(0.0, 0)  # (the package's export)
    try:
        bound = _run(dilated_attention, q, k, v, dout, **kw)
    finally:
        memory.set_memory_bound(*previous)
    want = _run(dense_dilated_attention, q, k, v, dout, **kw)
    for name, b, w, o in zip(("out", "dq", "dk", "dv"), bound, whole, want):
        assert_within_rule(name, b, o, context="set_memory_bound(0.0, 0)")
        torch.testing.assert_close(b, w, rtol=1e-12, atol=1e-12, msg=name)


def _disagreeing_bounds(rank: int, world_size: int) -> str | None:
    from dilated_attention.comm import get_backend

    gen = torch.Generator().manual_seed(40 + rank)
    q, k, v = (torch.randn(1, 16, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    if rank == 0:
        memory.set_memory_bound(0.0, 0)  # this rank alone chunks its heads
    try:
        dilated_attention(q, k, v, [8, 32], [1, 2], comm=get_backend("collective", timeout=60), strategy="ring")
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_with_different_bounds_raise_together():
    from dilated_attention.testing.spawn import spawn_ranks

    for message in spawn_ranks(_disagreeing_bounds, 2):
        assert message is not None and "head chunks (set_memory_bound): rank 0=4, rank 1=1" in message, message
