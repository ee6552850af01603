"""Replaying a repro file: rebuild each input with its recorded layout (``build_inputs``, ``build_mask``,
``build_cu_seqlens``), run the call forward and backward, judge it against the float64 dense oracle under the
project's tolerance rule, and narrow a difference down (each pattern alone, the reference kernel); on one
process (``run_spec``) or on spawned CPU gloo ranks (``replay_spawned``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import get_backend
from ..functional import dilated_attention
from ..kernels.registry import KERNEL_NAMES
from ..launch_utils import leave_process_group
from ..patterns import head_groups, longnet_offsets
from ..testing.compare import rel_err, tolerance
from ..testing.oracle import dense_dilated_attention
from ..testing.spawn import init_local_rank, run_spawned, write_result
from .repro_file import _DTYPES, _MASK_DTYPES, _TENSOR_KWARGS
from .repro_summary import describe_call


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


def _saved_tensors(spec: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The ``.pt`` of real tensors beside the JSON (single process only), if there is one."""
    pt = spec.get("tensors")
    if pt and int(spec.get("world_size") or 1) == 1:
        here = os.path.join(os.path.dirname(spec.get("_path", ".")), pt)
        if os.path.exists(here):
            return torch.load(here)
    return None


def build_inputs(spec: dict[str, Any], rank: int, device) -> tuple[torch.Tensor, ...]:
    """This rank's ``q, k, v`` (leaves that require grad, recorded layouts) and ``dout`` (contiguous)."""
    dtype = _dtype(spec)
    seed = int(spec.get("seed", 0))
    saved = _saved_tensors(spec)
    if saved is not None:
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


def random_mask(desc: dict[str, Any], seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """The seeded bool ``(batch, seq_len)`` mask a description stands for (the same on every rank).

    Each key is padded with probability ``density``; then, per batch row, ``runs`` random runs
    ``[a, b)`` are padded (a run may cover the whole row) and, with ``tail``, a random-length tail
    (0 up to the whole row: a batch of unequal lengths).
    """
    g = torch.Generator().manual_seed(seed * 7919 + 50)  # apart from every rank's q/k/v/dout streams
    mask = torch.rand(batch, seq_len, generator=g, dtype=torch.float64) < float(desc.get("density", 0.0))
    for b in range(batch):
        for _ in range(int(desc.get("runs", 0))):
            a, c = sorted(int(x) for x in torch.randint(0, seq_len + 1, (2,), generator=g))
            mask[b, a:c] = True
        if desc.get("tail"):
            mask[b, seq_len - int(torch.randint(0, seq_len + 1, (1,), generator=g)):] = True
    return mask


def build_mask(spec: dict[str, Any], rank: int, device) -> tuple[Any, torch.Tensor | None]:
    """``(this rank's key_padding_mask, the whole sequence's bool mask for the oracle)``, or ``(None, None)``.

    The whole mask is drawn from the seed (``random_mask``) with the recorded exact runs laid
    over the rows they cover; rank ``r`` takes rows ``[r L, (r + 1) L)``.
    """
    desc = spec.get("key_padding_mask")
    if desc is None:
        return None, None
    if "type" in desc:  # not a tensor at capture: replay something that is not one either
        return f"<{desc['type']}>", None
    world = int(spec.get("world_size") or 1)
    shape = list(desc.get("shape") or spec["q"]["shape"][:2])
    dtype = _MASK_DTYPES.get(desc.get("dtype", "bool"), torch.bool)
    saved = _saved_tensors(spec)
    if saved is not None and "key_padding_mask" in saved:
        mask = saved["key_padding_mask"]
        whole = (mask != 0).cpu() if mask.dim() == 2 else None
        return mask.to(device), whole
    if len(shape) != 2:
        return torch.zeros(shape, dtype=dtype, device=device), None
    batch, local = shape
    whole = random_mask(desc, int(spec.get("seed", 0)), batch, local * world)
    for piece in desc.get("exact") or []:
        lo, hi = piece["rows"]
        whole[:, lo:hi] = False
        for b, runs in enumerate(piece["padded"][:batch]):
            for a, c in runs:
                whole[b, a:c] = True
    mine = whole[:, rank * local:(rank + 1) * local]
    return mine.to(device=device, dtype=dtype), whole


def build_cu_seqlens(spec: dict[str, Any], device) -> Any:
    """The recorded ``cu_seqlens`` as the call gets it (int32 unless another dtype was recorded)."""
    offsets = spec.get("cu_seqlens")
    if offsets is None:
        return None
    name = spec.get("cu_seqlens_dtype", "int32")
    if name == "python":
        return offsets
    return torch.tensor(offsets, dtype=_MASK_DTYPES.get(name, torch.int32), device=device)


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


def _call_kwargs(spec: dict[str, Any], mask: Any, cu_seqlens: Any) -> dict[str, Any]:
    """Keywords for ``dilated_attention`` beyond the patterns, comm and kernel."""
    kwargs = {key: val for key, val in (spec.get("kwargs") or {}).items() if key not in _TENSOR_KWARGS}
    if spec.get("key_padding_mask") is not None:
        kwargs["key_padding_mask"] = mask
    if spec.get("cu_seqlens") is not None:
        kwargs["cu_seqlens"] = cu_seqlens
    return kwargs


def _oracle_kwargs(spec: dict[str, Any], whole_mask: torch.Tensor | None) -> dict[str, Any]:
    """The oracle's view of the same call: the whole sequence's mask and the global document offsets."""
    kwargs = spec.get("kwargs") or {}
    return dict(head_offsets=kwargs.get("head_offsets", "spread"), pad_to_segments=kwargs.get("pad_to_segments", True),
                key_padding_mask=whole_mask, cu_seqlens=spec.get("cu_seqlens"))


def _oracle(spec, q, k, v, dout, dtype, segs, rates, extra=None):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*leaves, segs, rates, mode=spec.get("mode", "longnet"),
                                  causal=bool(spec.get("causal", False)), softmax_scale=spec.get("softmax_scale"),
                                  **(extra or {}))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return [t.detach().double() for t in (out, *grads)]


