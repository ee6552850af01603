"""Masks and packed documents on one GPU: do they cost more than their unmasked work?

Forward+backward through ``dilated_attention`` (bf16, LongNet patterns, the public API),
each case next to the unmasked work it stands for, timed in the same run:

* ``key_padding_mask``: a ``(B, N)`` mask with a random 10% of keys padded, vs no mask.
* ``docs_equal``: ``D`` packed documents of equal length via ``cu_seqlens``, vs the same
  documents as a ``(D, n)`` batch (identical work: the ratio is the masking overhead).
* ``docs_varlen``: documents of random lengths via ``cu_seqlens`` (padded internally to
  lengths the segments tile), vs the same documents one call each (the unmasked work).
  Also reported: the packed call against the whole unmasked sequence (it does less work).

``--kernel auto,flash4,fused`` times every case with each kernel in the same run (records carry
``kernel``; a case a kernel refuses is recorded as skipped with its reason): ``flash4`` takes packed
documents and internal padding as per-call lengths, not a ``key_padding_mask``.

Writes ``benchmarks/results/masks_<gpu>.json`` (``{"meta", "records"}``, ``<gpu>`` the model as
``gpu_tag.py`` names it: ``h200``, ``h100``) and prints a table.

    python benchmarks/bench_masks.py [--seq 65536] [--kernel auto,flash4,fused] [--out benchmarks/results]
    python benchmarks/bench_masks.py --smoke      # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=65536, help="total tokens")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--segments", default="2048,4096,8192,16384")
    ap.add_argument("--rates", default="1,2,4,8")
    ap.add_argument("--docs", type=int, default=8, help="documents in the equal-length case")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kernel", default="auto", help="kernel(s), comma-separated, each timed in the same run")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--out", default=RESULTS)
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors before torch and the kernels load

if "--smoke" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernel import timed  # noqa: E402  (median of CUDA-event timings, one definition)
from gpu_tag import gpu_tag, package_versions  # noqa: E402

from dilated_attention import dilated_attention  # noqa: E402


def fwd_bwd(q, k, v, dout, segs, rates, **kw):
    """One timed unit: forward and backward through the public API."""
    def run():
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = dilated_attention(qs, ks, vs, segs, rates, **kw)
        torch.autograd.grad(out, (qs, ks, vs), dout)
    return run


def doc_lengths(total: int, quantum: int, rng: random.Random) -> list[int]:
    """Random document lengths summing to ``total`` (multiples of ``quantum``, a few not)."""
    lengths, left = [], total
    while left > 0:
        n = min(left, rng.choice([1, 2, 3, 4, 6, 8, 12, 16]) * quantum - rng.choice([0, 0, 0, 7]))
        lengths.append(max(n, 1))
        left -= lengths[-1]
    return lengths


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.seq, args.heads, args.dim, args.docs = 128, 1, 16, 2
        args.segments, args.rates, args.warmup, args.reps, args.kernel = "16,32", "1,2", 0, 1, "fused"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    segs, rates = [int(x) for x in args.segments.split(",")], [int(x) for x in args.rates.split(",")]
    n, h, d = args.seq, args.heads, args.dim
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    q, k, v, dout = (rnd(1, n, h, d) for _ in range(4))
    rng = random.Random(0)
    records = []
    kernels = args.kernel.split(",")

    def record(kernel, case, causal, ms, baseline_ms, baseline):
        """One case against its comparison; ``ms`` a refusal's message where the kernel takes no such input."""
        if isinstance(ms, str):
            records.append({"kernel": kernel, "case": case, "causal": causal, "skipped": ms})
            print(f"  {kernel:8s} {case:22s} causal={causal!s:5s} skipped: {ms[:120]}", flush=True)
            return
        rec = {"kernel": kernel, "case": case, "causal": causal, "ms": round(ms, 4), "baseline": baseline,
               "baseline_ms": round(baseline_ms, 4), "ratio": round(ms / baseline_ms, 4)}
        records.append(rec)
        print(f"  {kernel:8s} {case:22s} causal={causal!s:5s} {ms:9.3f} ms  vs {baseline:28s} {baseline_ms:9.3f} ms  "
              f"ratio {rec['ratio']:.3f}", flush=True)

    def t(fn):
        """Median ms, or the message of a kernel that refuses the input (``kernel="flash4"`` and a key mask)."""
        try:
            return timed(fn, args.warmup, args.reps, device)
        except ValueError as exc:
            return str(exc)

    for causal in (bool(int(c)) for c in args.causal.split(",")):
        mask = torch.rand(1, n, generator=gen, device=device) < 0.1
        per = n // args.docs
        # offsets on the host, as the Hugging Face integration passes them: on the GPU, reading them syncs
        equal = torch.arange(0, n + 1, per, dtype=torch.int32)
        batch = [x.reshape(args.docs, per, h, d) for x in (q, k, v, dout)]
        lengths = doc_lengths(n, segs[0], rng)
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        cu = torch.tensor(offsets, dtype=torch.int32)
        for kernel in kernels:  # the same inputs and documents for each kernel
            kw = dict(causal=causal, kernel=kernel)
            plain = t(fwd_bwd(q, k, v, dout, segs, rates, **kw))
            record(kernel, "key_padding_mask 10%", causal,
                   t(fwd_bwd(q, k, v, dout, segs, rates, key_padding_mask=mask, **kw)), plain, "no mask")
            record(kernel, "docs_equal", causal, t(fwd_bwd(q, k, v, dout, segs, rates, cu_seqlens=equal, **kw)),
                   t(fwd_bwd(*batch, segs, rates, **kw)), f"({args.docs}, {per}) batch")
            packed = t(fwd_bwd(q, k, v, dout, segs, rates, cu_seqlens=cu, **kw))
            alone = [fwd_bwd(*(x[:, a:b] for x in (q, k, v, dout)), segs, rates, **kw)
                     for a, b in zip(offsets, offsets[1:])]
            record(kernel, f"docs_varlen ({len(lengths)})", causal, packed, t(lambda: [f() for f in alone]),
                   "each document alone")
            record(kernel, f"docs_varlen ({len(lengths)})", causal, packed, plain, "whole sequence unmasked")
    meta = {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "python": platform.python_version(), "dtype": str(dtype).removeprefix("torch."), "tokens": n,
            "heads": h, "dim": d, "segment_lengths": segs, "dilation_rates": rates, "kernels": kernels,
            "packages": package_versions("nvidia-cudnn-frontend", "flash-attn-4"), "command": "python " + " ".join(sys.argv), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result = {"meta": meta, "records": records}
    os.makedirs(args.out, exist_ok=True)
    slug = "smoke" if args.smoke else gpu_tag(meta["gpu"])
    path = os.path.join(args.out, f"masks_{slug}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
