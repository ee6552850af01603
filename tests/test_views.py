import pytest
import torch

from dilated_attention import views
from dilated_attention.patterns import plan_patterns
from dilated_attention.testing.compare import LAYOUTS, as_layout
from dilated_attention.views import chunk_views, dilated_view, pack_kv, unpack_add_


def _layouts(b, n, h, d):
    g = torch.Generator().manual_seed(0)
    for name in LAYOUTS:
        yield name, as_layout(torch.randn(b, n, h, d, dtype=torch.float64, generator=g), name, generator=g)


def test_dilated_view_is_a_view_with_the_right_rows():
    for name, x in _layouts(2, 24, 5, 4):
        v = dilated_view(x, segment=12, dilation=3, offset=2, h0=1, h1=4)
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), name  # no copy
        assert v.shape == (2, 2, 4, 3, 4)
        for s in range(2):
            for j in range(4):
                torch.testing.assert_close(v[:, s, j], x[:, s * 12 + 2 + 3 * j, 1:4], rtol=0, atol=0)


def test_dilated_view_writes_through():
    x = torch.zeros(1, 8, 2, 3)
    dilated_view(x, 8, 2, 1, 0, 2).add_(1.0)
    assert x[:, 1::2].eq(1).all() and x[:, 0::2].eq(0).all()


def test_pack_kv_is_contiguous_and_holds_each_pair_once():
    (plan,) = plan_patterns([32], [4], seq_len=64, local_len=16, num_heads=6, num_kv_heads=2)
    for name, k in _layouts(2, 16, 2, 4):
        v = k * 2 + 1
        buf = pack_kv(k, v, plan)
        assert buf.is_contiguous() and buf.shape == (2, 2, 4, plan.packed_heads, 4), name
        for c in plan.chunks:
            got = buf[0, :, :, c.buffer_head : c.buffer_head + c.k1 - c.k0]
            torch.testing.assert_close(got, k[:, c.offset :: 4, c.k0 : c.k1], rtol=0, atol=0)
            torch.testing.assert_close(buf[1, :, :, c.buffer_head : c.buffer_head + c.k1 - c.k0], v[:, c.offset :: 4, c.k0 : c.k1])