def _document(spec, pos: int) -> tuple[int, int] | None:
    """``(document index, its first position)`` of global position ``pos`` under ``cu_seqlens``."""
    cu = spec.get("cu_seqlens")
    if not isinstance(cu, list) or not all(isinstance(x, int) for x in cu):
        return None
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        if a <= pos < b:
            return i, a
    return None


def _covering(spec, heads: int, seq_len: int, pos: int, head: int) -> list[int]:
    """Patterns whose dilated set contains (position, head) (docs/design.md section 1); ``pos`` counts from
    the start of its document (segments restart at each one)."""
    segs, rates = spec["segment_lengths"], spec["dilation_rates"]
    rule = (spec.get("kwargs") or {}).get("head_offsets", "spread")
    found = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        if spec.get("mode", "longnet") == "grouped":
            h0, h1 = head_groups(heads, len(segs))[i]
            if h0 <= head < h1 and pos % r == i % r:
                found.append(i)
        elif pos % r == longnet_offsets(heads, r, rule)[head]:
            found.append(i)
    return found


def _run_once(spec, comm, device, kernel, segs, rates, inputs, extra=None):
    q, k, v, dout = inputs
    leaves = [q, k, v]  # leaves built by build_inputs (autograd.grad does not accumulate into them)
    kwargs = extra if extra is not None else _call_kwargs(spec, None, None)
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


def _judge(spec, comm, rank, got, oracle, plain, dtype, local_len):
    # A rank's rows are judged as part of the whole result (what one device would return): errors are
    # relative to the whole tensor's scale and the bound comes from plain torch on the whole tensor.
    # Judging a shard on its own scale made a shard of one or two rows, where the gradient nearly
    # cancels, fail on rounding that the same rows pass on one device.
    rows = slice(rank * local_len, (rank + 1) * local_len)
    errors, tols, bad = {}, {}, []
    for name, g, o, p in zip(NAMES, got, oracle, plain):
        scale = float(o.abs().max().clamp_min(SCALE_FLOOR)) if o.numel() else SCALE_FLOOR
        if bool(torch.isfinite(g).all()):
            errors[name] = float((g.double() - o[:, rows]).abs().max()) / scale if g.numel() else 0.0
        else:
            errors[name] = float("inf")
        tols[name] = tolerance(dtype, None if dtype == torch.float64 else rel_err(p, o, floor=SCALE_FLOOR))
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


