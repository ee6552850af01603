"""Debug mode: validate what reaches kernels and sends, name the call that faulted, write a repro.

Off by default and free when off: while on, it is a kernel hook (``hooks.py``) that sees
each call's kernel; off, nothing of it runs (the core never imports this module). Turn it on
with ``DILATED_ATTENTION_DEBUG=1`` (read once, when ``dilated_attention`` is imported, which
then loads this module) or for a block of code::

    with dilated_attention.debug(shadow=0.25):
        out = dilated_attention(q, k, v, [64, 128], [1, 2])

While on:

* every tensor reaching a kernel's ``forward_pattern``/``backward_pattern``
  (``wrap_kernel``) or a ring send (``check_send``) is checked: shape against the
  plan, dtype, device, element alignment, no view reaching outside its storage,
  no self-overlapping accumulator, no NaN/inf in inputs or results;
* on CUDA each kernel call is followed by a synchronize, so an asynchronous fault
  (illegal memory access, misaligned address) is raised under the name of the
  kernel, pattern, ring step and rank that launched it, not at some later op;
* a sampled fraction (``shadow``) of kernel calls is recomputed by the float64
  reference kernel and compared (gross errors: a wrong row, a wrong head);
* the metadata of the last few calls is kept (``record_call``/``last_calls``),
  and on an exception ``on_exception`` writes a repro JSON (``scripts/repro.py``)
  and appends "repro written to <path>" to the error.

Environment: ``DILATED_ATTENTION_DEBUG=1`` (on), ``DILATED_ATTENTION_DEBUG_SHADOW``
(fraction, default 0), ``DILATED_ATTENTION_DEBUG_DIR`` (where repros go, default
``./dilated_attention_repro``), ``DILATED_ATTENTION_DEBUG_TENSORS=1`` (also save
the real tensors of the last call as ``.pt``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import warnings
from typing import Any, Iterator

import torch

from .. import hooks
from ..kernels.chunk_loop import ChunkLoop
from ..kernels.protocol import CallSpec, Grads, Result, Saved
from ..kernels.reference import ReferenceKernel
from ..kernels.wrapper import KernelWrapper
from ..merge import Part, merge_pattern_, sum_grads
from ..patterns import PatternPlan
from ..testing.compare import rel_err
from . import repro
from .repro import call_extras, call_meta

ENV = "DILATED_ATTENTION_DEBUG"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "off", "no")


def _env_fraction(name: str) -> float:
    try:
        return min(max(float(os.environ.get(name, "0")), 0.0), 1.0)
    except ValueError:
        return 0.0


@dataclasses.dataclass(frozen=True)
class DebugSettings:
    """What debug mode does while on (``debug()``'s arguments; the defaults from the environment)."""

    shadow: float = 0.0  # fraction of kernel calls recomputed by the reference kernel
    sync: bool = True  # synchronise after each kernel call on CUDA
    repro_dir: str = "dilated_attention_repro"
    save_tensors: bool = False  # save the last call's tensors next to a repro


@dataclasses.dataclass
class DebugState:
    """Debug mode's state in this process: one instance, ``STATE``, owned by this module. ``enabled`` and
    ``settings`` are set by ``DILATED_ATTENTION_DEBUG`` at import and by ``debug()``, which restores them (and
    ``history``) on exit; on, ``_hook`` is registered at the kernel seam, and everything else is only touched
    while it is. ``history`` (recent calls' metadata) and ``last_tensors`` are a record for repros, not a cache:
    ``clear_history`` empties them, ``clear_caches`` does not."""

    enabled: bool = False
    settings: DebugSettings = DebugSettings()
    history: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=8))
    last_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    shadow_count: int = 0  # kernel calls seen by the shadow sampling


STATE = DebugState(settings=DebugSettings(shadow=_env_fraction(ENV + "_SHADOW"),
                                          repro_dir=os.environ.get(ENV + "_DIR") or "dilated_attention_repro",
                                          save_tensors=_env_flag(ENV + "_TENSORS")))