@pytest.mark.parametrize("heads, kv_heads, rate, mode, even", [
    (8, 8, 2, "longnet", True), (16, 16, 8, "longnet", True), (8, 4, 4, "longnet", True), (4, 4, 8, "longnet", True),
    (8, 2, 4, "longnet", False), (6, 2, 4, "longnet", False), (5, 5, 4, "longnet", False), (7, 7, 2, "grouped", False),
    (3, 3, 1, "longnet", False),
])
def test_pack_and_unpack_match_the_chunks_in_every_layout(heads, kv_heads, rate, mode, even):
    """``pack_kv``/``unpack_add_`` against per-chunk copies, for plans whose chunks step evenly (one strided copy
    per tensor) and those that do not, on every layout (transposed, head slices, expanded kv heads...)."""
    segs, rates = ([64], [rate]) if mode == "longnet" else ([32, 64], [1, rate])
    plan = plan_patterns(segs, rates, seq_len=64, local_len=32, num_heads=heads, num_kv_heads=kv_heads, mode=mode)[-1]
    assert plan.ring_size == 2
    assert (views._even_steps(plan) is not None) == even
    for name, k in _layouts(2, 32, kv_heads, 8):
        v = k * 3 - 1
        buf = pack_kv(k, v, plan)
        assert buf.shape == (2, 2, 32 // rate, plan.packed_heads, 8) and buf.is_contiguous(), name
        grads = torch.randn(buf.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        dk, dv = (torch.randn(k.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                  for i in (2, 3))
        want_dk, want_dv = dk.clone(), dv.clone()
        for c in plan.chunks:
            heads_of = slice(c.buffer_head, c.buffer_head + c.k1 - c.k0)
            torch.testing.assert_close(buf[0, :, :, heads_of], k[:, c.offset::rate, c.k0:c.k1], rtol=0, atol=0)
            torch.testing.assert_close(buf[1, :, :, heads_of], v[:, c.offset::rate, c.k0:c.k1], rtol=0, atol=0)
            want_dk[:, c.offset::rate, c.k0:c.k1] += grads[0, :, :, heads_of]
            want_dv[:, c.offset::rate, c.k0:c.k1] += grads[1, :, :, heads_of]
        unpack_add_(dk, dv, grads, plan)
        torch.testing.assert_close(dk, want_dk, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(dv, want_dv, rtol=0, atol=0, msg=name)


def test_unpack_add_inverts_pack_positions():
    (plan,) = plan_patterns([32], [4], seq_len=64, local_len=16, num_heads=6, num_kv_heads=2)
    k = torch.randn(2, 16, 2, 4, dtype=torch.float64)
    buf = pack_kv(k, -k, plan)
    dk, dv = torch.zeros_like(k), torch.zeros_like(k)
    unpack_add_(dk, dv, buf, plan)
    covered = torch.zeros_like(k, dtype=torch.bool)
    for c in plan.chunks:
        chunk_views(covered, plan, c, kv=True).fill_(True)
    torch.testing.assert_close(dk[covered], k[covered])
    torch.testing.assert_close(dv[covered], -k[covered])
    assert dk[~covered].eq(0).all()


from dilated_attention.views import compact_view, region_views  # noqa: E402


@pytest.mark.parametrize("heads, kv_heads, rate, mode, whole", [
    (8, 8, 2, "longnet", True), (8, 2, 4, "longnet", True), (4, 4, 8, "longnet", True),
    (6, 2, 4, "longnet", False), (5, 5, 4, "longnet", False), (7, 7, 2, "grouped", True),
])
def test_region_views_cover_a_pattern_like_its_chunks(heads, kv_heads, rate, mode, whole):
    segs, rates = ([32], [rate]) if mode == "longnet" else ([16, 32], [1, rate])
    plan = plan_patterns(segs, rates, seq_len=64, local_len=64, num_heads=heads, num_kv_heads=kv_heads, mode=mode)[-1]
    compact = torch.randn(2, 64 // rate, heads, 3, dtype=torch.float64)
    via_regions = torch.zeros(2, 64, heads, 3, dtype=torch.float64)
    pairs = region_views(via_regions, compact, plan)
    assert (len(pairs) == 1) == whole
    for rows, part in pairs:
        rows.copy_(part)
    via_chunks = torch.zeros_like(via_regions)
    for c in plan.chunks:
        chunk_views(via_chunks, plan, c).copy_(compact_view(compact, plan, c.h0, c.h1))
    torch.testing.assert_close(via_regions, via_chunks, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("dim,offset", [(16, 0), (16, 3), (6, 0)])
def test_widened_copies_copy(dtype, dim, offset):
    """Rows copied between ``widened`` views are what ``copy_`` writes, as 16-byte elements where both tensors
    allow it (rows of 16 bytes, aligned) and element by element where not (a 12-byte row, a start 3 in)."""
    from dilated_attention.views import widened
    torch.manual_seed(dim + offset)
    src = torch.randn(2, 64, 4, dim + offset).to(dtype)[..., offset:]
    dst = torch.full((2, 16, 8, dim), float("nan"), dtype=dtype)[:, :, 2:6]

    def rows(x):  # every fourth row: a dilated view
        return x.unflatten(1, (16, 4)).select(2, 1)

    want = dst.clone().copy_(rows(src))
    wide_src, wide_dst = widened(src, dst)
    wide = (dim * src.element_size()) % 16 == 0 and (offset * src.element_size()) % 16 == 0
    assert (wide_src.dtype == torch.complex128) == wide and (wide_dst.dtype == torch.complex128) == wide
    wide_dst.copy_(rows(wide_src))
    assert torch.equal(dst, want)