def _worst(spec, got, oracle, rank, local_len, name, whole_mask=None) -> str:
    idx = NAMES.index(name)
    g, o = got[idx].double(), oracle[idx][:, rank * local_len:(rank + 1) * local_len]
    diff = (g - o).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    b, row, head, _ = (int(i) for i in torch.nonzero(diff == diff.max())[0])
    pos = rank * local_len + row
    heads, seq = oracle[0].shape[2], oracle[0].shape[1]
    where = f"batch {b}, position {pos}, head {head}"
    doc = _document(spec, pos)
    start = 0
    if doc is not None:
        start = doc[1]
        where += f" (document {doc[0]}, its position {pos - start})"
    if whole_mask is not None and whole_mask.shape[0] > b and whole_mask.shape[1] > pos:
        where += f" (its key {'is' if bool(whole_mask[b, pos]) else 'is not'} padded; " \
                 f"{int(whole_mask[b].sum())} of {whole_mask.shape[1]} keys padded in batch row {b})"
    if name == "out" or name == "dq":
        where += f" (covered by patterns {_covering(spec, heads, seq, pos - start, head)})"
    return where


@dataclass(frozen=True)
class _Case:
    """A spec's call as this rank replays it: its inputs (``inputs``: this rank's q, k, v, dout; ``whole``: every
    rank's, for the oracle), the call's keywords (``extra``) and the oracle's (``oextra``)."""

    spec: dict[str, Any]
    comm: Any
    device: torch.device
    rank: int
    dtype: torch.dtype
    inputs: tuple[torch.Tensor, ...]
    whole: tuple[torch.Tensor, ...]
    extra: dict[str, Any]
    oextra: dict[str, Any]

    def run(self, kernel: Any, segs: list[int], rates: list[int]) -> list[torch.Tensor]:
        """This rank's output and gradients, the call run on ``kernel`` with these patterns."""
        return _run_once(self.spec, self.comm, self.device, kernel, segs, rates, self.inputs, self.extra)

    def oracle(self, dtype: torch.dtype, segs: list[int], rates: list[int]) -> list[torch.Tensor]:
        """The whole output and gradients in plain torch (``dtype``: float64 for the oracle itself)."""
        return _oracle(self.spec, *self.whole, dtype, segs, rates, self.oextra)

    def judge(self, got: list[torch.Tensor], oracle: list[torch.Tensor], plain: list[torch.Tensor]
              ) -> tuple[dict[str, float], dict[str, float], list[str]]:
        """``_judge`` of this rank's results."""
        return _judge(self.spec, self.comm, self.rank, got, oracle, plain, self.dtype, self.inputs[0].shape[1])


