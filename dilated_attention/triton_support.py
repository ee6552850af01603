"""Triton, where it is importable, and what the code launching Triton kernels shares (``kernels/fused.py``,
``merge.py``): the interpreter switch and one table of jitted kernels.

Kernels are jitted at first use, not at import, so ``TRITON_INTERPRET`` is read when a kernel first runs; a
process runs in one mode (Triton decides at its own import whether its library functions are interpreted),
and the table keys each kernel by the mode it was jitted for.
"""

from __future__ import annotations

import os

from . import caches

try:
    import triton

    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"

# (interpreting, kernel function) -> the jitted kernel (a handful per process)
JITTED = caches.table("triton_support.jitted", 64)


def interpreting() -> bool:
    """Is Triton's interpreter on (``TRITON_INTERPRET=1``: the kernels run on CPU tensors)?"""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


__all__ = ["JITTED", "TRITON_ERROR", "interpreting", "triton"]
