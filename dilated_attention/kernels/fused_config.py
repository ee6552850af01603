"""The fused kernel's pinned launch configurations (``FusedConfig``) and whether one fits a device's shared memory.

Nothing is autotuned: each head dim and dtype has one config, measured (``gpu_config``), or small tiles under
Triton's interpreter; the benchmark sweeps configs by constructing kernels with other configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import caches
from ..triton_support import interpreting


def padded_dim(dim: int) -> int:
    """The tile width for head dim ``dim``: the next power of two, at least 16 (``tl.arange``
    needs a power of two, ``tl.dot`` a K dim of 16); the extra columns are masked to zero."""
    return max(16, 1 << (dim - 1).bit_length())


@dataclass(frozen=True)
class FusedConfig:
    """Pinned launch parameters of each kernel: ``*_m``/``*_n`` query/key block rows, then warps and
    software-pipelining stages (the three kernels are tuned independently)."""

    fwd_m: int
    fwd_n: int
    fwd_warps: int
    fwd_stages: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dq_stages: int
    dkdv_m: int
    dkdv_n: int
    dkdv_warps: int
    dkdv_stages: int

    def __post_init__(self) -> None:
        for name in ("fwd_m", "fwd_n", "dq_m", "dq_n", "dkdv_m", "dkdv_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"FusedConfig.{name} must be a power of two >= 16, got {val}")
        for big, small in (("fwd_m", "fwd_n"), ("dq_m", "dq_n"), ("dkdv_n", "dkdv_m")):
            if getattr(self, big) % getattr(self, small):
                raise ValueError(f"FusedConfig.{big} must be a multiple of {small} (causal diagonal blocks)")

    def smem_bytes(self, dim: int, elem: int) -> dict[str, int]:
        """Estimated shared memory per program of each kernel (pipelined tiles + layout scratch)."""
        fwd = elem * (self.fwd_m * dim + self.fwd_stages * 2 * self.fwd_n * dim) + 4 * self.fwd_m * self.fwd_n
        dq = elem * (2 * self.dq_m * dim + self.dq_stages * 2 * self.dq_n * dim) + 4 * self.dq_m * self.dq_n
        dkdv = elem * (2 * self.dkdv_n * dim + self.dkdv_stages * 2 * self.dkdv_m * dim) + 4 * self.dkdv_m * self.dkdv_n
        return {"forward": fwd, "dq": dq, "dkdv": dkdv}


# Interpreter: small tiles, but not the smallest: its cost is per program and per op, not per element (a 256-row
# LongNet forward+backward on CPU took half the time on 32-row tiles as on 16-row ones).
_INTERPRET_CONFIG = FusedConfig(32, 32, 1, 1, 32, 32, 1, 1, 32, 32, 1, 1)


def default_config(dim: int, dtype: torch.dtype) -> FusedConfig:
    """The pinned config for a head dim and dtype: ``gpu_config`` on a GPU, 32-row tiles when interpreting."""
    return _INTERPRET_CONFIG if interpreting() else gpu_config(dim, dtype)


def gpu_config(dim: int, dtype: torch.dtype) -> FusedConfig:
    """The pinned GPU config: ``bench_kernel.py --sweep`` on an H200 and an H100 (one kernel varied at a
    time, LongNet B=1 N=32768 H=16).

    Hopper's wgmma gives each warpgroup (4 warps) 64 rows of a dot's M dim. 16-bit D=128: the forward's
    64x64 tile with 4 warps and 3 stages is fastest; the dQ kernel runs 128 query rows on 8 warps, dK/dV
    32 query rows per step on 4 warps (its 128-key tile spills registers at D=128, not at D=64), both
    3-stage pipelined (1.2-1.3x faster backward than 2 stages on both GPUs). D=64 was swept on an H100
    only; fp32 and D=256 keep their earlier configs (not re-swept).
    """
    big = dtype == torch.float32
    dim = padded_dim(dim)
    if dim <= 64:
        return FusedConfig(64, 32, 4, 2, 64, 32, 4, 2, 32, 64, 4, 2) if big else FusedConfig(128, 64, 4, 3, 128, 64, 8, 3, 32, 128, 4, 3)
    if dim == 128:
        return FusedConfig(64, 32, 4, 2, 64, 32, 8, 2, 32, 64, 8, 2) if big else FusedConfig(64, 64, 4, 3, 128, 64, 8, 3, 32, 64, 4, 3)
    # head dim 256
    return FusedConfig(32, 32, 4, 1, 32, 32, 8, 1, 16, 32, 8, 1) if big else FusedConfig(64, 64, 8, 2, 64, 32, 8, 1, 16, 32, 8, 1)


@caches.memoize("fused.shared_memory_reason", 256)  # asked on every call (``supports``)
def shared_memory_reason(cfg: FusedConfig, dim: int, dtype: torch.dtype, limit: int) -> str | None:
    """``None`` if every kernel of ``cfg`` fits ``limit`` bytes of shared memory, else why not."""
    elem = torch.empty((), dtype=dtype).element_size()
    for kern, need in cfg.smem_bytes(padded_dim(dim), elem).items():
        if need > limit:
            return (
                f"out of resource: shared memory: the {kern} kernel needs about {need} bytes "
                f"for head dim {dim} {dtype} with {cfg}, the device allows {limit}"
            )
    return None


@caches.memoize("fused.device_shared_memory", 64)
def _shared_memory(index: int) -> int:
    """Shared memory a block may opt in to on CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin
