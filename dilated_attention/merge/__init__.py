"""fp32 log-sum-exp merging of partial attention results, safe for empty rows: all of it lives here (the
Triton kernels' bodies in ``merge/_triton.py``, loaded at their first launch).

``merge_two`` merges two partials; ``merge_into_`` and ``merge_pattern_`` merge a partial
(a block's, or a whole pattern's in compact layout) into the running fp32 result in place;
``combine_results``/``sum_grads`` take every local pattern's compact part (and the running result,
if any) into the final output in one pass over the outputs (``combine_kernel``; results first get their
weights from ``combine_lse_kernel``).

A partial is ``(out, lse)`` with ``out`` of shape ``(..., D)`` and ``lse`` of
shape ``(...)`` in natural log. An empty row has ``lse = -inf``. Merging is the
online softmax combination; it never produces NaN from empty rows (two empty
rows stay empty), and NaN/inf inputs give NaN where plain attention gives NaN.

On CUDA, ``merge_into_`` runs one fused Triton kernel (``merge_kernel``: each element of the running
result read and written once, through any strides) instead of ``merge_two``'s dozen elementwise passes;
``merge_two`` stays the torch path (CPU, fp64 oracle, anything the kernel does not take) and the
semantics the kernel is tested against (``merge_into_triton_`` runs it on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import caches
from ..caches import remember
from ..patterns import PatternPlan
from ..replays import geometry
from ..triton_support import JITTED, Prepared, interpreting, launch_on, made_current, triton
from ..views import chunk_views, compact_view, region_views

tl = None if triton is None else triton.language

NEG_INF = float("-inf")
MAX_LEADING = 5  # leading (row) dims the kernel decomposes; out has at most 6 dims
INT32_LIMIT = 2**31 - 1  # offsets at or past it: the kernel indexes in int64
TILE_ELEMENTS = 4096  # elements per program (rows x head-dim block)
NUM_WARPS = 4


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, except that float64 (the oracle's precision) stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def normalize_lse(lse: torch.Tensor) -> torch.Tensor:
    """LSE in the accumulation dtype. NaN and ``+inf`` are kept: they come from NaN/inf inputs, and
    the result must then be NaN where plain attention's is (no kernel here marks empty rows with them)."""
    return lse.to(accum_dtype(lse.dtype))


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials; returns fp32 ``(out, lse)``. Differentiable, NaN-free for empty rows."""
    lse_a, lse_b = normalize_lse(lse_a), normalize_lse(lse_b)
    top = torch.maximum(lse_a, lse_b)
    # A row empty in both has top = -inf: shift by 0 instead so exp() sees -inf, not NaN.
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = wa + wb
    # log/reciprocal only of a safe total, so empty rows get no 0/0 in the backward either;
    # a NaN total (NaN input) is not empty: it must stay NaN.
    nonempty = ~(total == 0)
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    lse = torch.where(nonempty, shift + torch.log(safe_total), torch.full_like(total, float("-inf")))
    inv = torch.where(nonempty, 1.0 / safe_total, torch.zeros_like(total))
    return _weighted(out_a, wa * inv) + _weighted(out_b, wb * inv), lse


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # A zero weight must silence the row even if an empty row's out holds NaN (a NaN weight stays NaN).
    w = weight.unsqueeze(-1)
    return torch.where(w == 0, torch.zeros((), dtype=w.dtype, device=out.device), out.to(w.dtype) * w)


def fresh_weight(lse: torch.Tensor) -> torch.Tensor:
    """A partial's weight when merged into the empty result (0, ``-inf``), as ``merge_two`` gives it: 1 for a
    finite lse (out = the partial's, lse = its own), 0 for ``-inf`` (an empty row stays 0 whatever its out
    holds), NaN for ``+inf``/NaN (out NaN; the lse, ``+inf``/NaN, is kept). So ``fresh`` is not a plain copy."""
    empty_or_nan = torch.where(lse == NEG_INF, 0.0, float("nan")).to(lse.dtype)  # (0 and NaN are exact in any dtype)
    return torch.where(torch.isfinite(lse), 1.0, empty_or_nan)


def merge_into_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, *,
                fresh: bool = False) -> None:
    """Merge a partial into the running ``(out, lse)`` (fp32 views, possibly strided) in place. ``fresh``: the
    running result is empty (its contents are ignored and never read, as if 0 and ``-inf``): it is written.
    CUDA tensors the Triton kernel takes (``triton_reason``) go through it, the rest through ``merge_two``."""
    if out.is_cuda and triton_reason(out, lse, part_out, part_lse) is None:
        _launch(out, lse, part_out, part_lse, fresh)
    elif fresh:
        part_lse = normalize_lse(part_lse)
        out.copy_(_weighted(part_out, fresh_weight(part_lse)))
        lse.copy_(part_lse)
    else:
        merged, total = merge_two(out, lse, part_out, part_lse)
        out.copy_(merged)
        lse.copy_(total)


def merge_pattern_(out: torch.Tensor, lse: torch.Tensor, plan: PatternPlan, part_out: torch.Tensor,
                   part_lse: torch.Tensor, *, fresh: bool = False) -> None:
    """Merge one pattern's partial in compact layout (``kernels/protocol.py``) into the running full-layout
    ``(out, lse)`` in place: the generic ``PatternKernel.forward_pattern_into`` (the fused kernel merges
    in its epilogue instead). ``fresh``: see ``merge_into_``; rows the pattern does not cover are left as
    they were, so only a pattern that ``covers_all`` may pass it."""
    whole = out.is_contiguous() and lse.is_contiguous()  # both views whole, or both chunk by chunk
    lse_regions = region_views(lse, part_lse, plan, whole)
    for (rows, part), (rows_lse, part_l) in zip(region_views(out, part_out, plan, whole), lse_regions):
        merge_into_(rows, rows_lse, part, part_l, fresh=fresh)


# ---------------------------------------------------------------------------
# The fused kernel (its Triton source, and the combine's: ``merge/_triton.py``)


def triton_kernel(name: str):
    """The kernel ``name`` of ``_triton.KERNEL_FUNCS`` jitted for the current mode, at first use (so
    TRITON_INTERPRET is read then, not at import; importing ``merge._triton`` jits the helpers the kernels call)."""
    key = (interpreting(), name)
    fn = JITTED.get(key)
    if fn is None:
        from . import _triton  # (its kernels need Triton at import: loaded only where Triton is)

        fn = JITTED[key] = triton.jit(_triton.KERNEL_FUNCS[name])
    return fn


PART_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_reason(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
                  ) -> str | None:
    """``None`` if ``merge_kernel`` takes these tensors (CUDA, or CPU under ``TRITON_INTERPRET=1``), else why
    not: then ``merge_into_`` takes the torch path, which handles (or rejects) everything."""
    ts = (out, lse, part_out, part_lse)
    if out.dtype != torch.float32 or lse.dtype != torch.float32 or part_out.dtype not in PART_DTYPES \
            or part_lse.dtype not in PART_DTYPES:
        return f"dtypes: fp32 running result, fp16/bf16/fp32 partial, got {[t.dtype for t in ts]}"
    if not 1 <= out.dim() <= MAX_LEADING + 1 or part_out.shape != out.shape \
            or lse.shape != out.shape[:-1] or part_lse.shape != lse.shape:
        return f"shapes: (..., D) and (...) alike, at most 6 dims, got {[tuple(t.shape) for t in ts]}"
    return _launch_reason((out, lse), (part_out, part_lse))


def add_reason(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """``None`` if ``merge_kernel``'s plain sum takes ``dst += src`` (``add_into_``), else why not."""
    if dst.dtype != torch.float32 or src.dtype not in PART_DTYPES:
        return f"dtypes: fp32 destination, fp16/bf16/fp32 source, got {dst.dtype} and {src.dtype}"
    if not 1 <= dst.dim() <= MAX_LEADING + 1 or src.shape != dst.shape:
        return f"shapes: equal, at most 6 dims, got {tuple(dst.shape)} and {tuple(src.shape)}"
    return _launch_reason((dst,), (src,))


