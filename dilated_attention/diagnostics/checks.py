"""Diagnostics for the failures ring and fused attention users hit (faults, hangs, wrong results).

* ``env_report``: versions, devices, shared memory limits, NCCL settings.
* ``check_views``: strided dilated views and packed ring buffers equal an
  explicit strided slice of a contiguous copy, for every layout of
  ``testing.compare.LAYOUTS`` (a head dim with stride != 1 and permuted buffers too), on the device in question (an index gather on a
  non-contiguous view reads the wrong memory on GPUs: the views must not).
* ``check_kernels``: the debugging method that works: the fp64 plain-torch
  oracle first, then one kernel at a time, forward and backward, each error
  judged against plain torch in the same dtype; a CUDA fault is attributed to
  the kernel that caused it (synchronise after each; ``isolate=True`` runs each
  kernel in a fresh process, since a CUDA context does not survive a fault).
* ``check_ring``: per rank, a ring ping on every ring size, the cross-rank
  consistency check, and a small ring result vs the single-device one.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch

from ..comm import get_backend
from ..functional import dilated_attention
from ..kernels.dispatch import select_kernel
from ..patterns import plan_patterns
from ..testing.compare import LAYOUTS, as_layout, rel_err, tolerance
from ..testing.oracle import dense_dilated_attention
from ..views import chunk_views, pack_kv
from .health import ring_neighbours

KERNELS = ("reference", "sdpa", "sdpa-cudnn", "fused", "cudnn", "cudnn-dkdv")


# (distribution, what it enables): the optional dependencies, read from the installed metadata (no import: DeepSpeed
# and flash-attn-4 take seconds to import, and a broken install still shows its version)
OPTIONAL = (("einops", "required"), ("tqdm", "required"), ("triton", "kernel fused"),
            ("fairscale", 'comm="fairscale"'), ("deepspeed", 'comm="deepspeed"'),
            ("transformers", "Hugging Face integration"), ("nvidia-cudnn-frontend", "kernel cudnn-det"),
            ("flash-attn-4", "kernels flash4, flash4-nondet"))


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution (a pip package name), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def env_report() -> dict[str, str]:
    """What to paste into a bug report: the library's and Python's versions, torch and its CUDA, each optional
    dependency's version (or "not installed", with what it enables), the GPUs and the settings that matter."""
    package = sys.modules[__name__.split(".")[0]]  # (imported: this module is part of it)
    info = {"dilated_attention": f"{package.__version__} ({os.path.dirname(package.__file__)})",
            "python": platform.python_version(), "torch": torch.__version__,
            "torch CUDA / cuDNN": f"{torch.version.cuda or 'none (CPU build)'} / "
                                  f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'}",
            "cuda available": str(torch.cuda.is_available())}
    for name, use in OPTIONAL:
        found = installed_version(name)
        info[name] = found if found is not None else f"not installed ({use})"
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            smem = getattr(p, "shared_memory_per_block_optin", None)
            info[f"cuda:{i}"] = f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, smem/block {smem}"
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for var in ("CUDA_LAUNCH_BLOCKING", "TORCH_USE_CUDA_DSA", "TRITON_INTERPRET", "NCCL_NVLS_ENABLE",
                "NCCL_DEBUG", "DS_ACCELERATOR"):
        if var in os.environ:
            info[var] = os.environ[var]
    return info


