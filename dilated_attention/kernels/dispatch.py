"""Choose the block kernel per call and validate it can run before any launch.

``kernel="auto"`` takes the first kernel whose ``supports()`` accepts the
inputs: fused (CUDA + Triton), then SDPA, then the reference. On a GPU model
with measurements in ``auto_table.py`` the fused kernel comes wrapped in
``auto.AutoKernel``, which runs each pattern and direction on the implementation
measured fastest there (fused, zero-copy cuDNN, cuDNN with its deterministic
backward through the cuDNN frontend, cuDNN with the fused dQ, or flash-attn-4 where it is
installed and the GPU runs it). Falling back from fused warns
once with the reason (shared memory, alignment, dtype, ...), so a configuration
that would fail at launch never reaches the GPU. Naming a kernel forces it and
raises ``ValueError`` with the reason when it cannot run. Masked calls (``key_padding_mask``,
``cu_seqlens``, internal padding) need a kernel with ``key_masks``: fused or reference; calls whose
masks are all the library's own padding (``cu_seqlens``, internal padding: ``protocol.py``'s padding
masks) also run on ``kernel="flash4"`` (``auto`` keeps them fused: measured as fast).
"""

from __future__ import annotations

import warnings

import torch

from .. import caches
from ..callers import user_stacklevel
from .auto import AutoKernel, available_choices, device_choices, nondeterministic_allowed, ranked, table_gap
from .chunk_loop import ChunkLoop
from .flash4 import unavailable_reason as flash4_unavailable
from .protocol import (OPTIONAL_MEMBERS, REQUIRED_MEMBERS, BlockKernel, PatternKernel, PatternKernelBase, takes_masks,
                       takes_padding_masks)
from .registry import FLASH4_NAMES, KERNEL_NAMES, KERNELS, build_kernel
from .wrapper import WithDefaults

_warned = caches.keys("dispatch.warned", 256)
_auto_kernels = caches.table("dispatch.auto_kernels", 64)  # per GPU model and determinism setting


# one instance per name: a kernel keeps per-geometry caches (cudnn-det's graphs take 0.5 s to build)
_make = caches.memoize("dispatch.kernels", len(KERNELS))(build_kernel)


def select_kernel(kernel: str | BlockKernel | PatternKernel, q: torch.Tensor, k: torch.Tensor,
                  masked: bool = False, padding_only: bool = False) -> PatternKernel:
    """The pattern-level kernel to run (a ``BlockKernel`` object is wrapped in ``ChunkLoop``, a ``PatternKernel``
    written without the optional members in ``WithDefaults``);
    ``masked``: the call has key masks, so the kernel must take them; ``padding_only``: they are all
    padding masks (``protocol.py``), which a kernel with ``padding_masks`` takes too."""
    if isinstance(kernel, str):  # (first: a Protocol isinstance check costs 20 us)
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {kernel!r}")
        if kernel == "auto":
            return _auto(q, k, masked)
        chosen = _make(kernel)
    elif isinstance(kernel, PatternKernelBase) or isinstance(kernel, PatternKernel):
        chosen = kernel
    elif not (missing := [m for m in REQUIRED_MEMBERS if not hasattr(kernel, m)]):
        _check_no_partial_defaults(kernel)
        chosen = WithDefaults(kernel)  # written without PatternKernel's optional members: their defaults
    elif isinstance(kernel, BlockKernel):
        chosen = ChunkLoop(kernel)
    else:
        raise TypeError(
            f"kernel must be one of {KERNEL_NAMES}, a BlockKernel or a PatternKernel, got {type(kernel).__name__}"
            + (f" (as a PatternKernel it lacks {missing}; parts/backward_pattern_parts are new in this release, "
               f"kernels/protocol.py)" if hasattr(kernel, "forward_pattern") else "")
        )
    reason = chosen.supports(q, k)
    if reason is None and masked and not takes_masks(chosen, padding_only):
        reason = ("it takes no key_padding_mask; use 'fused' or 'reference'" if takes_padding_masks(chosen)
                  else "it takes no key mask (key_padding_mask, cu_seqlens or internal padding); use 'fused' or "
                       "'reference'")
    if reason is not None:
        raise ValueError(f"kernel={chosen.name!r} cannot run on these inputs: {reason}")
    return chosen