def _launch_reason(written: tuple[torch.Tensor, ...], read: tuple[torch.Tensor, ...], *, overlap: bool = True
                   ) -> str | None:
    """What the kernel needs of any tensors it writes and reads beyond their dtypes and shapes; ``overlap``:
    whether to look at memory shared between them (``_overlap_reason``)."""
    ts = written + read
    if triton is None:
        return "Triton is not importable"
    if any(t.device != ts[0].device for t in ts) or (ts[0].device.type != "cuda" and not interpreting()):
        return f"needs all tensors on one CUDA device (or TRITON_INTERPRET=1), got {[str(t.device) for t in ts]}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return "autograd: the kernel is not differentiable"
    for t in written:  # a written element stored twice: torch's copy_ raises, a kernel would race
        if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            return "the written tensor has internal overlap (a zero stride)"
    if overlap and _shares_memory(written, read):
        return "the source shares memory with the written tensor"
    if any(t.data_ptr() % t.element_size() for t in ts):
        return "a data pointer is not aligned to its element size"
    return None


def _shares_memory(written: Sequence[torch.Tensor], read: Sequence[torch.Tensor]) -> bool:
    return bool({t.untyped_storage().data_ptr() for t in read} & {t.untyped_storage().data_ptr() for t in written})


def add_into_(dst: torch.Tensor, src: torch.Tensor, *, fresh: bool = False) -> None:
    """``dst += src`` (``dst = src`` if ``fresh``) for an fp32 ``dst`` view and a same-shape ``src``, both through
    any strides: one pass of ``merge_kernel`` on CUDA where it applies (bitwise what torch's ``add_``/``copy_``
    give: each element is the same one fp32 addition), else torch's ``add_``/``copy_``."""
    if dst.is_cuda and add_reason(dst, src) is None:
        _launch(dst, None, src, None, fresh)
    elif fresh:
        dst.copy_(src)
    else:
        dst.add_(src)


