"""The one multi-rank battery every communication backend passes (DESIGN.md section 5).

Every case builds global inputs from a seed (identical on all ranks), computes
the float64 dense oracle, shards the sequence, runs the ring on the group's
ranks through each backend, and compares this rank's rows of the output and of
the q/k/v gradients. Backends must also agree bit for bit with each other.

Runs inside an initialised process group:

* CPU, under pytest: ``run_spawned(...)`` spawns gloo ranks once for all cases;
* GPUs: ``torchrun --nproc_per_node=K -m dilated_attention.testing.harness --backend collective``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..comm import get_backend
from ..functional import dilated_attention
from ..launch_utils import init_distributed
from .compare import as_layout, rel_err, tolerance
from .oracle import dense_dilated_attention
from .spawn import spawn_ranks

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str = "longnet"
    causal: bool = False
    heads: int = 4
    kv_heads: int = 4
    local_len: int = 16
    batch: int = 2
    dim: int = 8
    dtype: str = "float64"
    layout: str = "contiguous"  # any of testing.compare.LAYOUTS
    kernel: str = "auto"
    strategy: str = "ring"
    masked: bool = False  # a random key_padding_mask (about a quarter of the keys)
    docs: tuple[int, ...] | None = None  # cu_seqlens over the global sequence (batch 1)

    @property
    def seq_len(self) -> int:
        return self.world * self.local_len


@dataclass
class Result:
    case: str
    backend: str
    rank: int
    world: int
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    message: str = ""


def cases(world: int, device_type: str = "cpu") -> list[Case]:
    """The battery for one world size (global length ``world * 16``)."""
    n = 16 * world
    spanning = ((8, 16, n), (1, 2, 4))  # local, shard-sized, and (world > 1) spanning every rank
    out = []
    for mode in ("longnet", "grouped"):
        for causal in (False, True):
            tag = f"{mode}-{'causal' if causal else 'full'}"
            out.append(Case(f"P{world}-{tag}", world, *spanning, mode=mode, causal=causal))
            out.append(Case(f"P{world}-{tag}-gqa-transposed", world, *spanning, mode=mode, causal=causal,
                            heads=6, kv_heads=2, layout="transposed"))
    out.append(Case(f"P{world}-head-slice-mqa", world, *spanning, heads=3, kv_heads=1, layout="head_slice", causal=True))
    out.append(Case(f"P{world}-dilation-above-heads", world, (16, n), (1, 8), heads=4))
    if world % 2 == 0 and world > 2:
        out.append(Case(f"P{world}-disjoint-rings", world, (8, 32, n), (2, 2, 4), causal=True))
    if n > 16:
        out.append(Case(f"P{world}-segment-clamped", world, (4, 4 * n), (1, 4), causal=True))
    for layout in ("strided_head_dim", "permuted", "storage_offset", "zero_stride"):
        out.append(Case(f"P{world}-{layout}", world, *spanning, causal=layout != "permuted", layout=layout))
    # head-parallel (all-to-all) and hybrid (all-to-all in teams, ring across): 12 heads split over
    # 1-4 ranks; kv heads 4 (split at P=2/4, expanded at P=3) and 1 (one kv head per rank)
    heads = 12 if 12 % world == 0 else 8 * world
    strategies = ["head"] + (["hybrid"] if world >= 4 else [])
    for strategy in strategies:
        for mode in ("longnet", "grouped"):
            out.append(Case(f"P{world}-{strategy}-{mode}-causal-gqa", world, *spanning, mode=mode, causal=True,
                            heads=heads, kv_heads=4, layout="transposed", strategy=strategy))
        out.append(Case(f"P{world}-{strategy}-mqa", world, *spanning, heads=heads, kv_heads=1, strategy=strategy))
        out.append(Case(f"P{world}-{strategy}-bfloat16", world, *spanning, causal=True, heads=heads, kv_heads=4,
                        dtype="bfloat16", dim=16, strategy=strategy))
    low = ["float32", "bfloat16"] + (["float16"] if device_type == "cuda" else [])
    for dt in low:
        out.append(Case(f"P{world}-{dt}", world, *spanning, causal=True, heads=4, kv_heads=2, dtype=dt, dim=16))
    # grouped mode in low precision too: on GPUs this is the fused kernel inside the ring
    out.append(Case(f"P{world}-grouped-bfloat16", world, *spanning, mode="grouped", heads=6, kv_heads=3,
                    dtype="bfloat16", dim=32, layout="transposed"))
    # masks: a key padding mask on the ring (spanning patterns read the visiting block's mask
    # rows), packed documents spanning ranks and internal padding with the head strategy
    for causal in (False, True):
        out.append(Case(f"P{world}-ring-key-padding-{'causal' if causal else 'full'}", world, *spanning,
                        causal=causal, heads=4, kv_heads=2, masked=True, layout="transposed"))
        out.append(Case(f"P{world}-head-docs-{'causal' if causal else 'full'}", world, (4, 8, 16), (1, 2, 4),
                        causal=causal, heads=heads, kv_heads=4, batch=1, masked=causal, strategy="head",
                        docs=(0, 5, 5, n // 2 + 3, n)))
    out.append(Case(f"P{world}-head-padded", world, (8, 32), (1, 2), causal=True, heads=heads, kv_heads=4,
                    local_len=12, strategy="head"))
    out.append(Case(f"P{world}-masked-bfloat16", world, *spanning, causal=True, heads=4, kv_heads=2, dim=16,
                    dtype="bfloat16", masked=True))
    return out


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = 1 if case.layout == "zero_stride" else case.batch  # then expanded: every batch row alike
    shape_q = (batch, case.seq_len, case.heads, case.dim)
    shape_kv = (batch, case.seq_len, case.kv_heads, case.dim)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).expand(case.batch, -1, -1, -1)
               for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, torch.randn((case.batch, *shape_q[1:]), generator=g, dtype=torch.float64)


def _masks(case: Case, seed: int) -> dict:
    """``key_padding_mask`` (global) and ``cu_seqlens`` keywords of a case."""
    kw = {}
    if case.masked:
        g = torch.Generator().manual_seed(seed + 1)
        kw["key_padding_mask"] = torch.rand(case.batch, case.seq_len, generator=g) < 0.25
    if case.docs is not None:
        kw["cu_seqlens"] = torch.tensor(case.docs, dtype=torch.int32)
    return kw


def _oracle(case: Case, q, k, v, dout, dtype, seed: int):
    """Dense attention in ``dtype`` on CPU: output and q/k/v gradients (float64 = the oracle)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*leaves, case.segment_lengths, case.dilation_rates, mode=case.mode, causal=case.causal,
                                  **_masks(case, seed))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return [t.double() for t in (out, *grads)]


