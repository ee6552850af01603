"""One launch of each fused kernel on the LongNet benchmark shape, for Nsight Compute.

    ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section LaunchStats -k regex:"fwd_kernel|dq_kernel|dkdv_kernel" \\
        python benchmarks/profile_fused.py [--causal] [--plan 0]

B=1, N=32768, H=16, D=128, bf16, LongNet w=2048..32768, r=1..16: ``--plan`` picks the pattern (0 is the
dense w=2048 one). A warm-up call compiles the kernels first, so each profiled launch is a steady one;
``ncu -c`` / ``--launch-skip`` select among the launches (warm-up first, then the profiled set).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--plan", type=int, default=0)
    ap.add_argument("--seq", type=int, default=32768)
    args = ap.parse_args()
    import torch

    from dilated_attention.kernels.fused import FusedKernel
    from dilated_attention.kernels.protocol import CallSpec
    from dilated_attention.patterns import plan_patterns

    assert torch.cuda.is_available(), "profiling needs a GPU"
    n, heads, dim = args.seq, 16, 128
    plan = plan_patterns([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16], seq_len=n, local_len=n,
                         num_heads=heads, num_kv_heads=heads)[args.plan]
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    kern, spec = FusedKernel(), CallSpec(args.causal, dim**-0.5)
    for _ in range(2):  # warm-up (compiles), then the launches to profile
        out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        lse = torch.full(q.shape[:3], float("-inf"), device="cuda")
        kern.forward_pattern_into(q, k, v, plan, spec, (out, lse))
        grads = [torch.zeros(x.shape, dtype=torch.float32, device="cuda") for x in (q, k, v)]
        kern.backward_pattern(q, k, v, plan, spec, (out.to(q.dtype), lse, dout), grads)
    torch.cuda.synchronize()
    print(f"profiled plan {plan.index} (w={plan.segment}, r={plan.dilation}) causal={args.causal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
