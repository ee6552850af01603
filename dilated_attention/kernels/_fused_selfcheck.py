"""The fused kernel through the whole library on a gloo ring (used by tests/test_fused.py).

``ring_worker`` runs on each spawned rank: ``dilated_attention(..., comm="collective",
kernel="fused")`` against the same call with ``kernel="reference"`` on this rank's
shard, forward and backward (an autograd ``.sum()`` too, whose gradient reaches
the kernel as an expanded zero-stride tensor). Without CUDA the fused kernel runs
in Triton's interpreter, so the environment variable is set before any launch.
"""

from __future__ import annotations

import json
import os


def _cases():
    # (mode, causal, heads, kv_heads, layout, dtype)
    return [
        ("longnet", True, 4, 2, "transposed", "float32"),
        ("longnet", False, 6, 2, "contiguous", "float32"),
        ("grouped", True, 4, 4, "contiguous", "float16"),
    ]


def ring_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from dilated_attention import dilated_attention
    from dilated_attention.testing.harness import init_local_rank

    torch.set_num_threads(1)
    init_local_rank(rank, world_size, port)
    results = []
    try:
        local, dim, batch = 32, 32, 1
        n = local * world_size
        segs, rates = (8, 16, n), (1, 2, 4)
        for mode, causal, heads, kv_heads, layout, dtype_name in _cases():
            dtype = getattr(torch, dtype_name)
            g = torch.Generator().manual_seed(1000 + len(results))
            full = [torch.randn(batch, n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
            dout = torch.randn(batch, n, heads, dim, generator=g)
            rows = slice(rank * local, (rank + 1) * local)
            got = {}
            for kern in ("fused", "reference"):
                xs = []
                for t in full:
                    x = t[:, rows].to(dtype)
                    if layout == "transposed":
                        x = x.transpose(1, 2).contiguous().transpose(1, 2)
                    xs.append(x.requires_grad_())
                out = dilated_attention(*xs, segs, rates, mode=mode, causal=causal, comm="collective", kernel=kern)
                grads = torch.autograd.grad(out, xs, dout[:, rows].to(dtype))
                out2 = dilated_attention(*xs, segs, rates, mode=mode, causal=causal, comm="collective", kernel=kern)
                gsum = torch.autograd.grad(out2.float().sum(), xs)
                got[kern] = [t.detach().float() for t in (out, *grads, *gsum)]
            errs = [((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(got["fused"], got["reference"])]
            finite = all(torch.isfinite(t).all().item() for t in got["fused"])
            results.append({"case": f"{mode}-causal{causal}-H{heads}-{kv_heads}-{layout}-{dtype_name}",
                            "rank": rank, "errors": errs, "finite": finite})
    finally:
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
