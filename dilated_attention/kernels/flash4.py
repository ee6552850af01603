"""flash-attn-4 (FlashAttention's CuTe-DSL kernels for Hopper and Blackwell) as a pattern kernel: ``kernel="flash4"``.

``Flash4Kernel`` is the zero-copy view logic the cuDNN kernel runs on too (``view_kernel.ViewKernel``: a
pattern's head chunks stacked into the batch dimension of a few strided views, its forward parts and backward
targets) on FA4's ops (``Flash4Ops``) instead of cuDNN's: one FA4 call per (pattern, head-offset group), every
segment of the pattern in the batch dimension of one view ``x.view(B, S, M, r, H, D)[:, :, :, o, h0:h1]``,
read in place. FA4 reads any layout whose last dim is contiguous, whose address is 16-byte aligned and
whose other strides are multiples of 16 bytes (``views.readable``); an operand that is not is copied
compact by the shared view logic, explicitly (FA4 would copy it silently).

* Forward: FA4 writes ``out`` straight into the pattern's compact part where the shared logic hands it a
  view (a pattern of several calls), else into a tensor allocated here that becomes the part with no copy
  (one call covering the pattern); merged into the running result as the cuDNN kernel does
  (``merge.merge_pattern_``). FA4's LSE is ``(B', h, M)`` fp32 natural log, ``-inf`` for an empty row:
  the library's convention.
* Backward: ``deterministic=True`` (FA4 orders its fp32 dQ accumulation with semaphores), from the final
  merged ``out``/``lse``. Gradients are written by FA4 into strided views of the pattern's compact
  gradient parts where the pattern leaves parts (each local pattern whose kv heads read one offset), else
  into scratch in the inputs' dtype added into the fp32 accumulators (``merge.add_into_``; the first
  pattern covering every row and head writes them, no fill). The ``lse`` goes in as FA4's packed
  ``(B', h, M)`` copy with ``-inf`` (a row no pattern covers) turned into ``+inf``: FA4 reads ``-inf``
  as 0 and would give such a row gradients, ``+inf`` gives it none.
* GQA runs natively (query head ``i`` reads kv head ``i // (Hq // Hk)``, FA4's rule); causal blocks are
  square, where FA4's causal mask is the library's; packed ring blocks (``views.pack_kv``) as cuDNN's.
* Long causal squares are split (``causal_block``, default ``CAUSAL_BLOCK`` dilated rows; ``protocol.py``,
  ``ring/square_split.py``): FA4's deterministic causal backward is slow on long squares (full causal
  attention over 65536 rows: 0.77-0.87x of cuDNN's), its non-causal backward and small causal blocks are
  not; one causal call of the diagonal blocks and non-causal rectangles measured 0.91-1.05x. Squares of up
  to four blocks (LongNet's) stay whole: there the split's extra calls cost more than they save.
* Padding masks (``padding_masks = True``; ``protocol.py``: packed documents and segment padding, made by
  the library) are FA4's per-sequence lengths: each call's ``seqused_q = seqused_k`` is the count of kept
  keys in its view of the mask (the rows before the padding, as the mask's kept keys are a prefix of every
  dilated view). FA4 skips the rows past them: their results are left unspecified, as the protocol allows
  (the caller discards them). Other key masks (``key_padding_mask``) are not taken (``key_masks = False``):
  FA4 expresses a mask only as lengths or a compiled ``mask_mod``, not the per-key boolean the seam
  passes, so ``kernel="auto"`` runs them on the fused kernel and ``kernel="flash4"`` with one raises.

FA4 takes output tensors only in its internal entry points ``flash_attn.cute.interface.
_flash_attn_fwd`` / ``_flash_attn_bwd`` (its public ``flash_attn_func`` allocates them); they are
checked for the arguments passed here when first loaded, so a release that changes them gives a
reason, not a crash. Tested with flash-attn-4 4.0.0b36 on an H100 (torch 2.11, CUDA 13).
"""

from __future__ import annotations

import inspect

import torch

from .. import caches
from .view_kernel import AttentionOps, ViewKernel

DTYPES = (torch.float16, torch.bfloat16)
INSTALL = 'pip install ".[flash4]" (or "dilated-attention[flash4]")'
_FWD_ARGS = ("q", "k", "v", "softmax_scale", "causal", "return_lse", "out", "lse", "seqused_q", "seqused_k")
_BWD_ARGS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "deterministic", "dq", "dk", "dv",
             "seqused_q", "seqused_k")
# Causal squares of more than ``routes.Tuning.whole_blocks`` (4) times this many dilated rows are split into blocks
# of at most this many rows and non-causal rectangles (module doc). Set by measurement (re-measure with
# ``benchmarks/bench_kernel.py --methods flash4 --full-seq 65536 --causal-block 8192,0,2048``): full causal
# attention through the API, forward+backward on an H100, alternated runs: 65536 rows 139.3 ms whole, 108.0 ms
# in blocks of 8192 (2048: 109.8; 16384: 106.4, but four such blocks would stay whole); 32768 rows: whole is
# fastest (27.4 ms; split 29.0-30.6).
CAUSAL_BLOCK = 8192


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


