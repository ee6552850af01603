"""Minimal reproducers: capture one call into a small JSON, replay it against the fp64 oracle.

A repro file holds what decides a failure, not the data: every input's shape,
strides, storage offset, dtype and device, the patterns, mode, causal, scale,
kernel, backend, world size and a seed. Replay rebuilds each input with exactly
that layout (a seeded random storage viewed with the recorded strides and
offset), runs ``dilated_attention`` forward and backward, and compares the
output and the q/k/v gradients with the float64 dense oracle under the project's
tolerance rule (``testing/compare.py``). When something differs it narrows it
down: each pattern alone, and the same call with the reference kernel (is it the
kernel, or the strategy around it?). With ``save_tensors`` the real tensors go
to a ``.pt`` beside the JSON and replace the seeded ones on a single process.

Capture from user code::

    from dilated_attention.diagnostics import repro
    repro.capture(q, k, v, [2048, 4096], [1, 2], causal=True, path="bad_call.json")

Replay (``scripts/repro.py``)::

    python scripts/repro.py replay bad_call.json            # 1 process, or spawned CPU ranks
    torchrun --nproc_per_node=8 scripts/repro.py replay bad_call.json   # the recorded world
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .debug import call_meta

VERSION = 1
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- capture ------------------------------------------------------------------------------------


def capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths, dilation_rates, *,
            path: str | os.PathLike | None = None, directory: str | os.PathLike | None = None,
            save_tensors: bool = False, error: BaseException | str | None = None, seed: int = 0,
            mode: str = "longnet", causal: bool = False, softmax_scale: float | None = None,
            kernel: Any = "auto", comm: Any = None, **kwargs: Any) -> str:
    """Write a repro of ``dilated_attention(q, k, v, segment_lengths, dilation_rates, ...)``; returns its path.

    Call it with the arguments of the failing call (on every rank when ``comm`` is
    given: each rank writes its own file, suffixed ``.rank<r>``). ``error``: the
    exception (or text) seen. ``save_tensors``: also save q, k, v as ``.pt``.
    """
    spec = call_meta(q, k, v, segment_lengths, dilation_rates, mode=mode, causal=causal,
                     softmax_scale=softmax_scale, kernel=kernel, comm=comm, **kwargs)
    spec["seed"] = int(seed)
    if error is not None:
        spec["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    tensors = {"q": q.detach(), "k": k.detach(), "v": v.detach()} if save_tensors else None
    return write(spec, directory=directory, path=path, tensors=tensors)


def write(spec: dict[str, Any], *, directory: str | os.PathLike | None = None, path: str | os.PathLike | None = None,
          tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write ``spec`` as JSON (under ``directory`` with a fresh name, or at ``path``); returns the path."""
    spec = {"version": VERSION, "seed": 0, **spec}
    rank = int(spec.get("rank") or 0)
    if path is None:
        directory = os.fspath(directory or "dilated_attention_repro")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(directory, f"repro-{stamp}-{os.getpid()}")
        if int(spec.get("world_size") or 1) > 1:
            path += f".rank{rank}"
        path += ".json"
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if tensors:
        pt = os.path.splitext(path)[0] + ".pt"
        torch.save({n: t.detach().cpu() for n, t in tensors.items()}, pt)
        spec["tensors"] = os.path.basename(pt)
    with open(path, "w") as f:
        json.dump(spec, f, indent=1, default=str)
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as f:
        spec = json.load(f)
    for key in ("q", "k", "v", "segment_lengths", "dilation_rates"):
        if key not in spec:
            raise ValueError(f"{path} is not a repro file: it has no {key!r}")
    spec["_path"] = os.fspath(path)
    return spec


# -- rebuilding inputs ------------------------------------------------------------------------------


def _extent(shape, stride, offset) -> int:
    return offset + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0) + 1