def add_into_triton_(dst: torch.Tensor, src: torch.Tensor, *, fresh: bool = False) -> None:
    """``add_into_`` through ``merge_kernel`` always (raises ``ValueError`` where it cannot run): tests on CPU."""
    reason = add_reason(dst, src)
    if reason is not None:
        raise ValueError(f"add kernel cannot run: {reason}")
    _launch(dst, None, src, None, fresh)


def merge_into_triton_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, *,
                       fresh: bool = False) -> None:
    """``merge_into_`` through ``merge_kernel`` always (raises ``ValueError`` where it cannot run); what tests
    call on CPU tensors under ``TRITON_INTERPRET=1``."""
    reason = triton_reason(out, lse, part_out, part_lse)
    if reason is not None:
        raise ValueError(f"merge kernel cannot run: {reason}")
    _launch(out, lse, part_out, part_lse, fresh)


def _launch(out: torch.Tensor, lse: torch.Tensor | None, part_out: torch.Tensor, part_lse: torch.Tensor | None,
            fresh: bool) -> None:
    """One ``merge_kernel`` launch: an lse-weighted merge, or with ``lse``/``part_lse`` ``None`` a plain sum
    (the kernel then reads neither: ``out``/``part_out`` stand in for them, with zero row strides)."""
    if out.numel() == 0:
        return
    weighted = lse is not None
    lse_strides = (lse.stride(), part_lse.stride()) if weighted else ((0,) * (out.dim() - 1),) * 2
    key = (weighted, fresh, interpreting(), INT32_LIMIT, TILE_ELEMENTS, tuple(out.shape), out.stride(),
           part_out.stride(), *lse_strides)
    plan = _LAUNCHES.get(key)
    if plan is None:
        plan = remember(_LAUNCHES, key, _launch_plan(out.shape, out.stride(), part_out.stride(), *lse_strides, fresh,
                                                     weighted))
    ints, meta, grid = plan
    args = (out, lse if weighted else out, part_out, part_lse if weighted else part_out, *ints)
    launch_on(out.device, triton_kernel("merge_kernel"), grid, args, meta, num_warps=NUM_WARPS)


