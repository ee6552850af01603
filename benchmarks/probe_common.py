"""What the session-14 probes share: LongNet's benchmark inputs on one GPU (B=1, N=32768, H=16, D=128, bf16,
``w=[2048..32768]``, ``r=[1..16]``) and a host-issue timer; wall time is ``bench_kernel.timed``."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from bench_kernel import timed  # (the probes' wall timer; it puts this checkout first on sys.path)
from profile_pipeline import cpu_issue_ms
from dilated_attention.patterns import plan_patterns


def longnet_inputs(seed: int = 0) -> SimpleNamespace:
    """q, k, v, dout (and q, k, v as autograd leaves), the segments, rates and their plans, on ``cuda``."""
    dev = torch.device("cuda")
    bsz, n, heads, dim = 1, 32768, 16, 128
    segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, dout = (torch.randn(bsz, n, heads, dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    plans = tuple(plan_patterns(segs, rates, seq_len=n, local_len=n, num_heads=heads, num_kv_heads=heads))
    return SimpleNamespace(q=q, k=k, v=v, dout=dout, leaves=[x.detach().requires_grad_() for x in (q, k, v)],
                           segs=segs, rates=rates, plans=plans, scale=dim ** -0.5)


def host_ms(fn, reps: int = 15) -> float:
    """Median milliseconds of host time to issue ``fn`` with the GPU drained first, after one warm-up call."""
    fn()
    return cpu_issue_ms(fn, reps)


__all__ = ["host_ms", "longnet_inputs", "timed"]
