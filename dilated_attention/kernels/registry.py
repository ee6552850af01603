"""Kernel names: each implementation ``kernel="<name>"`` selects, and how to build it.

Adding a kernel is a ``PatternKernel`` (or a ``BlockKernel``, run through ``ChunkLoop``) and one line
here: ``dispatch.select_kernel`` accepts the name, and ``benchmarks/bench_kernel.py`` builds it the same
way. ``"auto"`` is not a kernel of its own but a choice among these (``dispatch``).
"""

from __future__ import annotations

from typing import Callable

from .chunk_loop import ChunkLoop
from .cudnn import CudnnDkdvKernel, CudnnKernel
from .cudnn_frontend import CAUSAL_BLOCK, CudnnFrontendOps
from .flash4 import Flash4Kernel, Flash4Ops
from .fused import FusedKernel
from .protocol import PatternKernel
from .reference import ReferenceKernel
from .sdpa import SdpaKernel

FLASH4_NAMES = ("flash4", "flash4-nondet")  # the kernels that need flash-attn-4 (offered to auto where it runs)

KERNELS: dict[str, Callable[[], PatternKernel]] = {
    "fused": FusedKernel,
    "cudnn": CudnnKernel,
    "cudnn-det": lambda: CudnnKernel(CudnnFrontendOps(), causal_block=CAUSAL_BLOCK),  # (measured: cudnn_frontend.py)
    "cudnn-dkdv": CudnnDkdvKernel,
    "flash4": Flash4Kernel,  # flash-attn-4, deterministic backward (pip install ".[flash4]")
    "flash4-nondet": lambda: Flash4Kernel(Flash4Ops(deterministic=False), causal_block=0),  # its default backward
    "sdpa": lambda: ChunkLoop(SdpaKernel("flash")),
    "sdpa-cudnn": lambda: ChunkLoop(SdpaKernel("cudnn")),
    "reference": lambda: ChunkLoop(ReferenceKernel()),
}
KERNEL_NAMES = ("auto", *KERNELS)


def build_kernel(name: str) -> PatternKernel:
    """A new instance of the kernel ``name`` (one of ``KERNELS``)."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}")
    return KERNELS[name]()


__all__ = ["KERNELS", "KERNEL_NAMES", "build_kernel"]