def strided_random(desc: dict[str, Any], generator: torch.Generator, device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor with ``desc``'s shape, strides and storage offset over a random (never zero) storage."""
    shape, stride, offset = desc["shape"], desc["stride"], int(desc.get("storage_offset", 0))
    storage = torch.randn(_extent(shape, stride, offset), generator=generator, dtype=torch.float64)
    return storage.to(device=device, dtype=dtype).as_strided(shape, stride, offset)


def _dtype(spec) -> torch.dtype:
    name = spec["q"].get("dtype", "float32")
    if name not in _DTYPES:
        raise ValueError(f"repro dtype must be one of {tuple(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def build_inputs(spec: dict[str, Any], rank: int, device) -> tuple[torch.Tensor, ...]:
    """This rank's ``q, k, v`` (leaves that require grad, recorded layouts) and ``dout`` (contiguous)."""
    dtype = _dtype(spec)
    seed = int(spec.get("seed", 0))
    pt = spec.get("tensors")
    if pt and int(spec.get("world_size") or 1) == 1:
        here = os.path.join(os.path.dirname(spec.get("_path", ".")), pt)
        if os.path.exists(here):
            saved = torch.load(here)
            qkv = [saved[n].to(device).requires_grad_() for n in ("q", "k", "v")]
            g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + 3)
            dout = torch.randn(qkv[0].shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            return (*qkv, dout)
    out = []
    for i, name in enumerate(("q", "k", "v")):
        g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + i)
        out.append(strided_random(spec[name], g, device, dtype).requires_grad_())
    g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + 3)
    dout = torch.randn(spec["q"]["shape"], generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return (*out, dout)


# -- replay -------------------------------------------------------------------------------------------

NAMES = ("out", "dq", "dk", "dv")


@dataclass
class Report:
    """One rank's verdict on one replayed call."""

    rank: int
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    raised: str | None = None
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(f"[rank {self.rank}] {line}" for line in self.lines)


def _gather_global(x: torch.Tensor, comm) -> torch.Tensor:
    """Concatenate every rank's rows (dim 1) of ``x`` (a local contiguous copy) on CPU."""
    if comm is None:
        return x.detach().double().cpu()
    local = x.detach().contiguous()
    return torch.cat(list(comm.all_gather(local).cpu().double().unbind(0)), dim=1)


def _oracle(spec, q, k, v, dout, dtype, segs, rates):
    from ..testing.oracle import dense_dilated_attention

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*leaves, segs, rates, mode=spec.get("mode", "longnet"),
                                  causal=bool(spec.get("causal", False)), softmax_scale=spec.get("softmax_scale"))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return [t.detach().double() for t in (out, *grads)]


def _covering(spec, heads: int, seq_len: int, pos: int, head: int) -> list[int]:
    """Patterns whose dilated set contains (position, head) (DESIGN.md section 1)."""
    from ..patterns import head_groups, longnet_offsets

    segs, rates = spec["segment_lengths"], spec["dilation_rates"]
    found = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        if spec.get("mode", "longnet") == "grouped":
            h0, h1 = head_groups(heads, len(segs))[i]
            if h0 <= head < h1 and pos % r == i % r:
                found.append(i)
        elif pos % r == longnet_offsets(heads, r)[head]:
            found.append(i)
    return found


