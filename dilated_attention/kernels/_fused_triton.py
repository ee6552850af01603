"""Triton kernel bodies of the fused dilated block kernel (see ``fused.py``).

These are plain Python functions; ``fused.py`` wraps them with ``triton.jit``
lazily, at first launch, so the ``TRITON_INTERPRET`` setting is read when a
kernel is first used rather than when this module is imported. The bodies
therefore call no other ``@triton.jit`` helper: everything is inlined.

Addressing. Every tensor is read as ``(B, S, M, H, D)`` through five element
strides ``(b, s, m, h, off)``: row ``j`` of segment ``s`` of head ``h`` whose
dilation offset is ``o`` lives at ``b*sb + s*ss + j*sm + h*sh + o*soff`` (the
head dim has unit stride). A strided 5D view has ``soff = 0``; a full
``(B, L, H, D)`` tensor read dilated has ``ss = w*sL``, ``sm = r*sL``,
``soff = sL``. Per-head tables (int32) say which heads exist and where they
read, so a whole pattern (all its head chunks and offsets) is one launch.

Head dim: tiles are ``DP`` wide (a power of two >= ``D``); when ``EVEN_D`` is false
the columns ``>= D`` are masked on every load (zeros, so dots are unchanged) and
store.

In-tile row offsets (``row * stride``) are int32 unless ``IDX`` is ``tl.int64``
(chosen by the host when a segment's extent does not fit in int32); per-program
bases are always int64.

Key padding (``HAS_MASK``; ``False`` compiles the unmasked kernels unchanged).
``KM``: uint8, nonzero = the key is excluded, read as ``(b, s, m, off)`` through
four strides like ``K`` (no head dim) at the head's *query* offset (a packed ring
half stores k at offset 0, but its mask is in the full layout). ``LT`` (int32,
written by ``tiles_kernel``): for each ``(b, s, offset)`` row (``n_off`` offsets)
the key tiles of ``BLOCK_N`` keys holding a real key, as ``n_tiles + 1`` prefix
counts then entries ``2 * tile + (1 if it holds some padding)``. The forward and
dQ loops run over that list: a tile of padding only is never visited (no loads,
dots or exp), the loop stays software-pipelined (a branch around the dots is
not: 1.8x slower forward on an H100), and only a tile with some padding loads
its mask bytes and sets their scores to ``-inf`` (P = 0 in the backward). A dK/dV
program whose key block is padding only returns at once (it adds nothing).

Head table ``HT`` (4, NH): query head, query offset, kv head, kv offset.
Unit table ``UT`` (5, NU): kv head, kv offset, first and end query head of the
(contiguous) query heads reading it, their query offset. Each (kv head, kv
offset) pair is one unit, so dK/dV rows are owned by exactly one program.
"""

import triton.language as tl


