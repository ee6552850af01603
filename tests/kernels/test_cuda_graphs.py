"""A forward+backward of ``dilated_attention`` captured into CUDA graphs, by hand or by
``torch.compile(mode="reduce-overhead")`` (GPUs only; CI has none).

A LongNet call of a few thousand rows per segment issues faster kernels than the host can launch them
one by one; a captured step replays without the host. Replays must give, bit for bit, what the eager
call gives on the same values, and on fresh values written into the captured inputs they must pass the
fp64 oracle's rule: nothing data-dependent may be baked into the graph.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import CUDA, d64, seeded
from dilated_attention import dilated_attention
from dilated_attention.kernels import flash4
from dilated_attention.testing.compare import assert_within_rule
from dilated_attention.testing.graphs import capture, eager_and_compiled, replay_problem
from dilated_attention.testing.oracle import dense_dilated_attention

pytestmark = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")

KERNELS = ["auto", "fused", "cudnn-det", "flash4"]
SEGS, RATES = [256, 512, 1024], [1, 2, 4]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_captured_step_replays_eager_bits_and_follows_new_inputs(kernel, causal):
    if kernel == "flash4" and flash4.unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(flash4.unavailable_reason(torch.device("cuda")))
    seed = seeded("cuda-graph", kernel, causal)
    shape, dtype = (1, 2048, 8, 128), torch.bfloat16
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        for x in leaves:
            x.grad = None
        out = dilated_attention(*leaves, SEGS, RATES, causal=causal, kernel=kernel)
        out.backward(dout)
        return out

    graph, out = capture(step)
    grads = [x.grad for x in leaves]
    for trial in range(2):  # fresh values in the captured inputs each time
        fresh = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4)]
        with torch.no_grad():
            for x, f in zip((*leaves, dout), fresh):
                x.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in (out, *grads)]
        eager = step()
        want = [eager.detach(), *(x.grad for x in leaves)]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(g, w), f"{kernel} causal={causal}: replayed {name} differs from eager (seed {seed})"
        _follow_oracle(got, fresh, causal, 1, f"({kernel}, causal={causal}, replay {trial}, seed {seed})")


def _follow_oracle(got: list[torch.Tensor], fresh: list[torch.Tensor], causal: bool, factor: float,
                   context: str) -> None:
    """``got`` (out, dq, dk, dv of ``factor`` times the call on ``fresh`` q, k, v, with ``fresh[3]`` as dout)
    within the flash-attention rule of the fp64 oracle."""
    base = [d64(f).requires_grad_() for f in fresh[:3]]
    ref = dense_dilated_attention(*base, SEGS, RATES, causal=causal) * factor
    ref.backward(d64(fresh[3]))
    low = [f.detach().requires_grad_() for f in fresh[:3]]
    plain = dense_dilated_attention(*low, SEGS, RATES, causal=causal) * factor
    plain.backward(fresh[3])
    for name, g, o, p in zip(("out", "dq", "dk", "dv"), got, (ref, *(x.grad for x in base)),
                             (plain, *(x.grad for x in low))):
        assert_within_rule(name, g, o.detach(), p.detach(), context=context)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["auto", "fused"])
def test_reduce_overhead_replays_the_call(kernel, causal):
    """Under ``torch.compile(mode="reduce-overhead")`` the cudagraph tree warms the op up, records it, then
    replays it without running it: each step, on fresh values, gives what the eager call gives, bit for bit, and
    follows the fp64 oracle."""
    seed = seeded("reduce-overhead", kernel, causal)
    shape, dtype = (1, 2048, 8, 128), torch.bfloat16

    def layer(q, k, v):
        return dilated_attention(q, k, v, SEGS, RATES, causal=causal, kernel=kernel) * 2

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, recording, replays
        fresh = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4)]
        eager, got, runs = eager_and_compiled(layer, compiled, *fresh)
        problem = replay_problem(step, runs)
        assert problem is None, problem
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, eager):
            assert torch.equal(g, w), f"{kernel} causal={causal}: compiled {name} differs from eager (step {step})"
        _follow_oracle(got, fresh, causal, 2, f"({kernel}, causal={causal}, step {step}, seed {seed})")
