import inspect

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


# -- nn.MultiheadAttention-style ergonomics ---------------------------------------------------------


def test_multihead_attention_call_convention():
    """``mha(x, x, x, need_weights=False)`` as with nn.MultiheadAttention: ``(out, None)``, same ``out``."""
    torch.manual_seed(4)
    mha = MultiheadDilatedAttention(16, 2, [8], [2], dtype=torch.float64)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    out, weights = mha(x, x, x, need_weights=False, average_attn_weights=False)
    assert weights is None
    torch.testing.assert_close(out, mha(x), rtol=0, atol=0)


def test_multihead_unsupported_arguments_raise_clearly():
    mha = MultiheadDilatedAttention(16, 2, [8], [2])
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="need_weights=True: dilated attention never materialises"):
        mha(x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        mha(x, attn_mask=torch.zeros(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_causal=True, but this layer was built with causal=False"):
        mha(x, is_causal=True)
    with pytest.raises(ValueError, match="dropout=0.1: attention-weight dropout is not supported"):
        MultiheadDilatedAttention(16, 2, [8], [2], dropout=0.1)
    with pytest.raises(TypeError, match="dropout must be a float"):
        MultiheadDilatedAttention(16, 2, [8], [2], dropout="0.1")


def test_multihead_is_causal_hint_on_a_causal_layer():
    torch.manual_seed(5)
    mha = MultiheadDilatedAttention(16, 2, [8], [2], causal=True, dropout=0.0, dtype=torch.float64)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(mha(x, is_causal=True), mha(x), rtol=0, atol=0)


@pytest.mark.parametrize("head_offsets", ["spread", "torchscale"])
def test_module_forwards_head_offsets(head_offsets):
    """H=6, r=4: the two offset rules differ, so the layer must pass the choice through."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 16, 6, 4, dtype=torch.float64) for _ in range(3))
    layer = DilatedAttention([16], [4], head_offsets=head_offsets)
    want = dilated_attention(q, k, v, [16], [4], head_offsets=head_offsets)
    other = dilated_attention(q, k, v, [16], [4], head_offsets="torchscale" if head_offsets == "spread" else "spread")
    assert not torch.allclose(want, other)
    torch.testing.assert_close(layer(q, k, v), want, rtol=0, atol=0)
    assert f"head_offsets={head_offsets!r}" in repr(layer)


@pytest.mark.skipif("key_padding_mask" not in inspect.signature(dilated_attention).parameters,
                    reason="dilated_attention has no key_padding_mask yet")
def test_multihead_passes_key_padding_mask_through():
    torch.manual_seed(7)
    mha = MultiheadDilatedAttention(16, 2, [8, 16], [1, 2], causal=True, dtype=torch.float64)
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, :5] = True  # left padding: later queries would see these keys without the mask
    q, k, v = (rearrange(proj(x), "b n (h d) -> b n h d", d=8) for proj in (mha.q_proj, mha.k_proj, mha.v_proj))
    att = dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, key_padding_mask=pad)
    want = mha.out_proj(rearrange(att, "b n h d -> b n (h d)"))
    torch.testing.assert_close(mha(x, key_padding_mask=pad), want, rtol=0, atol=0)
    assert not torch.allclose(mha(x)[1], want[1])


def _message_of_the_call(**options) -> str:
    """What ``dilated_attention`` itself raises for these options (the layer must say the same)."""
    q = torch.randn(1, 256, 4, 32, generator=torch.Generator().manual_seed(9))
    segments, rates = options.pop("segment_lengths", [256]), options.pop("dilation_rates", [1])
    with pytest.raises((ValueError, TypeError)) as raised:
        dilated_attention(q, q, q, segments, rates, **options)
    return str(raised.value)


@pytest.mark.parametrize("options", [
    {"comm": "nccl-typo"}, {"comm": 3}, {"strategy": "rign"}, {"mode": "longent"}, {"kernel": "fusd"},
    {"layout": "zigzig"}, {"head_offsets": "spreed"}, {"segment_lengths": [256, 512, 1024], "dilation_rates": [1, 2]},
    {"segment_lengths": [], "dilation_rates": []}, {"dilation_rates": [0]}, {"segment_lengths": [256.0]},
    {"softmax_scale": "0.1"}, {"causal": 1},
])
def test_layers_reject_wrong_options_at_construction_with_the_calls_message(options):
    want = _message_of_the_call(**dict(options))
    segments, rates = options.pop("segment_lengths", [256]), options.pop("dilation_rates", [1])
    with pytest.raises((ValueError, TypeError)) as raised:
        DilatedAttention(segments, rates, **options)
    assert str(raised.value) == want
    options.pop("softmax_scale", None)  # (not an argument of the multi-head layer)
    if options or segments != [256] or rates != [1]:
        with pytest.raises((ValueError, TypeError)) as raised:
            MultiheadDilatedAttention(128, 4, segments, rates, **options)
        assert str(raised.value) == want


def test_layers_accept_every_valid_option_name():
    for mode in ("longnet", "grouped"):
        for strategy in ("auto", "ring", "head", "hybrid"):
            DilatedAttention([8, 16], [1, 2], mode=mode, strategy=strategy, comm="collective", layout="zigzag",
                             kernel="reference", head_offsets="torchscale")


def test_misuse_warning_through_a_layer_points_at_the_calling_line():
    import warnings

    from dilated_attention.misuse import MisuseWarning

    class Block(torch.nn.Module):  # a user's model: the layer called from its forward
        def __init__(self):
            super().__init__()
            self.attn = DilatedAttention([64], [1])

        def forward(self, x):
            return self.attn(x, x, x)

    # heads first (B, H, N, D) = (1, 41, 3, 8) read as 3 tokens of 41 heads: a MisuseWarning (once per shape:
    # a call of a shape seen before reuses its plan)
    for heads, model in ((41, lambda t: Block().attn(t, t, t)), (43, Block())):
        x = torch.randn(1, 3, heads, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x)
        mine = [w for w in caught if issubclass(w.category, MisuseWarning)]
        assert mine and all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in caught]
