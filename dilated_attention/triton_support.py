"""Triton, where it is importable, and what the code launching Triton kernels shares (``kernels/fused.py``,
``merge``): the interpreter switch, one table of jitted kernels, and ``launch``.

Kernels are jitted at first use, not at import, so ``TRITON_INTERPRET`` is read when a kernel first runs; a
process runs in one mode (Triton decides at its own import whether its library functions are interpreted),
and the table keys each kernel by the mode it was jitted for.

``launch`` is ``fn[grid](*args, **meta)`` with Triton's per-launch work done once per specialization: Triton's
launcher binds every argument, specializes it, builds a cache key and reads the device and stream anew on each
launch, about as much host time as a LongNet step's own Python between its 25-45 launches. A launch whose
arguments specialize as an earlier one's did reuses that launch's compiled kernel and calls its launcher
directly.
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import caches

try:
    import triton

    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"

# (interpreting, kernel function) -> the jitted kernel (a handful per process)
JITTED = caches.table("triton_support.jitted", 64)


@caches.memoize("triton_support.interpreting", 1)  # asked on every launch; read once (one mode per process)
def interpreting() -> bool:
    """Is Triton's interpreter on (``TRITON_INTERPRET=1``: the kernels run on CPU tensors)?"""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# (kernel, device, options, meta, argument specialization) -> (compiled kernel, constexpr values after the args)
_COMPILED = caches.table("triton_support.compiled", 4096)
# Triton releases whose compiled kernels are launched as ``run(grid, stream, function, packed metadata,
# launch metadata, enter hook, exit hook, *every argument)`` (read in their ``JITFunction.run``): others always
# launch through Triton.
_DIRECT_LAUNCH = ("3.4.", "3.5.", "3.6.", "3.7.", "3.8.", "3.9.")
DIRECT = triton is not None and triton.__version__.startswith(_DIRECT_LAUNCH)


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's, e.g. Proton's): it needs Triton's launch metadata."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _specialization(args: tuple) -> tuple:
    """What Triton's specialization reads of ``args``, or finer: a tensor's dtype and whether its address is
    16-byte aligned, every other value itself (ints exactly; a float by type only, as Triton never specializes
    a non-constexpr float)."""
    return tuple((a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor) else
                 (float if type(a) is float else a) for a in args)


def _key(fn, device: int, options: dict, meta: dict, args: tuple) -> tuple:
    return (fn, device, tuple(options.items()), tuple(meta.items()), _specialization(args))


def _grid3(grid: tuple) -> tuple[int, int, int]:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


def _run(hit: tuple, grid3: tuple[int, int, int], device: int, args: tuple) -> None:
    """A compiled kernel (``hit``: it and its constexpr values) launched through its own launcher on ``device``'s
    current stream, with the arguments Triton would pass."""
    compiled, consts = hit
    compiled.run(*grid3, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *consts)


def launch(fn, grid: tuple, args: tuple, meta: dict, **options) -> None:
    """``fn[grid](*args, **meta, **options)`` on the current CUDA device and stream (``options``: ``num_warps``,
    ``num_stages``; not passed to the interpreter). ``args`` are the kernel's leading parameters, ``meta`` by name
    every later one (its constexprs).
    The first launch of each specialization goes through Triton (compiling if needed); later ones call the
    compiled kernel's launcher with the same arguments Triton would pass. Under the interpreter, or while a
    launch hook is set (a profiler's), every launch goes through Triton."""
    if interpreting():  # (the interpreter takes no launch options)
        fn[grid](*args, **meta)
        return
    if not DIRECT or _hooked():
        fn[grid](*args, **meta, **options)
        return
    device = torch.cuda.current_device()
    key = _key(fn, device, options, meta, args)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = fn[grid](*args, **meta, **options)
        rest = fn.arg_names[len(args):]
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")) and set(rest) == set(meta):
            _COMPILED[key] = (compiled, tuple(meta[name] for name in rest))  # (else Triton's path every time)
        return
    _run(hit, _grid3(grid), device, args)


def other_device(device: torch.device) -> bool:
    """Whether launching for tensors on ``device`` needs it made current first: Triton launches on the current
    device, and entering the device guard costs as much as a launch, so it is entered only where needed."""
    return device.type == "cuda" and torch.cuda.current_device() != device.index


def made_current(device: torch.device):
    """A context in which ``device`` (a launch's tensors') is the current one: entered only where it is not
    (``other_device``)."""
    return torch.cuda.device(device) if other_device(device) else contextlib.nullcontext()


def launch_on(device: torch.device, fn, grid: tuple, args: tuple, meta: dict, **options) -> None:
    """``launch`` with ``device`` (the tensors') current (``made_current``)."""
    with made_current(device):
        launch(fn, grid, args, meta, **options)


class Prepared:
    """One ``launch`` (kernel, grid, constexprs, options) for arguments that always specialize alike, its key
    worked out once: ``Prepared(fn, grid, meta, **options)(*args)``. The caller vouches that every call's
    ``args`` specialize as the first call's did (equal integers, tensors of the same dtypes and 16-byte
    alignment): the compiled kernel found for the first is called directly after, with no per-argument work.
    The first call, the interpreter, a launch hook, or another current device go through ``launch``."""

    __slots__ = ("fn", "grid", "meta", "options", "device", "compiled")

    def __init__(self, fn, grid: tuple, meta: dict, **options) -> None:
        self.fn, self.meta, self.options = fn, meta, options
        self.grid = _grid3(grid)
        self.device, self.compiled = None, None

    def __call__(self, *args) -> None:
        if self.compiled is not None and not _hooked():
            device = torch.cuda.current_device()
            if device == self.device:
                _run(self.compiled, self.grid, device, args)
                return
        launch(self.fn, self.grid, args, self.meta, **self.options)
        if self.compiled is None and DIRECT and not interpreting():
            self.device = torch.cuda.current_device()
            self.compiled = _COMPILED.get(_key(self.fn, self.device, self.options, self.meta, args))