def run_case(case: Case, backend_name: str, group, device: torch.device, seed: int):
    """Run one case on this rank; returns ``(Result, tensors)`` (tensors for the bitwise check)."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    q, k, v, dout = _inputs(case, seed)
    names = ("out", "dq", "dk", "dv")
    oracle = _oracle(case, q, k, v, dout, torch.float64, seed)
    dtype = DTYPES[case.dtype]
    if case.dtype == "float64":
        tol = {n: tolerance(dtype, None) for n in names}
    else:
        plain = _oracle(case, q, k, v, dout, dtype, seed)
        tol = {n: tolerance(dtype, rel_err(p, o)) for n, p, o in zip(names, plain, oracle)}
    rows = slice(rank * case.local_len, (rank + 1) * case.local_len)
    g = torch.Generator(device=device).manual_seed(seed)
    local = [as_layout(t[:, rows].to(device=device, dtype=dtype), case.layout, generator=g).requires_grad_()
             for t in (q, k, v)]
    masks = _masks(case, seed)
    if "key_padding_mask" in masks:
        masks["key_padding_mask"] = masks["key_padding_mask"][:, rows].to(device)
    if "cu_seqlens" in masks:
        masks["cu_seqlens"] = masks["cu_seqlens"].to(device)
    out = dilated_attention(*local, case.segment_lengths, case.dilation_rates, mode=case.mode, causal=case.causal,
                            comm=comm, kernel=case.kernel, strategy=case.strategy, **masks)
    grads = torch.autograd.grad(out, local, dout[:, rows].to(device=device, dtype=dtype))
    got = [t.detach().cpu() for t in (out, *grads)]
    errors = {n: rel_err(g, o[:, rows]) for n, g, o in zip(names, got, oracle)}
    ok = all(errors[n] <= tol[n] for n in names) and all(torch.isfinite(g).all().item() for g in got)
    res = Result(case.name, backend_name, rank, case.world, ok, errors, tol)
    if not ok:
        res.message = "error above tolerance: " + ", ".join(
            f"{n} {errors[n]:.2e} > {tol[n]:.2e}" for n in names if not errors[n] <= tol[n])
    return res, got


def check_disagreement(backend_name: str, group, device: torch.device) -> Result:
    """Ranks that disagree on the call must all raise ValueError, none may hang."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    n_local = 16
    q = torch.randn(1, n_local, 2, 8, dtype=torch.float64, device=device)
    segs = (8, n_local * comm.world_size) if rank == 0 else (16, n_local * comm.world_size)
    try:
        dilated_attention(q, q, q, segs, (1, 2), comm=comm)
    except ValueError as exc:
        # the message shows the differing values themselves, not hashes
        ok = "disagree" in str(exc) and f"segment_lengths: rank 0=[8, {n_local * comm.world_size}]" in str(exc)
        return Result("disagreeing-ranks", backend_name, rank, comm.world_size, ok, message=str(exc)[:200])
    return Result("disagreeing-ranks", backend_name, rank, comm.world_size, False, message="no error raised")


