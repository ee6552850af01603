"""flash-attn-4 (FlashAttention's CuTe-DSL kernels for Hopper and Blackwell) as a block kernel: ``kernel="flash4"``.

``Flash4Kernel`` is a ``BlockKernel`` (``protocol.py``; ``ChunkLoop`` drives it per head chunk). It
hands FA4 the ``(B * S, M, h, D)`` views of a block's dilated rows, ``x.view(B, S, M, r, H, D)[:, :,
:, o, h0:h1]`` with ``B`` and ``S`` merged into one batch stride, read in place: FA4 reads any
layout whose last dim is contiguous, whose address is 16-byte aligned and whose other strides are
multiples of 16 bytes, and copies anything else silently. So the layout is checked here, and an
operand that fails it is copied here (explicitly, and only that operand). Where ``B`` and ``S`` do
not merge into one stride (a ``(B, H, N, D)`` buffer seen as ``(B, N, H, D)``, a batch expanded
with stride 0), there is one call per batch row instead of a copy.

* Forward: FA4 writes ``out`` and its LSE into tensors allocated here, the only allocations.
  FA4's LSE is ``(B', h, M)`` fp32 natural log, ``-inf`` for an empty row: the library's
  convention but for the layout, so ``lse`` is returned as a transposed view, no copy.
* Backward: ``deterministic=True`` (FA4 orders its fp32 dQ accumulation with semaphores),
  gradients written into tensors allocated here in the inputs' dtype. The final ``lse`` is copied
  into FA4's packed ``(B', h, M)`` layout (small: one fp32 per row and head), with ``-inf`` (a row
  no pattern covers) turned into ``+inf``: FA4 reads ``-inf`` as 0 and would give such a row
  nonzero gradients, ``+inf`` gives it none.
* GQA runs natively (query head ``i`` reads kv head ``i // (Hq // Hk)``, FA4's rule); causal
  blocks are square (the seam's rule), where FA4's causal mask is the library's.

FA4 takes output tensors only in its internal entry points ``flash_attn.cute.interface.
_flash_attn_fwd`` / ``_flash_attn_bwd`` (its public ``flash_attn_func`` allocates them); they are
checked for the arguments passed here when first loaded, so a release that changes them gives a
reason, not a crash. Tested with flash-attn-4 4.0.0b36 on an H100 (torch 2.11, CUDA 13).

Measured there (bf16, H = 16, D = 128, forward + backward): one block per call is fast, full attention
over 65536 rows took 0.90x the time of torch's (nondeterministic) cuDNN attention and 0.62x that of
``cudnn-det``, causal 1.24x and 0.85x; LongNet's many small head-chunk calls are not, N = 32768 with
segments 2048-32768 took 2.0x (3.6x causal) the time of ``cudnn-det``: 31 FA4 calls per direction where
the cuDNN kernel stacks chunks into a few, so FA4's per-call host cost is the likely reason (not profiled).
"""

from __future__ import annotations

import inspect

import torch

from .. import caches

DTYPES = (torch.float16, torch.bfloat16)
ALIGN_BYTES = 16  # what FA4's kernels assume of the start address and of every stride but the last
INSTALL = 'pip install ".[flash4]" (or "dilated-attention[flash4]")'
_FWD_ARGS = ("q", "k", "v", "softmax_scale", "causal", "return_lse", "out", "lse")
_BWD_ARGS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "deterministic", "dq", "dk", "dv")


@caches.memoize("flash4.api", 1)  # imported once: FA4 pulls in the CUTLASS DSL (seconds)
def _api():
    """FA4's ``(forward, backward)`` functions, or the reason they cannot be used."""
    try:
        from flash_attn.cute import interface
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("flash_attn", "cutlass", "quack"):
            return f"flash-attn-4 is not installed ({exc}): {INSTALL}"
        return f"flash-attn-4 cannot load ({exc}): {INSTALL}"
    except Exception as exc:  # e.g. a CUDA or CUTLASS DSL library that does not load
        return f"flash-attn-4 cannot load ({type(exc).__name__}: {exc})"
    fns = []
    for attr, needed in (("_flash_attn_fwd", _FWD_ARGS), ("_flash_attn_bwd", _BWD_ARGS)):
        fn = getattr(interface, attr, None)
        try:
            params = inspect.signature(fn).parameters if fn is not None else {}
        except (TypeError, ValueError):
            params = {}
        missing = [a for a in needed if a not in params]
        if missing:
            return (f"this flash-attn-4 ({_version()}) has no {attr} taking {missing}; the tested release is "
                    f"4.0.0b36: {INSTALL}")
        fns.append(fn)
    return tuple(fns)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "unknown version"


@caches.memoize("flash4.device_arch", 16)  # asked on every call: depends on the device only
def _device_arch(device: torch.device) -> int | str:
    """The compute capability's major version, or the reason FA4 cannot run there."""
    if device.type != "cuda":
        return f"needs a CUDA device, got device {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):  # sm80 has no FA4 backward, sm120 no deterministic one
        return f"flash-attn-4's deterministic backward needs compute capability 9.x to 11.x, got {major}.{minor}"
    return major


def _dim_reason(dim: int, arch: int) -> str | None:
    """FA4's head-dim rule (``interface._validate_head_dims``), for equal q/k/v head dims."""
    if dim % 8 == 0 and (8 <= dim <= 256 if arch == 9 else (8 <= dim <= 128 or dim == 256)):
        return None
    allowed = "a multiple of 8 in [8, 256]" if arch == 9 else "a multiple of 8 in [8, 128], or 256"
    return f"head dim must be {allowed} on compute capability {arch}.x, got {dim}"