def _check_no_partial_defaults(kernel) -> None:
    """A kernel of the required members only may not set what only ``PatternKernelBase``'s members read (the optional
    members would not see it): ``TypeError`` naming the fix."""
    settings = [m for m in ("padding_masks", "causal_block", *OPTIONAL_MEMBERS) if hasattr(kernel, m)]
    if settings:
        raise TypeError(f"kernel {type(kernel).__name__} sets {sorted(set(settings))} but not every optional "
                        f"PatternKernel member {list(OPTIONAL_MEMBERS)}: derive it from "
                        f"dilated_attention.kernels.PatternKernelBase, which reads them (kernels/protocol.py)")


def _auto(q: torch.Tensor, k: torch.Tensor, masked: bool) -> PatternKernel:
    """Masked calls run fused, padding masks too: flash-attn-4 takes those, but through the API it measured no
    faster than fused on packed documents (``benchmarks/bench_masks.py --kernel auto,flash4,fused``)."""
    if q.device.type == "cuda":
        fused = _make("fused")
        reason = fused.supports(q, k)
        if reason is None:
            return fused if masked else _measured(q.device, fused)
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"dilated_attention: fused kernel not used ({reason}); falling back",
                          stacklevel=user_stacklevel())
    if q.dtype != torch.float64 and not masked:
        sdpa = _make("sdpa")
        if sdpa.supports(q, k) is None:
            return sdpa
    return _make("reference")


def auto_implementations(device: torch.device) -> dict[str, PatternKernel]:
    """The implementations ``kernel="auto"`` may run on this device: fused, the cuDNN kernels, and flash-attn-4
    where it is installed and the GPU runs it (sm90+); the table's other names are dropped."""
    names = ("fused", "cudnn", "cudnn-det", "cudnn-dkdv") + (FLASH4_NAMES if flash4_unavailable(device) is None else ())
    return {name: _make(name) for name in names}


def _measured(device: torch.device, fused: PatternKernel) -> PatternKernel:
    """The fused kernel, inside an ``AutoKernel`` when this GPU model's measured choices name another
    implementation for some pattern (with the nondeterministic entries only when they are allowed)."""
    key = (torch.cuda.get_device_name(device), nondeterministic_allowed(), flash4_unavailable(device) is None)
    chosen = _auto_kernels.get(key)
    if chosen is None:
        impls = {**auto_implementations(device), "fused": fused}
        chosen = auto_for(available_choices(device_choices(device), impls), impls, allow_nondeterministic=key[1])
        _auto_kernels[key] = chosen
        gap = table_gap(key[0], impls)
        if gap is not None:
            warnings.warn(f"dilated_attention: {gap}; measure this GPU with `python benchmarks/bench_kernel.py` and "
                          "`--write-table` (docs/performance.md), or pass one by name (kernel=...)",
                          stacklevel=user_stacklevel())
    return chosen


def auto_for(choices: dict[str, str], impls: dict[str, PatternKernel], *, allow_nondeterministic: bool
             ) -> PatternKernel:
    """``impls["fused"]`` itself when every choice that can apply names it (no per-call lookup), else an
    ``AutoKernel`` over ``impls`` (which validates the table)."""
    auto = AutoKernel(impls, choices, allow_nondeterministic=allow_nondeterministic)  # refuses a bad table
    applicable = [ranked(v)[0] for k, v in choices.items() if allow_nondeterministic or not k.startswith("bwd-any/")]
    return impls["fused"] if all(name == "fused" for name in applicable) else auto
