"""A/B in one process: ``ring.CAUSAL_PART_STREAMS`` 1 vs 2 on LongNet's causal step (``probe_common``):
``ring_forward``, ``ring_forward`` + ``ring_backward``, and the public API, rounds alternating, with peak memory
(results/side_streams_ab_h200_session14.jsonl).

    python benchmarks/probe_side_streams_ab.py
"""
import json

import torch

import dilated_attention.ring as ring
from dilated_attention import dilated_attention as attn
from dilated_attention.kernels.dispatch import select_kernel
from probe_common import longnet_inputs, timed

x = longnet_inputs()
q, k, v, dout = x.q, x.k, x.v, x.dout
for rnd in range(3):
    for kernel in ("auto", "cudnn-det", "fused"):
        call = ring.RingCall(x.plans, None, ring.RingLayout(), 0, select_kernel(kernel, q, k), True, x.scale)
        for streams in (1, 2):
            ring.CAUSAL_PART_STREAMS = streams

            def step():
                o, l = ring.ring_forward(q, k, v, None, call)
                ring.ring_backward(q, k, v, None, o, l, dout, call)

            def api():
                o = attn(*x.leaves, x.segs, x.rates, causal=True, kernel=kernel)
                torch.autograd.grad(o, x.leaves, dout)

            torch.cuda.reset_peak_memory_stats()
            row = dict(round=rnd, kernel=kernel, streams=streams,
                       fwd=timed(lambda: ring.ring_forward(q, k, v, None, call), 3, 15), step=timed(step, 3, 15),
                       api=timed(api, 3, 15), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            print(json.dumps({key: round(val, 3) if isinstance(val, float) else val for key, val in row.items()}),
                  flush=True)
