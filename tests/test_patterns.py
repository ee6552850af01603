import pytest

from dilated_attention.patterns import head_groups, longnet_offsets, plan_patterns, validate_patterns


@pytest.mark.parametrize(
    "segs, rates, n, exc, words",
    [
        ([8, 16], [1], 32, ValueError, ["equal lengths", "2 and 1"]),
        ([], [], 32, ValueError, ["at least one"]),
        ([8, 0], [1, 1], 32, ValueError, ["segment_lengths", "positive"]),
        ([8, 16], [1, -2], 32, ValueError, ["dilation_rates", "positive"]),
        ([12], [1], 32, ValueError, ["32", "segment_lengths[0]=12"]),
        ([8, 16], [1, 3], 32, ValueError, ["segment_lengths[1]=16", "dilation_rates[1]=3"]),
        ([64], [3], 32, ValueError, ["segment_lengths[0]=32", "dilation_rates[0]=3"]),
        ([8.0], [1], 32, TypeError, ["segment_lengths[0]", "float"]),
        ("8", [1], 32, TypeError, ["segment_lengths"]),
        ([8], [True], 32, TypeError, ["dilation_rates[0]"]),
    ],
)
def test_invalid_patterns_name_the_rule(segs, rates, n, exc, words):
    with pytest.raises(exc) as info:
        validate_patterns(segs, rates, n)
    for w in words:
        assert w in str(info.value)


def test_segment_longer_than_sequence_is_clamped():
    assert validate_patterns([8, 1000], [1, 4], 32) == [(8, 1), (32, 4)]


def test_longnet_offsets_follow_design():
    assert longnet_offsets(4, 2) == [0, 0, 1, 1]
    assert longnet_offsets(4, 8) == [0, 2, 4, 6]
    assert longnet_offsets(3, 1) == [0, 0, 0]


def test_head_groups_larger_first_and_cover_all():
    assert head_groups(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="num_heads >= number of patterns"):
        head_groups(2, 3)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (8, 8), (8, 1), (12, 4), (5, 5)])
@pytest.mark.parametrize("rate", [1, 2, 3, 4, 8])
def test_chunks_cover_each_head_once_with_its_kv_head(heads, kv_heads, rate):
    seg = 24 * rate
    (plan,) = plan_patterns([seg], [rate], seq_len=seg, local_len=seg, num_heads=heads, num_kv_heads=kv_heads)
    group = heads // kv_heads
    offsets = longnet_offsets(heads, rate)
    seen, pairs = [], set()
    for c in plan.chunks:
        span, kv_span = c.h1 - c.h0, c.k1 - c.k0
        assert span % kv_span == 0
        for i, h in enumerate(range(c.h0, c.h1)):
            assert offsets[h] == c.offset
            assert c.k0 + i // (span // kv_span) == h // group  # local mapping = GQA mapping
            seen.append(h)
        for kv in range(c.k0, c.k1):
            assert (kv, c.offset) not in pairs  # each (kv head, offset) packed once
            pairs.add((kv, c.offset))
    assert sorted(seen) == list(range(heads))
    assert plan.packed_heads == len(pairs)


def test_ring_plan_local_and_spanning():
    plans = plan_patterns([8, 16, 64], [1, 2, 4], seq_len=64, local_len=16, num_heads=4, num_kv_heads=4)
    assert [(p.ring_size, p.local_segment) for p in plans] == [(1, 8), (1, 16), (4, 16)]


@pytest.mark.parametrize(
    "segs, rates, seq, local, words",
    [
        ([16], [1], 96, 24, ["segment_lengths[0]=16", "does not tile the local shard of 24"]),
        ([48, 96], [1, 1], 96, 32, ["segment_lengths[0]=48", "multiple of the local shard length 32"]),
        ([128], [64], 128, 32, ["local shard length 32", "dilation_rates[0]=64"]),
    ],
)
def test_ring_plan_errors(segs, rates, seq, local, words):
    with pytest.raises(ValueError) as info:
        plan_patterns(segs, rates, seq_len=seq, local_len=local, num_heads=2, num_kv_heads=2)
    for w in words:
        assert w in str(info.value)


def test_mode_and_heads_validation():
    with pytest.raises(ValueError, match="mode must be one of"):
        plan_patterns([8], [1], seq_len=8, local_len=8, num_heads=2, num_kv_heads=2, mode="dense")
    with pytest.raises(ValueError, match=r"query heads \(6\).*kv heads \(4\)"):
        plan_patterns([8], [1], seq_len=8, local_len=8, num_heads=6, num_kv_heads=4)