def fwd_kernel(
    Q, K, V, O, LSE, HT, KM, LT,
    sqb, sqs, sqm, sqh, sqo,
    skb, sks, skm, skh, sko,
    svb, svs, svm, svh, svo,
    sob, sos, som, soh, soo,
    slb, sls, slm, slh, slo,
    smb, sms, smm, smo, n_off,
    NH, S, M, MK, n_mblocks,
    qk_scale,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr, IDX: tl.constexpr, HAS_MASK: tl.constexpr,
    MERGE: tl.constexpr,
):
    """One row block of one head. ``MERGE``: ``O``/``LSE`` hold the running normalized fp32 result of the
    patterns so far (any layout, read through their strides); this block's result is merged into it
    (online softmax: both weighted by ``exp(lse_part - lse_total)``) instead of stored alone."""
    pid = tl.program_id(0)
    i = tl.program_id(1)
    start_m = pid % n_mblocks
    if CAUSAL:  # heaviest row blocks first
        start_m = n_mblocks - 1 - start_m
    bs = (pid // n_mblocks).to(tl.int64)
    b = bs // S
    s = bs % S
    h = tl.load(HT + i).to(tl.int64)
    qo = tl.load(HT + NH + i).to(tl.int64)
    kvh = tl.load(HT + 2 * NH + i).to(tl.int64)
    kvo = tl.load(HT + 3 * NH + i).to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    q_ptrs = Q + (b * sqb + s * sqs + h * sqh + qo * sqo) + offs_m.to(IDX)[:, None] * sqm + offs_d[None, :]
    k_base = K + (b * skb + s * sks + kvh * skh + kvo * sko) + offs_d[None, :]
    v_base = V + (b * svb + s * svs + kvh * svh + kvo * svo) + offs_d[None, :]
    if HAS_MASK:
        m_base = KM + (b * smb + s * sms + qo * smo)
        n_tiles = tl.cdiv(MK, BLOCK_N)
        tiles = LT + ((b * S + s) * n_off + qo) * (2 * n_tiles + 1)
    if EVEN_M & EVEN_D:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < M) & d_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DP], dtype=tl.float32)

    # Stage 0: key blocks fully visible; stage 1 (causal only): the diagonal block.
    for stage in tl.static_range(2 if CAUSAL else 1):
        if CAUSAL:
            if stage == 0:
                lo = 0
                hi = start_m * BLOCK_M
            else:
                lo = start_m * BLOCK_M
                hi = tl.minimum((start_m + 1) * BLOCK_M, MK)
        else:
            lo = 0
            hi = MK
        if HAS_MASK:  # positions in the list of the live tiles of [lo, hi)
            lo = tl.load(tiles + lo // BLOCK_N)
            hi = tl.load(tiles + tl.cdiv(hi, BLOCK_N))
        for it in range(lo, hi, 1 if HAS_MASK else BLOCK_N):
            if HAS_MASK:
                tile = tl.load(tiles + n_tiles + 1 + it)  # 2 * index + (1 if it holds some padding)
                start_n = (tile >> 1) * BLOCK_N
            else:
                start_n = it
            cols = start_n + offs_n
            if EVEN_N & EVEN_D:
                k = tl.load(k_base + cols.to(IDX)[:, None] * skm)
                v = tl.load(v_base + cols.to(IDX)[:, None] * svm)
            else:
                k = tl.load(k_base + cols.to(IDX)[:, None] * skm, mask=(cols[:, None] < MK) & d_ok, other=0.0)
                v = tl.load(v_base + cols.to(IDX)[:, None] * svm, mask=(cols[:, None] < MK) & d_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            if HAS_MASK:
                if (tile & 1) != 0:  # some padding here (keys past MK count as padding)
                    key_ok = tl.load(m_base + cols.to(IDX) * smm, mask=cols < MK, other=1) == 0
                    qk = tl.where(key_ok[None, :], qk, float("-inf"))
            elif not EVEN_N:
                qk = tl.where(cols[None, :] < MK, qk, float("-inf"))
            if CAUSAL and stage == 1:
                qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
            m_i = m_new

    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    acc = acc * inv[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = O + (b * sob + s * sos + h * soh + qo * soo) + offs_m.to(IDX)[:, None] * som + offs_d[None, :]
    l_ptrs = LSE + (b * slb + s * sls + h * slh + qo * slo) + offs_m.to(IDX) * slm
    if MERGE:  # merge_two's arithmetic (merge/): empty rows stay empty, NaN stays NaN
        row_ok = offs_m < M
        old_lse = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
        old = tl.load(o_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
        top = tl.maximum(old_lse, lse)
        shift = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp(old_lse - shift)
        w_new = tl.exp(lse - shift)
        total = w_old + w_new
        nonempty = total != 0.0
        safe = tl.where(nonempty, total, 1.0)
        lse = tl.where(nonempty, shift + tl.log(safe), float("-inf"))
        w_old = tl.where(nonempty, w_old / safe, 0.0)
        w_new = tl.where(nonempty, w_new / safe, 0.0)
        acc = tl.where(w_old[:, None] == 0.0, 0.0, old * w_old[:, None]) + tl.where(
            w_new[:, None] == 0.0, 0.0, acc * w_new[:, None])
    if EVEN_M & EVEN_D:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty))
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(offs_m[:, None] < M) & d_ok)
    if EVEN_M:
        tl.store(l_ptrs, lse)
    else:
        tl.store(l_ptrs, lse, mask=offs_m < M)


def delta_kernel(
    O, DO, DELTA, HT,
    sob, sos, som, soh, soo,
    sgb, sgs, sgm, sgh, sgo,
    sdb, sds, sdm, sdh,
    NH, S, M, n_mblocks,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, IDX: tl.constexpr,
):
    """delta = rowsum(dout * out) of the rows a head reads, into a compact fp32 buffer."""
    pid = tl.program_id(0)
    i = tl.program_id(1)
    start_m = pid % n_mblocks
    bs = (pid // n_mblocks).to(tl.int64)
    b = bs // S
    s = bs % S
    h = tl.load(HT + i).to(tl.int64)
    qo = tl.load(HT + NH + i).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    mask = (offs_m[:, None] < M) & d_ok
    o = tl.load(O + (b * sob + s * sos + h * soh + qo * soo) + offs_m.to(IDX)[:, None] * som + offs_d[None, :], mask=mask, other=0.0)
    g = tl.load(DO + (b * sgb + s * sgs + h * sgh + qo * sgo) + offs_m.to(IDX)[:, None] * sgm + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * g.to(tl.float32), 1)
    tl.store(DELTA + (b * sdb + s * sds + h * sdh) + offs_m.to(IDX) * sdm, delta, mask=offs_m < M)


def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, HT, KM, LT,
    sqb, sqs, sqm, sqh, sqo,
    skb, sks, skm, skh, sko,
    svb, svs, svm, svh, svo,
    sgb, sgs, sgm, sgh, sgo,
    slb, sls, slm, slh, slo,
    sdb, sds, sdm, sdh,
    sab, sas, sam, sah, sao,
    smb, sms, smm, smo, n_off,
    NH, S, M, MK, n_mblocks,
    qk_scale, scale,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr, IDX: tl.constexpr, HAS_MASK: tl.constexpr,
    ADD: tl.constexpr,
):
    """dQ of one row block of one head; adds into DQ (each element owned by one program), or with ``ADD``
    false stores it (DQ's contents ignored: the first pattern, which covers every row)."""
    pid = tl.program_id(0)
    i = tl.program_id(1)
    start_m = pid % n_mblocks
    if CAUSAL:
        start_m = n_mblocks - 1 - start_m
    bs = (pid // n_mblocks).to(tl.int64)
    b = bs // S
    s = bs % S
    h = tl.load(HT + i).to(tl.int64)
    qo = tl.load(HT + NH + i).to(tl.int64)
    kvh = tl.load(HT + 2 * NH + i).to(tl.int64)
    kvo = tl.load(HT + 3 * NH + i).to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    row_ok = offs_m < M
    q_ptrs = Q + (b * sqb + s * sqs + h * sqh + qo * sqo) + offs_m.to(IDX)[:, None] * sqm + offs_d[None, :]
    g_ptrs = DO + (b * sgb + s * sgs + h * sgh + qo * sgo) + offs_m.to(IDX)[:, None] * sgm + offs_d[None, :]
    if EVEN_M & EVEN_D:
        q = tl.load(q_ptrs)
        do = tl.load(g_ptrs)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
        do = tl.load(g_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
    if EVEN_M:
        lse = tl.load(LSE + (b * slb + s * sls + h * slh + qo * slo) + offs_m.to(IDX) * slm)
        delta = tl.load(DELTA + (b * sdb + s * sds + h * sdh) + offs_m.to(IDX) * sdm)
    else:
        lse = tl.load(LSE + (b * slb + s * sls + h * slh + qo * slo) + offs_m.to(IDX) * slm, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + (b * sdb + s * sds + h * sdh) + offs_m.to(IDX) * sdm, mask=row_ok, other=0.0)
    do = do.to(q.dtype)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # P = exp(s - lse); a row with lse = -inf (never covered) gets P = 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    k_base = K + (b * skb + s * sks + kvh * skh + kvo * sko) + offs_d[None, :]
    v_base = V + (b * svb + s * svs + kvh * svh + kvo * svo) + offs_d[None, :]
    if HAS_MASK:
        m_base = KM + (b * smb + s * sms + qo * smo)
        n_tiles = tl.cdiv(MK, BLOCK_N)
        tiles = LT + ((b * S + s) * n_off + qo) * (2 * n_tiles + 1)
    dq = tl.zeros([BLOCK_M, DP], dtype=tl.float32)
    for stage in tl.static_range(2 if CAUSAL else 1):
        if CAUSAL:
            if stage == 0:
                lo = 0
                hi = start_m * BLOCK_M
            else:
                lo = start_m * BLOCK_M
                hi = tl.minimum((start_m + 1) * BLOCK_M, MK)
        else:
            lo = 0
            hi = MK
        if HAS_MASK:  # positions in the list of the live tiles of [lo, hi)
            lo = tl.load(tiles + lo // BLOCK_N)
            hi = tl.load(tiles + tl.cdiv(hi, BLOCK_N))
        for it in range(lo, hi, 1 if HAS_MASK else BLOCK_N):
            if HAS_MASK:
                tile = tl.load(tiles + n_tiles + 1 + it)  # 2 * index + (1 if it holds some padding)
                start_n = (tile >> 1) * BLOCK_N
            else:
                start_n = it
            cols = start_n + offs_n
            if EVEN_N & EVEN_D:
                k = tl.load(k_base + cols.to(IDX)[:, None] * skm)
                v = tl.load(v_base + cols.to(IDX)[:, None] * svm)
            else:
                k = tl.load(k_base + cols.to(IDX)[:, None] * skm, mask=(cols[:, None] < MK) & d_ok, other=0.0)
                v = tl.load(v_base + cols.to(IDX)[:, None] * svm, mask=(cols[:, None] < MK) & d_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            p = tl.math.exp2(qk - lse2[:, None])
            if HAS_MASK:
                if (tile & 1) != 0:  # some padding here (keys past MK count as padding)
                    key_ok = tl.load(m_base + cols.to(IDX) * smm, mask=cols < MK, other=1) == 0
                    p = tl.where(key_ok[None, :], p, 0.0)
            elif not EVEN_N:
                p = tl.where(cols[None, :] < MK, p, 0.0)
            if CAUSAL and stage == 1:
                p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    dq = dq * scale
    a_ptrs = DQ + (b * sab + s * sas + h * sah + qo * sao) + offs_m.to(IDX)[:, None] * sam + offs_d[None, :]
    if EVEN_M & EVEN_D:
        if ADD:
            dq += tl.load(a_ptrs).to(tl.float32)
        tl.store(a_ptrs, dq.to(DQ.dtype.element_ty))
    else:
        if ADD:
            dq += tl.load(a_ptrs, mask=row_ok[:, None] & d_ok, other=0.0).to(tl.float32)
        tl.store(a_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok)


def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, UT, KM,
    sqb, sqs, sqm, sqh, sqo,
    skb, sks, skm, skh, sko,
    svb, svs, svm, svh, svo,
    sgb, sgs, sgm, sgh, sgo,
    slb, sls, slm, slh, slo,
    sdb, sds, sdm, sdh,
    skab, skas, skam, skah, skao,
    svab, svas, svam, svah, svao,
    smb, sms, smm, smo,
    NU, S, M, MK, n_nblocks,
    qk_scale, scale,
    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr, IDX: tl.constexpr, HAS_MASK: tl.constexpr,
    ADD: tl.constexpr,
):
    """dK, dV of one key block of one (kv head, offset) unit, summed over its query heads; added into
    DK/DV, or with ``ADD`` false stored (their contents ignored)."""
    pid = tl.program_id(0)
    u = tl.program_id(1)
    start_n = pid % n_nblocks
    bs = (pid // n_nblocks).to(tl.int64)
    b = bs // S
    s = bs % S
    kvh = tl.load(UT + u).to(tl.int64)
    kvo = tl.load(UT + NU + u).to(tl.int64)
    h0 = tl.load(UT + 2 * NU + u)
    n_heads = tl.load(UT + 3 * NU + u) - h0
    h0 = h0.to(tl.int64)
    qo = tl.load(UT + 4 * NU + u).to(tl.int64)

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d[None, :] < D
    col_ok = offs_n < MK
    ka_ptrs = DK + (b * skab + s * skas + kvh * skah + kvo * skao) + offs_n.to(IDX)[:, None] * skam + offs_d[None, :]
    va_ptrs = DV + (b * svab + s * svas + kvh * svah + kvo * svao) + offs_n.to(IDX)[:, None] * svam + offs_d[None, :]
    if HAS_MASK:
        key_ok = tl.load(KM + (b * smb + s * sms + qo * smo) + offs_n.to(IDX) * smm, mask=col_ok, other=1) == 0
        if tl.sum(key_ok.to(tl.int32), 0) == 0:  # a block of padding only: its dK/dV get nothing added
            if not ADD:  # (or are zero)
                zero = tl.zeros([BLOCK_N, DP], dtype=tl.float32)
                tl.store(ka_ptrs, zero.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok)
                tl.store(va_ptrs, zero.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok)
            return
    k_ptrs = K + (b * skb + s * sks + kvh * skh + kvo * sko) + offs_n.to(IDX)[:, None] * skm + offs_d[None, :]
    v_ptrs = V + (b * svb + s * svs + kvh * svh + kvo * svo) + offs_n.to(IDX)[:, None] * svm + offs_d[None, :]
    if EVEN_N & EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok, other=0.0)
        v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, DP], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DP], dtype=tl.float32)
    for hh in range(0, n_heads):
        h = h0 + hh
        q_base = Q + (b * sqb + s * sqs + h * sqh + qo * sqo) + offs_d[None, :]
        g_base = DO + (b * sgb + s * sgs + h * sgh + qo * sgo) + offs_d[None, :]
        l_base = LSE + (b * slb + s * sls + h * slh + qo * slo)
        d_base = DELTA + (b * sdb + s * sds + h * sdh)
        # Causal: query rows below this key block never see it; the first
        # BLOCK_N // BLOCK_M row blocks from the diagonal are masked.
        for stage in tl.static_range(2 if CAUSAL else 1):
            if CAUSAL:
                if stage == 0:
                    lo = start_n * BLOCK_N
                    hi = tl.minimum((start_n + 1) * BLOCK_N, M)
                else:
                    lo = (start_n + 1) * BLOCK_N
                    hi = M
            else:
                lo = 0
                hi = M
            for start_m in range(lo, hi, BLOCK_M):
                rows = start_m + offs_m
                if EVEN_M & EVEN_D:
                    q = tl.load(q_base + rows.to(IDX)[:, None] * sqm)
                    do = tl.load(g_base + rows.to(IDX)[:, None] * sgm)
                else:
                    q = tl.load(q_base + rows.to(IDX)[:, None] * sqm, mask=(rows[:, None] < M) & d_ok, other=0.0)
                    do = tl.load(g_base + rows.to(IDX)[:, None] * sgm, mask=(rows[:, None] < M) & d_ok, other=0.0)
                if EVEN_M:
                    lse = tl.load(l_base + rows.to(IDX) * slm)
                    delta = tl.load(d_base + rows.to(IDX) * sdm)
                else:
                    lse = tl.load(l_base + rows.to(IDX) * slm, mask=rows < M, other=float("-inf"))
                    delta = tl.load(d_base + rows.to(IDX) * sdm, mask=rows < M, other=0.0)
                do = do.to(k.dtype)
                if DOT_F32:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
                qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
                pT = tl.math.exp2(qkT - lse2[None, :])
                if HAS_MASK:
                    pT = tl.where(key_ok[:, None], pT, 0.0)
                elif not EVEN_N:
                    pT = tl.where(col_ok[:, None], pT, 0.0)
                if CAUSAL and stage == 0:
                    pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
                dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
                dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
                dsT = pT * (dpT - delta[None, :])
                dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    dk = dk * scale
    if EVEN_N & EVEN_D:
        if ADD:
            dk += tl.load(ka_ptrs).to(tl.float32)
            dv += tl.load(va_ptrs).to(tl.float32)
        tl.store(ka_ptrs, dk.to(DK.dtype.element_ty))
        tl.store(va_ptrs, dv.to(DV.dtype.element_ty))
    else:
        if ADD:
            dk += tl.load(ka_ptrs, mask=col_ok[:, None] & d_ok, other=0.0).to(tl.float32)
            dv += tl.load(va_ptrs, mask=col_ok[:, None] & d_ok, other=0.0).to(tl.float32)
        tl.store(ka_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok)
        tl.store(va_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok)


def tiles_kernel(
    KM, LT,
    smb, sms, smm, smo, n_off,
    S, MK,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, IDX: tl.constexpr,
):
    """The live key tiles ``LT`` of one ``(b, s, offset)`` mask row (layout in the module docstring)."""
    row = tl.program_id(0).to(tl.int64)  # (b * S + s) * n_off + offset
    bs = row // n_off
    m_base = KM + ((bs // S) * smb + (bs % S) * sms + (row % n_off) * smo)
    n_tiles = tl.cdiv(MK, BLOCK_N)
    out = LT + row * (2 * n_tiles + 1)
    tl.store(out, 0)
    count = 0
    for t0 in range(0, n_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        cols = t[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        n_pad = tl.sum(tl.load(m_base + cols.to(IDX) * smm, mask=cols < MK, other=1).to(tl.int32), 1)
        live = (n_pad < BLOCK_N) & (t < n_tiles)
        seen = count + tl.cumsum(live.to(tl.int32), 0)  # live tiles up to and including t
        tl.store(out + 1 + t, seen, mask=t < n_tiles)
        tl.store(out + n_tiles + seen, 2 * t + (n_pad > 0).to(tl.int32), mask=live)
        count += tl.sum(live.to(tl.int32), 0)


KERNEL_FUNCS = {
    "fwd": fwd_kernel,
    "delta": delta_kernel,
    "dq": dq_kernel,
    "dkdv": dkdv_kernel,
    "tiles": tiles_kernel,
}
