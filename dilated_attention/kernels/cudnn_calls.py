"""The view kernel's views and call plans (``view_kernel.py``: cuDNN's and flash-attn-4's kernels): which head
chunks share one call, the strided ``(B', h, M, D)`` views of a group's operands and targets, how a group's batch
dims split into calls, and the call plans (``_ForwardCall``, ``_BackwardCall``) built once per geometry and
replayed (``_ViewSpec``).

``ViewKernel`` runs the calls planned here; everything here is views and copies, no attention op.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .. import caches
from ..caches import remember
from ..patterns import HeadChunk, PatternPlan
from ..views import ALIGN_BYTES, compact_view, dilated_view, layout_key, packed_view, readable


# ---------------------------------------------------------------------------
# Which chunks share one call


@dataclass(frozen=True)
class _Group:
    """Consecutive chunks of equal size whose offset, first head, first kv head and
    buffer head step by constants: one strided batch dimension ``R``."""

    chunks: tuple[HeadChunk, ...]
    steps: tuple[int, int, int, int]  # offset, h0, k0, buffer_head


def _step(a: HeadChunk, b: HeadChunk) -> tuple[int, int, int, int]:
    return b.offset - a.offset, b.h0 - a.h0, b.k0 - a.k0, b.buffer_head - a.buffer_head


@caches.memoize("cudnn.groups", 512)
def _groups(plan: PatternPlan) -> tuple[_Group, ...]:
    out: list[list[HeadChunk]] = []
    steps: list[tuple[int, int, int, int]] = []
    for c in plan.chunks:
        if out:
            last = out[-1][-1]
            same = (c.h1 - c.h0, c.k1 - c.k0) == (last.h1 - last.h0, last.k1 - last.k0)
            st = _step(last, c)
            # distinct query rows and distinct kv rows (packed or not): group members never alias
            distinct = st[0] != 0 or (st[1] != 0 and st[2] != 0 and st[3] != 0)
            if same and distinct and (len(out[-1]) == 1 or st == steps[-1]):
                out[-1].append(c)
                steps[-1] = st
                continue
        out.append([c])
        steps.append((0, 0, 0, 0))
    return tuple(_Group(tuple(g), s) for g, s in zip(out, steps))


@caches.memoize("cudnn.singles", 512)
def _singles(plan: PatternPlan) -> tuple[_Group, ...]:
    """Every chunk on its own (what runs where cuDNN refused a stacked call)."""
    return tuple(_Group((c,), (0, 0, 0, 0)) for c in plan.chunks)


def _stacks(plan: PatternPlan) -> bool:
    return any(len(g.chunks) > 1 for g in _groups(plan))



# ---------------------------------------------------------------------------
# A group's views, and how its batch dims split into calls


def _group_view(x: torch.Tensor, plan: PatternPlan, g: _Group, role: str) -> torch.Tensor:
    """``(B, S, R, M, h, *rest)`` view of ``x`` for group ``g``.

    Roles: ``"q"`` full-layout query-head tensors (q, out, dout, lse, dq);
    ``"kv"`` full-layout kv tensors; ``"packed"`` ring buffer halves;
    ``"compact"`` a pattern's compact out/lse/dq; ``"compact_kv"`` its compact dk/dv.
    """
    c = g.chunks[0]
    d_off, d_h, d_k, d_buf = g.steps
    w, r = plan.local_segment, plan.dilation
    if role == "q":
        base, delta = dilated_view(x, w, r, c.offset, c.h0, c.h1), d_off * x.stride(1) + d_h * x.stride(2)
    elif role == "kv":
        base, delta = dilated_view(x, w, r, c.offset, c.k0, c.k1), d_off * x.stride(1) + d_k * x.stride(2)
    elif role == "packed":
        base, delta = packed_view(x, c), d_buf * x.stride(2)
    elif role == "compact":
        base, delta = compact_view(x, plan, c.h0, c.h1), d_h * x.stride(2)
    elif role == "compact_kv":
        base, delta = compact_view(x, plan, c.k0, c.k1), d_k * x.stride(2)
    else:
        raise ValueError(f"unknown role {role!r}")
    size = (*base.shape[:2], len(g.chunks), *base.shape[2:])
    stride = (*base.stride()[:2], delta, *base.stride()[2:])
    return x.as_strided(size, stride, base.storage_offset())


def _key_view(mask: torch.Tensor, plan: PatternPlan, g: _Group) -> torch.Tensor:
    """``(B, S, R, M)`` view of a ``(B, L)`` key mask: the keys group ``g``'s calls read (``_group_view``'s
    ``"kv"`` rows, without heads)."""
    c, w, r, unit = g.chunks[0], plan.local_segment, plan.dilation, mask.stride(1)
    return mask.as_strided((mask.shape[0], mask.shape[1] // w, len(g.chunks), w // r),
                           (mask.stride(0), w * unit, g.steps[0] * unit, r * unit),
                           mask.storage_offset() + c.offset * unit)


def _used(keys: torch.Tensor) -> torch.Tensor:
    """Per call batch entry, the rows before the padding: ``(prod T,)`` int32 from a padding mask's
    ``(T..., M)`` view (its kept keys are a prefix of each view row). At least 1: a view that is all
    padding has only padding queries (they share its rows), whose results are discarded anyway."""
    return (~keys).sum(-1, dtype=torch.int32).flatten().clamp_(min=1)


def _padding(keys: _ViewSpec | None, mask: torch.Tensor | None) -> dict:
    """The ops' ``used=`` keyword for a call with a padding mask; none without one."""
    return {} if keys is None else {"used": _used(keys.on((mask,)))}