def check_views(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[tuple[str, bool, str]]:
    """``[(layout, ok, detail)]``: views and packing vs an explicit gather on a contiguous copy."""
    results = []
    (plan,) = plan_patterns([64], [4], seq_len=128, local_len=32, num_heads=6, num_kv_heads=2)
    for name in LAYOUTS:
        try:
            x = as_layout(torch.randn(2, 32, 2, 16, device=device, dtype=dtype), name)
            safe = x.contiguous()  # the explicit gather runs on memory known to be contiguous
            buf = pack_kv(x, x, plan)
            ok = True
            for c in plan.chunks:
                want = safe[:, c.offset :: 4, c.k0 : c.k1]
                ok &= torch.equal(chunk_views(x, plan, c, kv=True).squeeze(1), want)
                ok &= torch.equal(buf[0, :, :, c.buffer_head : c.buffer_head + c.k1 - c.k0], want)
            if device != "cpu":
                torch.cuda.synchronize()
            results.append((name, bool(ok), f"strides {tuple(x.stride())}"))
        except Exception as exc:
            results.append((name, False, f"{type(exc).__name__}: {exc}"))
    return results


def check_kernels(device: str = "cpu", dtype: torch.dtype = torch.float32, kernels=KERNELS, heads: int = 4,
                  kv_heads: int = 2, seq_len: int = 256, head_dim: int = 64, causal: bool = True,
                  isolate: bool = False) -> list[dict]:
    """Each kernel vs the fp64 oracle (forward, backward) on one LongNet pattern set; one dict per kernel
    (``ok``: True, False, or None where the kernel declined the inputs, with a ``note``).

    The inputs: one batch row of ``seq_len`` tokens, ``heads`` query heads and ``kv_heads`` key/value heads
    (fewer than ``heads``: grouped-query attention), ``head_dim`` wide, causal or not, patterns
    ``[N/4, N/2, N]`` at rates ``[1, 2, 4]``. ``isolate``: each kernel in a subprocess of its own, so that a
    kernel that crashes the process (a CUDA fault) is reported as that kernel's failure and the others still
    run."""
    if isolate:
        return [_isolated(k, device, dtype, heads, kv_heads, seq_len, head_dim, causal) for k in kernels]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, heads, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, seq_len, kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    segs, rates = [seq_len // 4, seq_len // 2, seq_len], [1, 2, 4]

    def run_dense(dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = dense_dilated_attention(*leaves, segs, rates, causal=causal)
        return [t.double() for t in (out, *torch.autograd.grad(out, leaves, dout.to(dt)))]

    oracle, plain = run_dense(torch.float64), run_dense(dtype)
    report = []
    for name in kernels:
        row = {"kernel": getattr(name, "name", name)}
        try:
            qd, kd, vd, dd = (t.to(device, dtype) for t in (q, k, v, dout))
            kern = select_kernel(name, qd, kd)
            leaves = [t.clone().requires_grad_() for t in (qd, kd, vd)]
            out = dilated_attention(*leaves, segs, rates, causal=causal, kernel=kern)
            grads = torch.autograd.grad(out, leaves, dd)
            if qd.is_cuda:
                torch.cuda.synchronize()  # surface an asynchronous fault here, under this kernel's name
            for label, got, o, p in zip(("out", "dq", "dk", "dv"), (out, *grads), oracle, plain):
                err, base = rel_err(got, o), rel_err(p, o)
                row[label] = f"{err:.1e} (plain {base:.1e})"
                row.setdefault("ok", True)
                row["ok"] &= bool(torch.isfinite(got).all()) and err <= tolerance(dtype, base)
        except ValueError as exc:  # the kernel declined: that is an answer, not a failure
            row.update(ok=None, note=str(exc))
        except Exception as exc:
            row.update(ok=False, note=f"{type(exc).__name__}: {exc}")
        report.append(row)
    if device != "cpu":
        auto = select_kernel("auto", q.to(device, dtype), k.to(device, dtype))
        report.append({"kernel": "auto", "ok": None, "note": f"auto picks {auto.name!r}"})
    return report


def _isolated(name, device, dtype, heads, kv_heads, seq_len, head_dim, causal) -> dict:
    code = (
        "import torch, json; from dilated_attention.diagnostics import check_kernels; "
        f"print(json.dumps(check_kernels({device!r}, torch.{str(dtype).split('.')[-1]}, ({name!r},), {heads}, "
        f"{kv_heads}, {seq_len}, {head_dim}, {causal})[0]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        import json

        return json.loads(proc.stdout.strip().splitlines()[-1])
    return {"kernel": name, "ok": False, "note": f"process died (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"}


def check_ring(backend: str, device: torch.device) -> list[tuple[str, bool, str]]:
    """Run on every rank of an initialised world. ``[(check, ok, detail)]`` for this rank."""
    comm = get_backend(backend)
    out = []
    world, rank = comm.world_size, comm.rank
    for size in [s for s in range(2, world + 1) if world % s == 0]:
        nxt, prv = ring_neighbours(rank, size)
        send = torch.full((4,), float(rank), device=device)
        recv = torch.empty_like(send)
        comm.send_recv(send, nxt, recv, prv).wait()
        out.append((f"ring ping size {size}", bool((recv == prv).all()), f"rank {rank} got {recv[0].item():.0f} from {prv}"))
    gen = torch.Generator().manual_seed(1)
    n = 32 * world
    full = torch.randn(1, n, 4, 16, generator=gen)
    mine = full[:, rank * 32 : (rank + 1) * 32].to(device)
    got = dilated_attention(mine, mine, mine, [16, n], [1, 4], causal=True, comm=comm).float().cpu()
    want = dilated_attention(full, full, full, [16, n], [1, 4], causal=True)[:, rank * 32 : (rank + 1) * 32]
    err = (got - want).abs().max().item()
    out.append(("ring vs single device", err < 1e-2, f"max abs err {err:.1e}"))
    return out
