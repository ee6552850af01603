"""Diagnostics: find in minutes what broke and where.

  dilated-attention-diagnose env                       # versions, devices, limits
  dilated-attention-diagnose views --device cuda       # strided views / packing vs explicit gather
  dilated-attention-diagnose kernels --device cuda --dtype bfloat16 [--isolate]
  torchrun --nproc_per_node=2 -m dilated_attention.tools.diagnose ring --backend deepspeed
  torchrun --nproc_per_node=8 -m dilated_attention.tools.diagnose ring --distributed [--timeout 30]  # link health + bandwidth

ring --distributed, for each installed backend (or each --backend given): a ping on
every directed ring link of every ring size, the backend's ring exchange and
all-gather, each under a timeout (a hang is reported as "rank 5 -> rank 6 did not
complete within 30 s" and the check exits 1), then per-link bandwidth for ring
buffer sizes next to what nvidia-smi's topology says the link should give.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from .. import diagnostics as d
from ..comm import deepspeed as deepspeed_comm
from ..diagnostics import health
from ..launch_utils import (init_distributed, leave_process_group, positive_float, positive_int, positive_list,
                            say)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["env", "views", "kernels", "ring"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--isolate", action="store_true", help="each kernel in its own process (survives CUDA faults)")
    p.add_argument("--backend", action="append", choices=["collective", "fairscale", "deepspeed"],
                   help="repeatable (default: collective; with --distributed: every installed backend)")
    p.add_argument("--distributed", action="store_true", help="ring: link health check and bandwidth first")
    p.add_argument("--timeout", type=positive_float, default=30.0, help="ring --distributed: seconds any one wait may take")
    p.add_argument("--sizes-mb", type=positive_list(float), default=[1.0, 16.0, 64.0],
                   help="ring --distributed: buffer sizes for bandwidth (MiB, comma-separated)")
    p.add_argument("--iters", type=positive_int, default=5, help="ring --distributed: timed exchanges per size")
    p.add_argument("--simulate-dead-link", default=None, metavar="SRC,DST",
                   help="ring --distributed: SRC skips its ping to DST (to see what a dead link looks like)")
    a = p.parse_args(argv)
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
    return _ring(a)


def _ring(a) -> int:
    env = init_distributed("cuda" if a.device == "cuda" else "cpu", timeout=max(60.0, 4 * a.timeout))
    device, local, rank, world = env.device, env.local_rank, env.rank, env.world_size
    backends = a.backend or (health.installed_backends() if a.distributed else ["collective"])
    bad = 0
    if "deepspeed" in backends and device.type == "cpu":
        # DeepSpeed builds its CPU op on first use (minutes): here, before any wait runs against --timeout
        try:
            deepspeed_comm.prebuild_ops()
        except (ImportError, RuntimeError) as exc:
            say(f"FAIL: {exc}", rank, file=sys.stderr)
            leave_process_group(barrier=False)
            return 1
    if a.distributed:
        drop = set()
        if a.simulate_dead_link:
            src, dst = (int(x) for x in a.simulate_dead_link.split(","))
            drop.add((src, dst))
        sizes = [max(1, int(x * 2**20)) for x in a.sizes_mb]
        try:
            hosts = health.with_timeout(lambda: _gather_object(health.host_info(), world), a.timeout,
                                        "gathering host names from every rank", device)
            gpus = health.with_timeout(lambda: _gather_object(health.physical_gpu(local), world), a.timeout,
                                       "gathering GPU indices", device)
            for name in backends:
                rows = health.check_backend(name, device, timeout=a.timeout, sizes_bytes=sizes, iters=a.iters,
                                            drop_links=drop)
                lines = [r.text() for r in rows if r.gbps is None]
                if lines:
                    say("\n".join(lines), rank)
                bad += sum(not r.ok for r in rows)
                mine = [r for r in rows if r.gbps is not None]
                every = health.with_timeout(lambda: _gather_object(mine, world), a.timeout,
                                            f"gathering {name} bandwidth results", device)
                if rank == 0 and world > 1:
                    topo = health.topology_matrix() if device.type == "cuda" else None
                    print(f"== {name}: per-link bandwidth, all links at once "
                          f"({'topology from nvidia-smi topo -m' if topo else 'no nvidia-smi topology'})", flush=True)
                    for line in health.link_table(every, hosts, gpus, topo):
                        print("   " + line, flush=True)
        except (health.HealthTimeout, RuntimeError) as exc:
            # the process group cannot be trusted after a hang: say what we saw and leave now (a DeepSpeed op
            # build cut short removes its lock first: os._exit skips the build's own clean-up)
            say(f"FAIL: {exc}", rank, file=sys.stderr)
            deepspeed_comm.release_build_lock()
            os._exit(1)
    for name in backends:
        rows = d.check_ring(name, device)
        say("\n".join(f"{name:10s} {check:24s} {'ok' if ok else 'FAIL'}  {detail}" for check, ok, detail in rows),
            rank)
        bad += sum(not ok for _, ok, _ in rows)
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        print("healthy: every check passed on every rank" if flag.item() == 0 else f"{int(flag.item())} check(s) failed")
    leave_process_group(barrier=False)
    return 1 if flag.item() else 0


def _gather_object(obj, world: int) -> list:
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    sys.exit(main())
