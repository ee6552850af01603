"""What the kernel tests share: seeded random inputs in any layout, the plain-torch references and the checks
every pattern kernel passes against the fp64 oracle (``test_fused.py``, ``test_cudnn.py``,
``test_cudnn_frontend.py``, ``test_flash4.py``, ``test_auto.py``).

Without CUDA the fused kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here before any kernel
is built: import this module first) on small shapes; with CUDA the same checks run on real shapes. Inputs
are fresh random draws from fixed seeds (the seed is in every message). Low precision is judged by
``testing/compare.py``'s rule (docs/design.md section 7): error vs the fp64 oracle at most 2x the error of
plain torch in the same precision, plus a floor. "Plain torch in the same precision" is whichever is worse
of ReferenceKernel run on the low-precision inputs (fp32 inside) and ``LowpTorch`` below, which does every
matmul in the low dtype (flash-attention's ``attention_ref(upcast=False)``): the fused kernel feeds bf16/fp16
P and dS to the tensor cores, which ReferenceKernel alone would not account for.
"""

from __future__ import annotations

import os
import zlib

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first kernel build; fused.py jits lazily at first launch
    os.environ["TRITON_INTERPRET"] = "1"

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.kernels.chunk_loop import ChunkLoop  # noqa: E402
from dilated_attention.kernels.fused import FusedConfig  # noqa: E402
from dilated_attention.kernels.protocol import CallSpec  # noqa: E402
from dilated_attention.kernels.reference import ReferenceKernel, _expand_kv  # noqa: E402
from dilated_attention.merge import Part, merge_pattern_, sum_grads  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.ring.block import block_forward  # noqa: E402
from dilated_attention.ring.routes import RingCall, plan_ring  # noqa: E402
from dilated_attention.testing.compare import as_layout, assert_within_rule, rel_err  # noqa: E402
from dilated_attention.testing.oracle import dense_dilated_attention  # noqa: E402
from dilated_attention.views import chunk_views, compact_view, dilated_view, pack_kv  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# The fused kernel's own tests pin 16-row tiles in the interpreter (its default there is larger, for speed), so
# that their small segments span several query and key tiles, partial ones included; a GPU keeps its pinned config.
SMALL_TILES = None if CUDA else FusedConfig(16, 16, 1, 1, 16, 16, 1, 1, 16, 16, 1, 1)


