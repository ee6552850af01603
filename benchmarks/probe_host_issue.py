"""Host issue time and wall per LongNet step (B=1 N=32768 H=16 D=128 bf16) of the package on PYTHONPATH: one JSON
line per (kernel, causal) with the combine's, forward's and backward's host issue time (GPU drained first) and
the wall of the forward, the pipeline step, and the public API step (kernel object and name) and forward.
An A/B of two versions runs it alternately on each (results/host_ab_h200_session14.jsonl):

    for r in 1 2 3; do for v in old new; do PYTHONPATH=<$v checkout> python benchmarks/probe_host_issue.py $v; done; done
"""
import json, statistics, sys, time, torch
import dilated_attention
from dilated_attention import dilated_attention as attn
from dilated_attention.patterns import plan_patterns
from dilated_attention.ring import ring_forward, ring_backward, RingCall, RingLayout
from dilated_attention.kernels.dispatch import select_kernel
from dilated_attention.merge import combine_results
tag = sys.argv[1]
dev = torch.device("cuda")
B, N, H, D = 1, 32768, 16, 128
segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
g = torch.Generator(device=dev).manual_seed(0)
q, k, v, dout = (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
plans = tuple(plan_patterns(segs, rates, seq_len=N, local_len=N, num_heads=H, num_kv_heads=H))
def host(fn, reps=15):
    fn(); torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize(); return statistics.median(ts)
def wall(fn, reps=15):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for kernel in ("auto", "cudnn-det"):
    kern = select_kernel(kernel, q, k)
    for causal in (False, True):
        call = RingCall(plans, None, RingLayout(), 0, kern, causal, D ** -0.5)
        fwd = lambda: ring_forward(q, k, v, None, call)
        out, lse = fwd()
        from dilated_attention.merge import Part
        parts = [Part(p, *kern.forward_pattern(q, k, v, p, packed=False, causal=causal, scale=D ** -0.5)) for p in plans]
        def step():
            o, l = ring_forward(q, k, v, None, call); ring_backward(q, k, v, None, o, l, dout, call)
        def api():
            o = attn(*leaves, segs, rates, causal=causal, kernel=kern); torch.autograd.grad(o, leaves, dout)
        def api_str():
            o = attn(*leaves, segs, rates, causal=causal, kernel=kernel); torch.autograd.grad(o, leaves, dout)
        def api_fwd():
            with torch.no_grad():
                attn(q, k, v, segs, rates, causal=causal, kernel=kernel)
        row = dict(tag=tag, pkg=dilated_attention.__file__.split("/")[-3], kernel=kernel, causal=causal,
                   combine_host=host(lambda: combine_results(None, parts, q)), fwd_host=host(fwd), bwd_host=host(lambda: ring_backward(q, k, v, None, out, lse, dout, call)),
                   fwd_wall=wall(fwd), step_wall=wall(step), api_wall=wall(api),
                   api_str_wall=wall(api_str), api_fwd_host=host(api_fwd), api_fwd_wall=wall(api_fwd))
        print(json.dumps({k2: round(x, 3) if isinstance(x, float) else x for k2, x in row.items()}), flush=True)
