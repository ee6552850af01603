"""Triton kernel bodies of ``merge``: the fused merge (``merge_kernel``) and the one-pass combine of compact
parts (``combine_lse_kernel``, then ``combine_kernel``), with the helpers they call; and its inverse for
``ring/stacking.py``, the compact rows of several patterns gathered into one buffer (``gather_rows_kernel``).

The kernels are plain Python functions; ``merge`` wraps them with ``triton.jit`` at first launch (its
``triton_kernel``), which is also when it first imports this module, so ``TRITON_INTERPRET`` is settled by then (one
mode per process). The helpers are jitted here, at import, under the names the kernels call them by
(``_merge_weights``, ``_compact_row``): a kernel resolves them when it compiles, in either mode. This module
needs Triton at import: only ``merge`` loads it, and only where Triton is.
"""

import triton
import triton.language as tl


def merge_weights(lse_a, lse_b):
    """``merge_two``'s arithmetic in Triton: the merged lse of two partials and each one's weight (what
    ``merge_kernel`` calls, as ``_merge_weights``: jitted at import)."""
    top = tl.maximum(lse_a, lse_b, propagate_nan=tl.PropagateNan.ALL)
    shift = tl.where(tl.abs(top) < float("inf"), top, 0.0)  # isfinite (False for NaN)
    w_a = tl.exp(lse_a - shift)
    w_b = tl.exp(lse_b - shift)
    total = w_a + w_b
    nonempty = total != 0.0  # True for a NaN total: it stays NaN
    safe = tl.where(nonempty, total, 1.0)
    inv = tl.where(nonempty, 1.0 / safe, 0.0)
    return tl.where(nonempty, shift + tl.log(safe), float("-inf")), w_a * inv, w_b * inv


_merge_weights = triton.jit(merge_weights)


def merge_kernel(
    O, L, PO, PL, n_rows, D, n1, n2, n3, n4,
    so0, so1, so2, so3, so4, sod,
    sl0, sl1, sl2, sl3, sl4,
    sp0, sp1, sp2, sp3, sp4, spd,
    sq0, sq1, sq2, sq3, sq4,
    FRESH: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, IDX: tl.constexpr,
):
    """``BLOCK_R`` rows of the running result ``O``/``L`` merged with the partial ``PO``/``PL``; a flat row
    index is ``(i0, .., i4)`` of the leading dims (sizes ``n0..n4``) and every tensor is read through its
    own strides (``s*d``: the head dim's). ``merge_two``'s arithmetic, in fp32 and in the same order.
    ``WEIGHTED`` false: a plain sum ``O += PO`` (``O = PO`` if ``FRESH``), ``add_into_``; ``L``/``PL`` unread.

    Row quantities live in ``(BLOCK_R, 1)`` tiles, already in the 2D tile's layout: Triton 3.6 on an H200
    garbled some rows' ``out`` when per-row vectors were broadcast from 1D tiles (``[:, None]``), nondeter-
    ministically and only in compiled code."""
    rows = tl.program_id(0).to(IDX) * BLOCK_R + tl.arange(0, BLOCK_R).to(IDX)[:, None]
    row_ok = rows < n_rows
    i4 = rows % n4
    r = rows // n4
    i3 = r % n3
    r = r // n3
    i2 = r % n2
    r = r // n2
    i1 = r % n1
    i0 = r // n1
    o_row = i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3 + i4 * so4
    p_row = i0 * sp0 + i1 * sp1 + i2 * sp2 + i3 * sp3 + i4 * sp4
    if not WEIGHTED:
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D).to(IDX)[None, :]
            ok = row_ok & (cols < D)
            acc = tl.load(PO + p_row + cols * spd, mask=ok, other=0.0).to(O.dtype.element_ty)
            o_ptrs = O + o_row + cols * sod
            if not FRESH:
                acc = tl.load(o_ptrs, mask=ok, other=0.0) + acc
            tl.store(o_ptrs, acc, mask=ok)
    else:
        l_ptrs = L + (i0 * sl0 + i1 * sl1 + i2 * sl2 + i3 * sl3 + i4 * sl4)
        lse_b = tl.load(PL + (i0 * sq0 + i1 * sq1 + i2 * sq2 + i3 * sq3 + i4 * sq4), mask=row_ok,
                        other=float("-inf")).to(tl.float32)
        if FRESH:  # fresh_weight: 1 (finite), 0 (-inf: empty), NaN (+inf/NaN)
            w_b = tl.where(tl.abs(lse_b) < float("inf"), 1.0, tl.where(lse_b == float("-inf"), 0.0, float("nan")))
            lse = lse_b
            w_a = w_b  # unused
        else:
            lse, w_a, w_b = _merge_weights(tl.load(l_ptrs, mask=row_ok, other=float("-inf")), lse_b)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D).to(IDX)[None, :]
            ok = row_ok & (cols < D)
            new = tl.load(PO + p_row + cols * spd, mask=ok, other=0.0).to(tl.float32)
            # A zero weight silences its side even where it holds NaN (an empty row's garbage).
            acc = tl.where(w_b == 0.0, 0.0, new * w_b)
            o_ptrs = O + o_row + cols * sod
            if not FRESH:
                old = tl.load(o_ptrs, mask=ok, other=0.0)
                acc = tl.where(w_a == 0.0, 0.0, old * w_a) + acc
            tl.store(o_ptrs, acc, mask=ok)
        tl.store(l_ptrs, lse, mask=row_ok)