class LowpTorch:
    """Plain torch attention with every matmul in the input dtype (softmax and sums in fp32)."""

    name = "lowp-torch"
    key_masks = False
    deterministic_backward = True

    def supports(self, q, k):
        return None

    @staticmethod
    def _s(q, k, causal, scale):
        s = torch.einsum("bsmhd,bsnhd->bshmn", q, _expand_kv(k, q.shape[-2])).float() * scale
        if causal:
            m, n = s.shape[-2:]
            s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, *, causal, scale):
        s = self._s(q, k, causal, scale)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).to(q.dtype)
        out = torch.einsum("bshmn,bsnhd->bsmhd", p, _expand_kv(v, q.shape[-2]))
        return out, lse.permute(0, 1, 3, 2).float()

    def backward(self, q, k, v, out, lse, dout, *, causal, scale):
        dt, hq, hk = q.dtype, q.shape[-2], k.shape[-2]
        s = self._s(q, k, causal, scale)
        p = torch.exp(s - lse.permute(0, 1, 3, 2).float().unsqueeze(-1))
        do = dout.to(dt)
        dv = torch.einsum("bshmn,bsmhd->bsnhd", p.to(dt), do).float()
        dp = torch.einsum("bsmhd,bsnhd->bshmn", do, _expand_kv(v, hq)).float()
        delta = (dout.float() * out.float()).sum(-1).permute(0, 1, 3, 2)
        ds = (p * (dp - delta.unsqueeze(-1)) * scale).to(dt)
        dq = torch.einsum("bshmn,bsnhd->bsmhd", ds, _expand_kv(k, hq)).float()
        dk = torch.einsum("bshmn,bsmhd->bsnhd", ds, q).float()
        if hq != hk:
            dk = dk.unflatten(-2, (hk, hq // hk)).sum(-2)
            dv = dv.unflatten(-2, (hk, hq // hk)).sum(-2)
        return dq, dk, dv


REF = ReferenceKernel()
LOWP = LowpTorch()
REF_P = ChunkLoop(REF)
LOWP_P = ChunkLoop(LOWP)
LOW = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]
DTYPES = [torch.float32] + LOW

# pattern setups by device
PAT_N = 1024 if CUDA else 32
PAT_SEGS = [256, 512, 1024] if CUDA else [8, 16, 32]
PAT_RATES = [1, 2, 4]
PAT_DIM = 128 if CUDA else 32


def seeded(*parts) -> int:
    """A fixed seed per test case (crc32 of its parameters), set before its random draws."""
    seed = zlib.crc32(repr(parts).encode())
    torch.manual_seed(seed)
    return seed


def rand(shape, dtype, layout="contiguous"):
    """Random ``(B, N, H, D)`` values in a chosen memory layout (``testing.compare.as_layout``)."""
    return as_layout(torch.randn(shape, device=DEVICE, dtype=dtype), layout)


def rand5(shape, dtype, layout="contiguous"):
    """A ``(B, S, M, H, D)`` block view: a 4D layout with its sequence dim split."""
    b, s, m, h, d = shape
    return rand((b, s * m, h, d), dtype, layout).unflatten(1, (s, m))


def d64(x):
    return x.detach().double().cpu()


def judge(what, got, oracle, plains, seed):
    """The tolerance rule against the fp64 ``oracle``; ``plains`` are plain-torch results in got's dtype."""
    plains = plains if isinstance(plains, (list, tuple)) else [plains]
    worst = max(plains, key=lambda p: rel_err(p, oracle))
    assert_within_rule(what, got, oracle, worst, context=f"(seed {seed})")


def check_api_against_oracle(base, dout, segs, rates, dtype, layout, context, *, kernel, **options):
    """``dilated_attention(..., kernel=kernel, **options)`` on fp64 ``base`` q/k/v cast to ``dtype`` (in ``layout``):
    out, dq, dk, dv against the fp64 dense oracle by the tolerance rule (plain torch in ``dtype``)."""

    def run(fn, xs, do, **extra):
        xs = [x.detach().requires_grad_(True) for x in xs]
        out = fn(*xs, segs, rates, **options, **extra)
        out.backward(do)
        return [out.detach(), *(x.grad for x in xs)]

    oracle = run(dense_dilated_attention, base, dout)
    plain = run(dense_dilated_attention, [x.to(dtype) for x in base], dout.to(dtype))
    got = run(dilated_attention, [as_layout(x.to(dtype), layout) for x in base], dout.to(dtype), kernel=kernel)
    for what, gt, w, p in zip(("out", "dq", "dk", "dv"), got, oracle, plain):
        assert gt.dtype == dtype
        assert_within_rule(what, gt, w, p, context=context)


def check_fresh_backward(kern, q, k, v, plans, out, lse, dout, seed, **kw):
    """``backward_pattern(..., fresh=True)`` into NaN-filled accumulators gives bit for bit what adding into zeros
    gives, for each of ``plans``."""
    spec = CallSpec(**kw)
    for p in plans:
        want = tuple(torch.zeros(x.shape, device=DEVICE) for x in (q, k, v))
        kern.backward_pattern(q, k, v, p, spec, (out, lse, dout), want)
        got = tuple(torch.full(x.shape, float("nan"), device=DEVICE) for x in (q, k, v))
        kern.backward_pattern(q, k, v, p, spec, (out, lse, dout), got, fresh=True)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(g, w), f"fresh {name} differs on plan {p.index} (seed {seed})"


def plans_for(mode, heads, kv_heads, local_len, seq_len, segs=None, rates=None):
    return plan_patterns(segs or PAT_SEGS, rates or PAT_RATES, seq_len=seq_len, local_len=local_len,
                         num_heads=heads, num_kv_heads=kv_heads, mode=mode)


def final_out_lse(q, k, v, plans, causal, scale):
    """Merged (out, lse) of all local plans, the way the library combines them, fp64 kernel."""
    q, k, v = d64(q), d64(k), d64(v)
    ring = RingCall(plan_ring(plans, REF_P, causal=causal, scale=scale), None, 0)
    out, lse = block_forward(q, k, v, None, ring)
    return out, lse.float()


def backward_pattern_all(kern, q, k, v, p, out, lse, dout, packed, causal, scale):
    """``kern.backward_pattern``, the fp64 oracle and the two low-precision baselines, each
    adding into copies of the same random fp32 accumulators ``init``."""
    init = [torch.randn(x.shape, device=DEVICE) for x in (q, k, v)]
    spec = CallSpec(causal, scale, packed)
    acc = tuple(x.clone() for x in init)
    kern.backward_pattern(q, k, v, p, spec, (out, lse, dout), acc)
    acc64 = tuple(d64(x) for x in init)
    REF_P.backward_pattern(d64(q), d64(k), d64(v), p, spec, (d64(out), d64(lse), d64(dout)), acc64)
    acclo = []
    for kk in (REF_P, LOWP_P):
        acc_k = tuple(x.clone() for x in init)
        kk.backward_pattern(q, k, v, p, spec, (out, lse, dout), acc_k)
        acclo.append(acc_k)
    return init, acc, acc64, list(zip(*acclo))


def chunk_rows(x, plan):
    """Compact rows of the heads in the plan's chunks, stacked (heads outside are unspecified)."""
    return torch.cat([compact_view(x, plan, c.h0, c.h1).flatten(3) for c in plan.chunks], dim=-1)


def check_pattern_forward(kern, q, k, v, p, packed, causal, scale, seed, what):
    spec = CallSpec(causal, scale, packed)
    o, s = kern.forward_pattern(q, k, v, p, spec)
    o64, s64 = REF_P.forward_pattern(d64(q), d64(k), d64(v), p, spec)
    lows = [kk.forward_pattern(q, k, v, p, spec) for kk in (REF_P, LOWP_P)]
    judge(f"{what} out", chunk_rows(o, p), chunk_rows(o64, p), [chunk_rows(x[0], p) for x in lows], seed)
    judge(f"{what} lse", chunk_rows(s, p), chunk_rows(s64, p), [chunk_rows(x[1], p) for x in lows], seed)
    check_pattern_merge(kern, q, k, v, p, packed, causal, scale, seed, what)
    return o, s


def check_pattern_merge(kern, q, k, v, p, packed, causal, scale, seed, what):
    """``forward_pattern_into`` merges into a running fp32 result that already holds random values (every
    fifth row empty), read through head-sliced strides, against merging the fp64 oracle's partial; rows
    the pattern does not cover stay bit-for-bit unchanged."""
    g = torch.Generator().manual_seed(seed)
    bsz, n, heads, dim = q.shape
    out0 = torch.randn((bsz, n, heads + 1, dim), generator=g)[:, :, 1:]
    lse0 = (3 * torch.randn((bsz, n, heads + 2), generator=g))[:, :, 2:]
    out0[:, ::5], lse0[:, ::5] = 0.0, float("-inf")
    spec = CallSpec(causal, scale, packed)

    def head_sliced(x):  # a fresh copy that is a head slice of a wider tensor, like out0/lse0
        wide = torch.empty((*x.shape[:2], x.shape[2] + 1, *x.shape[3:]), device=DEVICE)
        wide[:, :, 1:].copy_(x)
        return wide[:, :, 1:]

    def merged(kernel):
        out, lse = head_sliced(out0), head_sliced(lse0)
        kernel.forward_pattern_into(q, k, v, p, spec, (out, lse))
        return out, lse

    got_o, got_l = merged(kern)
    want_o, want_l = d64(out0), d64(lse0)
    merge_pattern_(want_o, want_l, p, *REF_P.forward_pattern(d64(q), d64(k), d64(v), p, spec))
    lows = [merged(kk) for kk in (REF_P, LOWP_P)]
    fin = torch.isfinite(want_l)
    assert torch.equal(torch.isfinite(got_l.cpu()), fin), f"{what} merged lse: empty rows differ"
    judge(f"{what} merged out", got_o, want_o, [o for o, _ in lows], seed)
    judge(f"{what} merged lse", got_l.cpu()[fin], want_l[fin], [s.cpu()[fin] for _, s in lows], seed)
    covered = torch.zeros(lse0.shape, dtype=torch.bool)
    for c in p.chunks:
        dilated_view(covered, p.local_segment, p.dilation, c.offset, c.h0, c.h1).fill_(True)
    assert torch.equal(got_o.cpu()[~covered], out0[~covered]), f"{what} merged out: uncovered rows changed"


def check_pattern_local(kern, mode, heads, kv_heads, layout, causal, dtype, seed, dim, n, segs=None, rates=None,
                        subset=None):
    """Local plans (packed=False): compact forward, in-place backward accumulation, untouched heads."""
    b = 2 if not CUDA else 1
    plans = plans_for(mode, heads, kv_heads, n, n, segs, rates)
    q = rand((b, n, heads, dim), dtype, layout)
    k = rand((b, n, kv_heads, dim), dtype, layout)
    v = rand((b, n, kv_heads, dim), dtype, layout)
    scale = dim**-0.5
    fin_o, fin_l = final_out_lse(q, k, v, plans, causal, scale)
    out_low = fin_o.to(DEVICE, dtype)
    lse_dev = fin_l.to(DEVICE)
    dout = rand((b, n, heads, dim), dtype, layout)
    for p in plans if subset is None else subset(plans):
        what = f"plan {p.index} (w={p.segment}, r={p.dilation})"
        check_pattern_forward(kern, q, k, v, p, False, causal, scale, seed, what)
        # backward adds into fp32 accumulators that already hold random values
        init, acc, acc64, acclo = backward_pattern_all(kern, q, k, v, p, out_low, lse_dev, dout, False, causal, scale)
        read = [torch.zeros(x.shape, dtype=torch.bool) for x in (q, k, v)]
        for c in p.chunks:
            chunk_views(read[0], p, c).fill_(True)
            chunk_views(read[1], p, c, kv=True).fill_(True)
            chunk_views(read[2], p, c, kv=True).fill_(True)
        for name, got, want, low, x0, touched in zip(("dq", "dk", "dv"), acc, acc64, acclo, init, read):
            judge(f"{what} {name}", got, want, low, seed)
            # rows/heads the plan does not read must be bit-for-bit untouched
            assert torch.equal(got.cpu()[~touched], x0.cpu()[~touched]), f"{what} {name}: untouched entries changed"
        if mode == "grouped":
            covered = {h for c in p.chunks for h in range(c.h0, c.h1)}
            other = [h for h in range(heads) if h not in covered]
            assert torch.equal(acc[0][:, :, other], init[0][:, :, other]), f"{what}: dq of heads {other} touched"
        if kern.parts("bwd", p, q, k, causal=causal, masked=False):
            check_pattern_parts(kern, q, k, v, p, out_low, lse_dev, dout, causal, scale, seed, what)


def check_pattern_parts(kern, q, k, v, p, out, lse, dout, causal, scale, seed, what):
    """``backward_pattern_parts``: compact gradients in the inputs' dtype, placed in full layout (the slots a
    combine reads; ``merge.sum_grads``), against the fp64 oracle's and the plain-torch ones placed alike."""
    def placed(kernel, *xs):
        grads = kernel.backward_pattern_parts(*xs[:3], p, CallSpec(causal, scale), xs[3:])
        for g, x in zip(grads, xs[:3]):
            assert g.dtype == x.dtype and g.shape == (x.shape[0], x.shape[1] // p.dilation, *x.shape[2:]), what
        return [sum_grads(None, [Part(p, g, kv=kv)], x) for g, x, kv in zip(grads, xs[:3], (False, True, True))]

    xs = (q, k, v, out, lse, dout)
    got, want = placed(kern, *xs), placed(REF_P, *(d64(x) for x in xs))
    lows = list(zip(*(placed(kk, *xs) for kk in (REF_P, LOWP_P))))
    for name, g, w, low in zip(("dq", "dk", "dv"), got, want, lows):
        judge(f"{what} {name} (part)", g, w, low, seed)


def check_packed_ring_block(kern, mode, heads, kv_heads, causal, dtype, seed, dim=PAT_DIM, n=PAT_N):
    """Ring steps: k/v are halves of a packed buffer (causal only for the own block)."""
    b = 1
    local = n // 2
    plans = [p for p in plans_for(mode, heads, kv_heads, local, n) if p.ring_size > 1]
    assert plans, "no spanning pattern in this setup"
    q = rand((b, local, heads, dim), dtype, "transposed")
    k = rand((b, local, kv_heads, dim), dtype)
    v = rand((b, local, kv_heads, dim), dtype)
    scale = dim**-0.5
    for p in plans:
        buf = pack_kv(k, v, p)
        kp, vp = buf[0], buf[1]
        what = f"ring plan {p.index} (w={p.segment}, r={p.dilation})"
        o, s = check_pattern_forward(kern, q, kp, vp, p, True, causal, scale, seed, what)
        # final out/lse: this block merged with an arbitrary other partial (lse shifted up)
        out_full = torch.randn(b, local, heads, dim, device=DEVICE, dtype=dtype)
        lse_full = torch.full((b, local, heads), float("-inf"), device=DEVICE)
        for c in p.chunks:
            part = compact_view(s, p, c.h0, c.h1)
            dilated_view(lse_full, p.local_segment, p.dilation, c.offset, c.h0, c.h1).copy_(
                part + torch.rand(part.shape, device=DEVICE)
            )
        dout = torch.randn(b, local, heads, dim, device=DEVICE, dtype=dtype)
        init, acc, acc64, acclo = backward_pattern_all(kern, q, kp, vp, p, out_full, lse_full, dout, True, causal, scale)
        for name, got, want, low in zip(("dq", "dk", "dv"), acc, acc64, acclo):
            judge(f"{what} {name}", got, want, low, seed)
