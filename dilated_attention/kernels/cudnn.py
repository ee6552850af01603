"""Zero-copy cuDNN pattern kernel: strided dilated views straight into cuDNN's fused attention.

``CudnnKernel`` is ``view_kernel.ViewKernel`` (a pattern's head chunks stacked into the batch dimension of a few
strided views, read in place: that module says what is copied and why) on ``CudnnOps``, ``torch.ops.aten``'s two
cuDNN attention ops. cuDNN's backward is not deterministic (dQ is accumulated with atomics; torch
warns so under ``torch.use_deterministic_algorithms``), its forward is.
``CudnnKernel(CudnnFrontendOps())`` (``cudnn_frontend.py``, kernel ``"cudnn-det"``) runs
cuDNN's deterministic backward instead, through NVIDIA's cuDNN frontend.
``CudnnDkdvKernel`` keeps cuDNN's forward and dK/dV and takes dQ from the fused
Triton kernel, a reproducible backward when cuDNN's dK/dV are (measured).
"""

from __future__ import annotations

import torch

from .. import caches
from ..patterns import PatternPlan
from .fused import FusedKernel
from .protocol import CallSpec, Grads, PatternKernelBase, Result, Saved
from .view_kernel import AttentionOps, ViewKernel


DTYPES = (torch.float16, torch.bfloat16)


@caches.memoize("cudnn.device_reason", 64)  # asked on every call: the answer depends on the device and dtype only
def _device_reason(index: int, dtype: torch.dtype) -> str | None:
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"):
        return f"torch {torch.__version__} has no cuDNN attention op"
    major, _ = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"cuDNN attention needs compute capability >= 8.0, got {major}.x"
    if dtype not in DTYPES:
        return f"dtype must be fp16 or bf16, got {dtype}"
    return None


class CudnnOps(AttentionOps):
    """``torch.ops.aten``'s cuDNN attention, forward and backward, on 4D ``(B', h, M, D)`` views."""

    name = "cudnn"
    deterministic_backward = False  # cuDNN accumulates dQ with atomics (torch exposes no deterministic mode)
    own_strides = False  # backward out/dout must have q's strides: torch's graph cache keys on q, k, v only

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        if q.device.type != "cuda":
            return f"needs a CUDA device, got device {q.device.type}"
        return _device_reason(q.device.index, q.dtype)

    def forward(self, q, k, v, *, causal: bool, scale: float,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``; ``out``: a view shaped like q an op may write the result to (torch's op allocates
        its own instead; the frontend's writes there)."""
        res, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
        return res, lse

    def backward(self, dout, q, k, v, out, lse4, *, causal: bool, scale: float,
                 into: tuple[torch.Tensor, ...] | None = None):
        """``(dq, dk, dv)``; ``into``: views an op may write them to (torch's op allocates its own instead)."""
        empty = torch.empty(0, device=q.device)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse4, empty, empty, None,  # no dropout (philox unused), no attn_bias
            None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,  # cum_seq undefined: dense
        )


class CudnnKernel(ViewKernel):
    """``PatternKernel`` on cuDNN's fused attention with zero-copy strided views (``ViewKernel``)."""

    def __init__(self, ops: AttentionOps | None = None, *, grads: tuple[str, ...] = ("dq", "dk", "dv"),
                 causal_block: int = 0) -> None:
        """``ops``: torch's cuDNN ops by default (kernel ``"cudnn"``), the frontend's for ``"cudnn-det"``;
        ``grads``, ``causal_block``: ``ViewKernel``'s (0: never split)."""
        super().__init__(ops if ops is not None else CudnnOps(), grads=grads, causal_block=causal_block)


class CudnnDkdvKernel(PatternKernelBase):
    """cuDNN's forward and its dK/dV (per key block: no atomics), the fused kernel's dQ.

    cuDNN's backward accumulates dQ with atomics (not reproducible run to run);
    dK and dV come from one program per key block. Taking dQ from the fused
    Triton kernel instead (its dQ pass only) keeps the backward reproducible at
    a cost between the two. Whether it is faster, and reproducible on a given
    cuDNN, is measured (``benchmarks/bench_kernel.py``), not assumed.
    """

    name = "cudnn-dkdv"
    key_masks = False
    deterministic_backward = True  # one program per key block for dK/dV; dQ from the fused kernel

    def __init__(self, ops: CudnnOps | None = None, fused=None) -> None:
        self.cudnn = CudnnKernel(ops, grads=("dk", "dv"))
        self.fused = fused if fused is not None else FusedKernel(dkdv=False)

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return self.cudnn.supports(q, k) or self.fused.supports(q, k)

    def forward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                        spec: CallSpec) -> Result:
        return self.cudnn.forward_pattern(q, k, v, plan, spec)

    def forward_pattern_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                             spec: CallSpec, running: Result, *, fresh: bool = False) -> None:
        self.cudnn.forward_pattern_into(q, k, v, plan, spec, running, fresh=fresh)

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        """The forward's cuDNN results as parts; the backward accumulates (two kernels share the gradients)."""
        return direction == "fwd" and plan.leaves_parts(direction, k.shape[2])

    def backward_pattern_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                               spec: CallSpec, saved: Saved) -> Grads:
        raise ValueError("cudnn-dkdv accumulates its backward in place (parts('bwd') is False): call backward_pattern")

    def backward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, saved: Saved, grads: Grads, *, fresh: bool = False) -> None:
        # each part starts its own gradients (fresh)
        self.cudnn.backward_pattern(q, k, v, plan, spec, saved, grads, fresh=fresh)
        self.fused.backward_pattern(q, k, v, plan, spec, saved, grads, fresh=fresh)