_LAUNCHES = caches.table("merge.launch_plans", 1024)  # by geometry: a call pays only for Triton's own launch


def _launch_plan(shape, so, sp, sl, sq, fresh: bool, weighted: bool) -> tuple[tuple[int, ...], dict, tuple[int]]:
    """``merge_kernel``'s integer arguments, meta-parameters and grid for tensors of this geometry (``so``,
    ``sp``: out's and part_out's strides; ``sl``, ``sq``: lse's and part_lse's)."""
    rank, dim = len(shape) - 1, shape[-1]
    sizes = [1] * (MAX_LEADING - rank) + list(shape[:-1])
    n_rows = math.prod(shape[:-1])
    block_d = min(128, max(16, triton.next_power_of_2(dim)))
    block_r = max(1, TILE_ELEMENTS // block_d)
    # int32 index arithmetic unless a row index or an element offset (masked rows and columns past the end
    # included) may pass 2**31; int64 then: any real tensor's offsets fit, so no size goes to the torch path.
    worst = max(n_rows + block_r, *(sum((n - 1) * st for n, st in zip(shape, strides))
                                    + (block_r + block_d) * max(strides, default=0)
                                    for strides in (so, sp, (*sl, 0), (*sq, 0))))
    idx = tl.int64 if worst >= INT32_LIMIT else tl.int32
    pad = [0] * (MAX_LEADING - rank)
    ints = (n_rows, dim, *sizes[1:], *pad, *so[:rank], so[-1], *pad, *sl, *pad, *sp[:rank], sp[-1], *pad, *sq)
    meta = dict(FRESH=fresh, WEIGHTED=weighted, BLOCK_R=block_r, BLOCK_D=block_d, IDX=idx)
    return ints, meta, (triton.cdiv(n_rows, block_r),)


# ---------------------------------------------------------------------------
# Compact parts combined in one pass


@dataclass(frozen=True)
class Part:
    """One pattern's result in compact layout (``kernels/protocol.py``): ``out`` ``(B, L // r, heads, D)`` in
    the inputs' dtype and, for attention results, its ``lse`` ``(B, L // r, heads)``; gradients have none.
    ``kv``: the heads are kv heads (dK/dV). The plan must give each (row, head) one slot
    (``PatternPlan.head_offsets`` is not ``None``)."""

    plan: PatternPlan
    out: torch.Tensor
    lse: torch.Tensor | None = None
    kv: bool = False


def combine_results(running: tuple[torch.Tensor, torch.Tensor] | None, parts: Sequence[Part],
                    like: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                    consume: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The final ``(out, lse)`` of patterns that left compact parts, merged with the ``running`` fp32 result
    of those merged in place (``None`` if there were none): ``out`` in ``like``'s dtype and shape, ``lse`` in
    the accumulation dtype. ``merge_two``'s semantics (a row no pattern covers: 0 and ``-inf``); on CUDA
    ``combine_lse_kernel`` weighs the parts, then one ``combine_kernel`` pass reads each part once and writes
    the result once (no fp32 result in between). ``into``: ``(out, lse)`` views (of a larger result: a head
    range) written instead of new tensors, and returned. ``consume``: the parts are the caller's to overwrite
    (``_reused``: the result may be written over one of them)."""
    plan = _combine_plan(running, parts, like, into, weighted=True)
    if not parts and running is not None:  # nothing to gather: the cast alone
        return _placed((running[0].to(like.dtype), running[1]), into)
    if plan.reason is None and _overlap_reason(running, parts, into) is None:
        return _launch_combine(plan, running, parts, like, into=into, consume=consume)
    acc = accum_dtype(like.dtype)
    if running is None:
        out = torch.zeros(like.shape, dtype=acc, device=like.device)
        lse = torch.full(like.shape[:-1], NEG_INF, dtype=acc, device=like.device)
    else:
        out, lse = running
    for part in parts:
        merge_pattern_(out, lse, part.plan, part.out, part.lse)
    return _placed((out.to(like.dtype), lse), into)


def _placed(results: tuple[torch.Tensor, ...], into: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
    """``results``, or copied into ``into`` (the views a caller asked to have them written to)."""
    if into is None:
        return results
    for dst, src in zip(into, results):
        if dst is not src:
            dst.copy_(src)
    return into


def sum_grads(running: torch.Tensor | None, parts: Sequence[Part], like: torch.Tensor,
              into: torch.Tensor | None = None, *, consume: bool = False) -> torch.Tensor:
    """A gradient: the ``running`` fp32 accumulator (``None`` if no pattern accumulated in place) plus every
    compact part, summed in fp32 in that order and cast to ``like``'s dtype (its shape). Bit for bit what
    adding each part into an accumulator, then casting, gives (where the cast rounds to nearest: Triton's
    interpreter truncates to bf16); on CUDA one ``combine_kernel`` pass. The parts are in the inputs' dtype,
    so each pattern's gradient is rounded once before the sum (cuDNN's come that way; the fused kernel's
    were summed in fp32 before): measured in the tolerance tests, within the rule against fp64. ``into``: a view
    written instead of a new tensor, and returned. ``consume``: as ``combine_results``'."""
    dst = None if into is None else (into,)
    plan = _combine_plan(running, parts, like, dst, weighted=False)
    if not parts and running is not None:  # nothing to gather: the cast alone (none for fp32)
        return _placed((running.to(like.dtype),), dst)[0]
    if plan.reason is None and _overlap_reason(running, parts, dst) is None:
        return _launch_combine(plan, running, parts, like, into=dst, consume=consume)[0]
    acc = running if running is not None else torch.zeros(like.shape, dtype=accum_dtype(like.dtype),
                                                           device=like.device)
    for part in parts:
        for c in part.plan.chunks:
            chunk_views(acc, part.plan, c, kv=part.kv).add_(
                compact_view(part.out, part.plan, *((c.k0, c.k1) if part.kv else (c.h0, c.h1))))
    return _placed((acc.to(like.dtype),), dst)[0]


def _reused(parts: Sequence[Part], like: torch.Tensor, candidates: Sequence[int] | None = None
            ) -> torch.Tensor | None:
    """The out of a part the combine may write its result over, or ``None``: a rate-1 part in ``like``'s dtype
    and strides (the part of a LongNet call's first pattern, as large as the result; its strides, so that the
    result reads as a new one would, e.g. zero-copy in a kernel that compares them with q's) whose memory no
    other part shares. The kernel reads each element of such a part in the program that then writes that same
    element, so writing over it changes no bit; the call then holds one result-sized tensor less.
    ``candidates``: the indices of the parts of the right rate, dtype and strides (``_reuse_candidates``), if
    known; only the sharing is then looked at."""
    for i in _reuse_candidates(parts, like) if candidates is None else candidates:
        at = parts[i].out.untyped_storage().data_ptr()
        if not any(at == p.out.untyped_storage().data_ptr() for j, p in enumerate(parts) if j != i):
            return parts[i].out
    return None


def _reuse_candidates(parts: Sequence[Part], like: torch.Tensor) -> tuple[int, ...]:
    """The parts ``_reused`` may pick by rate, dtype and strides (what a combine's geometry fixes)."""
    return tuple(i for i, p in enumerate(parts) if p.plan.dilation == 1 and p.out.dtype == like.dtype
                 and p.out.stride() == like.stride())


def _check_parts(parts: Sequence[Part], like: torch.Tensor, weighted: bool) -> None:
    bsz, n, heads, dim = like.shape
    for part in parts:
        rows = n // part.plan.dilation
        if tuple(part.out.shape) != (bsz, rows, heads, dim) or part.out.dtype != like.dtype:
            raise ValueError(f"pattern {part.plan.index}: part has shape {tuple(part.out.shape)} {part.out.dtype}, "
                             f"expected {(bsz, rows, heads, dim)} {like.dtype}")
        if weighted and (part.lse is None or tuple(part.lse.shape) != (bsz, rows, heads)):
            raise ValueError(f"pattern {part.plan.index}: a result part needs lse of shape {(bsz, rows, heads)}")
        if part.plan.head_offsets(heads, kv=part.kv) is None or n % part.plan.local_segment:
            raise ValueError(f"pattern {part.plan.index} cannot leave a compact part: it must tile {n} rows and "
                             f"give each (row, head) one slot")


MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (the combine kernel's batch)
COMBINE_TILE = 2048  # elements per program (rows x head-dim block)
COMBINE_WARPS = 4
COMBINE_LSE_BLOCK = 512  # (row, head) pairs per program of the lse pass


def row_divider(dilation: int) -> tuple[int, int]:
    """``(multiplier, shift)`` with ``n // dilation == (n * multiplier) >> shift`` for every ``0 <= n < 2**31``
    (round-up reciprocal: the error stays under ``1 / dilation``), so the kernels divide rows by a multiply."""
    bits = (dilation - 1).bit_length()
    return (1 << (31 + bits)) // dilation + 1, 31 + bits


def _held(running) -> list[torch.Tensor]:
    """The tensors of a running result: ``(out, lse)``, one accumulator, or none."""
    return list(running) if isinstance(running, tuple) else [running] if running is not None else []


def _combine_reason(running, parts: Sequence[Part], like: torch.Tensor,
                    into: tuple[torch.Tensor, ...] | None = None, *, overlap: bool = True) -> str | None:
    """``None`` if ``combine_kernel`` takes these tensors (CUDA, or CPU under ``TRITON_INTERPRET=1``), else why not:
    then the torch path (the merges and adds it replaces) runs. ``overlap``: whether to look at shared memory
    between ``into`` and what is read (per call: the rest follows from the geometry, ``_combine_plan``)."""
    if like.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype: fp16/bf16/fp32, got {like.dtype}"
    held = _held(running)
    if any(t.dtype != torch.float32 for t in held):
        return "the running result is not fp32"
    if any(p.lse is not None and p.lse.dtype != torch.float32 for p in parts):
        dtypes = sorted({str(p.lse.dtype) for p in parts if p.lse is not None})
        return f"part lse dtypes {dtypes}: the kernel reads fp32"
    if not parts:
        return "no parts to combine"
    read = [p.out for p in parts] + [p.lse for p in parts if p.lse is not None] + held
    if max(2 * len(parts), like.shape[2]) * like.shape[1] >= INT32_LIMIT:
        return f"{like.shape[1]} rows of {like.shape[2]} heads: the kernel indexes rows in int32"
    if (len(parts) + 1) * like.shape[1] * like.shape[2] >= INT32_LIMIT:
        return f"{like.shape[1]} rows of {like.shape[2]} heads: the kernel indexes part weights in int32"
    if like.shape[0] > MAX_GRID_Z or like.shape[2] > MAX_GRID_Z:
        return f"batch {like.shape[0]} or heads {like.shape[2]} exceed the launch grid's limit ({MAX_GRID_Z})"
    if any(t.device != like.device for t in read + list(into or ())):
        return f"needs every part on {like.device}"
    return _launch_reason(tuple(into or ()), tuple(read), overlap=overlap)


def current_raw_stream(index: int) -> int:
    """Device ``index``'s current CUDA stream as a handle (what Triton's launcher reads too);
    ``torch.cuda.current_stream`` builds a Python stream object per call: 7 us of host time, measured."""
    return torch._C._cuda_getCurrentRawStream(index)


_TABLES = caches.table("merge.combine_tables", 64)  # combine (and stack gather) tables on the device, by content
_COMBINES = caches.table("merge.combine_plans", 256)  # by geometry: what a combine works out once


def device_table(rows: list[list[int]], device: torch.device, key: tuple | None = None) -> torch.Tensor:
    """``rows`` as an int64 tensor on ``device``, kept by content (or by ``key``, which determines it): a training
    loop's parts come back at the same relative addresses step after step (the caching allocator), so a step
    usually reuses the last step's table instead of a pinned host copy and a transfer (what the kernels read is
    never written). Kept per stream: the copy is ordered on the stream it was issued on, and so is the freeing of
    a dropped table. ``rows`` may be a function making them (called only where the table is not kept)."""
    stream = current_raw_stream(device.index) if device.type == "cuda" else None
    made = rows if callable(rows) else (lambda: rows)
    return caches.kept_table("merge.combine_tables", _TABLES,
                             (device, stream, *(map(tuple, rows) if key is None else key)),
                             lambda: caches.rows_on("merge.combine_table", made(), torch.int64, device), device)


@dataclass(frozen=True, eq=False)
class _CombinePlan:
    """What combines of one geometry share (``_combine_plan``): why the kernel cannot take them (``reason``: then
    the torch path runs), the parts the result may be written over (``_reuse_candidates``), each part's table row
    after its two offsets, and the kernels' integer arguments and launches. Kept per geometry: a call then reads
    only its parts' addresses."""

    reason: str | None
    weighted: bool = False
    candidates: tuple[int, ...] = ()
    rows: tuple[tuple[int, ...], ...] = ()
    lse_args: tuple[int, ...] = ()  # combine_lse_kernel's after its tensors
    args: tuple[int, ...] = ()  # combine_kernel's after its tensors and before out's and the weights' strides
    weight_strides: tuple[int, int] = (0, 0)
    slots: int = 0
    lse_launch: Prepared | None = None
    launches: dict = None  # combine_kernel's Prepared launch by out's strides and alignment
    grid: tuple[int, ...] = ()
    meta: dict = None


def _combine_plan(running, parts: Sequence[Part], like: torch.Tensor, into: tuple[torch.Tensor, ...] | None,
                  weighted: bool) -> _CombinePlan:
    """The plan of this combine's geometry (every tensor's shape, strides, dtype, alignment and device, the parts'
    patterns, autograd's state), worked out at its first call: ``_check_parts`` (raises on parts that cannot be
    combined), ``_combine_reason`` (all but the per-call memory overlap), the table rows and launches."""
    held = _held(running)
    tensors = [like, *held, *(into or ()), *(p.out for p in parts), *(p.lse for p in parts if p.lse is not None)]
    key = (weighted, len(held), 0 if into is None else len(into), tuple([(p.plan, p.kv, p.lse is None) for p in parts]),
           torch.is_grad_enabled() and any([t.requires_grad for t in tensors]), geometry(tensors))
    plan = _COMBINES.get(key)
    if plan is None:
        _check_parts(parts, like, weighted)
        plan = remember(_COMBINES, key, _make_plan(running, parts, like, into, weighted))
    return plan


def _make_plan(running, parts: Sequence[Part], like: torch.Tensor, into: tuple[torch.Tensor, ...] | None,
               weighted: bool) -> _CombinePlan:
    reason = "no parts to combine" if not parts else _combine_reason(running, parts, like, into, overlap=False)
    if reason is not None:
        return _CombinePlan(reason)
    bsz, n, heads, dim = like.shape
    run_out, run_lse = running if weighted and running is not None else (running, None)
    align, wide, rows = 16 // like.element_size(), False, []
    base = parts[0].out
    for part in parts:
        strides = part.out.stride()
        delta_bytes = part.out.data_ptr() - base.data_ptr()  # (its alignment is the geometry's)
        if strides[3] != 1 or delta_bytes % 16 or any(x % align for x in strides[:3]):
            align = 1
        wide |= part.out.shape[1] * strides[1] >= INT32_LIMIT
        rows.append((*strides, *(part.lse.stride() if weighted else (0, 0, 0)), part.plan.dilation,
                     *row_divider(part.plan.dilation), *part.plan.head_offsets(heads, part.kv)))
    slots = len(parts) + (running is not None)  # (the running result's weight is the last slot)
    lse_args, lse_launch, w_strides = (), None, (0, 0)
    if weighted:
        lse_strides = into[1].stride() if into is not None else (n * heads, heads, 1)  # (a new lse's)
        w_strides = (n * heads, slots * n * heads)  # (a new (bsz, slots, n * heads) tensor's)
        lse_args = (n, *(run_lse.stride() if run_lse is not None else (0, 0, 0)), *lse_strides, *w_strides)
        lse_launch = Prepared(triton_kernel("combine_lse_kernel"), (triton.cdiv(n * heads, COMBINE_LSE_BLOCK), bsz),
                              dict(H=heads, P=len(parts), HAS_RUN=running is not None, BLOCK=COMBINE_LSE_BLOCK),
                              num_warps=COMBINE_WARPS)
    block_d = max(16, triton.next_power_of_2(dim))
    block_r = max(1, COMBINE_TILE // block_d)
    return _CombinePlan(
        None, weighted, _reuse_candidates(parts, like), tuple(rows), lse_args,
        (n, dim, *(run_out.stride() if run_out is not None else (0, 0, 0, 0))), w_strides, slots, lse_launch, {},
        (triton.cdiv(n, block_r), heads, bsz),
        dict(H=heads, P=len(parts), WEIGHTED=weighted, HAS_RUN=running is not None, ALIGN=align, WIDE=wide,
             BLOCK_R=block_r, BLOCK_D=block_d))


def _overlap_reason(running, parts: Sequence[Part], into: tuple[torch.Tensor, ...] | None) -> str | None:
    """Why the kernel cannot write ``into`` (memory it also reads), per call; ``None`` when it writes new tensors."""
    if into is None:
        return None
    held = _held(running)
    read = [p.out for p in parts] + [p.lse for p in parts if p.lse is not None] + held
    return "the source shares memory with the written tensor" if _shares_memory(into, read) else None


def _launch_combine(plan: _CombinePlan, running, parts: Sequence[Part], like: torch.Tensor,
                    into: tuple[torch.Tensor, ...] | None = None, consume: bool = False):
    weighted = plan.weighted
    if into is not None:
        out, lse = into[0], (into[1] if weighted else None)
    else:
        reused = _reused(parts, like, plan.candidates) if consume and plan.candidates else None
        out = reused if reused is not None else torch.empty(like.shape, dtype=like.dtype, device=like.device)
        lse = torch.empty(like.shape[:-1], dtype=torch.float32, device=like.device) if weighted else None
    if out.numel() == 0:
        return out, lse
    run_out, run_lse = running if weighted and running is not None else (running, None)
    base = parts[0].out  # (the callers send no part-less work here: the running result alone is a cast)
    at, size = base.data_ptr(), like.element_size()
    if weighted:
        lse_base = parts[0].lse
        lse_at = lse_base.data_ptr()
        offsets = tuple([((p.out.data_ptr() - at) // size, (p.lse.data_ptr() - lse_at) // 4) for p in parts])
    else:
        lse_base = base  # (unread: the kernels read no lse when summing)
        offsets = tuple([((p.out.data_ptr() - at) // size, 0) for p in parts])
    table = device_table(lambda: [[*o, *r] for o, r in zip(offsets, plan.rows)], like.device, (plan, offsets))
    weights = lse_base  # (unread when summing)
    out_strides = out.stride()[:3]
    launch_combine = plan.launches.get((out_strides, out.data_ptr() & 15))  # (a new out, or a reused part)
    if launch_combine is None:
        launch_combine = plan.launches[(out_strides, out.data_ptr() & 15)] = Prepared(
            triton_kernel("combine_kernel"), plan.grid, plan.meta, num_warps=COMBINE_WARPS)
    with made_current(like.device):
        if weighted:  # the lse pass: each (row, head)'s merged lse and each part's weight
            weights = torch.empty((like.shape[0], plan.slots, like.shape[1] * like.shape[2]), dtype=torch.float32,
                                  device=like.device)
            plan.lse_launch(table, lse_base, lse_base if run_lse is None else run_lse, lse, weights, *plan.lse_args)
        launch_combine(table, base, weights, out if run_out is None else run_out, out, *plan.args, *out_strides,
                       *plan.weight_strides)
    return out, lse
