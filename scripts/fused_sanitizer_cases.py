"""A few small kernel launches for compute-sanitizer (memcheck / racecheck).

Covers: uneven block edges, GQA with misaligned chunks, causal and not, strided
(transposed, head-sliced) inputs, packed ring blocks, fp32 / bf16, head dims 40,
64, 96, 128, 256 (40 and 96 run padded tiles with masked columns), for the fused
kernel; and the zero-copy cuDNN pattern kernel on the same patterns (``--cudnn``,
or ``--only-cudnn``). Checks results loosely against the reference so a silent
no-op fails.

    compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/fused_sanitizer_cases.py [--cudnn]
"""

import argparse
import os
import sys

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _parser.add_argument("--cudnn", action="store_true", help="also the cuDNN pattern kernel")
    _parser.add_argument("--only-cudnn", action="store_true", help="only the cuDNN pattern kernel")
    ARGS = _parser.parse_args()  # --help before torch and the kernels load

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dilated_attention.kernels.cudnn import CudnnKernel  # noqa: E402
from dilated_attention.kernels.fused import FusedKernel  # noqa: E402
from dilated_attention.kernels.chunk_loop import ChunkLoop  # noqa: E402
from dilated_attention.kernels.protocol import CallSpec  # noqa: E402
from dilated_attention.kernels.reference import ReferenceKernel  # noqa: E402
from dilated_attention.patterns import plan_patterns  # noqa: E402
from dilated_attention.views import pack_kv  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: run with TRITON_INTERPRET=1
R = ReferenceKernel()
RP = ChunkLoop(R)
bad = []


def close(name, a, b, tol):
    err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
    print(f"{name}: rel err {err:.2e}", flush=True)
    if not err <= tol:
        bad.append(name)


def block_cases(F):
    for dim, dt, causal in ((64, torch.bfloat16, True), (128, torch.float32, False), (256, torch.bfloat16, False),
                            (40, torch.bfloat16, True), (96, torch.float32, False)):
        q = torch.randn(1, 2, 100, 8, dim, device=dev, dtype=dt)[:, :, :, 1:7]  # head-sliced, 6 heads
        k = torch.randn(1, 2, 100, 2, dim, device=dev, dtype=dt)
        v = torch.randn(1, 2, 2, 100, dim, device=dev, dtype=dt).transpose(2, 3)  # strided
        o, l = F.forward(q, k, v, causal=causal, scale=dim**-0.5)
        o2, l2 = R.forward(q, k, v, causal=causal, scale=dim**-0.5)
        close(f"block fwd D{dim} {dt} causal={causal}", o, o2, 2e-2)
        g = torch.randn_like(q)
        a = F.backward(q, k, v, o, l, g, causal=causal, scale=dim**-0.5)
        b = R.backward(q, k, v, o, l, g, causal=causal, scale=dim**-0.5)
        for n, x, y in zip("qkv", a, b):
            close(f"block d{n} D{dim} {dt} causal={causal}", x, y, 3e-2)


def pattern_cases(F, tag):
    for causal in (False, True):
        n, h, hk, d = 512, 6, 2, 64
        plans = plan_patterns([128, 256, 512], [1, 2, 4], seq_len=n, local_len=n, num_heads=h, num_kv_heads=hk)
        q = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, n, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, n, hk, d, device=dev, dtype=torch.bfloat16)
        for p in plans:
            o, s = F.forward_pattern(q, k, v, p, CallSpec(causal, 0.125))
            o2, s2 = RP.forward_pattern(q, k, v, p, CallSpec(causal, 0.125))
            close(f"{tag} pattern {p.index} fwd causal={causal}", o, o2, 2e-2)
            out = torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16)
            lse = torch.randn(1, n, h, device=dev) + 6.0
            g = torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16)
            acc = [torch.zeros(x.shape, device=dev) for x in (q, k, v)]
            acc2 = [torch.zeros(x.shape, device=dev) for x in (q, k, v)]
            F.backward_pattern(q, k, v, p, CallSpec(causal, 0.125), (out, lse, g), acc)
            RP.backward_pattern(q, k, v, p, CallSpec(causal, 0.125), (out, lse, g), acc2)
            for nme, x, y in zip("qkv", acc, acc2):
                close(f"{tag} pattern {p.index} d{nme} causal={causal}", x, y, 3e-2)
        # ring block: local 256 of 512, packed k/v
        plans = plan_patterns([512], [4], seq_len=n, local_len=256, num_heads=h, num_kv_heads=hk)
        p = plans[0]
        ql, kl, vl = q[:, :256], k[:, :256], v[:, :256]
        buf = pack_kv(kl, vl, p)
        o, s = F.forward_pattern(ql, buf[0], buf[1], p, CallSpec(causal, 0.125, packed=True))
        o2, s2 = RP.forward_pattern(ql, buf[0], buf[1], p, CallSpec(causal, 0.125, packed=True))
        close(f"{tag} ring fwd causal={causal}", o, o2, 2e-2)
        acc = [torch.zeros(x.shape, device=dev) for x in (ql, buf[0], buf[1])]
        acc2 = [torch.zeros(x.shape, device=dev) for x in (ql, buf[0], buf[1])]
        out = torch.randn(1, 256, h, d, device=dev, dtype=torch.bfloat16)
        lse = torch.randn(1, 256, h, device=dev) + 6.0
        g = torch.randn_like(out)
        F.backward_pattern(ql, buf[0], buf[1], p, CallSpec(causal, 0.125, packed=True), (out, lse, g), acc)
        RP.backward_pattern(ql, buf[0], buf[1], p, CallSpec(causal, 0.125, packed=True), (out, lse, g), acc2)
        for nme, x, y in zip("qkv", acc, acc2):
            close(f"{tag} ring d{nme} causal={causal}", x, y, 3e-2)


if __name__ == "__main__":
    torch.manual_seed(1234)
    if not ARGS.only_cudnn:
        block_cases(FusedKernel())
        pattern_cases(FusedKernel(), "fused")
    if ARGS.cudnn or ARGS.only_cudnn:
        pattern_cases(CudnnKernel(), "cudnn")

    if dev == "cuda":
        torch.cuda.synchronize()
    print("FAILED: " + ", ".join(bad) if bad else "all sanitizer cases match the reference")
    sys.exit(1 if bad else 0)
