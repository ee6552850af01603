"""LongNet-style dilated attention with ring sequence parallelism."""

from .diagnostics.debug import debug
from .functional import dilated_attention
from .modules import DilatedAttention, MultiheadDilatedAttention

__all__ = ["dilated_attention", "DilatedAttention", "MultiheadDilatedAttention", "debug"]
__version__ = "0.1.0"
