"""Long causal squares split into one causal call of their diagonal blocks and non-causal rectangles
(``ring/routes.py``, ``ring/square_split.py``, a kernel's ``causal_block``), forced on at small sizes (segments of
64 rows, blocks of 4), against the float64 oracle: forward and backward through the public API and the ring functions.

Kernels: ``flash4`` on the float64 stand-in ``FakeFA4`` (``test_flash4.py``; the real one where it runs), the
cuDNN view logic on ``MathOps`` (``test_cudnn.py``: ``cudnn-det``'s constructor route), and the reference
kernel given a ``causal_block``. Low precision is judged by the tolerance rule (``kernel_checks.py``).
Every case also counts the calls that reached the kernel, so a split that silently fell back fails.
"""

from __future__ import annotations

import pytest
import torch

# first: kernel_checks sets TRITON_INTERPRET on CPU, which must precede triton's import
from kernel_checks import DEVICE, check_api_against_oracle, seeded  # noqa: I001
from test_cudnn import MathOps
from test_flash4 import REAL, FakeFA4, _install

from dilated_attention import dilated_attention
from dilated_attention.kernels import KernelWrapper, flash4
from dilated_attention.kernels.chunk_loop import ChunkLoop
from dilated_attention.kernels.cudnn import CudnnKernel
from dilated_attention.kernels.flash4 import CAUSAL_BLOCK, Flash4Kernel
from dilated_attention.kernels.reference import ReferenceKernel
from dilated_attention.patterns import plan_patterns
from dilated_attention.ring.block import block_backward, block_forward
from dilated_attention.ring.layout import RingLayout
from dilated_attention.ring.routes import TUNING, RingCall, plan_ring, split_pieces
from dilated_attention.testing.compare import as_layout, assert_within_rule
from dilated_attention.testing.oracle import dense_dilated_attention

N, DIM, BLOCK = 64, 16, 4