TABLE_HEADS = tl.constexpr(12)  # a combine TABLE row's first head offset


def compact_row(n, entry, head):
    """Row ``n``'s compact row in a part (``n // r``: a dilated segment's row ``s * w + j * r + o`` is compact
    row ``s * w / r + j``, whatever ``w``), by the part's ``TABLE`` entry's multiplier (no division), and
    whether the part covers it for ``head`` (``n % r`` is the head's offset)."""
    slot = ((n.to(tl.int64) * tl.load(entry + 10)) >> tl.load(entry + 11)).to(tl.int32)
    return slot, n - slot * tl.load(entry + 9).to(tl.int32) == tl.load(entry + TABLE_HEADS + head)


_compact_row = triton.jit(compact_row)


def combine_lse_kernel(
    TABLE, PART_LSE, RUN_L, LSE, WEIGHTS, N,
    srl_b, srl_n, srl_h, sol_b, sol_n, sol_h, sw_p, sw_b,
    H: tl.constexpr, P: tl.constexpr, HAS_RUN: tl.constexpr, BLOCK: tl.constexpr,
):
    """The weighted combine's first pass, one (row, head) pair ``f = n * H + h`` of batch ``program_id(1)`` per
    lane: the merged lse of the running result (if any) and every part covering the pair, written to ``LSE``,
    and each one's weight, written to ``WEIGHTS[b, p, f]`` (0 where the part does not cover it; the running
    result's is ``WEIGHTS[b, P]``), so that ``combine_kernel`` does one multiply-add per element and part. One
    log-sum-exp over all of them (``merge_two``'s rules: shift by the largest finite lse, an empty pair gives
    ``-inf`` and weights 0, NaN or ``+inf`` give NaN), not ``merge_two``'s pairwise rounding: the same value
    within fp32 rounding. ``TABLE``: see ``combine_kernel``. ``WEIGHTS`` first holds each part's lse (one
    gather per part, then reads of what this lane wrote)."""
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = f // H
    head = f - n * H
    b = tl.program_id(1).to(tl.int64)
    ok = n < N
    w_row = WEIGHTS + b * sw_b + f
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    if HAS_RUN:
        run_l = tl.load(RUN_L + b * srl_b + n.to(tl.int64) * srl_n + head * srl_h, mask=ok, other=float("-inf"))
        top = run_l
    for p in tl.static_range(P):
        entry = TABLE + p * (TABLE_HEADS + H)
        slot, hit = _compact_row(n, entry, head)
        at = tl.load(entry + 1) + b * tl.load(entry + 6) + slot.to(tl.int64) * tl.load(entry + 7) \
            + head * tl.load(entry + 8)
        part_l = tl.load(PART_LSE + at, mask=ok & hit, other=float("-inf"))
        tl.store(w_row + p * sw_p, part_l, mask=ok)
        top = tl.maximum(top, part_l, propagate_nan=tl.PropagateNan.ALL)
    shift = tl.where(tl.abs(top) < float("inf"), top, 0.0)  # isfinite (False for NaN)
    total = tl.zeros((BLOCK,), tl.float32)
    if HAS_RUN:
        total = tl.exp(run_l - shift)
    for p in tl.static_range(P):
        total += tl.exp(tl.load(w_row + p * sw_p, mask=ok, other=float("-inf")) - shift)
    nonempty = total != 0.0  # True for a NaN total: it stays NaN
    safe = tl.where(nonempty, total, 1.0)
    inv = tl.where(nonempty, 1.0 / safe, 0.0)
    tl.store(LSE + b * sol_b + n.to(tl.int64) * sol_n + head * sol_h,
             tl.where(nonempty, shift + tl.log(safe), float("-inf")), mask=ok)
    for p in tl.static_range(P):
        part_l = tl.load(w_row + p * sw_p, mask=ok, other=float("-inf"))
        tl.store(w_row + p * sw_p, tl.exp(part_l - shift) * inv, mask=ok)
    if HAS_RUN:
        tl.store(w_row + P * sw_p, tl.exp(run_l - shift) * inv, mask=ok)


