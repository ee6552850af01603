"""Key padding masks (``key_mask=``) in the fused Triton kernel, against a float64 dense oracle written here.

The oracle is plain softmax attention with masked scores set to ``-inf`` (and the
guarded ``exp(s - lse)`` of the backward: ``P = 0`` where ``lse = -inf``). It runs
in float64 (the oracle) and in the inputs' dtype (the plain-torch result the
tolerance rule of ``testing/compare.py`` scales from). Without CUDA the kernels
run in Triton's interpreter on small shapes. Inputs are fresh draws from a
``torch.Generator`` with a fixed seed per case; the tests pin 16-row tiles in
the interpreter (``kernel_checks.SMALL_TILES``), so the "half" masks below mask
whole key tiles (and, with the GPU sizes, whole GPU tiles), and "by_offset" masks
different tiles for different dilation offsets.
"""

from __future__ import annotations

import os
import zlib

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first kernel build; fused.py jits lazily at first launch
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from dilated_attention.kernels.fused import FusedKernel, _key_mask  # noqa: E402
from dilated_attention.kernels.protocol import CallSpec  # noqa: E402
from kernel_checks import SMALL_TILES  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.testing.compare import assert_within_rule  # noqa: E402
from dilated_attention.views import pack_kv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
FUSED = FusedKernel(SMALL_TILES)
LOW = torch.bfloat16 if CUDA else torch.float16
INF = float("inf")


def generator(*parts) -> tuple[torch.Generator, int]:
    seed = zlib.crc32(repr(parts).encode())
    return torch.Generator().manual_seed(seed), seed


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def d64(x):
    return x.detach().double().cpu()


# ---------------------------------------------------------------------------
# the dense oracle: a (B, S, M, Hq, D) block, keys (B, S, Mk, Hk, D), mask (B, S, Mk)


def _expand(x, hq):
    return x.repeat_interleave(hq // x.shape[-2], dim=-2)  # query head i reads kv head i // group


def _scores(q, k, mask, causal, scale):
    """Scores (B, S, Hq, M, Mk) in at least fp32; the matmul in q's dtype (as plain low-precision torch)."""
    s = torch.einsum("bsmhd,bsnhd->bshmn", q, _expand(k, q.shape[-2]))
    s = s.to(torch.promote_types(q.dtype, torch.float32)) * scale
    s = s.masked_fill(mask[:, :, None, None, :], -INF)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -INF)
    return s


def _probs(s, lse):
    """``exp(s - lse)``; a row with ``lse = -inf`` (nothing visible) has only ``-inf`` scores: P = 0, not NaN."""
    return torch.exp(s - torch.where(lse == -INF, 0.0, lse).unsqueeze(-1))


def dense_forward(q, k, v, mask, causal, scale):
    s = _scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(s, -1)  # -inf for an empty row
    p = _probs(s, lse)
    out = torch.einsum("bshmn,bsnhd->bsmhd", p.to(q.dtype), _expand(v, q.shape[-2]))
    return out, lse.permute(0, 1, 3, 2)


