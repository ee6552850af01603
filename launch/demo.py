"""Multi-rank demo: LongNet-style ring-dilated attention on a sharded sequence.

Run under torchrun (launch/demo.sh does it): gloo on CPU ranks, NCCL on GPUs.
For each available backend, every rank runs forward+backward on its shard,
checks its rows of the output and gradients against the single-device result,
and rank 0 prints a table: max error, time per forward+backward, peak memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from dilated_attention import dilated_attention
from dilated_attention.comm import BACKEND_NAMES, get_backend
from dilated_attention.distributed import shard_sequence


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=None, help="global tokens (default 8192 CPU, 65536 per GPU)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--patterns", type=int, default=5, help="LongNet patterns w = N/2^k, r = 2^(m-1-k)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3, help="timed forward+backward iterations per backend")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKEND_NAMES)
    p.add_argument("--kernel", default="auto")
    return p.parse_args()


def available_backends() -> list[str]:
    mods = {"collective": None, "fairscale": "fairscale", "deepspeed": "deepspeed"}
    present = []
    for name, mod in mods.items():
        if mod is not None and importlib.util.find_spec(mod) is None:
            continue
        if importlib.util.find_spec(f"dilated_attention.comm.{name}") is None:
            continue
        present.append(name)
    return present


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: process peak RSS


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    n = args.seq_len or (65536 * world if use_cuda else 8192)
    m = args.patterns
    segs = [n // 2 ** (m - 1 - i) for i in range(m)]
    rates = [2**i for i in range(m)]
    kv_heads = args.kv_heads or args.heads
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"ring-dilated attention demo: {world} ranks ({'NCCL, ' + torch.cuda.get_device_name() if use_cuda else 'gloo, CPU'}), "
        f"{dtype}, B={args.batch} N={n} (local {n // world}) H={args.heads} Hkv={kv_heads} D={args.head_dim}, "
        f"causal={args.causal}\n  segment_lengths={segs}\n  dilation_rates={rates}", flush=True)

    gen = torch.Generator().manual_seed(0)  # same global inputs on every rank
    full = [torch.randn(args.batch, n, h, args.head_dim, generator=gen) for h in (args.heads, kv_heads, kv_heads)]
    dout = torch.randn(args.batch, n, args.heads, args.head_dim, generator=gen)
    call = dict(segment_lengths=segs, dilation_rates=rates, causal=args.causal, kernel=args.kernel)

    say("[1/2] single-device result (every rank, full sequence)...", flush=True)
    ref_in = [t.to(device, dtype).requires_grad_() for t in full]
    ref_out = dilated_attention(*ref_in, **call)
    ref = [t.float() for t in (ref_out, *torch.autograd.grad(ref_out, ref_in, dout.to(device, dtype)))]
    del ref_in, ref_out

    rows = []
    backends = args.backends or available_backends()
    for i, name in enumerate(backends):
        comm = get_backend(name)
        say(f"[2/2] backend {name} ({i + 1}/{len(backends)}): 1 warm-up + {args.iters} timed steps", flush=True)
        local = [shard_sequence(t, comm).to(device, dtype).requires_grad_() for t in full]
        local_dout = shard_sequence(dout, comm).to(device, dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for step in range(args.iters + 1):
            dist.barrier()
            start = time.perf_counter()
            out = dilated_attention(*local, comm=comm, **call)
            grads = torch.autograd.grad(out, local, local_dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:
                times.append(time.perf_counter() - start)
            say(f"    step {step}/{args.iters} {'(warm-up) ' if not step else ''}{1e3 * (time.perf_counter() - start):.0f} ms",
                flush=True)
        part = slice(rank * (n // world), (rank + 1) * (n // world))
        errs = [((g.float() - r[:, part]).abs().max() / r.abs().max()).item() for g, r in zip((out, *grads), ref)]
        stats = torch.tensor([max(errs[:1]), max(errs[1:]), statistics.median(times), peak_memory_mib(device)],
                             dtype=torch.float64, device=device if use_cuda else "cpu")
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        g = torch.stack(gathered).cpu()
        rows.append((name, g[:, 0].max().item(), g[:, 1].max().item(), 1e3 * g[:, 2].max().item(), g[:, 3].max().item()))

    if rank == 0:
        try:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=f"ring vs single device, {world} ranks, {dtype}")
            for col in ("backend", "max rel err out", "max rel err grads", "ms / fwd+bwd (median, slowest rank)",
                        "peak mem / rank (MiB)"):
                table.add_column(col, justify="right")
            for r in rows:
                table.add_row(r[0], f"{r[1]:.2e}", f"{r[2]:.2e}", f"{r[3]:.1f}", f"{r[4]:.0f}")
            Console().print(table)
        except ImportError:
            for r in rows:
                print(f"{r[0]:12s} err out {r[1]:.2e} grads {r[2]:.2e}  {r[3]:.1f} ms  {r[4]:.0f} MiB")
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        bad = [r[0] for r in rows if max(r[1], r[2]) > tol]
        print("peak mem: " + ("torch.cuda.max_memory_allocated" if use_cuda else "process peak RSS (includes torch)"))
        print("all backends match the single-device result" if not bad else f"MISMATCH for {bad}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
