"""LongNet-style dilated attention with ring sequence parallelism."""

import os as _os

from .caches import cache_info, clear_caches
from .functional import dilated_attention
from .memory import set_memory_bound
from .modules import DilatedAttention, MultiheadDilatedAttention

__all__ = ["dilated_attention", "DilatedAttention", "MultiheadDilatedAttention", "debug", "cache_info",
           "clear_caches", "set_memory_bound"]
__version__ = "0.1.0"

# DILATED_ATTENTION_DEBUG=1: debug mode loads now and registers itself at the kernel seam (hooks.py)
if _os.environ.get("DILATED_ATTENTION_DEBUG", "0").strip().lower() not in ("", "0", "false", "off", "no"):
    from .diagnostics import debug as _debug_mode  # noqa: F401


def __getattr__(name: str):
    if name == "debug":  # the context manager, loaded on first use (the call path never imports diagnostics)
        from .diagnostics.debug import debug

        return debug
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
