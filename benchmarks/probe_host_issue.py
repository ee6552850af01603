"""Host issue time and wall per LongNet step (``probe_common.longnet_inputs``) of the package on PYTHONPATH: one
JSON line per (kernel, causal) with the combine's, forward's and backward's host issue time (GPU drained first)
and the wall of the forward, the pipeline step, and the public API step (kernel object and name) and forward.
An A/B of two versions runs it alternately on each (results/host_ab_h200_session14.jsonl):

    for r in 1 2 3; do for v in old new; do PYTHONPATH=<$v checkout> python benchmarks/probe_host_issue.py $v; done; done
"""
import json
import sys

import torch

import dilated_attention  # (first: probe_common's bench_kernel puts this checkout on sys.path)
from dilated_attention import dilated_attention as attn
from dilated_attention.kernels.dispatch import select_kernel
from dilated_attention.merge import Part, combine_results
from dilated_attention.ring import RingCall, RingLayout, ring_backward, ring_forward
from probe_common import host_ms, longnet_inputs, timed

tag = sys.argv[1]
x = longnet_inputs()
q, k, v, dout = x.q, x.k, x.v, x.dout


def wall(fn):
    return timed(fn, 3, 15)


for kernel in ("auto", "cudnn-det"):
    kern = select_kernel(kernel, q, k)
    for causal in (False, True):
        call = RingCall(x.plans, None, RingLayout(), 0, kern, causal, x.scale)
        out, lse = ring_forward(q, k, v, None, call)
        parts = [Part(p, *kern.forward_pattern(q, k, v, p, packed=False, causal=causal, scale=x.scale))
                 for p in x.plans]

        def step():
            o, l = ring_forward(q, k, v, None, call)
            ring_backward(q, k, v, None, o, l, dout, call)

        def api(name):
            o = attn(*x.leaves, x.segs, x.rates, causal=causal, kernel=name)
            torch.autograd.grad(o, x.leaves, dout)

        def api_fwd():
            with torch.no_grad():
                attn(q, k, v, x.segs, x.rates, causal=causal, kernel=kernel)

        row = dict(tag=tag, pkg=dilated_attention.__file__.split("/")[-3], kernel=kernel, causal=causal,
                   combine_host=host_ms(lambda: combine_results(None, parts, q)),
                   fwd_host=host_ms(lambda: ring_forward(q, k, v, None, call)),
                   bwd_host=host_ms(lambda: ring_backward(q, k, v, None, out, lse, dout, call)),
                   fwd_wall=wall(lambda: ring_forward(q, k, v, None, call)), step_wall=wall(step),
                   api_wall=wall(lambda: api(kern)), api_str_wall=wall(lambda: api(kernel)),
                   api_fwd_host=host_ms(api_fwd), api_fwd_wall=wall(api_fwd))
        print(json.dumps({key: round(val, 3) if isinstance(val, float) else val for key, val in row.items()}),
              flush=True)