def run_spec(spec: dict[str, Any], *, comm=None, device=None, kernel: Any = None, narrow: bool = True) -> Report:
    """Replay ``spec`` on this rank (all ranks of ``comm`` must call it); returns this rank's ``Report``."""
    rank = comm.rank if comm is not None else 0
    world = comm.world_size if comm is not None else 1
    device = torch.device(device) if device is not None else torch.device("cpu")
    kernel = kernel if kernel is not None else spec.get("kernel", "auto")
    rep = Report(rank, True)
    if isinstance(kernel, str) and kernel not in KERNEL_NAMES:
        rep.lines.append(f"kernel {kernel!r} is not a library kernel name; replaying with kernel='auto'")
        kernel = "auto"
    dtype = _dtype(spec)
    segs, rates = list(spec["segment_lengths"]), list(spec["dilation_rates"])
    inputs = build_inputs(spec, rank, device)
    mask, whole_mask = build_mask(spec, rank, device)
    extra = _call_kwargs(spec, mask, build_cu_seqlens(spec, device))
    oextra = _oracle_kwargs(spec, whole_mask)
    q, k, v, dout = inputs
    local_len = q.shape[1]
    case = _Case(spec, comm, device, rank, dtype, inputs, tuple(_gather_global(t, comm) for t in inputs), extra,
                 oextra)
    kname = getattr(kernel, "name", kernel)
    rep.lines.append(f"{spec.get('mode', 'longnet')} causal={bool(spec.get('causal'))} patterns {segs} x {rates}, "
                     f"q {tuple(q.shape)} stride {tuple(q.stride())}, k {tuple(k.shape)} stride {tuple(k.stride())}, "
                     f"{dtype}, kernel {kname}, world {world}, device {device}")
    more = describe_call(spec)
    if more:
        rep.lines.append(more)
    if isinstance(mask, torch.Tensor) and whole_mask is not None:
        rep.lines.append(f"key_padding_mask: {int(whole_mask.sum())} of {whole_mask.numel()} keys padded, "
                         f"{int(whole_mask.all(1).sum())} of {whole_mask.shape[0]} batch rows wholly")
    if spec.get("error"):
        rep.lines.append(f"recorded error: {spec['error'].splitlines()[0][:300]}")
    try:
        got = case.run(kernel, segs, rates)
    except Exception as exc:
        rep.ok, rep.raised = False, f"{type(exc).__name__}: {exc}"
        rep.lines.append(f"FAIL: the call raised {rep.raised.splitlines()[0][:400]}")
        return rep
    try:
        oracle = case.oracle(torch.float64, segs, rates)
        plain = oracle if dtype == torch.float64 else case.oracle(dtype, segs, rates)
    except Exception as exc:  # the library accepted a call the oracle cannot evaluate
        rep.ok, rep.raised = False, f"the call ran, but the oracle raised {type(exc).__name__}: {exc}"
        rep.lines.append(f"FAIL: {rep.raised.splitlines()[0][:400]}")
        return rep
    rep.errors, rep.tolerance, bad = case.judge(got, oracle, plain)
    rep.lines.append("vs fp64 oracle: " + ", ".join(
        f"{n} {rep.errors[n]:.1e}{'' if n not in bad else ' > ' + format(rep.tolerance[n], '.1e') + ' DIFFERS'}"
        for n in NAMES))
    if not bad:
        rep.lines.append("ok: output and gradients within the tolerance rule")
    else:
        rep.ok = False
        for name in bad:
            rep.lines.append(f"{name} differs most at {_worst(spec, got, oracle, rank, local_len, name, whole_mask)}")
    # narrowing must be collective: every rank runs the same calls even if only one rank failed
    any_bad = not rep.ok
    if comm is not None:
        flags = comm.all_gather(torch.tensor([int(any_bad)], device=device)).cpu()
        any_bad = bool(flags.any())
    if narrow and any_bad:
        _narrow(case, kernel, segs, rates, oracle, rep)
    return rep


def _narrow(case: _Case, kernel: Any, segs: list[int], rates: list[int], oracle: list[torch.Tensor],
            rep: Report) -> None:
    """Which pattern, and is it the kernel? (every rank runs the same calls); ``oracle``: the whole call's."""
    spec, dtype = case.spec, case.dtype
    culprits = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        if len(segs) == 1:
            break
        if spec.get("mode", "longnet") == "grouped":
            break  # a lone pattern changes the head groups: no like-for-like comparison
        try:
            got = case.run(kernel, [w], [r])
            o1 = case.oracle(torch.float64, [w], [r])
            p1 = o1 if dtype == torch.float64 else case.oracle(dtype, [w], [r])
            _, _, bad = case.judge(got, o1, p1)
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
            got = case.run("reference", segs, rates)
            plain = oracle if dtype == torch.float64 else case.oracle(dtype, segs, rates)
            _, _, bad = case.judge(got, oracle, plain)
        except Exception as exc:
            bad = [f"raised {type(exc).__name__}: {exc}"]
        if bad:
            rep.lines.append(f"the reference kernel differs too ({', '.join(bad)}): the fault is outside the kernel "
                             "(strategy, merge, communication)")
        else:
            rep.lines.append(f"the reference kernel is right: the fault is in kernel {getattr(kernel, 'name', kernel)!r}")


# -- entry points for the CLI ----------------------------------------------------------------------------


def _spawned_worker(rank, world, port, spec, device, backend, out_dir):
    torch.set_num_threads(1)
    init_local_rank(rank, world, port)
    try:
        rep = run_spec(spec, comm=get_backend(backend), device=device)
    except Exception as exc:
        rep = Report(rank, False, raised=repr(exc), lines=[f"FAIL: replay raised {exc!r}"])
    write_result(out_dir, rank, rep.__dict__)
    leave_process_group(barrier=False)


def replay_spawned(spec: dict[str, Any], backend: str | None = None) -> list[Report]:
    """Replay a multi-rank repro on this machine: ``world_size`` gloo ranks on CPU."""
    world = int(spec.get("world_size") or 1)
    return [Report(**x) for x in run_spawned(_spawned_worker, world, spec, "cpu",
                                             backend or spec.get("backend") or "collective")]
