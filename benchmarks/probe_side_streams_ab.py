"""A/B in one process: ring.CAUSAL_PART_STREAMS 1 vs 2, LongNet causal step (B=1 N=32768 H=16 D=128 bf16), ring_forward, ring_forward + ring_backward, and the public API; rounds alternate (results/side_streams_ab_h200_session14.jsonl)."""
import json, statistics, torch
import dilated_attention.ring as R
from dilated_attention import dilated_attention as attn
from dilated_attention.patterns import plan_patterns
from dilated_attention.kernels.dispatch import select_kernel
dev = torch.device("cuda")
B, N, H, D = 1, 32768, 16, 128
segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
g = torch.Generator(device=dev).manual_seed(0)
q, k, v, dout = (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
plans = tuple(plan_patterns(segs, rates, seq_len=N, local_len=N, num_heads=H, num_kv_heads=H))
def wall(fn, reps=15):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for rnd in range(3):
    for kernel in ("auto", "cudnn-det", "fused"):
        kern = select_kernel(kernel, q, k)
        call = R.RingCall(plans, None, R.RingLayout(), 0, kern, True, D ** -0.5)
        for streams in (1, 2):
            R.CAUSAL_PART_STREAMS = streams
            def step():
                o, l = R.ring_forward(q, k, v, None, call); R.ring_backward(q, k, v, None, o, l, dout, call)
            def api():
                o = attn(*leaves, segs, rates, causal=True, kernel=kernel); torch.autograd.grad(o, leaves, dout)
            torch.cuda.reset_peak_memory_stats()
            row = dict(round=rnd, kernel=kernel, streams=streams, fwd=wall(lambda: R.ring_forward(q, k, v, None, call)),
                       step=wall(step), api=wall(api), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            print(json.dumps({a: round(b, 3) if isinstance(b, float) else b for a, b in row.items()}), flush=True)
