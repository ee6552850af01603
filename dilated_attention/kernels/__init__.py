"""The local block: ``(q, k, v)`` views of one pattern -> ``(out, lse)``, forward and backward.

* ``protocol``: the interfaces (``BlockKernel``, ``PatternKernel``, the defaults of its optional members in
  ``PatternKernelBase``, ``CallSpec``: how a pattern call scores its keys) and the layouts they exchange
* ``wrapper``: ``KernelWrapper``, the base of a kernel that changes another one; ``chunk_loop``: ``ChunkLoop``
* one module per implementation: ``reference`` (plain torch, the oracle), ``sdpa``, ``fused`` (Triton; its configs
  in ``fused_config``), ``view_kernel`` (the zero-copy view logic on any ``AttentionOps``) with its ops in
  ``cudnn``/``cudnn_frontend``/``flash4``
* ``registry``: kernel names -> how to build each; ``dispatch``: the choice per call (``kernel="auto"``,
  with ``auto``'s measured table); ``guard``: resource-error fallback and explained CUDA errors
"""

from .protocol import BlockKernel, CallSpec, PatternKernel, PatternKernelBase
from .wrapper import KernelWrapper

__all__ = ["BlockKernel", "CallSpec", "KernelWrapper", "PatternKernel", "PatternKernelBase"]
