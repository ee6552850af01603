"""Same-run A/B of the fresh first pattern (``ring._fresh_first``): on, and forced off (zero-filled running
result and accumulators, merged/added into), through the API, forward+backward and forward; GPU only.

    python benchmarks/ab_fresh_first_pattern.py     # log: benchmarks/results/fresh_first_pattern_ab_h200.log
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import bench_kernel as bk
import dilated_attention.ring as ring
from dilated_attention import dilated_attention
from dilated_attention.kernels.fused import FusedKernel

if not torch.cuda.is_available():
    raise SystemExit("this A/B needs a CUDA GPU")
torch.backends.cuda.matmul.allow_tf32 = False
n, h, d = 32768, 16, 128
segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
torch.manual_seed(0)
q, k, v, g = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
kern = FusedKernel()
real = ring._fresh_first
res = {}
for causal in (False, True):
    def api():
        o = dilated_attention(*leaves, segs, rates, causal=causal, kernel=kern)
        torch.autograd.grad(o, leaves, g)
    def fwd():
        with torch.no_grad():
            dilated_attention(*leaves, segs, rates, causal=causal, kernel=kern)
    outs = {}
    for mode in ("on", "off"):
        ring._fresh_first = real if mode == "on" else (lambda *a: False)
        o = dilated_attention(*leaves, segs, rates, causal=causal, kernel=kern)
        outs[mode] = [o.float(), *torch.autograd.grad(o, leaves, g)]
    print(f"causal={causal}: on == off bitwise:", all(torch.equal(a, b) for a, b in zip(outs["on"], outs["off"])), flush=True)
    for rnd in range(3):  # alternate, to spread drift over both
        for mode in ("on", "off"):
            ring._fresh_first = real if mode == "on" else (lambda *a: False)
            res.setdefault((causal, mode, "api"), []).append(bk.timed(api, 2, 9))
            res.setdefault((causal, mode, "fwd"), []).append(bk.timed(fwd, 2, 9))
ring._fresh_first = real
for key, vals in sorted(res.items(), key=str):
    vals.sort()
    print(key, "median of rounds", round(vals[len(vals) // 2], 3), "all", [round(x, 3) for x in vals])
for causal in (False, True):
    for what in ("api", "fwd"):
        a = sorted(res[(causal, "on", what)])[1]; b = sorted(res[(causal, "off", what)])[1]
        print(f"causal={causal} {what}: fresh {a:.3f} ms vs fill+merge {b:.3f} ms: {b / a:.3f}x")
