"""Kernel-failure guard: a failing kernel call says what was launched and what to do next.

``guard_kernel(kernel, meta)`` wraps a ``PatternKernel``:

* a **launch-resource error** (Triton's ``OutOfResources``, "out of resource:
  shared memory", too many registers/threads for a launch) happens before any
  work is done on the GPU and leaves the context healthy: the call is re-run on
  the SDPA path (the reference path where SDPA cannot run), with one warning per
  reason, and later calls with the same kernel, dtype and head dim go straight to
  the fallback;
* a **sticky CUDA error** (illegal memory access, misaligned address,
  unspecified launch failure, device-side assert, illegal instruction) poisons
  the CUDA context: it is re-raised with the call's shapes, strides and pattern,
  says plainly that the process must restart (no device reset "recovers" it: the
  memory it corrupted is still in use), and points at ``scripts/repro.py`` and
  ``scripts/sanitize.py``;
* any other CUDA error is re-raised with the same details;
* everything else (``ValueError``, ``TypeError``, ...) passes through untouched.

The guard adds one ``try`` per kernel call: nothing measurable next to a launch. ``functional`` wraps
every kernel a call plans in it (outermost, around whatever debug mode or the audit added).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from .. import caches
from ..callers import user_stacklevel
from .dispatch import select_kernel
from .protocol import Op, call_tensors, run
from .wrapper import KernelWrapper

RESOURCE = re.compile(r"out of resource|outofresources|shared memory|too many resources requested|"
                      r"registers|cudaErrorLaunchOutOfResources", re.I)
STICKY = re.compile(r"illegal memory access|misaligned address|unspecified launch failure|device-side assert|"
                    r"illegal instruction|illegal address|invalid program counter|hardware stack error|"
                    r"cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL", re.I)
CUDA = re.compile(r"\bCUDA\b|cuda error|CUBLAS_STATUS|CUDNN_STATUS|NCCL|triton", re.I)

_warned = caches.keys("guard.warned", 256)
_fallen_back = caches.table("guard.fallen_back", 256)  # (kernel, dtype, head dim, device type) -> reason
# Launch resources depend on the kernel's config (dtype, head dim), not on shapes: once a backward of a
# key has run, it will launch again. Until then its accumulators are snapshotted, because a backward is
# several launches and one may fail after another already added into dq.
_proven = caches.keys("guard.proven", 256)


def classify_error(exc: BaseException) -> str | None:
    """``"resource"``, ``"sticky"``, ``"cuda"`` or ``None`` (not a GPU error: let it through)."""
    if isinstance(exc, (ValueError, TypeError, KeyboardInterrupt)):
        return None
    text = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ == "OutOfResources" or (RESOURCE.search(text) and "memory access" not in text):
        if "out of memory" in text.lower() and "shared memory" not in text.lower():
            return "cuda"  # a plain CUDA OOM is not a launch-resource error: a smaller kernel will not fix it
        return "resource"
    if STICKY.search(text):
        return "sticky"
    if isinstance(exc, RuntimeError) and CUDA.search(text):
        return "cuda"
    return None


def _describe(op: Op, args: tuple) -> str:
    """Each tensor of the call: shape, strides, offset, dtype, device, alignment."""
    parts = []
    for name, t in call_tensors(op, args):
        if isinstance(t, torch.Tensor):
            parts.append(f"  {name}: shape {tuple(t.shape)} stride {tuple(t.stride())} offset {t.storage_offset()} "
                         f"{t.dtype} {t.device} ptr%16={t.data_ptr() % 16}")
    return "\n".join(parts)


def _where(meta: dict[str, Any], plan, op: str, kernel_name: str) -> str:
    bits = [f"kernel {kernel_name!r}.{op}", f"pattern {plan.index} (segment {plan.segment}, dilation {plan.dilation}, "
            f"ring size {plan.ring_size})"]
    for key in ("step", "rank", "world_size", "backend"):
        if meta.get(key) is not None:
            bits.append(f"{key} {meta[key]}")
    return ", ".join(bits)


ADVICE = ("  next: rerun with DILATED_ATTENTION_DEBUG=1 to write a repro file, replay it with "
          "`python scripts/repro.py replay <file>`, and run it under the sanitizer with "
          "`python scripts/sanitize.py --repro <file>` (memcheck names the faulting access)")


class KernelError(RuntimeError):
    """A CUDA error inside one of our kernels, with the call's details."""


