"""Stacked local patterns' gathers (``stacking.gather``): one ``gather_rows_kernel`` launch per tensor puts every
member's compact rows at its span, the same bytes as the copies it replaces and as plain slicing, for the q
side, the kv side (grouped heads) and lse, on tensors of any strides."""

from __future__ import annotations

import zlib

import pytest
import torch

from dilated_attention.ring import routes, stacking
from dilated_attention.patterns import plan_patterns

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, HEADS, DIM = 64, 4, 16
SEGMENTS, RATES = [8, 16, 32, 64], [1, 2, 4, 8]  # every dilated pattern 8 compact rows: one stack of three
# grouped heads (8 query heads on 4 kv heads): r = 2 and 4 give each kv head one offset and stack; r = 8 does not
GROUPED = dict(heads=8, kv_heads=4, segments=[8, 16, 32, 64], rates=[1, 2, 4, 8], members=2)


def _stack(heads: int = HEADS, kv_heads: int = HEADS, segments=SEGMENTS, rates=RATES, members: int = 3
           ) -> routes.Stack:
    plans = plan_patterns(segments, rates, seq_len=N, local_len=N, num_heads=heads, num_kv_heads=kv_heads,
                          mode="longnet")
    (stack,) = routes.find_stacks(tuple(plans), N, heads, kv_heads)
    assert len(stack.members) == members
    return stack


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (B, N, H, ...) with the same values in another memory layout."""
    if layout == "transposed":  # (B, H, N, ...) memory
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "head_slice":  # a view of a wider tensor's heads
        wide = torch.randn(x.shape[0], x.shape[1], x.shape[2] + 3, *x.shape[3:], dtype=x.dtype, device=x.device)
        view = wide[:, :, 2:2 + x.shape[2]]
        view.copy_(x)
        return view
    return x


def _sliced(x: torch.Tensor, stack: routes.Stack, kv: bool) -> torch.Tensor:
    """What the stack buffer holds, by plain slicing: member ``p``'s compact row ``j`` of head ``h`` is row
    ``j * r + offset(h)``."""
    heads = x.shape[2]
    out = torch.empty((x.shape[0], stack.rows, *x.shape[2:]), dtype=x.dtype, device=x.device)
    for plan, (a, b) in zip(stack.plans, stack.spans):
        for h, offset in enumerate(plan.head_offsets(heads, kv)):
            out[:, a:b, h] = x[:, offset::plan.dilation, h]
    return out


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head_slice"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("side", ["q", "kv", "lse"])
def test_gather_puts_each_members_compact_rows_at_its_span(layout, dtype, side, monkeypatch):
    stack = _stack(**GROUPED) if side == "kv" else _stack()
    kv_heads = GROUPED["kv_heads"] if side == "kv" else HEADS
    g = torch.Generator().manual_seed(zlib.crc32(f"{layout} {dtype} {side}".encode()))
    shape = (2, N, kv_heads, DIM) if side != "lse" else (2, N, HEADS)
    x = _layout(torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(DEVICE), layout)
    kv = side == "kv"
    assert stacking._launches(x), "the gather's kernel should take this tensor"
    got = stacking.gather(x, stack, kv=kv)
    want = _sliced(x, stack, kv)
    assert torch.equal(got, want)
    monkeypatch.setattr(stacking, "_launches", lambda x: False)  # the copies' path, for the same bytes
    assert torch.equal(stacking.gather(x, stack, kv=kv), want)


def test_the_members_spans_tile_the_stack_buffer():
    """The spans tile the buffer: every row of it belongs to exactly one member (what the kernel relies on)."""
    stack = _stack()
    rows = [r for a, b in stack.spans for r in range(a, b)]
    assert rows == list(range(stack.rows))


def test_a_geometrys_prepared_gather_follows_each_calls_tensors(monkeypatch):
    """The gather's launch is prepared once per geometry (``stacking._GATHERS``): later calls of that geometry
    gather their own tensor's rows, and a tensor of other strides or another dtype gets a launch of its own."""
    monkeypatch.setattr(stacking, "_GATHERS", {})  # (other tests' geometries kept out of the count)
    stack = _stack()
    g = torch.Generator().manual_seed(5801)
    first, second = (torch.randn((2, N, HEADS, DIM), generator=g).to(DEVICE) for _ in range(2))
    assert torch.equal(stacking.gather(first, stack), _sliced(first, stack, False))
    kept = len(stacking._GATHERS)
    assert torch.equal(stacking.gather(second, stack), _sliced(second, stack, False))
    assert len(stacking._GATHERS) == kept, "a second call of one geometry should reuse its prepared launch"
    for other in (_layout(second, "transposed"), second.to(torch.bfloat16)):
        assert torch.equal(stacking.gather(other, stack), _sliced(other, stack, False))
    assert len(stacking._GATHERS) == kept + 2, "another layout or dtype should get a launch of its own"
