import pytest
import torch
from einops import rearrange

from dilated_attention import DilatedAttention, MultiheadDilatedAttention, dilated_attention


def test_dilated_attention_module_matches_function():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 32, 4, 8, dtype=torch.float64) for _ in range(3))
    layer = DilatedAttention([8, 32], [1, 2], causal=True, mode="grouped")
    want = dilated_attention(q, k, v, [8, 32], [1, 2], causal=True, mode="grouped")
    torch.testing.assert_close(layer(q, k, v), want, rtol=0, atol=0)
    assert "segment_lengths=[8, 32]" in repr(layer)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_multihead_matches_manual_projections(num_kv_heads):
    torch.manual_seed(1)
    mha = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2], num_kv_heads=num_kv_heads, causal=True,
                                    dtype=torch.float64)
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    out = mha(x)
    assert out.shape == (2, 16, 32)
    q = rearrange(mha.q_proj(x), "b n (h d) -> b n h d", d=8)
    k = rearrange(mha.k_proj(x), "b n (h d) -> b n h d", d=8)
    v = rearrange(mha.v_proj(x), "b n (h d) -> b n h d", d=8)
    att = dilated_attention(q, k, v, [8, 16], [1, 2], causal=True)
    torch.testing.assert_close(out, mha.out_proj(rearrange(att, "b n h d -> b n (h d)")), rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in mha.parameters())


def test_batch_first_false_is_a_transpose():
    torch.manual_seed(2)
    a = MultiheadDilatedAttention(16, 2, [8], [2], dtype=torch.float64)
    b = MultiheadDilatedAttention(16, 2, [8], [2], batch_first=False, dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(b(x.transpose(0, 1)).transpose(0, 1), a(x))


def test_drop_in_inside_a_transformer_block_trains():
    torch.manual_seed(3)
    block = torch.nn.ModuleDict({
        "norm": torch.nn.LayerNorm(16),
        "attn": MultiheadDilatedAttention(16, 4, [4, 16], [1, 4], causal=True),
        "head": torch.nn.Linear(16, 16),
    })
    x = torch.randn(4, 16, 16)
    opt = torch.optim.Adam(block.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        h = x + block["attn"](block["norm"](x))
        loss = (block["head"](h) - x.roll(1, dims=1)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(embed_dim=30, num_heads=4), ["embed_dim (30)", "num_heads (4)"]),
        (dict(embed_dim=32, num_heads=4, num_kv_heads=3), ["num_heads (4)", "num_kv_heads (3)"]),
        (dict(embed_dim=32, num_heads=0), ["num_heads must be a positive int"]),
    ],
)
def test_multihead_invalid_arguments(kwargs, words):
    with pytest.raises(ValueError) as info:
        MultiheadDilatedAttention(segment_lengths=[8], dilation_rates=[1], **kwargs)
    for w in words:
        assert w in str(info.value)


def test_multihead_rejects_wrong_embed_dim():
    mha = MultiheadDilatedAttention(16, 2, [8], [1])
    with pytest.raises(ValueError, match=r"query must have shape \(B, N, 16\)"):
        mha(torch.randn(1, 8, 12))
