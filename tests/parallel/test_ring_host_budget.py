"""The host's budget of a LongNet ring step on two ranks: how many torch operations the library dispatches around
its kernels, counted (never timed) on spawned gloo ranks, the fused kernel's and the merges' Triton kernels in
Triton's interpreter (each one launch, as on a GPU).

Eager ring steps on two GPUs are host-bound where the one-GPU step is not (docs/performance.md, "Two GPUs,
eager"): the ring's exchanges, the causal pattern's head swap and their packing dispatch ten times the operations
of a one-GPU step on the same kernel. A change that adds per-call work shows here as a higher count: each bound is
the count measured (the same on both ranks and in every run), so a single added operation fails the test. A bound
is lowered with the work, and raised only in a commit that says why the added host work is worth its time. The
counts include gloo's host-side stamp exchanges, which NCCL runs on the device.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention import merge, triton_support
from dilated_attention.testing.op_count import OpCount
from dilated_attention.testing.spawn import spawn_ranks

SEGMENTS, RATES = [16, 32, 128, 256], [1, 2, 4, 8]  # LongNet on 128 rows per rank: the last pattern spans both
# ops dispatched around the kernels per forward+backward on a rank (non-causal: a ring of two steps; causal: the
# spanning pattern swapped for heads, ``ring/swapped.py``; packed: causal documents, ``ring/documents.py``), as
# measured. A bound is the measurement: raised only in a commit that explains why.
BUDGET = {False: 159, True: 281, "packed": 673}  # packed: a ring call of one dealt document, one whole on each rank
DOCUMENTS = (0, 40, 100, 256)  # causal documents: two whole on a rank each, one dealt over both (128 rows a rank)

needs_triton = pytest.mark.skipif(merge.triton is None or not merge.interpreting(),
                                  reason="counts on CPU: needs Triton's interpreter (TRITON_INTERPRET=1, as without "
                                         "CUDA)")


def _count_step(rank: int, world: int) -> dict:
    from dilated_attention import dilated_attention
    from dilated_attention.kernels import fused
    from dilated_attention.testing.compare import assert_within_rule
    from dilated_attention.testing.oracle import dense_dilated_attention

    mode: list[OpCount | None] = [None]
    real = triton_support.launch

    def launch(*args, **kwargs):  # a Triton kernel: one launch, its interpreter's work outside the count
        if mode[0] is None:
            return real(*args, **kwargs)
        with mode[0].paused():
            return real(*args, **kwargs)

    for module in (triton_support, merge, fused):
        module.launch = launch
    rows = 128
    result = {}
    for case in (False, True, "packed"):
        causal = bool(case)
        g = torch.Generator().manual_seed(5801 + causal)  # the same global inputs on every rank
        q, k, v, dout = (torch.randn(1, rows * world, 4, 16, generator=g) for _ in range(4))
        mine = slice(rank * rows, (rank + 1) * rows)
        leaves = [x[:, mine].clone().requires_grad_() for x in (q, k, v)]
        docs = {"cu_seqlens": torch.tensor(DOCUMENTS, dtype=torch.int32)} if case == "packed" else {}
        kw = dict(causal=causal, kernel="fused", comm="collective", strategy="ring", **docs)
        # one call first: plans, tables and replays of this configuration made and cached (a second changes no count)
        dilated_attention(*leaves, SEGMENTS, RATES, **kw).backward(dout[:, mine])
        for x in leaves:
            x.grad = None
        with OpCount() as counted:
            mode[0] = counted
            out = dilated_attention(*leaves, SEGMENTS, RATES, **kw)
            out.backward(dout[:, mine])
        mode[0] = None
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        want = dense_dilated_attention(*ref, SEGMENTS, RATES, causal=causal, **docs)
        want.backward(dout.double())
        for name, got, exp in (("out", out, want), *zip(("dq", "dk", "dv"), (x.grad for x in leaves),
                                                         (x.grad for x in ref))):
            exp = exp[:, mine]
            assert_within_rule(name, got, exp, exp.float(), context=f"rank {rank}, causal={causal}")
        result[str(case)] = [counted.total(), counted.most(6)]
    return result


@needs_triton
def test_a_two_rank_longnet_ring_step_dispatches_no_more_operations_than_its_budget():
    for rank, counts in enumerate(spawn_ranks(_count_step, 2)):
        for case in (False, True, "packed"):
            total, most = counts[str(case)]
            assert 0 < total <= BUDGET[case], (
                f"rank {rank}: one LongNet ring forward+backward ({case=}) dispatched {total} operations "
                f"around its kernels, over its budget of {BUDGET[case]}; most: {most}")
