"""Probe: LongNet's ten cuDNN calls per direction (B=1, N=32768, H=16, D=128, bf16: one per pattern and call
group, with the library's batch and head counts, on contiguous tensors) one after another on one stream vs
spread over 2 and 4 side streams, where the tails of small calls overlap. torch's cuDNN ops.

    python benchmarks/probe_side_streams.py    # results/side_streams_probe_h200_session14.log
"""
import torch

from bench_kernel import timed

dev = torch.device("cuda")
M, D = 2048, 128
calls = [(16, 16)] + [(8, 8)] * 2 + [(4, 4)] * 4 + [(8, 2)] * 2 + [(16, 1)]
g = torch.Generator(device=dev).manual_seed(0)
ts = [[torch.randn(b, h, M, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4)] for b, h in calls]
op, bop = torch.ops.aten._scaled_dot_product_cudnn_attention, torch.ops.aten._scaled_dot_product_cudnn_attention_backward
def fwd(i, causal):
    q, k, v, _ = ts[i]
    return op(q, k, v, None, True, 0.0, causal, False, scale=D ** -0.5)
outs = {c: [fwd(i, c) for i in range(len(calls))] for c in (False, True)}
def bwd(i, causal):
    q, k, v, do = ts[i]
    o, lse = outs[causal][i][:2]
    e = torch.empty(0, device=dev)
    return bop(do, q, k, v, o, lse, e, e, None, None, None, M, M, 0.0, causal, scale=D ** -0.5)
streams = [torch.cuda.Stream() for _ in range(4)]
def run(fn, causal, nstreams):
    main = torch.cuda.current_stream()
    if nstreams == 1:
        for i in range(len(calls)): fn(i, causal)
        return
    start = torch.cuda.Event(); start.record(main)
    ends = []
    order = [0] + list(range(1, len(calls)))
    for j, i in enumerate(order):
        s = streams[j % nstreams]
        s.wait_event(start)
        with torch.cuda.stream(s):
            fn(i, causal)
        e = torch.cuda.Event(); e.record(s); ends.append(e)
    for e in ends: main.wait_event(e)
def wall(f):
    return timed(f, 5, 30)


for causal in (False, True):
    for name, fn in (("fwd", fwd), ("bwd", bwd)):
        res = {n: wall(lambda: run(fn, causal, n)) for n in (1, 2, 4)}
        big = wall(lambda: fn(0, causal))
        print(f"causal={causal} {name}: 1 stream {res[1]:.3f} ms, 2 streams {res[2]:.3f}, 4 streams {res[4]:.3f}; "
              f"first call alone {big:.3f} (16/31 of the work: ideal total {big * 31 / 16:.3f})", flush=True)
