"""Stacked local patterns: the dilated local patterns of one compact segment length run as one dense call.

A dilated pattern run locally on strided views is a few kernel calls of a few hundred query tiles each
(LongNet ``r = 16`` over one 32768-row segment: 16 heads of 2048 compact rows, one call of 256 tiles; ``r = 4``:
four calls). A causal call that small leaves the GPU idle in its tail. LongNet's dilated patterns all read
``w / r`` compact rows per segment (2048 for ``w = [2048, 4096, ..., 32768]``, ``r = [1, 2, ..., 16]``): their
compact rows (``views.compact``: row ``j`` of head ``h`` is the segment's row ``j * r + offset(h)``) copied
side by side into one buffer are dense attention over segments of that length, one call for all of them,
and each pattern's compact part of the result (and of the gradients) is a slice of it. The copies cost a read
and a write of the rows, and the backward copies ``out``, ``dout`` and ``lse`` too, which it holds while the
call runs (``memory.gathered_bytes``: about 0.8 x the call's own bytes more at the backward's peak for LongNet).

Measured on an H200 (LongNet 32768 tokens, causal, 16 x 128 heads, bf16, forward+backward, issued back to
back, two runs): ``kernel="flash4"`` 8.34-8.43 -> 5.61-5.74 ms stacked, ``"cudnn"`` 6.97-8.37 -> 5.95-6.77 ms,
at about 0.8 x more peak memory than unstacked. ``"cudnn-det"`` gained 0.97-1.27x (the runs disagreed): its ops
do not stack. ``"auto"`` stacks where the kernel its table names for the stack's dense pattern does (with
flash-attn-4 installed, its backward): 6.04 -> 5.51 ms back to back, 6.53 -> 6.06 ms alone. Non-causal calls
are long enough not to idle: stacked, their GPU time rose (``auto`` 8.08 -> 8.36 ms, ``"cudnn"`` 8.94 -> 8.87,
at 1.5-2 ms less host issue), so they do not stack.

A pattern joins a stack where it is local (``ring_size == 1``), dilated, unmasked, and gives every query and kv
head one offset (so its compact layout holds each row and head once and a query head's kv head reads the same
offset), and where the kernel says so (``routes.py`` decides it, asking ``protocol.stacks``: cuDNN's and
flash-attn-4's, whose calls on views cost more than copying the rows; ``auto`` answers for the kernel its table
names for the stack's dense pattern; the fused kernel reads a pattern's views in one launch anyway).
"""

from __future__ import annotations

import torch

from .. import caches
from ..caches import remember
from ..kernels.protocol import CallSpec, PatternKernel, Saved
from ..merge import MAX_GRID_Z, device_table, triton_kernel
from ..replays import geometry
from ..triton_support import Prepared, interpreting, made_current, triton
from ..views import region_views, widened
from .routes import Stack


def gather(x: torch.Tensor, stack: Stack, kv: bool = False) -> torch.Tensor:
    """A new ``(B, stack.rows, heads, ...)`` buffer of every member's compact rows of ``x`` (``kv``: a kv
    tensor), each at its span: one ``gather_rows_kernel`` launch for every member where Triton runs on ``x``
    (a copy per member and tensor cost about 20 us of host time each: 24 per stacked backward), else copies."""
    buf = x.new_empty((x.shape[0], stack.rows, *x.shape[2:]))
    if _launches(x):
        _gather_rows(x, buf, stack, kv)
        return buf
    src, dst = widened(x, buf)
    for plan, (a, b) in zip(stack.plans, stack.spans):
        for rows, part in region_views(src, dst[:, a:b], plan, kv=kv):
            part.copy_(rows)
    return buf


def _launches(x: torch.Tensor) -> bool:
    """Whether ``gather_rows_kernel`` takes ``x``: ``(B, N, heads)`` (lse), or ``(B, N, heads, D)`` with unit-stride
    rows, on CUDA (or CPU under Triton's interpreter)."""
    return (triton is not None and (x.is_cuda or (x.device.type == "cpu" and interpreting()))
            and (x.dim() == 3 or (x.dim() == 4 and x.stride(-1) == 1)) and x.numel() > 0
            and max(x.shape[0], x.shape[2]) <= MAX_GRID_Z)


GATHER_TILE = 4096  # elements per program (rows x dim block)
# (stack, kv, the source's geometry) -> its Prepared launch: the launcher's binding, specialization and constexprs
# are worked out once per geometry, not for each of a stacked backward's six gathers (on an H200 they took a causal
# LongNet step's host 0.3-0.4 ms)
_GATHERS = caches.table("stacking.gathers", 256)


def _gather_rows(x: torch.Tensor, buf: torch.Tensor, stack: Stack, kv: bool) -> None:
    if x.dim() == 3:  # lse: rows of one element
        x, buf = x.unsqueeze(-1), buf.unsqueeze(-1)
    bsz, _, heads, dim = x.shape
    key = (stack, kv, geometry((x,)))  # (buf: new and dense, its geometry follows x's shape)
    launch = _GATHERS.get(key)
    if launch is None:
        block_d = max(16, triton.next_power_of_2(dim))
        block_r = max(1, GATHER_TILE // block_d)
        launch = remember(_GATHERS, key, Prepared(
            triton_kernel("gather_rows_kernel"), (triton.cdiv(stack.rows, block_r), heads, bsz),
            dict(H=heads, P=len(stack.plans), BLOCK_R=block_r, BLOCK_D=block_d), num_warps=4))

    def rows() -> list[list[int]]:
        return [[a, b, p.dilation, *p.head_offsets(heads, kv)] for p, (a, b) in zip(stack.plans, stack.spans)]

    table = device_table(rows, x.device, ("stacking.gather", stack, heads, kv))  # (kept per stream, as the combine's)
    with made_current(x.device):
        launch(table, x, buf, stack.rows, dim, *x.stride()[:3], *buf.stride()[:3])


def stack_forward(kernel: PatternKernel, stack: Stack, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  spec: CallSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack's ``(out, lse)`` over its buffer, from ``inputs`` ``(q, k, v)`` (``spec``: the call's, unmasked): a
    member's compact part is the slice at its span (``slices``)."""
    q, k, v = inputs
    return kernel.forward_pattern(gather(q, stack), gather(k, stack, kv=True), gather(v, stack, kv=True),
                                  stack.dense, spec)


def stack_backward(kernel: PatternKernel, stack: Stack, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   saved: Saved, spec: CallSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stack's ``(dq, dk, dv)`` over its buffer, from the call's final ``saved`` ``(out, lse, dout)``: a member's
    compact gradient parts are the slices at its span."""
    q, k, v = inputs
    qs, os_, ls, ds = (gather(x, stack) for x in (q, *saved))
    return kernel.backward_pattern_parts(qs, gather(k, stack, kv=True), gather(v, stack, kv=True), stack.dense,
                                         spec, (os_, ls, ds))