def check_one_rank_invalid(backend_name: str, group, device: torch.device) -> Result:
    """A rank whose own input is invalid raises its error; the others raise too, instead of waiting."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, device=device)
    rates = (1, 3) if rank == comm.world_size - 1 else (1, 2)  # 3 does not divide the segment
    try:
        dilated_attention(q, q, q, (8, 16 * comm.world_size), rates, comm=comm)
    except ValueError as exc:
        ok = ("dilation_rates" in str(exc)) if rank == comm.world_size - 1 else ("rejected" in str(exc))
        return Result("one-rank-invalid", backend_name, rank, comm.world_size, ok, message=str(exc)[:200])
    return Result("one-rank-invalid", backend_name, rank, comm.world_size, False, message="no error raised")


def check_unchecked_calls(backend_name: str, group, device: torch.device) -> Result:
    """``check_calls=False`` skips only the signature gather: results are bitwise the same."""
    checked, unchecked = get_backend(backend_name, group), get_backend(backend_name, group, check_calls=False)
    rank, size = checked.rank, checked.world_size
    g = torch.Generator().manual_seed(7)
    full = torch.randn(1, 16 * size, 4, 8, generator=g, dtype=torch.float64)
    mine = full[:, rank * 16 : (rank + 1) * 16].to(device)  # on the harness's device: NCCL moves CUDA tensors only
    a = dilated_attention(mine, mine, mine, (8, 16 * size), (1, 4), causal=True, comm=checked)
    b = dilated_attention(mine, mine, mine, (8, 16 * size), (1, 4), causal=True, comm=unchecked)
    same = torch.equal(a, b)
    return Result("unchecked-calls", backend_name, rank, size, same, message="" if same else "results differ")


def run_battery(backends: list[str], device: torch.device, world_sizes: list[int] | None = None,
                progress: bool = False) -> list[Result]:
    """Every case for every world size that fits, on this rank. Call on all ranks of the world."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    world_sizes = world_sizes or list(range(1, world + 1))
    results: list[Result] = []
    for size in world_sizes:
        group = dist.new_group(list(range(size)))  # collective call: every rank takes part
        if rank >= size:
            continue
        battery = cases(size, device.type)
        for i, case in enumerate(battery):
            seed = 1000 * size + i
            tensors = {}
            for name in backends:
                try:
                    res, got = run_case(case, name, group, device, seed)
                    tensors[name] = got
                except Exception as exc:  # report, keep going: one failure must not hide the rest
                    res = Result(case.name, name, rank, size, False, message=f"{type(exc).__name__}: {exc}")
                    traceback.print_exc()
                results.append(res)
                if progress and rank == 0:
                    print(f"[harness] {name:10s} {case.name:40s} {'ok' if res.ok else 'FAIL'}", flush=True)
            if len(tensors) > 1:
                first, ref = next(iter(tensors.items()))
                same = all(all(torch.equal(a, b) for a, b in zip(ref, t)) for t in tensors.values())
                results.append(Result(case.name + "[bitwise]", "+".join(tensors), rank, size, same,
                                      message="" if same else f"backends differ from {first}"))
        if size > 1:
            for name in backends:
                for check in (check_disagreement, check_one_rank_invalid, check_unchecked_calls):
                    try:
                        results.append(check(name, group, device))
                    except Exception as exc:
                        results.append(Result(check.__name__, name, rank, size, False, message=repr(exc)))
    return results


# -- spawning gloo ranks on one machine (pytest, demo) ------------------------------------------


def _battery(rank: int, world_size: int, backends: list[str]) -> list[dict]:
    return [asdict(r) for r in run_battery(backends, torch.device("cpu"))]


def spawn_battery(backends: list[str], world_size: int = 4) -> list[Result]:
    return [Result(**x) for part in spawn_ranks(_battery, world_size, backends) for x in part]


# -- torchrun entry point ------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    lines = [f"{'case':44s} {'backend':28s} {'P':>2s} {'rank':>4s}  {'max rel err (out/dq/dk/dv)':40s} ok"]
    for r in results:
        errs = "/".join(f"{r.errors[n]:.1e}" for n in ("out", "dq", "dk", "dv")) if r.errors else r.message[:40]
        lines.append(f"{r.case:44s} {r.backend:28s} {r.world:2d} {r.rank:4d}  {errs:40s} {'ok' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", choices=["collective", "fairscale", "deepspeed"],
                        help="repeat to test several (and check they agree bitwise); default collective")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    env = init_distributed(args.device)
    results = run_battery(args.backend or ["collective"], env.device, progress=True)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [asdict(r) for r in results])
    all_results = [Result(**x) for part in everyone for x in part]
    failed = [r for r in all_results if not r.ok]
    if dist.get_rank() == 0:
        print(format_table(all_results))
        print(f"{len(all_results) - len(failed)} passed, {len(failed)} failed")
    env.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