def dense_backward(q, k, v, mask, out, lse, dout, causal, scale):
    """dq, dk, dv for the final ``out``/``lse`` (in at least fp32); matmuls in q's dtype."""
    dt, hq, hk = q.dtype, q.shape[-2], k.shape[-2]
    acc = torch.promote_types(dt, torch.float32)
    p = _probs(_scores(q, k, mask, causal, scale), lse.permute(0, 1, 3, 2).to(acc))
    dout = dout.to(dt)
    dv = torch.einsum("bshmn,bsmhd->bsnhd", p.to(dt), dout).to(acc)
    dp = torch.einsum("bsmhd,bsnhd->bshmn", dout, _expand(v, hq)).to(acc)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).permute(0, 1, 3, 2)
    ds = (p * (dp - delta.unsqueeze(-1)) * scale).to(dt)
    dq = torch.einsum("bshmn,bsnhd->bsmhd", ds, _expand(k, hq)).to(acc)
    dk = torch.einsum("bshmn,bsmhd->bsnhd", ds, q).to(acc)
    fold = (hk, hq // hk)
    return dq, dk.unflatten(-2, fold).sum(-2), dv.unflatten(-2, fold).sum(-2)


# ---------------------------------------------------------------------------
# judging


def judge(what, got, oracle, plain, seed):
    assert_within_rule(what, got, oracle, plain, context=f"(seed {seed})")


def judge_lse(what, got, oracle, plain, seed):
    """Empty rows must be exactly ``-inf``; the rest is judged by the rule."""
    empty = oracle == -INF
    assert torch.equal(got.cpu() == -INF, empty), f"{what}: -inf rows differ (seed {seed})"
    if not empty.all():
        judge(what, got.cpu()[~empty], oracle[~empty], plain.cpu()[~empty], seed)


def check_block(q, k, v, mask, dout, causal, scale, seed, tag):
    """Fused forward and backward of one block against the oracle; exact zeros where nothing is visible."""
    out, lse = FUSED.forward(q, k, v, causal=causal, scale=scale, key_mask=mask)
    m64 = mask.cpu()
    o64, l64 = dense_forward(d64(q), d64(k), d64(v), m64, causal, scale)
    o_lo, l_lo = dense_forward(q, k, v, mask, causal, scale)
    judge(f"{tag} out", out, o64, o_lo, seed)
    judge_lse(f"{tag} lse", lse, l64, l_lo, seed)
    empty = (l64 == -INF).unsqueeze(-1)
    assert (out.cpu().masked_select(empty) == 0).all(), f"{tag}: rows with no visible key must be 0 (seed {seed})"

    grads = FUSED.backward(q, k, v, out, lse, dout, causal=causal, scale=scale, key_mask=mask)
    g64 = dense_backward(d64(q), d64(k), d64(v), m64, d64(out), d64(lse), d64(dout), causal, scale)
    glo = dense_backward(q, k, v, mask, out, lse, dout, causal, scale)
    for name, got, want, low in zip(("dq", "dk", "dv"), grads, g64, glo):
        judge(f"{tag} {name}", got, want, low, seed)
    dq, dk, dv = (x.cpu() for x in grads)
    assert (dq.masked_select(empty) == 0).all(), f"{tag}: dq of empty rows must be 0 (seed {seed})"
    keys = m64[..., None, None]
    assert (dk.masked_select(keys) == 0).all() and (dv.masked_select(keys) == 0).all(), \
        f"{tag}: masked keys must get exactly zero dk/dv (seed {seed})"
    return out, lse, grads


# ---------------------------------------------------------------------------
# masks


def make_mask(kind, g, shape, segment=None, rate=1):
    """A bool key mask of ``shape`` (..., keys); ``True`` = padding. ``segment``: the keys of one segment
    (default: all of them); ``rate``: the dilation (for ``by_offset``)."""
    *lead, n = shape
    seg = segment or n
    if kind == "random":
        return (torch.rand(shape, generator=g) < 0.35).to(DEVICE)
    if kind == "half":  # the first half of every segment (whole key tiles of padding), random elsewhere
        m = torch.rand(shape, generator=g) < 0.2
        m.unflatten(-1, (n // seg, seg))[..., : seg // 2] = True
        return m.to(DEVICE)
    if kind == "by_offset":  # dead tiles differ by dilation offset: all of offset 0, offset 1's second half
        m = torch.rand(shape, generator=g) < 0.2
        pos = torch.arange(n) % seg
        m[..., pos % rate == 0] = True
        m[..., (pos % rate == 1) & (pos >= seg // 2)] = True
        return m.to(DEVICE)
    if kind == "empty_rows":  # random, and every key of batch row 0 (of segment 0 for a block) masked
        m = torch.rand(shape, generator=g) < 0.35
        m[(0,) * len(lead)] = True
        return m.to(DEVICE)
    if kind == "strided":  # a step-2 slice of a wider buffer, batch expanded with stride 0
        wide = torch.rand((1, *lead[1:], 2 * n), generator=g).to(DEVICE) < 0.35
        return wide[..., ::2].expand(shape)
    if kind == "transposed":  # a buffer with the keys outermost, permuted back
        buf = torch.rand((n, *reversed(lead)), generator=g).to(DEVICE) < 0.35
        return buf.permute(*range(len(shape) - 1, 0, -1), 0)
    raise ValueError(kind)


# ---------------------------------------------------------------------------
# the block seam


M_BIG = 40 if not CUDA else 300
BLOCK_CASES = [
    # mask kind, causal, (M, Mk), head dim, dtype
    ("random", False, (24, 32), 32, torch.float32),
    ("random", True, (M_BIG, M_BIG), 32, LOW),
    ("half", False, (24, M_BIG), 40, torch.float32),
    ("half", True, (M_BIG, M_BIG), 40, torch.float32),
    ("empty_rows", True, (24, 24), 32, torch.float32),
    ("strided", False, (24, M_BIG), 32, torch.float32),
    ("transposed", True, (M_BIG, M_BIG), 40, torch.float32),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-causal{c[1]}-M{c[2][0]}-N{c[2][1]}-D{c[3]}-{c[4]}")
def test_block_key_mask(case):
    kind, causal, (m, mk), dim, dtype = case
    g, seed = generator("block", case)
    b, s, hq, hk = 2, 2, 4, 2  # GQA
    q, dout = (randn(g, b, s, m, hq, dim, dtype=dtype) for _ in range(2))
    k, v = (randn(g, b, s, mk, hk, dim, dtype=dtype) for _ in range(2))
    mask = make_mask(kind, g, (b, s, mk))
    check_block(q, k, v, mask, dout, causal, dim**-0.5, seed, f"block {kind}")


def test_block_all_keys_masked():
    """Nothing visible anywhere: out 0, lse -inf, all gradients exactly zero (never NaN)."""
    g, seed = generator("all-masked")
    q, k, v, dout = (randn(g, 1, 2, 24, 2, 32) for _ in range(4))
    mask = torch.ones(1, 2, 24, dtype=torch.bool, device=DEVICE)
    out, lse, grads = check_block(q, k, v, mask, dout, True, 0.2, seed, "all masked")
    assert (out == 0).all() and (lse == -INF).all()
    assert all((x == 0).all() for x in grads)


def test_block_none_is_unchanged():
    """``key_mask=None`` is the unmasked launch: bitwise what a call without the argument gives."""
    g, _ = generator("none")
    q, dout = (randn(g, 2, 1, 24, 4, 40) for _ in range(2))
    k, v = (randn(g, 2, 1, 24, 2, 40) for _ in range(2))
    for causal in (False, True):
        plain = FUSED.forward(q, k, v, causal=causal, scale=0.15)
        given = FUSED.forward(q, k, v, causal=causal, scale=0.15, key_mask=None)
        assert all(torch.equal(a, b) for a, b in zip(plain, given))
        grads = FUSED.backward(q, k, v, *plain, dout, causal=causal, scale=0.15)
        grads_none = FUSED.backward(q, k, v, *plain, dout, causal=causal, scale=0.15, key_mask=None)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_none))


# ---------------------------------------------------------------------------
# the pattern interface: one launch per pattern, local (packed=False) or a packed ring half


def positions(plan, offset, n, device):
    """Local positions (S, M) read by heads of dilation offset ``offset``: ``s * w + offset + r * j``."""
    w, r = plan.local_segment, plan.dilation
    return (torch.arange(n // w)[:, None] * w + offset + r * torch.arange(w // r)).to(device)


def pattern_forward(q, k, v, mask, plan, causal, scale):
    """The dense oracle per chunk: ``{chunk: (out (B, S, M, h, D), lse (B, S, M, h))}``."""
    res = {}
    for c in plan.chunks:
        pos = positions(plan, c.offset, q.shape[1], q.device)
        kv = slice(c.k0, c.k1)
        res[c] = dense_forward(q[:, pos, c.h0 : c.h1], k[:, pos, kv], v[:, pos, kv], mask[:, pos], causal, scale)
    return res


def pattern_backward(q, k, v, mask, plan, out, lse, dout, acc, packed, causal, scale):
    """The dense gradients added into ``acc`` = [dq, dk, dv] (dk/dv packed like ``pack_kv`` for
    ``packed``); ``k``/``v`` are the local (unpacked) keys either way."""
    for c in plan.chunks:
        pos = positions(plan, c.offset, q.shape[1], q.device)
        hs, kv = slice(c.h0, c.h1), slice(c.k0, c.k1)
        grads = dense_backward(q[:, pos, hs], k[:, pos, kv], v[:, pos, kv], mask[:, pos], out[:, pos, hs],
                               lse[:, pos, hs], dout[:, pos, hs], causal, scale)
        for i, (a, gr) in enumerate(zip(acc, grads)):
            if packed and i:  # one segment: packed row j is chunk row j; kv heads from buffer_head on
                a[:, :, c.buffer_head : c.buffer_head + c.k1 - c.k0] += gr[:, 0]
            else:
                part = a[:, pos]
                part[:, :, :, hs if i == 0 else kv] += gr
                a[:, pos] = part


def check_pattern(plan, q, k, v, mask, packed, causal, g, seed, tag):
    """forward_pattern and backward_pattern (adding into random fp32 accumulators) against the oracle;
    masked keys and rows this pattern leaves empty are left bit-for-bit untouched."""
    scale = q.shape[-1] ** -0.5
    bsz, n, heads, dim = q.shape
    w, r = plan.local_segment, plan.dilation
    kk, vv = pack_kv(k, v, plan).unbind(0) if packed else (k, v)
    out, lse = FUSED.forward_pattern(q, kk, vv, plan, CallSpec(causal, scale, packed=packed, key_mask=mask))
    out, lse = out.unflatten(1, (n // w, w // r)), lse.unflatten(1, (n // w, w // r))
    m64 = mask.cpu()
    f64 = pattern_forward(d64(q), d64(k), d64(v), m64, plan, causal, scale)
    flo = pattern_forward(q, k, v, mask, plan, causal, scale)
    # final lse: this pattern's, raised as if merged with other patterns; half of the rows it leaves
    # empty are covered by another pattern (finite lse: this one must still add nothing for them)
    lse_fin = torch.full((bsz, n, heads), -INF, dtype=torch.float64)
    empty = torch.zeros(bsz, n, heads, dtype=torch.bool)
    for c in plan.chunks:
        hs = slice(c.h0, c.h1)
        judge(f"{tag} out heads {c.h0}:{c.h1}", out[..., hs, :], f64[c][0], flo[c][0], seed)
        judge_lse(f"{tag} lse heads {c.h0}:{c.h1}", lse[..., hs], f64[c][1], flo[c][1], seed)
        none = f64[c][1] == -INF
        assert (out[..., hs, :].cpu()[none] == 0).all(), f"{tag}: rows with no visible key must be 0 (seed {seed})"
        covered = none & (torch.rand(none.shape, generator=g) < 0.5)
        raised = f64[c][1] + torch.rand(none.shape, generator=g, dtype=torch.float64)
        pos = positions(plan, c.offset, n, "cpu")
        lse_fin[:, pos, hs] = torch.where(covered, torch.randn(none.shape, generator=g, dtype=torch.float64), raised)
        empty[:, pos, hs] = none
    lse_fin = lse_fin.float().to(DEVICE)
    out_fin, dout = (randn(g, bsz, n, heads, dim, dtype=q.dtype) for _ in range(2))
    init = [randn(g, *x.shape) for x in (q, kk, vv)]
    acc = [x.clone() for x in init]
    FUSED.backward_pattern(q, kk, vv, plan, CallSpec(causal, scale, packed=packed, key_mask=mask),
                           (out_fin, lse_fin, dout), acc)
    acc64 = [d64(x) for x in init]
    pattern_backward(d64(q), d64(k), d64(v), m64, plan, d64(out_fin), d64(lse_fin), d64(dout), acc64, packed,
                     causal, scale)
    acclo = [x.clone() for x in init]
    pattern_backward(q, k, v, mask, plan, out_fin, lse_fin, dout, acclo, packed, causal, scale)
    for name, got, want, low in zip(("dq", "dk", "dv"), acc, acc64, acclo):
        judge(f"{tag} {name}", got, want, low, seed)
    # untouched: dq rows with nothing visible here; dk/dv of masked keys (and of rows no chunk reads)
    assert torch.equal(acc[0].cpu()[empty], init[0].cpu()[empty]), f"{tag}: dq of empty rows changed (seed {seed})"
    live = torch.zeros(kk.shape[:3], dtype=torch.bool)
    for c in plan.chunks:
        keys = ~m64[:, positions(plan, c.offset, n, "cpu")]  # (B, S, M)
        if packed:
            live[:, :, c.buffer_head : c.buffer_head + c.k1 - c.k0] = keys[:, 0, :, None]
        else:
            live[:, positions(plan, c.offset, n, "cpu"), c.k0 : c.k1] |= keys[..., None]
    for name, got, x0 in zip(("dk", "dv"), acc[1:], init[1:]):
        assert torch.equal(got.cpu()[~live], x0.cpu()[~live]), f"{tag}: {name} of masked keys changed (seed {seed})"


N_PAT = 64 if not CUDA else 512  # local rows: with r = 2 a segment of N_PAT has two interpreter key tiles
PATTERN_CASES = [
    # mask kind, causal, packed, segment, dilation, head dim, dtype
    ("random", False, False, N_PAT // 2, 4, 32, torch.float32),
    ("half", True, False, N_PAT, 2, 40, torch.float32),
    ("half", False, False, N_PAT // 2, 2, 32, LOW),
    ("empty_rows", True, False, N_PAT // 2, 2, 32, torch.float32),
    ("strided", True, False, N_PAT, 4, 32, torch.float32),
    ("by_offset", True, False, N_PAT, 2, 32, torch.float32),
    ("by_offset", False, True, 2 * N_PAT, 2, 32, torch.float32),
    ("random", True, True, 2 * N_PAT, 2, 32, torch.float32),
    ("half", False, True, 2 * N_PAT, 2, 40, torch.float32),
    ("transposed", True, True, 2 * N_PAT, 4, 32, LOW),
]


@pytest.mark.parametrize(
    "case", PATTERN_CASES, ids=lambda c: f"{c[0]}-causal{c[1]}-packed{c[2]}-w{c[3]}-r{c[4]}-D{c[5]}-{c[6]}"
)
def test_pattern_key_mask(case):
    kind, causal, packed, seg, rate, dim, dtype = case
    g, seed = generator("pattern", case)
    b, heads, kv_heads = 2, 4, 2  # GQA; longnet head offsets spread over the dilation
    # packed: a ring pattern (segment = 2 shards); k/v are the other shard's rows, packed by pack_kv
    (plan,) = plan_patterns([seg], [rate], seq_len=2 * N_PAT if packed else N_PAT, local_len=N_PAT,
                            num_heads=heads, num_kv_heads=kv_heads)
    assert (plan.ring_size > 1) == packed
    q = randn(g, b, N_PAT, heads, dim, dtype=dtype)
    k, v = (randn(g, b, N_PAT, kv_heads, dim, dtype=dtype) for _ in range(2))
    mask = make_mask(kind, g, (b, N_PAT), plan.local_segment, rate)
    check_pattern(plan, q, k, v, mask, packed, causal, g, seed, f"pattern {kind} w={seg} r={rate}")


# ---------------------------------------------------------------------------
# the list of live key tiles the masked forward and dQ loops walk


@pytest.mark.parametrize("rate", [1, 2])
def test_live_tile_list(rate):
    """Per (b, s, offset) row: prefix counts of the tiles holding a real key, then ``2 * tile + partial``
    for each in order; tiles of padding only are absent (never visited). 70 tiles: several chunks."""
    g, _ = generator("tiles", rate)
    block, n_tiles, bsz, segs = 16, 70, 2, 3
    keys = block * n_tiles - 5  # the last tile runs past the end (read as padding)
    w = keys * rate
    tiles = torch.rand(bsz, segs, rate, n_tiles, block, generator=g) < 0.3
    tiles[torch.rand(tiles.shape[:-1], generator=g) < 0.4] = True  # whole tiles of padding
    tiles.flatten(-2)[..., keys:] = True
    mask = torch.empty(bsz, segs * w, dtype=torch.bool)  # key j of offset o in segment s: s * w + o + rate * j
    mask.unflatten(1, (segs, keys, rate)).transpose(2, 3).copy_(tiles.flatten(-2)[..., :keys])
    mask = mask.to(DEVICE)
    if rate == 1:  # the block seam's (B, S, Mk) mask
        km = _key_mask(mask.view(bsz, segs, keys), (bsz, segs, keys), mask.device)
    else:  # a pattern's (B, Lk) mask, read dilated
        (plan,) = plan_patterns([w], [rate], seq_len=segs * w, local_len=segs * w, num_heads=rate, num_kv_heads=1)
        km = _key_mask(mask, mask.shape, mask.device, plan)
    got = FUSED._live_tiles(km, bsz, segs, keys, block, triton.language.int32).cpu()
    live, partial = ~tiles.all(-1), tiles.any(-1)
    for row, (lv, pt) in enumerate(zip(live.flatten(0, 2), partial.flatten(0, 2))):
        n = int(lv.sum())
        assert got[row, 0] == 0 and torch.equal(got[row, 1 : n_tiles + 1], lv.cumsum(0).int()), row
        idx = lv.nonzero().flatten()
        assert torch.equal(got[row, n_tiles + 1 : n_tiles + 1 + n], (2 * idx + pt[idx]).int()), row


# ---------------------------------------------------------------------------
# validation


def test_key_mask_validation():
    q = torch.zeros(2, 2, 16, 4, 32, device=DEVICE)
    k = torch.zeros(2, 2, 16, 2, 32, device=DEVICE)
    bad = {
        "shape": torch.zeros(2, 2, 17, dtype=torch.bool, device=DEVICE),
        "dtype": torch.zeros(2, 2, 16, dtype=torch.uint8, device=DEVICE),
        "device": torch.zeros(2, 2, 16, dtype=torch.bool, device="meta"),
    }
    for mask in bad.values():  # the message names key_mask, the expected and the given shape
        with pytest.raises(ValueError, match=r"key_mask .*\(2, 2, 16\).*got .*\(2, 2, 1[67]\)"):
            FUSED.forward(q, k, k, causal=False, scale=0.1, key_mask=mask)
        with pytest.raises(ValueError, match="key_mask"):
            FUSED.backward(q, k, k, q, q[..., 0], q, causal=False, scale=0.1, key_mask=mask)
    # a packed ring half: the mask covers the sender's full rows L = 2 * (packed rows) for r = 2
    (plan,) = plan_patterns([64], [2], seq_len=64, local_len=32, num_heads=4, num_kv_heads=2)
    ql = torch.zeros(1, 32, 4, 32, device=DEVICE)
    kp, vp = pack_kv(ql[:, :, :2], ql[:, :, :2], plan).unbind(0)
    short = torch.zeros(1, 16, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match=r"key_mask .*\(1, 32\).*got .*\(1, 16\)"):
        FUSED.forward_pattern(ql, kp, vp, plan, CallSpec(False, 0.1, packed=True, key_mask=short))
    acc = [torch.zeros(x.shape, device=DEVICE) for x in (ql, kp, vp)]
    with pytest.raises(ValueError, match=r"key_mask .*\(1, 32\).*got .*\(1, 16\)"):
        FUSED.backward_pattern(ql, kp, vp, plan, CallSpec(False, 0.1, packed=True, key_mask=short),
                               (ql, ql[..., 0], ql), acc)