def _run_once(spec, comm, device, kernel, segs, rates, inputs):
    from ..functional import dilated_attention

    q, k, v, dout = inputs
    leaves = [q, k, v]  # leaves built by build_inputs (autograd.grad does not accumulate into them)
    kwargs = dict(spec.get("kwargs") or {})
    out = dilated_attention(*leaves, segs, rates, mode=spec.get("mode", "longnet"), causal=bool(spec.get("causal")),
                            softmax_scale=spec.get("softmax_scale"), comm=comm, kernel=kernel, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    if out.is_cuda:
        torch.cuda.synchronize()
    return [t.detach().cpu() for t in (out, *grads)]


# Inputs are standard normal by construction, so the terms summed into any output or gradient are
# O(1) or larger. Errors are relative to max(|oracle|, 1): a result the oracle gives as (near) zero,
# e.g. dq when every row sees one key, is judged in absolute terms instead of dividing rounding
# residue (1e-7 in fp32) by zero.
SCALE_FLOOR = 1.0
ZERO_RESIDUE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().double()
    diff = (got.detach().double().to(want.device) - want).abs().max()
    return (diff / want.abs().max().clamp_min(SCALE_FLOOR)).item()


def _judge(spec, comm, rank, got, oracle, plain, dtype, local_len):
    from ..testing.compare import tolerance

    rows = slice(rank * local_len, (rank + 1) * local_len)
    errors, tols, bad = {}, {}, []
    for name, g, o, p in zip(NAMES, got, oracle, plain):
        errors[name] = rel_err(g, o[:, rows]) if bool(torch.isfinite(g).all()) else float("inf")
        tols[name] = tolerance(dtype, None if dtype == torch.float64 else rel_err(p[:, rows], o[:, rows]))
        floor = (spec.get("floor") or {}).get(str(dtype).replace("torch.", ""))
        if floor is not None:
            tols[name] = max(tols[name], float(floor))
        if float(o.abs().max()) < 1e-8:
            # analytically zero (every row sees one key, so the softmax gradient cancels): plain torch may
            # hit exact zeros by luck, so "2x plain" means nothing; allow rounding residue instead
            tols[name] = max(tols[name], ZERO_RESIDUE[dtype])
        if not errors[name] <= tols[name]:
            bad.append(name)
    return errors, tols, bad


def _worst(spec, got, oracle, rank, local_len, name) -> str:
    idx = NAMES.index(name)
    g, o = got[idx].double(), oracle[idx][:, rank * local_len:(rank + 1) * local_len]
    diff = (g - o).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    b, row, head, _ = (int(i) for i in torch.nonzero(diff == diff.max())[0])
    pos = rank * local_len + row
    heads, seq = oracle[0].shape[2], oracle[0].shape[1]
    where = f"batch {b}, position {pos}, head {head}"
    if name == "out" or name == "dq":
        where += f" (covered by patterns {_covering(spec, heads, seq, pos, head)})"
    return where


def run_spec(spec: dict[str, Any], *, comm=None, device=None, kernel: Any = None, narrow: bool = True) -> Report:
    """Replay ``spec`` on this rank (all ranks of ``comm`` must call it); returns this rank's ``Report``."""
    rank = comm.rank if comm is not None else 0
    world = comm.world_size if comm is not None else 1
    device = torch.device(device) if device is not None else torch.device("cpu")
    kernel = kernel if kernel is not None else spec.get("kernel", "auto")
    from ..kernels.dispatch import KERNEL_NAMES

    rep = Report(rank, True)
    if isinstance(kernel, str) and kernel not in KERNEL_NAMES:
        rep.lines.append(f"kernel {kernel!r} is not a library kernel name; replaying with kernel='auto'")
        kernel = "auto"
    dtype = _dtype(spec)
    segs, rates = list(spec["segment_lengths"]), list(spec["dilation_rates"])
    inputs = build_inputs(spec, rank, device)
    q, k, v, dout = inputs
    local_len = q.shape[1]
    g_q, g_k, g_v, g_d = (_gather_global(t, comm) for t in inputs)
    kname = getattr(kernel, "name", kernel)
    rep.lines.append(f"{spec.get('mode', 'longnet')} causal={bool(spec.get('causal'))} patterns {segs} x {rates}, "
                     f"q {tuple(q.shape)} stride {tuple(q.stride())}, k {tuple(k.shape)} stride {tuple(k.stride())}, "
                     f"{dtype}, kernel {kname}, world {world}, device {device}")
    if spec.get("error"):
        rep.lines.append(f"recorded error: {spec['error'].splitlines()[0][:300]}")
    try:
        got = _run_once(spec, comm, device, kernel, segs, rates, inputs)
    except Exception as exc:
        rep.ok, rep.raised = False, f"{type(exc).__name__}: {exc}"
        rep.lines.append(f"FAIL: the call raised {rep.raised.splitlines()[0][:400]}")
        return rep
    oracle = _oracle(spec, g_q, g_k, g_v, g_d, torch.float64, segs, rates)
    plain = oracle if dtype == torch.float64 else _oracle(spec, g_q, g_k, g_v, g_d, dtype, segs, rates)
    rep.errors, rep.tolerance, bad = _judge(spec, comm, rank, got, oracle, plain, dtype, local_len)
    rep.lines.append("vs fp64 oracle: " + ", ".join(
        f"{n} {rep.errors[n]:.1e}{'' if n not in bad else ' > ' + format(rep.tolerance[n], '.1e') + ' DIFFERS'}"
        for n in NAMES))
    if not bad:
        rep.lines.append("ok: output and gradients within the tolerance rule")
    else:
        rep.ok = False
        for name in bad:
            rep.lines.append(f"{name} differs most at {_worst(spec, got, oracle, rank, local_len, name)}")
    # narrowing must be collective: every rank runs the same calls even if only one rank failed
    any_bad = not rep.ok
    if comm is not None:
        flags = comm.all_gather(torch.tensor([int(any_bad)], device=device)).cpu()
        any_bad = bool(flags.any())
    if narrow and any_bad:
        _narrow(spec, comm, device, kernel, segs, rates, inputs, oracle, rep, rank, local_len, dtype, g_q, g_k, g_v, g_d)
    return rep


def _narrow(spec, comm, device, kernel, segs, rates, inputs, oracle, rep, rank, local_len, dtype, g_q, g_k, g_v, g_d):
    """Which pattern, and is it the kernel? (every rank runs the same calls)"""
    culprits = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        if len(segs) == 1:
            break
        if spec.get("mode", "longnet") == "grouped":
            break  # a lone pattern changes the head groups: no like-for-like comparison
        try:
            got = _run_once(spec, comm, device, kernel, [w], [r], inputs)
            o1 = _oracle(spec, g_q, g_k, g_v, g_d, torch.float64, [w], [r])
            p1 = o1 if dtype == torch.float64 else _oracle(spec, g_q, g_k, g_v, g_d, dtype, [w], [r])
            _, _, bad = _judge(spec, comm, rank, got, o1, p1, dtype, local_len)
        except Exception as exc:
            bad = [f"raised {type(exc).__name__}"]
        if bad:
            culprits.append(f"pattern {i} (segment {w}, dilation {r}): {', '.join(bad)}")
    if culprits:
        rep.lines.append("alone, these patterns differ: " + "; ".join(culprits))
    elif len(segs) > 1 and spec.get("mode", "longnet") != "grouped":
        rep.lines.append("every pattern alone is right: the combination of patterns differs")
    if getattr(kernel, "name", kernel) != "reference":
        try:
            got = _run_once(spec, comm, device, "reference", segs, rates, inputs)
            plain = oracle if dtype == torch.float64 else _oracle(spec, g_q, g_k, g_v, g_d, dtype, segs, rates)
            _, _, bad = _judge(spec, comm, rank, got, oracle, plain, dtype, local_len)
        except Exception as exc:
            bad = [f"raised {type(exc).__name__}: {exc}"]
        if bad:
            rep.lines.append(f"the reference kernel differs too ({', '.join(bad)}): the fault is outside the kernel "
                             "(strategy, merge, communication)")
        else:
            rep.lines.append(f"the reference kernel is right: the fault is in kernel {getattr(kernel, 'name', kernel)!r}")


# -- entry points for the CLI ----------------------------------------------------------------------------


def _spawned_worker(rank, world, port, spec, device, backend, out_dir):
    import torch.distributed as dist

    from ..comm import get_backend
    from ..testing.spawn import init_local_rank

    torch.set_num_threads(1)
    init_local_rank(rank, world, port)
    try:
        rep = run_spec(spec, comm=get_backend(backend), device=device)
    except Exception as exc:
        rep = Report(rank, False, raised=repr(exc), lines=[f"FAIL: replay raised {exc!r}"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rep.__dict__, f)
    dist.destroy_process_group()


def replay_spawned(spec: dict[str, Any], backend: str | None = None) -> list[Report]:
    """Replay a multi-rank repro on this machine: ``world_size`` gloo ranks on CPU."""
    from ..testing.spawn import run_spawned

    world = int(spec.get("world_size") or 1)
    out_dir = run_spawned(_spawned_worker, world, spec, "cpu", backend or spec.get("backend") or "collective")
    reports = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            reports.append(Report(**json.load(f)))
    return reports


__all__ = ["Report", "build_inputs", "capture", "load", "replay_spawned", "run_spec", "strided_random", "write"]
