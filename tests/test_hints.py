"""Common mistakes get a hint: a warning or an error that says what to do."""

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.patterns import plan_patterns


def test_heads_first_layout_warns_at_the_callers_line():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 64, 8)  # (B, H, N, D) by mistake: read as N=4 tokens, H=64 heads
    with pytest.warns(UserWarning, match=r"read as \(B, N, H, D\).*clamped to 4.*q\.transpose\(1, 2\)") as caught:
        dilated_attention(q, q, q, [16, 32], [1, 2])
    assert caught[0].filename == __file__


def test_short_sequence_in_the_right_layout_warns_of_the_clamp_only():
    torch.manual_seed(0)
    q = torch.randn(1, 8, 4, 8)  # 8 tokens, 4 heads: segments clamped, but the layout is plausible
    with pytest.warns(UserWarning, match="clamped") as caught:
        out = dilated_attention(q, q, q, [16, 32], [1, 2])
    assert out.shape == q.shape
    assert not any("transpose" in str(w.message) for w in caught)


@pytest.mark.parametrize("segments, rates, local", [([24], [1], 16), ([24], [1], 32), ([64], [4], 2)])
def test_untiled_ring_shard_error_names_the_head_strategy(segments, rates, local):
    with pytest.raises(ValueError, match=r"segment_lengths\[0\].*strategy='head'"):
        plan_patterns(segments, rates, seq_len=192 if segments[0] != 64 else 64, local_len=local, num_heads=4,
                      num_kv_heads=4, mode="longnet", head_offsets="spread", head_start=0, total_heads=4)