def combine_kernel(
    TABLE, PARTS, WEIGHTS, RUN_O, OUT, N, D,
    sr_b, sr_n, sr_h, sr_d, so_b, so_n, so_h, sw_p, sw_b,
    H: tl.constexpr, P: tl.constexpr, WEIGHTED: tl.constexpr, HAS_RUN: tl.constexpr, ALIGN: tl.constexpr,
    WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``BLOCK_R`` rows of head ``program_id(1)`` in batch ``program_id(2)``: the running result (if any), then
    each part's slot of each row, read once and added in registers in part order: weighted by ``WEIGHTS``
    (``combine_lse_kernel``'s) or summed (a gradient: bit for bit the fp32 sum of the accumulators).

    ``TABLE`` has one row of ``TABLE_HEADS + H`` int64 per part: its out's and lse's offsets in elements from
    ``PARTS``/the lse base (any tensors of those dtypes: the parts are addressed from them, so the compiler
    sees ``PARTS``' alignment), out strides b/row/head/dim, lse strides b/row/head, its dilation and the
    multiplier and shift that divide a row by it, then each head's dilation offset (-1: none). ``ALIGN``:
    every part offset and out stride is a multiple of it and the dim stride is 1 (vector loads). ``WIDE``:
    a part's row offsets need int64. A row a part does not cover is masked (weight 0, or its dilation offset
    not the head's), so a dilated part costs only its rows. The parts are unrolled: every load is
    independent of the others (no row table to read first), so they are all in flight at once."""
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    row_ok = n < N
    cols = tl.arange(0, BLOCK_D)[None, :]
    ok = row_ok & (cols < D)
    w_row = WEIGHTS + b * sw_b + n * H + head
    if HAS_RUN:
        acc = tl.load(RUN_O + b * sr_b + n.to(tl.int64) * sr_n + head * sr_h + cols * sr_d, mask=ok, other=0.0)
        if WEIGHTED:  # a zero weight silences its side even where it holds NaN
            w_run = tl.load(w_row + P * sw_p, mask=row_ok, other=0.0)
            acc = tl.where(w_run == 0.0, 0.0, acc * w_run)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for p in tl.static_range(P):
        entry = TABLE + p * (TABLE_HEADS + H)
        slot, hit = _compact_row(n, entry, head)
        if WEIGHTED:
            weight = tl.load(w_row + p * sw_p, mask=row_ok, other=0.0)
            hit = weight != 0.0  # (NaN: read, so it propagates)
        if WIDE:
            row_at = slot.to(tl.int64) * tl.load(entry + 3)
        else:
            row_at = slot * tl.load(entry + 3).to(tl.int32)
        at = tl.load(entry) + b * tl.load(entry + 2) + head * tl.load(entry + 4) + row_at
        if ALIGN > 1:
            new = tl.load(PARTS + tl.multiple_of(at, [ALIGN, ALIGN]) + cols, mask=ok & hit, other=0.0)
        else:
            new = tl.load(PARTS + at + cols * tl.load(entry + 5), mask=ok & hit, other=0.0)
        if WEIGHTED:
            acc += new.to(tl.float32) * weight
        else:
            acc += new.to(tl.float32)
    tl.store(OUT + b * so_b + n.to(tl.int64) * so_n + head * so_h + cols, acc.to(OUT.dtype.element_ty), mask=ok)


def gather_rows_kernel(
    TABLE, SRC, DST, ROWS, D, ss_b, ss_n, ss_h, sd_b, sd_n, sd_h,
    H: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``BLOCK_R`` rows of a stack buffer ``DST`` (``stacking.gather``), head ``program_id(1)``, batch
    ``program_id(2)``: row ``t`` of member ``p`` (rows ``[start, end)``) is row ``(t - start) * dilation +
    offset(head)`` of ``SRC``. ``TABLE`` has one row of ``3 + H`` int64 per member: start, end, dilation, then
    each head's offset. Both tensors' last dims have stride 1 (a row's ``D`` elements are read and written as one
    vector); ``DST``'s rows are the members' spans back to back, so every row has one member."""
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    src_row = tl.zeros((BLOCK_R, 1), tl.int64)
    for p in tl.static_range(P):
        entry = TABLE + p * (3 + H)
        start = tl.load(entry)
        row = (t - start) * tl.load(entry + 2) + tl.load(entry + 3 + head)
        src_row = tl.where((t >= start) & (t < tl.load(entry + 1)), row, src_row)
    ok = (t < ROWS) & (cols < D)
    x = tl.load(SRC + b * ss_b + src_row * ss_n + head * ss_h + cols, mask=ok)
    tl.store(DST + b * sd_b + t.to(tl.int64) * sd_n + head * sd_h + cols, x, mask=ok)


KERNEL_FUNCS = {
    "merge_kernel": merge_kernel,
    "combine_lse_kernel": combine_lse_kernel,
    "combine_kernel": combine_kernel,
    "gather_rows_kernel": gather_rows_kernel,
}