class GuardedKernel(KernelWrapper):
    """A ``PatternKernel`` whose GPU failures are explained (and launch-resource failures survived)."""

    def __init__(self, kernel, meta: dict[str, Any] | None = None, fallback=None) -> None:
        super().__init__(kernel)
        self.meta = meta if meta is not None else {}
        self._fallback = fallback

    def _key(self, q) -> tuple:
        return (self.name, q.dtype, q.shape[-1], q.device.type)

    def fallback_kernel(self, q, k, masked: bool = False):
        if self._fallback is not None:
            return self._fallback
        if q.dtype != torch.float64 and not masked:  # SDPA's ops take no key mask
            try:
                return select_kernel("sdpa", q, k)
            except ValueError:
                pass
        return select_kernel("reference", q, k)

    def target(self, direction, plan, causal, q, k, masked):
        """The fallback once this kernel's configuration failed to launch (``parts`` asks it too: a fallback,
        ``ChunkLoop``, leaves parts wherever the layout allows, at least where this kernel does)."""
        return self.fallback_kernel(q, k, masked) if self._key(q) in _fallen_back else self.inner

    def call(self, op: Op, args: tuple, kwargs: dict[str, Any]):
        q, k, plan, masked = args[0], args[1], args[3], args[4].key_mask is not None
        key = self._key(q)
        if key in _fallen_back:
            return run(op, self.fallback_kernel(q, k, masked), args, kwargs)
        # the accumulators a call adds into (dq, dk, dv; the running out, lse)
        accs = args[6] if op == Op.BACKWARD else args[5] if op == Op.FORWARD_INTO else ()
        snapshot = [a.clone() for a in accs] if accs and key not in _proven else None
        try:
            result = run(op, self.inner, args, kwargs)
            if accs:
                _proven.add(key)
            return result
        except Exception as exc:
            kind = classify_error(exc)
            if kind is None:
                raise
            where = _where(self.meta, plan, op, self.name)
            if kind == "resource":
                reason = str(exc).splitlines()[0][:300]
                fb = self.fallback_kernel(q, k, masked)
                for acc, before in zip(accs, snapshot or ()):
                    acc.copy_(before)  # undo what the launches before the failing one added
                _fallen_back[key] = reason
                if reason not in _warned:
                    _warned.add(reason)
                    warnings.warn(f"dilated_attention: {where} could not launch ({reason}); using the {fb.name!r} "
                                  f"path for {q.dtype} head dim {q.shape[-1]} from now on", RuntimeWarning,
                                  stacklevel=user_stacklevel())
                return run(op, fb, args, kwargs)
            sticky = kind == "sticky"
            msg = (f"{type(exc).__name__} in {where}: {str(exc).strip().splitlines()[0][:500]}\n"
                   f"{_describe(op, args)}\n")
            if sticky:
                msg += ("  this error leaves the CUDA context unusable: every later CUDA call in this process will "
                        "fail. Restart the process (a device reset does not make the corrupted state safe).\n")
            raise KernelError(msg + ADVICE) from exc


def guard_kernel(kernel, meta: dict[str, Any] | None = None, fallback=None):
    """``kernel`` wrapped in the guard (see the module doc). ``meta`` may carry step/rank/world_size/backend."""
    if isinstance(kernel, GuardedKernel):
        return kernel
    return GuardedKernel(kernel, meta, fallback)


def reset() -> None:
    """Forget fallbacks and warnings (tests; a process whose GPU config changed); ``clear_caches`` does too."""
    _warned.clear()
    _fallen_back.clear()
    _proven.clear()