class Recorder(KernelWrapper):
    """Passes every call on to ``inner`` and records ``(op, plan's segment rows, causal, packed, q rows)``."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls: list[tuple] = []

    def call(self, op, args, kwargs):
        self.calls.append((op, args[3].local_segment, args[4].causal, args[4].packed, args[0].shape[1]))
        return super().call(op, args, kwargs)

    def counts(self, *ops: str) -> dict[tuple[int, bool], int]:
        """Calls of any of ``ops`` per (segment rows of the plan, causal)."""
        out: dict[tuple[int, bool], int] = {}
        for o, seg, causal, _, _ in self.calls:
            if o in ops:
                out[(seg, causal)] = out.get((seg, causal), 0) + 1
        return out


def expected(segs, rates, block, batch=1) -> dict[tuple[int, bool], int]:
    """The calls a causal pattern set splits into, per (segment rows, causal), written out independently of
    ``split_pieces``: a square of ``M <= TUNING.whole_blocks * block`` dilated rows whole; else blocks of
    ``b = M / 2^j`` dilated rows (the least ``j`` with ``b <= block``), one causal call of the diagonal, then one
    rectangle of ``t / 2`` rows for each span ``t = M, M/2, ..., 2b``. ``batch``: batch rows whose spans do not
    fold into one batch dim (one call per row where a piece has several spans)."""
    out: dict[tuple[int, bool], int] = {}
    for w, r in zip(segs, rates):
        m = w // r
        if m <= TUNING.whole_blocks * block:
            out[(w, True)] = out.get((w, True), 0) + 1
            continue
        b = m
        while b > block:
            b //= 2
        spans = [(b, True)] + [(t, False) for t in (m >> j for j in range(64)) if t >= 2 * b]
        for t, causal in spans:
            key = (t * r if causal else t * r // 2, causal)
            out[key] = out.get(key, 0) + (batch if N // (t * r) > 1 else 1)
    return out


# ---------------------------------------------------------------------------
# The decomposition and its rule


@pytest.mark.parametrize("m,block,r", [(64, 8, 1), (64, 8, 2), (32, 4, 4), (48, 8, 1), (40, 8, 2), (16, 2, 1),
                                       (64, 15, 1)])
def test_pieces_cover_the_causal_square_once(m, block, r):
    """Every (query, key) pair with key <= query in exactly one piece, no other pair in any; every causal
    piece at most ``block`` rows; one causal call and one rectangle per halving level."""
    (plan,) = plan_patterns([m * r], [r], seq_len=m * r, local_len=m * r, num_heads=r, num_kv_heads=r)
    pieces = split_pieces(plan, block)
    seen = torch.zeros(m, m, dtype=torch.int64)
    for p in pieces:
        assert p.plan.local_segment % r == 0 and p.plan.dilation == r
        if p.rectangle:
            t = p.span
            assert p.plan.local_segment == t // 2 * r
            for s in range(m // t):
                seen[s * t + t // 2:(s + 1) * t, s * t:s * t + t // 2] += 1
        else:
            b = p.span
            assert p.plan.local_segment == b * r and b <= block
            for s in range(m // b):
                seen[s * b:(s + 1) * b, s * b:(s + 1) * b] += torch.ones(b, b, dtype=torch.int64).tril()
    assert torch.equal(seen, torch.ones(m, m, dtype=torch.int64).tril())
    assert sum(not p.rectangle for p in pieces) == 1
    assert len(pieces) == 1 + (m // pieces[0].span).bit_length() - 1


@pytest.mark.parametrize("m,block", [(64, 64), (64, 100), (64, 0), (64, 16), (32, 8), (36, 8), (7, 2)])
def test_no_split_where_the_rule_says_so(m, block):
    """A square of at most four blocks (``Tuning.whole_blocks``), a block of 0, or rows that do not halve down to the
    block: one call."""
    assert TUNING.whole_blocks == 4
    (plan,) = plan_patterns([m], [1], seq_len=m, local_len=m, num_heads=2, num_kv_heads=2)
    assert split_pieces(plan, block) == ()


def test_causal_block_is_validated_and_chosen_per_instance():
    assert Flash4Kernel().causal_block == CAUSAL_BLOCK > 0
    assert Flash4Kernel(causal_block=512).causal_block == 512 and Flash4Kernel(causal_block=0).causal_block == 0
    assert CudnnKernel(MathOps()).causal_block == 0 and CudnnKernel(MathOps(), causal_block=64).causal_block == 64
    with pytest.raises(ValueError, match="causal_block must be >= 0"):
        Flash4Kernel(causal_block=-1)
    with pytest.raises(TypeError, match="causal_block must be an int"):
        CudnnKernel(MathOps(), causal_block=8.0)


# ---------------------------------------------------------------------------
# Through the public API


@pytest.fixture
def fa4(monkeypatch):
    """The fake FA4 installed (``None`` where the real one runs)."""
    flash4._api.cache_clear()
    if REAL:
        yield None
    else:
        fake = FakeFA4()
        _install(monkeypatch, fake)
        yield fake
    flash4._api.cache_clear()


def _kernel(name: str, block: int):
    if name == "flash4":
        return Flash4Kernel(causal_block=block)
    if name == "cudnn-view":
        return CudnnKernel(MathOps(), causal_block=block)
    kernel = ChunkLoop(ReferenceKernel())
    kernel.causal_block = block  # any kernel (or wrapper) may carry one
    return kernel


API_CASES = [
    # name, segments, rates, heads, kv heads, layout
    ("full", [N], [1], 4, 4, "contiguous"),
    ("longnet", [N // 2, N], [1, 2], 8, 8, "contiguous"),
    ("longnet-gqa", [N // 2, N], [1, 2], 8, 2, "contiguous"),
    ("head-slice", [N // 4, N // 2, N], [1, 1, 2], 4, 2, "head_slice"),  # the first stays whole: four blocks
    ("transposed", [N], [1], 4, 2, "transposed"),  # batch rows do not fold: one call per row
]


@pytest.mark.parametrize("kernel", ["flash4", "cudnn-view", "reference"])
@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c[0])
def test_public_api_matches_oracle(fa4, kernel, case):
    """``dilated_attention(..., causal=True)`` with the split forced on: out, dq, dk, dv against the float64 dense
    oracle by the tolerance rule (plain torch in bf16), and the calls that reached the kernel are the split's."""
    name, segs, rates, heads, kv_heads, layout = case
    bsz, dtype = 2, torch.bfloat16
    seed = seeded("causal-split-api", kernel, case)
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(bsz, N, h, DIM, generator=g, dtype=torch.float64).to(DEVICE)
            for h in (heads, kv_heads, kv_heads)]
    dout = torch.randn(bsz, N, heads, DIM, generator=g, dtype=torch.float64).to(DEVICE)

    rec = Recorder(_kernel(kernel, BLOCK))
    check_api_against_oracle(base, dout, segs, rates, dtype, layout, f"{name} {kernel} (seed {seed})", kernel=rec,
                             causal=True)
    want = expected(segs, rates, BLOCK, bsz if layout == "transposed" else 1)
    assert rec.counts("forward_pattern", "forward_pattern_into") == want, rec.calls
    assert rec.counts("backward_pattern", "backward_pattern_parts") == want, rec.calls
    whole = {(w, True) for w, r in zip(segs, rates) if w // r <= TUNING.whole_blocks * BLOCK}
    assert set(rec.counts("forward_pattern", "backward_pattern_parts")) <= whole, "a split left parts"
    assert len(whole) < len(segs), "no pattern split"


@pytest.mark.skipif(REAL, reason="counts the stand-in's calls")
def test_flash4_calls_are_one_diagonal_and_one_rectangle_per_level(fa4):
    """Full causal attention over 64 rows, blocks of 8, batch 2: FA4 gets one causal call of the 16 diagonal blocks
    ``(2 * 8, 8, h, D)`` and non-causal rectangles ``(2, 32)``, ``(4, 16)``, ``(8, 8)``, forward and backward, every
    operand read in the caller's storage."""
    seeded("causal-split-fa4-calls")
    q, k, v, dout = (torch.randn(2, N, 4, DIM, dtype=torch.bfloat16, requires_grad=i < 3) for i in range(4))
    dilated_attention(q, k, v, [N], [1], causal=True, kernel=Flash4Kernel(causal_block=8)).backward(dout)
    storages = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    for kind in ("fwd", "bwd"):
        calls = [c for c in fa4.calls if c["kind"] == kind]
        got = sorted((c["causal"], c["shapes"][0][:2]) for c in calls)
        assert got == [(False, (2, 32)), (False, (4, 16)), (False, (8, 8)), (True, (16, 8))], got
        if kind == "fwd":
            assert all(set(c["storages"]) <= storages for c in calls), "an input was copied"


@pytest.mark.parametrize("kernel", ["flash4", "reference"])
def test_causal_block_zero_does_not_split(fa4, kernel):
    """``causal_block=0``: one causal call per pattern and direction, as before the split existed; the same
    kernel with a block splits."""
    seeded("causal-split-off", kernel)
    x = [torch.randn(1, N, 4, DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(1, N, 4, DIM, device=DEVICE, dtype=torch.bfloat16)
    segs, rates = [N // 2, N], [1, 2]
    for block in (0, BLOCK):
        rec = Recorder(_kernel(kernel, block))
        dilated_attention(*x, segs, rates, causal=True, kernel=rec).backward(dout)
        for ops in (("forward_pattern", "forward_pattern_into"), ("backward_pattern", "backward_pattern_parts")):
            calls = rec.counts(*ops)
            want = {(N // 2, True): 1, (N, True): 1} if block == 0 else expected(segs, rates, BLOCK)
            assert calls == want, rec.calls


def test_no_split_when_not_causal_or_masked():
    """Non-causal calls and masked calls (a key mask's slices stay whole) run as one call per pattern."""
    seeded("causal-split-none")
    x = [torch.randn(1, N, 4, DIM, dtype=torch.float64) for _ in range(3)]
    rec = Recorder(_kernel("reference", BLOCK))
    dilated_attention(*x, [N], [1], causal=False, kernel=rec)
    assert {c[1:3] for c in rec.calls} == {(N, False)}
    rec.calls.clear()
    mask = torch.zeros(1, N, dtype=torch.bool)
    mask[:, -5:] = True
    dilated_attention(*x, [N], [1], causal=True, kernel=rec, key_padding_mask=mask)
    assert {c[1:3] for c in rec.calls} == {(N, True)}


# ---------------------------------------------------------------------------
# A ring's own block


class _OneRank:
    """The comm of a one-rank zigzag ring (rank 0 holds chunks 0 and 1: the middle segment, held whole)."""

    rank, world_size = 0, 1

    @staticmethod
    def ring_peers(ranks):
        return 0, ranks[0], ranks[0]

    @staticmethod
    def stamp(call, direction):
        return None


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("kernel,dtype,bsz,layout", [("reference", torch.float64, 2, "transposed"),
                                                     ("flash4", torch.bfloat16, 1, "head_slice"),
                                                     ("cudnn-view", torch.bfloat16, 2, "contiguous")])
def test_ring_own_block_splits(fa4, kernel, dtype, bsz, layout, r):
    """A ring's causal own-block call (packed K/V) split like a local square: ``block_forward``/``block_backward``
    on a one-rank zigzag ring (a segment of two chunks, ring size 2, one member) against the float64 oracle.
    At rate 2 the ring runs on compact rows (``routes.dense_view``: a dense square of ``N / 2`` rows, whose
    query-side copies fold into the batch dim in every layout); at rate 1 on the caller's rows."""
    heads, kv_heads = 4, 2
    seed = seeded("causal-split-ring", kernel, dtype, bsz, layout)
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(bsz, N, h, DIM, generator=g, dtype=torch.float64).to(DEVICE)
            for h in (heads, kv_heads, kv_heads)]
    dout = torch.randn(bsz, N, heads, DIM, generator=g, dtype=torch.float64).to(DEVICE)
    plans = plan_patterns([N // 4, N], [1, r], seq_len=N, local_len=N, num_heads=heads, num_kv_heads=kv_heads,
                          layout="zigzag")
    assert [p.ring_size for p in plans] == [1, 2]
    rec = Recorder(_kernel(kernel, BLOCK))
    q, k, v = (as_layout(x.to(dtype), layout) for x in base)
    one = _OneRank()
    plan = plan_ring(plans, rec, causal=True, scale=DIM**-0.5, comm=one, layout=RingLayout(zigzag=True))
    ring = RingCall(plan, one, 0)
    out, lse = block_forward(q, k, v, None, ring)
    grads = block_backward(q, k, v, None, (out, lse, dout.to(dtype)), ring)

    def dense(xs, do):
        xs = [x.detach().requires_grad_(True) for x in xs]
        o = dense_dilated_attention(*xs, [N // 4, N], [1, r], causal=True)
        o.backward(do)
        return [o.detach(), *(x.grad for x in xs)]

    oracle = dense(base, dout)
    plain = dense([x.to(dtype) for x in base], dout.to(dtype))
    for what, gt, w, p in zip(("out", "dq", "dk", "dv"), (out, *grads), oracle, plain):
        assert_within_rule(what, gt, w, p, context=f"ring {kernel} {layout} (seed {seed})")
    folds = r > 1 or layout != "transposed"  # packed K/V and compact copies fold; transposed queries do not
    want = expected([N // r], [1], BLOCK, 1 if folds else bsz)
    for op in ("forward_pattern_into", "backward_pattern"):
        got: dict[tuple[int, bool], int] = {}
        for o, seg, causal, packed, _ in rec.calls:
            if o == op and packed:
                got[(seg, causal)] = got.get((seg, causal), 0) + 1
        assert got == want, rec.calls
