"""GPU check of ``kernel="auto"`` through dispatch with the shipped table: full attention (one 32768-row
segment) takes cuDNN's forward, matches the fused kernel, and its forward + backward are bitwise
reproducible (the deterministic entries only). Needs a GPU the table lists (H200, H100).

    python scripts/check_auto_dispatch.py
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    import torch

    from dilated_attention import dilated_attention
    from dilated_attention.kernels import dispatch
    from dilated_attention.patterns import plan_patterns

    if not torch.cuda.is_available():
        raise SystemExit("check_auto_dispatch.py needs a CUDA GPU (one that kernels/auto_table.py lists)")
    torch.manual_seed(0)
    n, h, d = 32768, 16, 128
    q, k, v, g = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    kern = dispatch.select_kernel("auto", q, k)
    plan = plan_patterns([n], [1], seq_len=n, local_len=n, num_heads=h, num_kv_heads=h)[0]
    print(type(kern).__name__, "full-attention fwd ->", kern.pick("fwd", plan, False, q, k).name,
          "bwd ->", kern.pick("bwd", plan, False, q, k).name, "| deterministic_backward", kern.deterministic_backward)
    res = {}
    for name in ("auto", "auto", "fused"):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        for causal in (False, True):
            o = dilated_attention(*leaves, [n], [1], causal=causal, kernel=name)
            grads = torch.autograd.grad(o, leaves, g)
            res.setdefault((name, causal), []).append([o.float(), *[x.float() for x in grads]])
    for causal in (False, True):
        a, b = res[("auto", causal)]
        f = res[("fused", causal)][0]
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        rel = [((x - y).norm() / y.norm()).item() for x, y in zip(a, f)]
        print(f"causal={causal}: auto reproducible bitwise {same}; rel diff vs fused out/dq/dk/dv {[f'{r:.1e}' for r in rel]}")
        assert same and max(rel) < 2e-2
    print("auto check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
