#!/usr/bin/env python
"""Diagnostics: find in minutes what broke and where.

  python scripts/diagnose.py env                       # versions, devices, limits
  python scripts/diagnose.py views --device cuda       # strided views / packing vs explicit gather
  python scripts/diagnose.py kernels --device cuda --dtype bfloat16 [--isolate]
  torchrun --nproc_per_node=2 scripts/diagnose.py ring --backend deepspeed
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["env", "views", "kernels", "ring"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--isolate", action="store_true", help="each kernel in its own process (survives CUDA faults)")
    p.add_argument("--backend", default="collective", choices=["collective", "fairscale", "deepspeed"])
    a = p.parse_args()
    from dilated_attention import diagnostics as d

    dtype = getattr(torch, a.dtype)
    if a.what == "env":
        for k, v in d.env_report().items():
            print(f"{k:>22s}: {v}")
        return 0
    if a.what == "views":
        rows = d.check_views(a.device, dtype)
        for layout, ok, detail in rows:
            print(f"{layout:12s} {'ok' if ok else 'FAIL'}  {detail}")
        return 0 if all(ok for _, ok, _ in rows) else 1
    if a.what == "kernels":
        rows = d.check_kernels(a.device, dtype, seq_len=a.seq_len, head_dim=a.head_dim, isolate=a.isolate)
        for r in rows:
            verdict = {True: "ok", False: "FAIL", None: "skipped"}[r.get("ok")]
            detail = r.get("note") or "  ".join(f"{k} {r[k]}" for k in ("out", "dq", "dk", "dv") if k in r)
            print(f"{r['kernel']:11s} {verdict:8s} {detail}")
        return 0 if all(r.get("ok") is not False for r in rows) else 1
    import torch.distributed as dist

    cuda = a.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rows = d.check_ring(a.backend, torch.device("cuda", local) if cuda else torch.device("cpu"))
    for check, ok, detail in rows:
        print(f"[rank {dist.get_rank()}] {check:24s} {'ok' if ok else 'FAIL'}  {detail}", flush=True)
    bad = torch.tensor([sum(not ok for _, ok, _ in rows)], device="cuda" if cuda else "cpu")
    dist.all_reduce(bad)
    dist.destroy_process_group()
    return 1 if bad.item() else 0


if __name__ == "__main__":
    sys.exit(main())