def unavailable_reason(device: torch.device) -> str | None:
    """``None`` where FA4 is installed and this device runs its deterministic backward, else why not."""
    api = _api()
    if isinstance(api, str):
        return api
    arch = _device_arch(device)
    return arch if isinstance(arch, str) else None


def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """A ``(B', h, M, D)`` view (the shared view logic's layout) as FA4's ``(B', M, h, D)``: the same memory.

    FA4 refuses an output with a zero stride even on a dimension of size 1 (views of one segment or one
    head often have one), where any stride addresses the same memory: such a dimension gets the span of
    the others, which keeps FA4's alignment rule (a multiple of 16 bytes, as their strides are)."""
    x = x.transpose(1, 2)
    if 0 not in x.stride():
        return x
    span = max((n * st for n, st in zip(x.shape, x.stride()) if st), default=1)
    strides = [span if st == 0 and n == 1 else st for n, st in zip(x.shape, x.stride())]
    return x.as_strided(x.shape, strides, x.storage_offset())


def _empty_seq_major(x: torch.Tensor) -> torch.Tensor:
    """A new ``(B', M, h, D)`` tensor for a ``(B', h, M, D)`` operand's result (dense, so FA4 writes it in place)."""
    b, h, m, d = x.shape
    return torch.empty((b, m, h, d), dtype=x.dtype, device=x.device)


class Flash4Ops(AttentionOps):
    """FA4's forward and backward as ``AttentionOps``: 4D ``(B', h, M, D)`` views (what ``ViewKernel`` builds),
    results in the same layout, written into given views where asked.

    ``deterministic=False`` (kernel ``"flash4-nondet"``): FA4's default backward, whose dQ accumulation is
    not ordered; for ``DILATED_ATTENTION_NONDETERMINISTIC=1`` (its causal backward needs no split).
    ``used`` (``(B',)`` int32, padding masks): each batch entry's rows before the padding, for queries and
    keys alike (a causal square stays aligned); the rows past them are skipped, their results unspecified."""

    padding_masks = True
    lse_neginf = float("inf")  # the lse a backward reads: a row no pattern covers (-inf) as +inf, no gradient
    own_strides = False  # (``CudnnOps.own_strides``) out/dout without q's strides are copied with q (unmeasured)

    def __init__(self, deterministic: bool = True) -> None:
        self.deterministic_backward = bool(deterministic)
        self.name = "flash4" if deterministic else "flash4-nondet"

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        reason = unavailable_reason(q.device)
        if reason is not None:
            return reason
        if q.dtype not in DTYPES:
            return f"dtype must be fp16 or bf16, got {q.dtype}"
        if k.dtype != q.dtype or k.device != q.device:
            return f"q and k must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}"
        if q.shape[-1] != k.shape[-1]:
            return f"q and k head dims differ: {q.shape[-1]} and {k.shape[-1]}"
        if q.shape[-2] % k.shape[-2]:
            return f"query heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})"
        return _dim_reason(q.shape[-1], _device_arch(q.device))

    def forward(self, q, k, v, *, causal: bool, scale: float, out: torch.Tensor | None = None,
                used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` as ``(B', h, M, D)`` and ``(B', h, M)``; ``out``: a view FA4 writes the result to."""
        fwd, _ = _api()
        res = _seq_major(out) if out is not None else _empty_seq_major(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        fwd(_seq_major(q), _seq_major(k), _seq_major(v), softmax_scale=scale, causal=causal, return_lse=True,
            out=res, lse=lse, seqused_q=used, seqused_k=used)
        return out if out is not None else _seq_major(res), lse  # (``out`` itself: the caller skips its copy)

    def backward(self, dout, q, k, v, out, lse4, *, causal: bool, scale: float,
                 into: tuple[torch.Tensor, ...] | None = None, used: torch.Tensor | None = None):
        """``(dq, dk, dv)`` in the inputs' layout and dtype, written into ``into`` when given; ``lse4``:
        a packed ``(B', h, M, 1)`` fp32 copy with uncovered rows at ``+inf`` (``lse_neginf``: how the kernel makes it)."""
        _, bwd = _api()
        lse = lse4.view(lse4.shape[:3])
        grads = tuple(_seq_major(g) for g in into) if into is not None else tuple(
            _empty_seq_major(x) for x in (q, k, v))
        bwd(*(_seq_major(x) for x in (q, k, v, out, dout)), lse, softmax_scale=scale, causal=causal,
            deterministic=self.deterministic_backward, dq=grads[0], dk=grads[1], dv=grads[2], seqused_q=used,
            seqused_k=used)
        return into if into is not None else tuple(_seq_major(g) for g in grads)  # (``into``: no copy after)


class Flash4Kernel(ViewKernel):
    """``PatternKernel`` on flash-attn-4: the zero-copy view logic (``ViewKernel``) on ``Flash4Ops``."""

    key_masks = False  # other masked work runs on the fused kernel; padding masks are taken (see the module doc)

    def __init__(self, ops: Flash4Ops | None = None, *, causal_block: int = CAUSAL_BLOCK) -> None:
        """``causal_block``: causal squares of more than four times this many dilated rows are split into blocks of
        at most this many (module doc); 0: never."""
        super().__init__(ops if ops is not None else Flash4Ops(), causal_block=causal_block)
