"""LongNet-style dilated attention with ring sequence parallelism."""

from .functional import dilated_attention
from .modules import DilatedAttention, MultiheadDilatedAttention

__all__ = ["dilated_attention", "DilatedAttention", "MultiheadDilatedAttention"]
__version__ = "0.1.0"