class DebugCheckError(ValueError):
    """A tensor reaching a kernel or a send broke an assumption (debug mode names which and where)."""


class KernelFault(RuntimeError):
    """A kernel call raised (or faulted asynchronously); the message names kernel, pattern, step and rank."""


class ShadowMismatch(AssertionError):
    """A kernel's result differs from the float64 reference kernel on the same inputs."""


def enabled() -> bool:
    """Is debug mode on? (One attribute read: call sites may test it on every call.)"""
    return STATE.enabled


def _set_enabled(on: bool) -> None:
    STATE.enabled = bool(on)
    (hooks.add_kernel_hook if STATE.enabled else hooks.remove_kernel_hook)(_hook)


def _hook(kernel, call: hooks.Call):
    """The kernel seam's view of a call while debug mode is on: its metadata recorded (the first time it is
    planned), shared with the kernel guard (``call.meta``), and its kernel checked (``DebugKernel``)."""
    options = call.options
    meta = call_meta(call.q, call.k, call.v, call.segment_lengths, call.dilation_rates, mode=options["mode"],
                     causal=options["causal"], softmax_scale=options["softmax_scale"], kernel=options["kernel"],
                     comm=call.comm, strategy=options["strategy"], pad_to_segments=options["pad_to_segments"],
                     head_offsets=options["head_offsets"])
    meta.update(call_extras(options["key_padding_mask"], options["cu_seqlens"], rank=meta["rank"],
                            world=meta["world_size"]))
    call.meta.update(meta)
    if call.record:
        record_call(call.meta, {"q": call.q, "k": call.k, "v": call.v})
    return wrap_kernel(kernel, call.meta)


@contextlib.contextmanager
def debug(enabled: bool = True, *, shadow: float | None = None, sync: bool = True, history: int | None = None,
          repro_dir: str | os.PathLike | None = None, save_tensors: bool | None = None) -> Iterator[None]:
    """Turn debug mode on (or off) inside a ``with`` block; settings are restored on exit.

    ``shadow``: fraction in [0, 1] of kernel calls re-checked against the reference kernel (default 0).
    ``sync``: wait for the GPU after each kernel call, so that an asynchronous CUDA fault is raised by the
    kernel that caused it, with its call's shapes and strides, instead of by a later unrelated line (slower;
    no effect on CPU). ``history``: how many recent calls' shapes, strides and options to keep (default 8);
    a repro file records how many there were. ``repro_dir``: where repro files go (default
    ``./dilated_attention_repro``). ``save_tensors``: also save the failing call's real input tensors next
    to its repro, so that a data-dependent failure replays exactly (files as large as the tensors; by
    default the repro records shapes and layouts and replays on random values).
    """
    if shadow is not None and not (isinstance(shadow, (int, float)) and 0.0 <= shadow <= 1.0):
        raise ValueError(f"shadow must be a fraction in [0, 1], got {shadow!r}")
    if history is not None and (not isinstance(history, int) or history < 1):
        raise ValueError(f"history must be a positive int, got {history!r}")
    changes: dict[str, Any] = {"sync": bool(sync)}
    if shadow is not None:
        changes["shadow"] = float(shadow)
    if repro_dir is not None:
        changes["repro_dir"] = os.fspath(repro_dir)
    if save_tensors is not None:
        changes["save_tensors"] = bool(save_tensors)
    saved = (STATE.enabled, STATE.settings, STATE.history)
    _set_enabled(enabled)
    STATE.settings = dataclasses.replace(STATE.settings, **changes)
    if history is not None:
        STATE.history = collections.deque(STATE.history, maxlen=history)
    try:
        yield
    finally:
        was_enabled, STATE.settings, STATE.history = saved
        _set_enabled(was_enabled)


# -- call metadata -------------------------------------------------------------------------------


