"""Multi-rank demo: LongNet-style dilated attention on a sequence sharded across ranks.

Run under torchrun (launch/demo.sh does it): gloo on CPU ranks, NCCL on GPUs.
For each available backend, every rank runs forward+backward on its shard,
checks its rows of the output and gradients against the single-device result,
and rank 0 prints a table: max error, time per forward+backward, peak memory.
Rank 0 speaks for the job: other ranks print nothing (errors aside), and a bad
argument is one line on rank 0 (exit status 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time

from rank_zero import RankZeroParser, quiet_other_ranks, run_job

quiet_other_ranks()  # before torch / fairscale / DeepSpeed print or warn anything

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.comm import BACKEND_NAMES, get_backend  # noqa: E402
from dilated_attention.distributed import shard_sequence  # noqa: E402
from dilated_attention.validation import STRATEGIES  # noqa: E402
from dilated_attention.kernels.dispatch import KERNEL_NAMES  # noqa: E402
from dilated_attention.launch_utils import init_distributed  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Arguments, checked before any process group exists (``WORLD_SIZE`` comes from torchrun)."""
    p = RankZeroParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=None, help="global tokens (default 8192 CPU, 65536 per GPU)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--patterns", type=int, default=5, help="LongNet patterns w = N/2^k, r = 2^(m-1-k)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3, help="timed forward+backward iterations per backend")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKEND_NAMES)
    p.add_argument("--strategy", default="auto", choices=STRATEGIES, help="how the ranks share the work")
    p.add_argument("--kernel", default="auto", choices=KERNEL_NAMES)
    p.add_argument("--check-args", action="store_true",
                   help="only check the arguments for WORLD_SIZE ranks and exit (demo.sh does, before torchrun)")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 1
    args.seq_len = args.seq_len or (65536 * world if args.use_cuda else 8192)
    args.kv_heads = args.kv_heads or args.heads
    for name in ("seq_len", "heads", "kv_heads", "head_dim", "batch", "patterns", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be divisible by --kv-heads ({args.kv_heads})")
    if args.seq_len % world:
        p.error(f"--seq-len ({args.seq_len}) must be divisible by the number of ranks ({world})")
    m = args.patterns
    if args.seq_len % 2 ** (m - 1):
        p.error(f"--seq-len ({args.seq_len}) must be divisible by 2^(patterns - 1) = {2 ** (m - 1)} "
                f"(the segments are N / 2^k)")
    args.segments = [args.seq_len // 2 ** (m - 1 - i) for i in range(m)]
    args.rates = [2**i for i in range(m)]
    args.prog = p.prog
    missing = [name for name in args.backends or () if name not in available_backends()]
    if missing:  # one line, before any rank starts (demo.sh checks the arguments first)
        p.error(f"--backends {' '.join(missing)}: not installed; install the extra: "
                + " && ".join(f'pip install -c launch/constraints.txt ".[{name}]"' for name in missing))
    if args.check_args:
        sys.exit(0)
    return args


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = init_distributed("cuda" if args.use_cuda else "cpu")
    if not args.use_cuda:  # ranks on this host share its cores (torchrun's default is one thread each)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    return run_job(args.prog, env, lambda: run(args, env))


def run(args: argparse.Namespace, env) -> None:
    rank, world, device = env.rank, env.world_size, env.device
    use_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if use_cuda else torch.float32
    n, segs, rates = args.seq_len, args.segments, args.rates
    say = print  # other ranks' stdout is silenced by quiet_other_ranks
    say(f"dilated attention demo: {world} ranks ({'NCCL, ' + torch.cuda.get_device_name() if use_cuda else 'gloo, CPU'}), "
        f"{dtype}, B={args.batch} N={n} (local {n // world}) H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, "
        f"causal={args.causal}, strategy={args.strategy}\n  segment_lengths={segs}\n  dilation_rates={rates}",
        flush=True)

    gen = torch.Generator().manual_seed(0)  # same global inputs on every rank
    full = [torch.randn(args.batch, n, h, args.head_dim, generator=gen)
            for h in (args.heads, args.kv_heads, args.kv_heads)]
    dout = torch.randn(args.batch, n, args.heads, args.head_dim, generator=gen)
    call = dict(segment_lengths=segs, dilation_rates=rates, causal=args.causal, kernel=args.kernel)

    backends = args.backends or available_backends()
    steps = 1 + len(backends)
    say(f"[1/{steps}] single-device result (every rank, full sequence)...", flush=True)
    ref_in = [t.to(device, dtype).requires_grad_() for t in full]
    ref_out = dilated_attention(*ref_in, **call)
    ref = [t.float() for t in (ref_out, *torch.autograd.grad(ref_out, ref_in, dout.to(device, dtype)))]
    del ref_in, ref_out

    rows = []
    for i, name in enumerate(backends):
        comm = get_backend(name)
        say(f"[{i + 2}/{steps}] backend {name}: 1 warm-up + {args.iters} timed steps", flush=True)
        local = [shard_sequence(t, comm).to(device, dtype).requires_grad_() for t in full]
        local_dout = shard_sequence(dout, comm).to(device, dtype)
        if use_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for step in range(args.iters + 1):
            dist.barrier()
            start = time.perf_counter()
            out = dilated_attention(*local, comm=comm, strategy=args.strategy, **call)
            grads = torch.autograd.grad(out, local, local_dout)
            if use_cuda:
                torch.cuda.synchronize(device)
            if step:
                times.append(time.perf_counter() - start)
            say(f"    step {step}/{args.iters} {'(warm-up) ' if not step else ''}"
                f"{1e3 * (time.perf_counter() - start):.0f} ms", flush=True)
        part = slice(rank * (n // world), (rank + 1) * (n // world))
        errs = [((g.float() - r[:, part]).abs().max() / r.abs().max()).item() for g, r in zip((out, *grads), ref)]
        stats = torch.tensor([max(errs[:1]), max(errs[1:]), statistics.median(times), peak_memory_mib(device)],
                             dtype=torch.float64, device=device)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        g = torch.stack(gathered).cpu()
        rows.append((name, g[:, 0].max().item(), g[:, 1].max().item(), 1e3 * g[:, 2].max().item(), g[:, 3].max().item()))

    if rank == 0:
        print_table(rows, world, dtype, args.strategy, use_cuda)


def print_table(rows: list[tuple], world: int, dtype: torch.dtype, strategy: str, use_cuda: bool) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"sequence parallel (strategy={strategy}) vs single device, {world} ranks, {dtype}")
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


if __name__ == "__main__":
    sys.exit(main())
