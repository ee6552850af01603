"""Block kernel on torch's fused SDPA ops that return the log-sum-exp.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (fp32/bf16/fp16/fp64).
CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, head dim <= 256)
or, with ``backend="cudnn"``, ``aten._scaled_dot_product_cudnn_attention``.
Their backward ops take ``out`` and ``lse`` as inputs, so passing the final
merged values gives the exact per-block gradient the ring needs.
Inputs are viewed (or, when not 16-byte aligned, copied) in the ``(B*S, H, M, D)``
layout these ops want; GQA kv heads are expanded (the composed path; the fused
kernel avoids both copies).
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..merge import accum_dtype
from ..views import readable


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device)


def _to_bhmd(x: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // x.shape[-2]
    if group > 1:
        x = x.repeat_interleave(group, dim=-2)
    return _op_ready(rearrange(x, "b s m h d -> (b s) h m d"))


def _op_ready(x: torch.Tensor) -> torch.Tensor:
    """``x``, or an aligned copy: ``rearrange`` returns a view when it can, and the CUDA ops read with 16-byte
    vector loads (a view with a storage offset of 7 fp16 elements faulted "misaligned address", found by
    ``scripts/fuzz.py --device cuda``). ``contiguous()`` would keep an already contiguous, misaligned view."""
    return x if not x.is_cuda or readable(x) else x.clone(memory_format=torch.contiguous_format)


def _from_bhmd(x: torch.Tensor, bsz: int) -> torch.Tensor:
    return rearrange(x, "(b s) h m d -> b s m h d", b=bsz)


def _fold_kv(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    heads = g.shape[-2]
    return g if heads == kv_heads else g.unflatten(-2, (kv_heads, heads // kv_heads)).sum(-2)


class SdpaKernel:
    def __init__(self, backend: str = "flash") -> None:
        if backend not in ("flash", "cudnn"):
            raise ValueError(f'SdpaKernel backend must be "flash" or "cudnn", got {backend!r}')
        self.backend = backend
        self.key_masks = False  # the aten ops with log-sum-exp take no key mask on CUDA
        self.deterministic_backward = False  # flash's and cuDNN's backwards accumulate dQ with atomics
        self.name = "sdpa" if backend == "flash" else "sdpa-cudnn"

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        if q.device.type == "cpu":
            return None if self.backend == "flash" else "the cuDNN backend needs a CUDA device"
        if q.device.type != "cuda":
            return f"no SDPA op with log-sum-exp for device {q.device.type}"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"CUDA {self.backend} attention needs fp16/bf16, got {q.dtype}"
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            return f"CUDA {self.backend} attention needs head dim <= 256 and a multiple of 8, got {q.shape[-1]}"
        return None

    def forward(self, q, k, v, *, causal: bool, scale: float):
        bsz, heads = q.shape[0], q.shape[-2]
        qb, kb, vb = _to_bhmd(q, heads), _to_bhmd(k, heads), _to_bhmd(v, heads)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, causal, scale=scale)
        elif self.backend == "flash":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, causal, False, scale=scale)[:2]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qb, kb, vb, None, True, 0.0, causal, False, scale=scale
            )[:2]
        lse = lse.reshape(qb.shape[:3]).to(accum_dtype(q.dtype))  # cuDNN may add a trailing unit dim
        return _from_bhmd(out, bsz), rearrange(lse, "(b s) h m -> b s m h", b=bsz)

    def backward(self, q, k, v, out, lse, dout, *, causal: bool, scale: float):
        bsz, heads, kv_heads = q.shape[0], q.shape[-2], k.shape[-2]
        qb, kb, vb = _to_bhmd(q, heads), _to_bhmd(k, heads), _to_bhmd(v, heads)
        ob, gb = _to_bhmd(out.to(q.dtype), heads), _to_bhmd(dout.to(q.dtype), heads)
        lb = _op_ready(rearrange(lse, "b s m h -> (b s) h m").to(accum_dtype(q.dtype)).contiguous())
        dev = q.device
        if dev.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gb, qb, kb, vb, ob, lb, 0.0, causal, scale=scale
            )
        elif self.backend == "flash":
            m, n = qb.shape[2], kb.shape[2]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                # cum_seq_q/k None (undefined, as autograd passes for dense inputs): a defined tensor
                # selects the varlen kernel, which torch 2.11 rejects unless it is int32
                gb, qb, kb, vb, ob, lb, None, None, m, n, 0.0, causal, _empty(dev), _empty(dev), scale=scale
            )
        else:
            m, n = qb.shape[2], kb.shape[2]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                gb, qb, kb, vb, ob, lb.unsqueeze(-1), _empty(dev), _empty(dev), None,  # no attn_bias
                None, None, m, n, 0.0, causal, scale=scale,  # cum_seq undefined: dense, not nested
            )
        return (
            _from_bhmd(dq, bsz),
            _fold_kv(_from_bhmd(dk, bsz), kv_heads),
            _fold_kv(_from_bhmd(dv, bsz), kv_heads),
        )