def record_call(meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Keep ``meta`` in the ring buffer of recent calls (and the real tensors, if asked to save them)."""
    if not STATE.enabled:
        return
    STATE.history.append(dict(meta))
    if tensors is not None and STATE.settings.save_tensors:
        STATE.last_tensors = {n: t.detach() for n, t in tensors.items()}


def last_calls() -> list[dict[str, Any]]:
    """Metadata of the most recent calls, oldest first."""
    return [dict(m) for m in STATE.history]


def clear_history() -> None:
    STATE.history.clear()
    STATE.last_tensors = {}


# -- tensor checks ---------------------------------------------------------------------------------


def _where(meta: dict[str, Any] | None) -> str:
    if not meta:
        return ""
    parts = []
    for key in ("kernel", "op", "pattern", "step", "rank", "world_size", "backend"):
        if meta.get(key) is not None:
            parts.append(f"{key}={meta[key]}")
    return " [" + ", ".join(parts) + "]" if parts else ""


def layout_problems(name: str, t: torch.Tensor, *, accumulator: bool = False) -> list[str]:
    """Everything wrong with how ``t`` lies in memory (empty list: nothing)."""
    problems = []
    if any(s < 0 for s in t.stride()):
        problems.append(f"{name} has a negative stride {tuple(t.stride())}")
    if t.numel() and t.data_ptr() % t.element_size():
        problems.append(f"{name}'s data pointer {t.data_ptr():#x} is not aligned to its element size "
                        f"{t.element_size()} (misaligned address)")
    if t.numel():
        extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
        capacity = t.untyped_storage().nbytes() // t.element_size()
        if extent > capacity:
            problems.append(f"{name} (shape {tuple(t.shape)}, stride {tuple(t.stride())}, storage offset "
                            f"{t.storage_offset()}) reaches element {extent - 1} of a storage of {capacity}")
    if accumulator and self_overlapping(t):
        problems.append(f"{name} is written to but its elements overlap in memory (stride {tuple(t.stride())})")
    return problems


def self_overlapping(t: torch.Tensor) -> bool:
    """Could two indices of ``t`` address one element? (conservative: False means certainly not)"""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # largest offset reachable by the dims seen so far
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def check_tensor(name: str, t: Any, meta: dict[str, Any] | None = None, *, shape=None, dtype=None,
                 device=None, finite: bool = True, allow_inf: bool = False, accumulator: bool = False) -> None:
    """Raise ``DebugCheckError`` naming ``t`` and the call if it breaks an assumption."""
    where = _where(meta)
    if not isinstance(t, torch.Tensor):
        raise DebugCheckError(f"{name} must be a tensor, got {type(t).__name__}{where}")
    problems = []
    if shape is not None and tuple(t.shape) != tuple(shape):
        problems.append(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        problems.append(f"{name} has dtype {t.dtype}, expected {dtype}")
    if device is not None and t.device != device:
        problems.append(f"{name} is on {t.device}, expected {device}")
    problems += layout_problems(name, t, accumulator=accumulator)
    if finite and t.numel() and t.is_floating_point():
        bad = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]]
            kind = "NaN" if allow_inf else "NaN/inf"
            problems.append(f"{name} holds {int(bad.sum())} {kind} value(s), first at index {first}")
    if problems:
        raise DebugCheckError("; ".join(problems) + where)


def check_send(tensor: torch.Tensor, meta: dict[str, Any] | None = None) -> None:
    """A tensor about to be sent must be contiguous, aligned, inside its storage and finite."""
    if not STATE.enabled:
        return
    check_tensor("send buffer", tensor, meta)
    if not tensor.is_contiguous():
        raise DebugCheckError(
            f"send buffer (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}) is not contiguous: "
            f"a P2P send of a strided view sends the wrong bytes or faults (pack it first){_where(meta)}")


# -- kernel wrapper ---------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan_shapes(q, k, plan, packed: bool):
    """(expected k shape, compact out shape, compact lse shape) for a pattern call."""
    bsz, n, heads, dim = q.shape
    rows = n // plan.dilation
    kshape = (bsz, rows, plan.packed_heads, dim) if packed else None
    return kshape, (bsz, rows, heads, dim), (bsz, rows, heads)


def _covered_heads(plan) -> list[int]:
    return sorted({h for c in plan.chunks for h in range(c.h0, c.h1)})


def _shadow_due() -> bool:
    """Deterministic sampling: calls i where floor((i+1)f) > floor(i f) (exactly fraction f of calls)."""
    f = STATE.settings.shadow
    i = STATE.shadow_count
    STATE.shadow_count += 1
    return f > 0 and math.floor((i + 1) * f) > math.floor(i * f)


SHADOW_TOL = {torch.float64: 1e-8, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


class DebugKernel(KernelWrapper):
    """A ``PatternKernel`` that checks what goes in and out of another one (see module doc)."""

    def __init__(self, kernel, meta: dict[str, Any] | None = None) -> None:
        super().__init__(kernel)
        self.meta = meta if meta is not None else {}

    def _meta(self, op: str, plan) -> dict[str, Any]:
        # read at call time: the caller may update meta["step"] / meta["rank"] between calls
        return {**self.meta, "kernel": self.name, "op": op, "pattern": plan.index}

    def _inputs(self, meta, q, k, v, plan, packed):
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise DebugCheckError(f"q must be a (B, L, H, D) tensor, got {getattr(q, 'shape', type(q))}{_where(meta)}")
        bsz, n, heads, dim = q.shape
        if n % plan.local_segment or plan.local_segment % plan.dilation:
            raise DebugCheckError(f"q has {n} rows, not tiled by the plan's segment {plan.local_segment} "
                                  f"and dilation {plan.dilation}{_where(meta)}")
        kshape, _, _ = _plan_shapes(q, k, plan, packed)
        check_tensor("q", q, meta)
        check_tensor("k", k, meta, shape=kshape, dtype=q.dtype, device=q.device)
        check_tensor("v", v, meta, shape=tuple(k.shape), dtype=q.dtype, device=q.device)
        if not packed and (k.shape[0], k.shape[1], k.shape[3]) != (bsz, n, dim):
            raise DebugCheckError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}{_where(meta)}")
        hk = k.shape[2]
        needed = max((c.k1 for c in plan.chunks), default=0) if not packed else plan.packed_heads
        if hk < needed:
            raise DebugCheckError(f"k has {hk} heads, the plan reads up to head {needed - 1}{_where(meta)}")

    def _call(self, meta, q, fn, *args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            if STATE.settings.sync:
                _sync(q.device)
            return result
        except (DebugCheckError, ShadowMismatch):
            raise
        except Exception as exc:
            fault = KernelFault(f"{type(exc).__name__} in {meta['kernel']}.{meta['op']}{_where(meta)}: {exc}\n"
                                f"  q {_layout(q)}")
            on_exception(fault, meta)
            raise fault from exc

    def forward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                        spec: CallSpec) -> Result:
        meta = self._meta("forward_pattern", plan)
        self._inputs(meta, q, k, v, plan, spec.packed)
        out, lse = self._call(meta, q, self.inner.forward_pattern, q, k, v, plan, spec)
        _, oshape, lshape = _plan_shapes(q, k, plan, spec.packed)
        heads = _covered_heads(plan)
        check_tensor("out", out, meta, shape=oshape, dtype=q.dtype, device=q.device, finite=False)
        check_tensor("lse", lse, meta, shape=lshape, device=q.device, finite=False)
        # heads outside the plan's chunks are unspecified: only covered heads must be finite
        check_tensor("out (covered heads)", out[:, :, heads], meta)
        check_tensor("lse (covered heads)", lse[:, :, heads], meta, allow_inf=True)
        if _shadow_due():
            self._shadow_forward(meta, (q, k, v), plan, spec, (out, lse), heads)
        return out, lse

    def forward_pattern_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                             spec: CallSpec, running: Result, *, fresh: bool = False) -> None:
        meta = self._meta("forward_pattern_into", plan)
        self._inputs(meta, q, k, v, plan, spec.packed)
        out, lse = running
        # a fresh result's contents are ignored (any values): only its shape is checked
        check_tensor("out", out, meta, shape=q.shape, device=q.device, accumulator=True, finite=not fresh)
        check_tensor("lse", lse, meta, shape=q.shape[:3], device=q.device, allow_inf=True, finite=not fresh)
        before = None
        if _shadow_due():
            before = (torch.zeros_like(out), torch.full_like(lse, float("-inf"))) if fresh else (
                out.detach().clone(), lse.detach().clone())
        self._call(meta, q, self.inner.forward_pattern_into, q, k, v, plan, spec, running, fresh=fresh)
        check_tensor("out (after)", out, meta)
        check_tensor("lse (after)", lse, meta, allow_inf=True)
        if before is not None:
            d = [t.detach().double() for t in (q, k, v)]
            want_out, want_lse = (t.double() for t in before)
            merge_pattern_(want_out, want_lse, plan, *self._reference().forward_pattern(*d, plan, spec))
            _compare(meta, "out", out, want_out, q.dtype)
            _compare_lse(meta, lse, want_lse, q.dtype)

    def backward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, saved: Saved, grads: Grads, *, fresh: bool = False) -> None:
        meta = self._meta("backward_pattern", plan)
        self._inputs(meta, q, k, v, plan, spec.packed)
        self._saved(meta, q, saved)
        for name, acc, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            check_tensor(name, acc, meta, shape=like.shape, device=q.device, accumulator=True, finite=not fresh)
        shadow = _shadow_due()
        before = [torch.zeros_like(a) if fresh else a.detach().clone() for a in grads] if shadow else None
        self._call(meta, q, self.inner.backward_pattern, q, k, v, plan, spec, saved, grads, fresh=fresh)
        for name, acc in zip(("dq", "dk", "dv"), grads):
            check_tensor(name + " (after)", acc, meta)
        if shadow:
            self._shadow_backward(meta, (q, k, v), plan, spec, saved, grads, before)

    def backward_pattern_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                               spec: CallSpec, saved: Saved) -> Grads:
        meta = self._meta("backward_pattern_parts", plan)
        self._inputs(meta, q, k, v, plan, False)
        self._saved(meta, q, saved)
        grads = self._call(meta, q, self.inner.backward_pattern_parts, q, k, v, plan, spec, saved)
        rows = q.shape[1] // plan.dilation
        placed = []  # each part in full layout: the slots a combine reads (uncovered ones are unspecified)
        for name, grad, like, kv in zip(("dq", "dk", "dv"), grads, (q, k, v), (False, True, True)):
            check_tensor(name, grad, meta, shape=(like.shape[0], rows, *like.shape[2:]), dtype=q.dtype,
                         device=q.device, finite=False)
            placed.append(sum_grads(None, [Part(plan, grad, kv=kv)], like))
            check_tensor(name + " (covered slots)", placed[-1], meta)
        if _shadow_due():
            self._shadow_backward(meta, (q, k, v), plan, spec, saved, placed, [torch.zeros_like(p) for p in placed])
        return grads

    @staticmethod
    def _saved(meta: dict[str, Any], q: torch.Tensor, saved: Saved) -> None:
        """The final ``(out, lse, dout)`` a backward reads, against ``q``."""
        out, lse, dout = saved
        check_tensor("out", out, meta, shape=q.shape, device=q.device)
        check_tensor("lse", lse, meta, shape=q.shape[:3], device=q.device, allow_inf=True)
        check_tensor("dout", dout, meta, shape=q.shape, device=q.device)

    # -- shadow checks against the float64 reference kernel ---------------------------------------

    @staticmethod
    def _reference() -> ChunkLoop:
        return ChunkLoop(ReferenceKernel())

    def _shadow_forward(self, meta: dict[str, Any], inputs: tuple[torch.Tensor, ...], plan: PatternPlan,
                        spec: CallSpec, result: Result, heads: list[int]) -> None:
        """The call's compact ``result`` against the reference kernel's, on the covered ``heads``."""
        (out, lse), dtype = result, inputs[0].dtype
        ref_out, ref_lse = self._reference().forward_pattern(*(t.detach().double() for t in inputs), plan, spec)
        _compare(meta, "out", out[:, :, heads], ref_out[:, :, heads], dtype)
        _compare_lse(meta, lse[:, :, heads], ref_lse[:, :, heads], dtype)

    def _shadow_backward(self, meta: dict[str, Any], inputs: tuple[torch.Tensor, ...], plan: PatternPlan,
                         spec: CallSpec, saved: Saved, accs: Grads, before: list[torch.Tensor]) -> None:
        """What the call added to ``accs`` (from ``before``) against the reference kernel's gradients."""
        d = [t.detach().double() for t in (*inputs, *saved)]
        ref = tuple(torch.zeros(a.shape, dtype=torch.float64, device=a.device) for a in accs)
        self._reference().backward_pattern(*d[:3], plan, spec, tuple(d[3:]), ref)
        for name, acc, b, r in zip(("dq", "dk", "dv"), accs, before, ref):
            _compare(meta, name, acc.detach().double() - b.double(), r, inputs[0].dtype)


def _compare_lse(meta, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """lse in absolute terms (a log: its relative error means little); infinite entries must match."""
    got = got.double()
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        raise ShadowMismatch(f"lse is finite where the reference kernel's is not (or the reverse){_where(meta)}")
    err = (got[fin] - want[fin]).abs().max().item() if bool(fin.any()) else 0.0
    if not err <= 20 * SHADOW_TOL[dtype]:
        raise ShadowMismatch(f"lse differs from the reference kernel by {err:.3e}{_where(meta)}")


def _compare(meta, name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(got, want)
    if not err <= SHADOW_TOL[dtype]:
        diff = (got.double() - want).abs()
        worst = [int(i) for i in torch.nonzero(diff == diff.max())[0]]
        raise ShadowMismatch(f"{name} differs from the reference kernel: relative error {err:.3e} > "
                             f"{SHADOW_TOL[dtype]:.0e}, worst at index {worst} (batch, row, head, dim) of "
                             f"shape {tuple(got.shape)}{_where(meta)}")


def _layout(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} stride {tuple(t.stride())} offset {t.storage_offset()} {t.dtype} {t.device}"


def wrap_kernel(kernel, meta: dict[str, Any] | None = None):
    """``kernel`` (a PatternKernel) with debug checks around every call; ``kernel`` itself when off."""
    if not STATE.enabled or isinstance(kernel, DebugKernel):
        return kernel
    return DebugKernel(kernel, meta)


# -- exceptions -> repro files -----------------------------------------------------------------------


def on_exception(exc: BaseException, meta: dict[str, Any] | None = None) -> str | None:
    """Write a repro for the failing call (once per exception) and say where; returns the path.

    ``meta`` is the failing call's ``call_meta`` (the last recorded call if None).
    """
    if not STATE.enabled or getattr(exc, "_dilated_attention_repro", None):
        return getattr(exc, "_dilated_attention_repro", None)
    spec = dict(meta) if meta else (dict(STATE.history[-1]) if STATE.history else None)
    if spec is None or "q" not in spec:
        return None
    spec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    spec["recent_calls"] = len(STATE.history)
    try:
        path = repro.write(spec, directory=STATE.settings.repro_dir,
                           tensors=dict(STATE.last_tensors) if STATE.settings.save_tensors else None)
    except Exception as write_error:  # never hide the user's error behind ours
        warnings.warn(f"dilated_attention debug: could not write a repro ({write_error})", stacklevel=2)
        return None
    try:
        exc._dilated_attention_repro = path  # type: ignore[attr-defined]
        exc.add_note(f"dilated_attention debug: repro written to {path} "
                     f"(replay: python scripts/repro.py replay {path})")
    except AttributeError:  # exceptions with __slots__
        pass
    warnings.warn(f"dilated_attention debug: repro written to {path}", stacklevel=2)
    return path


_set_enabled(_env_flag(ENV))