def _merge_order(sizes: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Split the batch dims ``(B, S, R)`` into (loop dims, merged dims outer->inner) so that the
    merged dims are one uniformly strided dim in every in-place operand; most rows merged wins."""
    dims = [d for d in range(len(sizes)) if sizes[d] > 1]
    best: tuple[int, list[int]] = (1, [])
    for k in range(len(dims), 0, -1):
        for subset in itertools.combinations(dims, k):
            order = sorted(subset, key=lambda d: -strides[0][d]) if strides else list(subset)
            if all(st[a] == sizes[b] * st[b] for st in strides for a, b in zip(order, order[1:])):
                n = math.prod(sizes[d] for d in subset)
                if n > best[0]:
                    best = (n, order)
    merged = best[1]
    return [d for d in range(len(sizes)) if d not in merged], merged  # length-1 dims loop once


def _split(views: dict[str, torch.Tensor], in_place: set[str]) -> tuple[list[int], list[int]]:
    """(loop dims, merged dims) of a group's batch dims ``(B, S, R)``, from its in-place operands."""
    sizes = tuple(next(iter(views.values())).shape[:3])
    return _merge_order(sizes, [tuple(views[n].stride()[:3]) for n in views if n in in_place])


def _calls(views: dict[str, torch.Tensor], loop: list[int], merged: list[int]):
    """The calls of a group: yields ``({name: (T..., M, h, *rest) view}, T sizes)`` per loop index."""
    sizes = tuple(next(iter(views.values())).shape[:3])
    perm = [*loop, *merged]
    arranged = {n: v.permute(*perm, *range(3, v.dim())) for n, v in views.items()}
    tsizes = tuple(sizes[d] for d in merged)
    for idx in itertools.product(*(range(sizes[d]) for d in loop)):
        yield {n: v[idx] for n, v in arranged.items()}, tsizes


def _as_4d(sub: torch.Tensor, nt: int) -> torch.Tensor:
    """``(T..., M, h, D)`` with mergeable ``T`` -> the in-place view ``(prod T, h, M, D)``."""
    tsz = sub.shape[:nt]
    m, h, d = sub.shape[nt:]
    n = math.prod(tsz)
    sm, sh, sd = sub.stride()[nt:]
    sb = sub.stride(nt - 1) if nt else 0
    size, stride = [n, h, m, d], [sb, sh, sm, sd]
    extent = max(st * (sz - 1) for st, sz in zip(stride, size)) + 1
    for i in range(3):  # a dim of length 1: give it a harmless, aligned stride
        if size[i] == 1:
            stride[i] = extent + (-extent) % (ALIGN_BYTES // sub.element_size())
    return sub.as_strided(size, stride, sub.storage_offset())


def _compact_4d(sub: torch.Tensor, nt: int, dtype: torch.dtype | None = None, neginf: float | None = None
                ) -> torch.Tensor:
    """A packed ``(prod T, h, M, *rest)`` copy of ``(T..., M, h, *rest)``; ``neginf``: what ``-inf`` becomes on the
    way (an lse some ops read otherwise: one pass, NaN and ``+inf`` kept)."""
    tsz, (m, h), rest = sub.shape[:nt], sub.shape[nt:nt + 2], sub.shape[nt + 2:]
    dst = torch.empty((math.prod(tsz), h, m, *rest), dtype=dtype or sub.dtype, device=sub.device)
    src, into = sub.transpose(nt, nt + 1), dst.view(*tsz, h, m, *rest)
    if neginf is None:
        into.copy_(src)
    elif src.dtype == dst.dtype:
        torch.nan_to_num(src, nan=math.nan, posinf=math.inf, neginf=neginf, out=into)
    else:
        into.copy_(src).nan_to_num_(nan=math.nan, posinf=math.inf, neginf=neginf)
    return dst


def _out_view(sub: torch.Tensor, nt: int) -> torch.Tensor:
    """``(T..., M, h, *rest)`` target seen as ``(T..., h, M, *rest)`` (matches a cuDNN result unflattened)."""
    return sub.transpose(nt, nt + 1)


def _flat_target(target: torch.Tensor, nt: int) -> torch.Tensor | None:
    """A ``(T..., h, M, D)`` target as the ``(prod T, h, M, D)`` view an op can write in place, if its ``T`` dims
    merge into one stride and the view is ``readable`` (else ``None``: the op's result is copied into it)."""
    tsz, st = target.shape[:nt], target.stride()[:nt]
    if any(st[a] != tsz[b] * st[b] for a, b in zip(range(nt - 1), range(1, nt)) if tsz[b] > 1):
        return None
    flat = target.as_strided((math.prod(tsz), *target.shape[nt:]), (st[-1] if nt else 0, *target.stride()[nt:]),
                             target.storage_offset())
    return flat if readable(flat) else None


def _adopt(res: torch.Tensor, tsz, merged: list[int], plan: PatternPlan, g: _Group, shape) -> torch.Tensor | None:
    """``res`` (one cuDNN result, ``(n, h, M, *rest)``) seen as the pattern's whole compact
    ``(B, L // r, H, *rest)`` tensor, when the single call covered every row and head; else ``None``."""
    strides = _adopted_strides(tuple(res.shape), res.stride(), tuple(tsz), tuple(merged), plan, g, tuple(shape))
    return None if strides is None else res.as_strided(shape, strides, res.storage_offset())


@caches.memoize("cudnn.adopted_strides", 512)  # (views built for the self-check: worked out once per geometry, on meta)
def _adopted_strides(res_shape, res_stride, tsz, merged, plan: PatternPlan, g: _Group, shape):
    res = torch.empty_strided(res_shape, res_stride, device="meta")
    bsz, rows, heads = shape[:3]
    c0, nch = g.chunks[0], len(g.chunks)
    h, m = res.shape[1], res.shape[2]
    step_h = g.steps[1]
    if c0.h0 != 0 or nch * h != heads or (nch > 1 and step_h != h):
        return None
    nt = len(tsz)
    x = res.view(*tsz, *res.shape[1:])
    st = {d: x.stride(i) for i, d in enumerate(merged)}
    s_rows = x.stride(nt + 1)
    s_h = x.stride(nt) if h > 1 else (st[2] if nch > 1 else 1)
    segs = rows // m
    if (segs > 1 and st.get(1) != m * s_rows) or (nch > 1 and st.get(2) != step_h * s_h):
        return None
    strides = (st.get(0, 0), s_rows, s_h, *x.stride()[nt + 2:])
    full = res.as_strided(shape, strides, res.storage_offset())
    # self-check: the group's compact view of ``full`` must address exactly ``res``
    (sub, _), = list(_calls({"t": _group_view(full, plan, g, "compact")}, [d for d in range(3) if d not in merged],
                            list(merged)))
    mine = _out_view(sub["t"], nt)
    same = mine.storage_offset() == x.storage_offset() and all(
        a == b for a, b, sz in zip(mine.stride(), x.stride(), x.shape) if sz > 1
    )
    return strides if same else None


# ---------------------------------------------------------------------------
# Call plans: a group's views are built op by op once per geometry, then replayed with one
# ``as_strided`` per operand (a LongNet step built about 1,500 views on the host otherwise)


@dataclass(frozen=True)
class _ViewSpec:
    """A view of one of a call's tensors (``base``: its index), as size, strides and storage offset
    relative to that tensor's."""

    base: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    delta: int

    @staticmethod
    def of(view: torch.Tensor, base: int, tensors) -> "_ViewSpec":
        return _ViewSpec(base, tuple(view.shape), tuple(view.stride()),
                         view.storage_offset() - tensors[base].storage_offset())

    def on(self, tensors) -> torch.Tensor:
        x = tensors[self.base]
        return x.as_strided(self.size, self.stride, x.storage_offset() + self.delta)


@dataclass(frozen=True)
class _BackwardCall:
    """One cuDNN backward call of a group: q, k, v, out, dout (the 4D view itself when read in place,
    else the ``(T..., M, h, D)`` view to copy compact), lse's view (always copied), and the gradient
    targets (``(T..., h, M, D)`` views of dq, dk, dv: full-layout accumulators, or compact parts)."""

    tsz: tuple[int, ...]
    operands: tuple[tuple[_ViewSpec, bool], ...]
    lse: _ViewSpec
    targets: tuple[tuple[str, _ViewSpec], ...]
    into: tuple[_ViewSpec, ...] | None  # compact targets the op may write in place (``_flat_target``)
    keys: _ViewSpec | None  # the ``(T..., M)`` view of a padding mask (on ``(mask,)``), if the call has one


@dataclass(frozen=True)
class _ForwardCall:
    """One cuDNN forward call: q, k, v (in place, or to copy compact) and the targets of its out and lse,
    views of the pattern's compact buffers (``tensors[3]``, ``tensors[4]``). ``group``/``merged``: what
    adopting cuDNN's own output as the buffer needs when this is the pattern's only call."""

    tsz: tuple[int, ...]
    operands: tuple[tuple[_ViewSpec, bool], ...]
    targets: tuple[_ViewSpec, _ViewSpec]
    group: _Group
    merged: tuple[int, ...]
    into: _ViewSpec | None  # the out target as a view an op may write in place (``_flat_target``)
    keys: _ViewSpec | None  # the ``(T..., M)`` view of a padding mask (on ``(mask,)``), if the call has one


_BACKWARD_CALLS = caches.table("cudnn.backward_calls", 512)


def _backward_calls(tensors, plan: PatternPlan, g: _Group, kv: str, joint: bool, compact: bool,
                    mask: torch.Tensor | None) -> tuple[_BackwardCall, ...]:
    """The calls of group ``g`` on ``tensors = (q, k, v, out, lse, dout, dq, dk, dv)``, cached by geometry;
    ``compact``: the gradients are a pattern's compact parts, else full-layout accumulators; ``mask``: a
    padding mask (``(B, L)``) or ``None``."""
    key = (plan, g, kv, joint, compact, *map(layout_key, tensors), mask is not None and layout_key(mask))
    hit = _BACKWARD_CALLS.get(key)
    if hit is not None:
        return hit
    q, k, v, out, lse, dout, dq, dk, dv = tensors
    index = {"q": 0, "k": 1, "v": 2, "out": 3, "lse": 4, "dout": 5, "dq": 6, "dk": 7, "dv": 8}
    grad_roles = ("compact", "compact_kv", "compact_kv") if compact else ("q", kv, kv)
    src = {"q": _group_view(q, plan, g, "q"), "k": _group_view(k, plan, g, kv), "v": _group_view(v, plan, g, kv),
           "out": _group_view(out, plan, g, "q"), "dout": _group_view(dout, plan, g, "q"),
           "lse": _group_view(lse, plan, g, "q"),
           **{name: _group_view(x, plan, g, role)
              for name, x, role in zip(("dq", "dk", "dv"), (dq, dk, dv), grad_roles)},
           **({} if mask is None else {"keys": _key_view(mask, plan, g)})}
    in_place = {name for name in ("k", "v") if readable(src[name])}
    if joint and all(readable(src[x]) for x in ("q", "out", "dout")):
        in_place |= {"q", "out", "dout"}  # out/dout share q's strides, or the ops plan each tensor's (``joint``)
    calls = []
    for sub, tsz in _calls(src, *_split(src, in_place)):
        nt = len(tsz)
        operands = tuple(
            (_ViewSpec.of(_as_4d(sub[x], nt) if x in in_place else sub[x], index[x], tensors), x in in_place)
            for x in ("q", "k", "v", "out", "dout"))
        targets = tuple((x, _ViewSpec.of(_out_view(sub[x], nt), index[x], tensors)) for x in ("dq", "dk", "dv"))
        flat = [_flat_target(_out_view(sub[x], nt), nt) for x in ("dq", "dk", "dv")] if compact else [None]
        into = None if any(f is None for f in flat) else tuple(
            _ViewSpec.of(f, index[x], tensors) for f, x in zip(flat, ("dq", "dk", "dv")))
        calls.append(_BackwardCall(tuple(tsz), operands, _ViewSpec.of(sub["lse"], index["lse"], tensors), targets,
                                   into, None if mask is None else _ViewSpec.of(sub["keys"], 0, (mask,))))
    return remember(_BACKWARD_CALLS, key, tuple(calls))


_FORWARD_CALLS = caches.table("cudnn.forward_calls", 512)


def _forward_calls(tensors, plan: PatternPlan, groups, kv: str, shapes, mask: torch.Tensor | None
                   ) -> tuple[_ForwardCall, ...]:
    """The forward calls of ``groups`` on ``tensors = (q, k, v)``, cached by geometry; the targets are
    views of contiguous buffers of ``shapes`` (planned on meta tensors); ``mask``: a padding mask or ``None``."""
    key = (plan, groups, kv, *map(layout_key, tensors), mask is not None and layout_key(mask))
    hit = _FORWARD_CALLS.get(key)
    if hit is not None:
        return hit
    q, k, v = tensors
    buffers = tuple(torch.empty(shape, dtype=dt, device="meta") for shape, dt in zip(shapes, (q.dtype, torch.float32)))
    every = (q, k, v, *buffers)
    calls = []
    for g in groups:
        src = {"q": _group_view(q, plan, g, "q"), "k": _group_view(k, plan, g, kv), "v": _group_view(v, plan, g, kv)}
        in_place = {name for name in src if readable(src[name])}
        loop, merged = _split(src, in_place)
        views = {**src, **{name: _group_view(b, plan, g, "compact") for name, b in zip(("out", "lse"), buffers)},
                 **({} if mask is None else {"keys": _key_view(mask, plan, g)})}
        for sub, tsz in _calls(views, loop, merged):
            nt = len(tsz)
            operands = tuple((_ViewSpec.of(_as_4d(sub[x], nt) if x in in_place else sub[x], i, every), x in in_place)
                             for i, x in enumerate(("q", "k", "v")))
            targets = tuple(_ViewSpec.of(_out_view(sub[name], nt), i, every) for i, name in ((3, "out"), (4, "lse")))
            flat = _flat_target(_out_view(sub["out"], nt), nt)
            calls.append(_ForwardCall(tuple(tsz), operands, targets, g, tuple(merged),
                                      None if flat is None else _ViewSpec.of(flat, 3, every),
                                      None if mask is None else _ViewSpec.of(sub["keys"], 0, (mask,))))
    return remember(_FORWARD_CALLS, key, tuple(calls))
