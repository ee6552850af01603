"""Ring benchmark across communication backends (forward + backward of the sequence-parallel ring).

Every rank holds ``--local-len`` tokens (B=1, H=16, D=128, bf16 on GPU by default);
the default patterns ``[2048, 8192, 32768, 131072] / [1, 2, 4, 8]`` put the last
one across both ranks of a 2-GPU run (global N = 2 x 65536), so it rides the ring.
Each iteration times ``dilated_attention`` forward + backward once per backend
(backend order rotates each iteration), with CUDA events per rank; an
iteration's time is the slowest rank's. Reported: median ms per backend and the
ratio of fairscale's and deepspeed's medians to collective's (the backends move
the same bytes with the same primitives underneath, so the target is within 3%).

Files (``--out``): ``ring_<gpu>_x<K>.json`` (``ring_<gpu>_x<K>_causal.json`` with ``--causal``),
``<gpu>`` the model as ``gpu_tag.py`` names it (``h200``), and ``ring_<gpu>_x<K>.md``: one table of
every such JSON in the directory, causal and not.

    torchrun --nproc_per_node=2 benchmarks/bench_ring.py --out benchmarks/results          # GPUs, NCCL
    torchrun --nproc_per_node=2 benchmarks/bench_ring.py --smoke                           # CPU, gloo, tiny
    python benchmarks/bench_ring.py --render benchmarks/results/ring_h200_x2*.json         # the table again
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_types import int_list  # noqa: E402
from gpu_tag import gpu_tag  # noqa: E402

BACKENDS = ("collective", "fairscale", "deepspeed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", choices=BACKENDS, help="repeat; default: all three")
    p.add_argument("--local-len", type=int, default=65536, help="tokens per rank")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--segments", type=int_list, default=[2048, 8192, 32768, 131072])
    p.add_argument("--rates", type=int_list, default=[1, 2, 4, 8])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--kernel", default="sdpa", help="block kernel: sdpa (default), auto, fused, reference")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="directory for ring_<tag>.json and ring_<tag>.md")
    p.add_argument("--tag", default=None, help="file name tag (default: <gpu>_x<K>, then _causal with --causal)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized problem (overrides sizes)")
    p.add_argument("--render", nargs="+", metavar="JSON",
                   help="write the table of these result JSONs (named after the first, less _causal) and exit")
    args = p.parse_args(argv)
    if args.smoke:
        args.local_len, args.heads, args.head_dim = 128, 2, 16
        args.segments, args.rates, args.warmup, args.iters = [32, 256], [1, 2], 1, 3
        args.kernel = "auto"
    for name in ("local_len", "batch", "heads", "head_dim", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def _reports_in_order(reports: list[dict]) -> list[dict]:
    return sorted(reports, key=lambda r: (r["config"]["kernel"], r["config"]["causal"]))


def markdown(reports: list[dict]) -> str:
    """One table of the runs in ``reports`` (ring JSONs of one machine), causal and not."""
    reports = _reports_in_order(reports)
    r0, c0 = reports[0], reports[0]["config"]
    nccl = f", NCCL {r0['nccl']}" if r0.get("nccl") else ""
    lines = [f"ring fwd+bwd, {r0['device']} x{r0['world']}, torch {r0['torch']}{nccl}, "
             f"B={c0['batch']} N={c0['local_len']}x{r0['world']} H={c0['heads']} D={c0['head_dim']} {c0['dtype']} "
             f"segments={c0['segments']} rates={c0['rates']}; {c0['warmup']} warm-up + {c0['iters']} timed "
             "iterations per backend (order rotated), the slowest rank's time (CUDA events on GPUs), median", "",
             "| kernel | causal | backend | median ms | min ms | max ms | ratio vs collective |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in reports:
        for n, med in r["median_ms"].items():
            ratio = r["ratio_vs_collective"].get(n)
            lines.append(f"| {r['config']['kernel']} | {'yes' if r['config']['causal'] else 'no'} | {n} | {med:.3f} "
                         f"| {min(r['times_ms'][n]):.3f} | {max(r['times_ms'][n]):.3f} | "
                         + (f"{ratio:.4f}" if ratio is not None else "-") + " |")
    return "\n".join(lines) + "\n"


def md_path(json_path: str) -> str:
    """``ring_h200_x2_causal.json`` -> ``ring_h200_x2.md``: one table for the causal and non-causal runs."""
    return re.sub(r"_causal$", "", os.path.splitext(json_path)[0]) + ".md"


def render(paths: list[str]) -> str:
    paths = sorted({p for pat in paths for p in (glob.glob(pat) or [pat])})
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    out = md_path(paths[0])
    with open(out, "w") as f:
        f.write(markdown(reports))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        print(f"wrote {render(args.render)}")
        return 0
    import torch

    import torch.distributed as dist

    from dilated_attention.launch_utils import init_distributed, leave_process_group

    env = init_distributed("cpu" if args.smoke else "auto")  # before DeepSpeed is imported
    from dilated_attention import dilated_attention
    from dilated_attention.comm import get_backend

    rank, world, device = env.rank, env.world_size, env.device
    use_cuda = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if use_cuda else "fp32")]
    names = args.backend or list(BACKENDS)
    comms = {n: get_backend(n) for n in names}  # default groups: world / fairscale MP over world / DeepSpeed's

    g = torch.Generator(device=device).manual_seed(1234 + rank)
    shape = (args.batch, args.local_len, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=g, device=device, dtype=dtype)

    def step(comm):
        out = dilated_attention(q, k, v, args.segments, args.rates, causal=args.causal, comm=comm, kernel=args.kernel)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    def timed(comm) -> float:
        dist.barrier()
        if use_cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(comm)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            step(comm)
            ms = 1e3 * (time.perf_counter() - t0)
        slowest = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()

    for _ in range(args.warmup):
        for n in names:
            step(comms[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.iters):
        for j in range(len(names)):  # rotate the order: no backend always goes first
            n = names[(i + j) % len(names)]
            times[n].append(timed(comms[n]))

    if rank == 0:
        med = {n: statistics.median(t) for n, t in times.items()}
        base = med.get("collective")
        ratio = {n: (med[n] / base if base else None) for n in names}
        dev_name = torch.cuda.get_device_name(device) if use_cuda else platform.processor() or "cpu"
        report = {
            "device": dev_name, "world": world, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            "config": {"batch": args.batch, "local_len": args.local_len, "global_len": args.local_len * world,
                       "heads": args.heads, "head_dim": args.head_dim, "segments": args.segments,
                       "rates": args.rates, "causal": args.causal, "dtype": str(dtype), "kernel": args.kernel,
                       "warmup": args.warmup, "iters": args.iters},
            "command": " ".join(sys.argv),
            "median_ms": med, "ratio_vs_collective": ratio, "times_ms": times,
        }
        lines = [f"ring fwd+bwd, {dev_name} x{world}, torch {torch.__version__}, B={args.batch} "
                 f"N={args.local_len}x{world} H={args.heads} D={args.head_dim} {dtype} kernel={args.kernel} "
                 f"segments={args.segments} rates={args.rates} causal={args.causal}",
                 "", "| backend | median ms | min ms | max ms | ratio vs collective |", "|---|---:|---:|---:|---:|"]
        for n in names:
            r = f"{ratio[n]:.4f}" if ratio[n] is not None else "-"
            lines.append(f"| {n} | {med[n]:.3f} | {min(times[n]):.3f} | {max(times[n]):.3f} | {r} |")
        summary = "\n".join(lines)
        print(summary, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            tag = args.tag or f"{gpu_tag(dev_name) if use_cuda else 'cpu'}_x{world}" + ("_causal" if args.causal else "")
            path = os.path.join(args.out, f"ring_{tag}.json")
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
            # the table covers this run and its causal / non-causal sibling, when the directory has it
            base = re.sub(r"_causal$", "", os.path.splitext(path)[0])
            print(f"wrote {path} and {render([p for p in (base + '.json', base + '_causal.json') if os.path.exists(p)])}")
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