def reads_in_place(x: torch.Tensor) -> bool:
    """Whether FA4 reads this view without copying it: unit-stride last dim, 16-byte aligned address and
    other strides (0 allowed: FA4 broadcasts it)."""
    unit = ALIGN_BYTES // x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % ALIGN_BYTES == 0
            and all(st % unit == 0 for st in x.stride()[:-1]))


def _tidy(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each length-1 dim given an aligned stride (its stride is never used; FA4 checks it anyway)."""
    if all(n > 1 for n in x.shape[:-1]):
        return x
    unit = ALIGN_BYTES // x.element_size()
    extent = sum(st * (n - 1) for st, n in zip(x.stride(), x.shape)) + 1
    harmless = extent + (-extent) % unit
    stride = [harmless if n == 1 else st for n, st in zip(x.shape[:-1], x.stride()[:-1])] + [x.stride(-1)]
    return x.as_strided(x.shape, stride, x.storage_offset())


def _operand(x: torch.Tensor) -> torch.Tensor:
    """A ``(B', M, h, D)`` operand as FA4 reads it in place, or a compact copy where it could not."""
    x = _tidy(x)
    return x if reads_in_place(x) else x.clone(memory_format=torch.contiguous_format)  # (new, so aligned)


def _merged(x: torch.Tensor) -> torch.Tensor | None:
    """The ``(B, S, M, h, D)`` view ``x`` as ``(B * S, M, h, D)`` without a copy, or ``None``."""
    b, s = x.shape[:2]
    return x.flatten(0, 1) if b == 1 or s == 1 or x.stride(0) == s * x.stride(1) else None


def _batches(*xs: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The 4D operands of each call: one call over ``B * S`` if every tensor merges them, else one per batch row."""
    merged = [_merged(x) for x in xs]
    if all(m is not None for m in merged):
        return [tuple(_operand(m) for m in merged)]
    return [tuple(_operand(x[i]) for x in xs) for i in range(xs[0].shape[0])]


class Flash4Kernel:
    """``BlockKernel`` on flash-attn-4's forward and deterministic backward (see module doc)."""

    name = "flash4"
    key_masks = False  # masked work runs on the fused kernel
    deterministic_backward = True

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        api = _api()
        if isinstance(api, str):
            return api
        arch = _device_arch(q.device)
        if isinstance(arch, str):
            return arch
        if q.dtype not in DTYPES:
            return f"dtype must be fp16 or bf16, got {q.dtype}"
        if k.dtype != q.dtype or k.device != q.device:
            return f"q and k must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}"
        if q.shape[-1] != k.shape[-1]:
            return f"q and k head dims differ: {q.shape[-1]} and {k.shape[-1]}"
        if q.shape[-2] % k.shape[-2]:
            return f"query heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})"
        return _dim_reason(q.shape[-1], arch)

    def _functions(self, q: torch.Tensor, k: torch.Tensor, key_mask, causal: bool):
        reason = self.supports(q, k)
        if reason is not None:
            raise ValueError(f"flash4 kernel cannot run: {reason}")
        if key_mask is not None:
            raise ValueError("flash4 kernel takes no key mask (key_masks is False)")
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"causal block needs equal query and key rows, got {q.shape[2]} and {k.shape[2]}")
        return _api()

    def forward(self, q, k, v, *, causal: bool, scale: float, key_mask: torch.Tensor | None = None):
        fwd, _ = self._functions(q, k, key_mask, causal)
        b, s, m, h, d = q.shape
        out = torch.empty((b, s, m, h, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, s, h, m), dtype=torch.float32, device=q.device)
        targets = [(out.view(b * s, m, h, d), lse.view(b * s, h, m))]
        calls = _batches(q, k, v)
        if len(calls) > 1:
            targets = list(zip(out.unbind(0), lse.unbind(0)))
        for (q4, k4, v4), (o4, l4) in zip(calls, targets):
            fwd(q4, k4, v4, softmax_scale=scale, causal=causal, return_lse=True, out=o4, lse=l4)
        return out, lse.transpose(2, 3)

    def backward(self, q, k, v, out, lse, dout, *, causal: bool, scale: float,
                 key_mask: torch.Tensor | None = None):
        _, bwd = self._functions(q, k, key_mask, causal)
        b, s, m, h, _ = q.shape
        out, dout = (x if x.dtype == q.dtype else x.to(q.dtype) for x in (out, dout))  # FA4 takes one dtype
        lse4 = lse.transpose(2, 3).contiguous()  # (B, S, h, M), FA4's layout
        lse4.masked_fill_(lse4 == float("-inf"), float("inf"))  # a row no pattern covers: no gradient
        grads = [torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v)]
        calls = _batches(q, k, v, out, dout)
        if len(calls) == 1:
            parts = [(lse4.view(b * s, h, m), *(g.flatten(0, 1) for g in grads))]
        else:
            parts = list(zip(lse4.unbind(0), *(g.unbind(0) for g in grads)))
        for (q4, k4, v4, o4, do4), (l4, dq, dk, dv) in zip(calls, parts):
            bwd(q4, k4, v4, o4, do4, l4, softmax_scale=scale, causal=causal, deterministic=True,
                dq=dq, dk=dk, dv=dv)
        return tuple(grads)


__all__ = ["DTYPES", "Flash4Kernel", "reads_in_place"]
