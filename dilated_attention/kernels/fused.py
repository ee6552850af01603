"""Fused dilated block kernel (Triton): strided dilated reads, a whole pattern per launch.

``FusedKernel`` implements both interfaces of ``protocol.py``: the block seam (``forward``/``backward``
on strided ``(B, S, M, H, D)`` views) and the pattern methods, one launch per pattern
(``forward_pattern``/``backward_pattern``). Nothing is copied: the
kernels read q/k/v/out/lse/dout through their strides, a head's dilation offset
and kv head come from small int32 tables built from the plan's chunks, and heads
in no chunk are never launched.

Launches: forward is one kernel; backward is three: ``delta = rowsum(dout*out)``,
dQ (one program per row block and head, adds into ``dq``, or stores a compact part),
dK/dV (one program per key block and (kv head, offset) unit, looping over that unit's
query heads, adds into ``dk``/``dv`` or stores). Every element is owned by exactly one program:
no atomics, and the configs are pinned (``FusedConfig``, ``fused_config.py``); nothing is autotuned
here (the benchmark sweeps configs by constructing kernels with other configs).
A pattern call's launches are worked out at the first call of its geometry and replayed after
(``replays.py``: the host's share of an eager step); calls with a key mask are not replayed (a mask's
live tiles are listed per call).

Key padding: every method takes ``key_mask=None`` or a bool mask (``True`` = the key
is excluded; any strides), read in place through a uint8 view of the same memory
(block seam: ``(B, S, Mk)``; pattern methods: ``(B, Lk)`` in the full layout of
the key block, see ``protocol.py``). A masked forward and a masked dQ each launch
one small kernel first (``tiles``) that lists the key tiles holding a real key;
their main loops visit only those. ``None`` launches the unmasked kernels
(``HAS_MASK=False``), unchanged.

Head dims: any multiple of 8 up to 256. ``tl.arange`` needs a power of two, so a
tile is ``padded_dim(D)`` wide (the next power of two, at least 16) and loads and
stores of the extra columns are masked (zeros in, nothing out); the pinned config
is the one of the padded width.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernels on CPU; there
``tl.dot`` operands are cast to fp32 (bf16 dots give garbage in the interpreter).
Set the variable before Triton is imported (before importing this library, which may
import Triton through torch): Triton decides at its import whether its own library
functions (``tl.sum``, ``tl.zeros``, ...) are interpreted.
"""

from __future__ import annotations

import torch

from .. import caches, replays
from ..patterns import PatternPlan
from ..triton_support import JITTED, TRITON_ERROR as _TRITON_ERROR, interpreting, launch, triton
from ..views import new_grad_parts
from .fused_config import FusedConfig, _shared_memory, default_config, padded_dim, shared_memory_reason
from .protocol import CallSpec, Grads, PatternKernelBase, Result, Saved

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dims(dim: int) -> dict:
    return {"D": dim, "DP": padded_dim(dim), "EVEN_D": padded_dim(dim) == dim}


def _kernel(name: str):
    key = (interpreting(), name)
    fn = JITTED.get(key)
    if fn is None:
        from . import _fused_triton  # (its kernels need Triton at import: loaded only where Triton is)

        fn = JITTED[key] = triton.jit(_fused_triton.KERNEL_FUNCS[name])
    return fn


def _idx_type(rows: int, *strides):
    """int32 in-tile row offsets unless ``rows`` (+ a block of padding) times a row stride may overflow."""
    worst = (rows + 512) * max([abs(st[2]) for st in strides] + [1]) + 4096
    return triton.language.int64 if worst >= 2**31 - 1 else triton.language.int32


# ---------------------------------------------------------------------------
# Head tables


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    return caches.rows_on("fused.head_table_host", rows, torch.int32, device).reshape(len(rows), -1)


def _plan_rows(plan: PatternPlan, packed: bool) -> tuple[list[list[int]], list[list[int]]]:
    heads = [[], [], [], []]  # query head, q offset, kv head, kv offset
    units = [[], [], [], [], []]  # kv head, kv offset, h0, h1, q offset
    for c in plan.chunks:
        nk = c.k1 - c.k0
        gc = (c.h1 - c.h0) // nk
        kv_first = c.buffer_head if packed else c.k0
        kv_off = 0 if packed else c.offset
        for h in range(c.h0, c.h1):
            for col, val in zip(heads, (h, c.offset, kv_first + (h - c.h0) // gc, kv_off)):
                col.append(val)
        for t in range(nk):
            for col, val in zip(units, (kv_first + t, kv_off, c.h0 + t * gc, c.h0 + (t + 1) * gc, c.offset)):
                col.append(val)
    return heads, units


def _dense_rows(hq: int, hk: int) -> tuple[list[list[int]], list[list[int]]]:
    g = hq // hk
    heads = [list(range(hq)), [0] * hq, [h // g for h in range(hq)], [0] * hq]
    units = [list(range(hk)), [0] * hk, [t * g for t in range(hk)], [(t + 1) * g for t in range(hk)], [0] * hk]
    return heads, units


_TABLES = caches.table("fused.head_tables", 1024)  # per plan (or head counts) and device: a run has a few


def _tables(key: tuple, rows_fn, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        heads, units = rows_fn()
        return _table(heads, device), _table(units, device)

    return caches.kept_table("fused.head_tables", _TABLES, key + (str(device),), make, device)


# ---------------------------------------------------------------------------
# Strides: every tensor is read as (b, s, m, h, off) element strides.


def _dilated_strides(x: torch.Tensor, plan: PatternPlan) -> tuple[int, ...]:
    """A full ``(B, L, H, ...)`` tensor read dilated: row j of segment s at offset o."""
    sl = x.stride(1)
    return (x.stride(0), plan.local_segment * sl, plan.dilation * sl, x.stride(2), sl)


def _compact_strides(x: torch.Tensor, rows: int) -> tuple[int, ...]:
    """A compact ``(B, S*M, H, ...)`` tensor: row j of segment s is row s*M + j (no offset)."""
    sl = x.stride(1)
    return (x.stride(0), rows * sl, sl, x.stride(2), 0)


def _view_strides(x: torch.Tensor) -> tuple[int, ...]:
    """A ``(B, S, M, H, ...)`` view, read as it is."""
    return (x.stride(0), x.stride(1), x.stride(2), x.stride(3), 0)


# A key mask has no head dim: it is read as (b, s, m, off) element strides; n_off offsets per segment.
_NO_MASK = (None, (0, 0, 0, 0), 0)


def _key_mask(key_mask: torch.Tensor | None, shape, device: torch.device, plan: PatternPlan | None = None):
    """``(uint8 view, strides, offsets)`` of a bool key mask of ``shape``: a ``(B, S, Mk)`` view as it
    is (one offset), or with ``plan`` a full ``(B, Lk)`` mask read dilated like k at the head's offset."""
    if key_mask is None:
        return _NO_MASK
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != tuple(shape) or key_mask.device != device:
        raise ValueError(
            f"key_mask must be a torch.bool tensor of shape {tuple(shape)} on {device}, "
            f"got {key_mask.dtype} of shape {tuple(key_mask.shape)} on {key_mask.device}"
        )
    km = key_mask.view(torch.uint8)  # the same bytes and strides (no copy), loaded as plain bytes
    if plan is None:
        return km, (km.stride(0), km.stride(1), km.stride(2), 0), 1
    sn = km.stride(1)
    return km, (km.stride(0), plan.local_segment * sn, plan.dilation * sn, sn), plan.dilation


class FusedKernel(PatternKernelBase):
    name = "fused"
    key_masks = True
    padding_masks = True  # (as any key mask)
    deterministic_backward = True  # every gradient element is owned by one program: no atomics

    def __init__(self, config: FusedConfig | None = None, *, dkdv: bool = True, epilogue_merge: bool = False) -> None:
        """``dkdv=False``: the backward adds dQ only (``cudnn.CudnnDkdvKernel`` takes dK/dV from cuDNN).
        ``epilogue_merge``: local patterns merge into the running fp32 result in the forward's epilogue and add
        into fp32 accumulators in the backward, instead of leaving compact parts in the inputs' dtype for one
        combine pass (``parts``); parts move fewer bytes (measured in ``benchmarks/results``)."""
        self.config = config
        self.dkdv = dkdv
        self.epilogue_merge = epilogue_merge

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        mine = direction == "fwd" or self.dkdv  # (dkdv=False: dQ only, added into what cuDNN's dK/dV share)
        return mine and not self.epilogue_merge and plan.leaves_parts(direction, k.shape[2])

    # -- checks ---------------------------------------------------------------

    def _settings(self) -> tuple:
        """What of this kernel's own settings its launches depend on (a replay key's part)."""
        return (self.config, self.dkdv, self.epilogue_merge)

    def _config(self, dim: int, dtype: torch.dtype) -> FusedConfig:
        return self.config if self.config is not None else default_config(dim, dtype)

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        if triton is None:
            return f"Triton is not importable ({_TRITON_ERROR})"
        if q.device.type != "cuda" and not interpreting():
            return f"needs a CUDA device (or TRITON_INTERPRET=1), got device {q.device.type}"
        if q.device != k.device:
            return f"q and k are on different devices ({q.device}, {k.device})"
        if q.dtype not in DTYPES or k.dtype != q.dtype:
            return f"dtype must be fp16, bf16 or fp32 (same for q and k), got {q.dtype} and {k.dtype}"
        if q.dim() not in (4, 5) or k.dim() != q.dim():
            return f"expects (B, N, H, D) or (B, S, M, H, D) inputs, got shapes {tuple(q.shape)} and {tuple(k.shape)}"
        dim = q.shape[-1]
        if dim % 8 or not 8 <= dim <= MAX_HEAD_DIM or k.shape[-1] != dim:
            return (f"head dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}] (equal for q and k), "
                    f"got {dim} and {k.shape[-1]}")
        if q.dim() == 5 and q.shape[-2] % max(k.shape[-2], 1):  # (4D k may be a packed ring buffer)
            return f"query heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})"
        for name, x in (("q", q), ("k", k)):
            if x.stride(-1) != 1:
                return f"{name} must have unit stride in its head dim, got strides {tuple(x.stride())}"
            if x.data_ptr() % x.element_size():
                return (
                    f"{name}'s data pointer {x.data_ptr():#x} is not aligned to its element size "
                    f"{x.element_size()} (misaligned address)"
                )
        if q.device.type == "cuda":
            return shared_memory_reason(self._config(dim, q.dtype), dim, q.dtype, _shared_memory(q.device.index))
        return None

    def _check(self, q: torch.Tensor, k: torch.Tensor) -> FusedConfig:
        reason = self.supports(q, k)
        if reason is not None:
            raise ValueError(f"fused kernel cannot run: {reason}")
        return self._config(q.shape[-1], q.dtype)

    @staticmethod
    def _common(q: torch.Tensor, cfg: FusedConfig) -> dict:
        interp = interpreting()
        return {
            "DOT_F32": interp,
            "DOT_PREC": "ieee" if (q.dtype == torch.float32 or interp) else "tf32",
        }

    def _live_tiles(self, mask, bsz: int, S: int, MK: int, block: int, idx) -> torch.Tensor | None:
        """The list of key tiles (``block`` keys) that hold a real key, per mask row (``tiles_kernel``):
        the forward and dQ loops visit only those, so a tile of padding only is never visited and the
        loop keeps its software pipelining (a branch around its dots would not)."""
        km, sm, n_off = mask
        if km is None:
            return None
        rows = bsz * S * n_off
        lt = torch.empty((rows, 2 * triton.cdiv(MK, block) + 1), dtype=torch.int32, device=km.device)
        self._launch("tiles", (rows,), (km, lt, *sm, n_off, S, MK), dict(BLOCK_N=block, CHUNK=32, IDX=idx), 4, 1)
        return lt

    @staticmethod
    def _launch(kernel: str, grid, args, meta, warps: int, stages: int, record: list | None = None) -> None:
        if record is not None:
            record.append(("launch", _kernel(kernel), grid, args, meta, dict(num_warps=warps, num_stages=stages)))
        try:
            launch(_kernel(kernel), grid, args, meta, num_warps=warps, num_stages=stages)
        except Exception as exc:  # turn Triton's resource errors into a clear message
            if triton is not None and isinstance(exc, triton.runtime.errors.OutOfResources):
                raise RuntimeError(f"fused {kernel} kernel: out of resources ({exc}); choose a smaller config") from exc
            raise

    # -- generic launchers ------------------------------------------------------

    def _forward(self, tensors: tuple[torch.Tensor, ...], strides: tuple[tuple[int, ...], ...], ht: torch.Tensor,
                 mask: tuple, dims: tuple[int, int, int], causal: bool, scale: float, cfg: FusedConfig,
                 merge: bool = False, record: list | None = None) -> None:
        """The forward launch: ``tensors`` ``(q, k, v, out, lse)`` read through ``strides`` (each tensor's
        ``(b, s, m, h, off)`` element strides), ``mask`` ``_key_mask``'s ``(uint8 view, strides, offsets)``,
        ``dims`` ``(S, M, MK)`` (segments, query and key rows per segment); ``merge``: merged into the running result
        that ``out``/``lse`` hold, else written."""
        q, k, v, out, lse = tensors
        sq, sk, sv, so, sl = strides
        S, M, MK = dims
        nh = ht.shape[1]
        if nh == 0 or M == 0 or S == 0 or q.shape[0] == 0:
            return
        km, sm, n_off = mask
        bm, bn = cfg.fwd_m, cfg.fwd_n
        nmb = triton.cdiv(M, bm)
        idx = _idx_type(max(M, MK), sq, sk, sv, so, sl, sm)
        lt = self._live_tiles(mask, q.shape[0], S, MK, bn, idx)
        meta = dict(
            **_dims(q.shape[-1]), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
            EVEN_M=M % bm == 0, EVEN_N=MK % bn == 0, **self._common(q, cfg), IDX=idx, HAS_MASK=km is not None,
            MERGE=merge,
        )
        args = (q, k, v, out, lse, ht, km, lt, *sq, *sk, *sv, *so, *sl, *sm, n_off,
                nh, S, M, MK, nmb, scale * LOG2E)
        self._launch("fwd", (q.shape[0] * S * nmb, nh), args, meta, cfg.fwd_warps, cfg.fwd_stages, record)

    def _backward(self, tensors: tuple[torch.Tensor, ...], strides: tuple[tuple[int, ...], ...],
                  tables: tuple[torch.Tensor, torch.Tensor], mask: tuple, dims: tuple[int, int, int], causal: bool,
                  scale: float, cfg: FusedConfig, add: bool = True, record: list | None = None) -> None:
        """The backward's launches (delta, dQ, dK/dV): ``tensors`` ``(q, k, v, out, lse, dout, dq, dk, dv)`` read
        through ``strides`` (as ``_forward``'s), ``tables`` the head and unit tables, ``mask`` and ``dims`` as
        ``_forward``'s; ``add``: added into what ``dq``/``dk``/``dv`` hold, else stored."""
        q, k, v, out, lse, dout, dq, dk, dv = tensors
        ht, ut = tables
        S, M, MK = dims
        sq, sk, sv, so, sl, sg, sdq, sdk, sdv = strides
        km, sm, n_off = mask
        idx = _idx_type(max(M, MK), *strides, sm)
        nh, nu = ht.shape[1], ut.shape[1]
        bsz = q.shape[0]
        if nh == 0 or M == 0 or S == 0 or bsz == 0 or MK == 0:
            return
        delta = torch.empty((bsz, S, M, q.shape[-2] if q.dim() == 5 else q.shape[2]), dtype=torch.float32, device=q.device)
        if record is not None:
            record.append(("alloc", "delta", delta))
        sd = delta.stride()
        dim = q.shape[-1]
        common = self._common(q, cfg)
        bm = 64 if not interpreting() else 16
        self._launch(
            "delta",
            (bsz * S * triton.cdiv(M, bm), nh),
            (out, dout, delta, ht, *so, *sg, *sd, nh, S, M, triton.cdiv(M, bm)),
            dict(D=dim, DP=padded_dim(dim), BLOCK_M=bm, IDX=idx),
            4, 1, record,
        )
        bm, bn = cfg.dq_m, cfg.dq_n
        nmb = triton.cdiv(M, bm)
        lt = self._live_tiles(mask, bsz, S, MK, bn, idx)
        self._launch(
            "dq",
            (bsz * S * nmb, nh),
            (q, k, v, dout, lse, delta, dq, ht, km, lt, *sq, *sk, *sv, *sg, *sl, *sd, *sdq, *sm, n_off,
             nh, S, M, MK, nmb, scale * LOG2E, scale),
            dict(**_dims(dim), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, EVEN_M=M % bm == 0, EVEN_N=MK % bn == 0,
                 IDX=idx, HAS_MASK=km is not None, **common, ADD=add),
            cfg.dq_warps, cfg.dq_stages, record,
        )
        if not self.dkdv:
            return
        bm, bn = cfg.dkdv_m, cfg.dkdv_n
        nnb = triton.cdiv(MK, bn)
        self._launch(
            "dkdv",
            (bsz * S * nnb, nu),
            (q, k, v, dout, lse, delta, dk, dv, ut, km, *sq, *sk, *sv, *sg, *sl, *sd, *sdk, *sdv, *sm,
             nu, S, M, MK, nnb, scale * LOG2E, scale),
            dict(**_dims(dim), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, EVEN_M=M % bm == 0, EVEN_N=MK % bn == 0,
                 IDX=idx, HAS_MASK=km is not None, **common, ADD=add),
            cfg.dkdv_warps, cfg.dkdv_stages, record,
        )

    # -- the block seam -----------------------------------------------------------

    def _check_block(self, q, k, v, causal: bool):
        """Config for these inputs, after the seam's shape rules (a causal block is square)."""
        cfg = self._check(q, k)
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"causal block needs equal query and key rows, got {q.shape[2]} and {k.shape[2]}")
        _check_view("v", v, k.shape)
        return cfg

    def forward(self, q, k, v, *, causal: bool, scale: float, key_mask: torch.Tensor | None = None):
        cfg = self._check_block(q, k, v, causal)
        bsz, S, M, hq, dim = q.shape
        MK, hk = k.shape[2], k.shape[3]
        mask = _key_mask(key_mask, k.shape[:3], k.device)
        v = _unit_last(v)
        out = torch.empty((bsz, S, M, hq, dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((bsz, S, M, hq), dtype=torch.float32, device=q.device)
        if MK == 0:
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        ht, _ = _tables(("dense", hq, hk), lambda: _dense_rows(hq, hk), q.device)
        tensors = (q, k, v, out, lse)
        self._forward(tensors, tuple(_view_strides(x) for x in tensors), ht, mask, (S, M, MK), causal, scale, cfg)
        return out, lse

    def backward(self, q, k, v, out, lse, dout, *, causal: bool, scale: float, key_mask: torch.Tensor | None = None):
        cfg = self._check_block(q, k, v, causal)
        bsz, S, M, hq, dim = q.shape
        MK, hk = k.shape[2], k.shape[3]
        for name, x, shape in (("out", out, q.shape), ("dout", dout, q.shape), ("lse", lse, q.shape[:4])):
            _check_view(name, x, shape)
        mask = _key_mask(key_mask, k.shape[:3], k.device)
        v, out, dout = _unit_last(v), _unit_last(out), _unit_last(dout)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        ht, ut = _tables(("dense", hq, hk), lambda: _dense_rows(hq, hk), q.device)
        vs = _view_strides
        strides = (vs(q), vs(k), vs(v), vs(out), vs(lse), vs(dout), vs(dq), vs(dk), vs(dv))
        self._backward((q, k, v, out, lse, dout, dq, dk, dv), strides, (ht, ut), mask, (S, M, MK), causal, scale, cfg)
        return dq, dk, dv

    # -- whole pattern, one launch ----------------------------------------------------

    def _pattern_geometry(self, q, k, plan: PatternPlan, packed: bool):
        bsz, n, heads, dim = q.shape
        w, r = plan.local_segment, plan.dilation
        if n % w or w % r:
            raise ValueError(f"plan segment {w} / dilation {r} do not tile {n} local rows")
        S, M = n // w, w // r
        if packed:
            if k.shape[1] != n // r:
                raise ValueError(f"packed k has {k.shape[1]} rows, expected L // r = {n // r}")
            if S != 1:
                raise ValueError(f"packed ring blocks need one local segment, got {S}")
        return bsz, S, M, heads, dim

    def _kv_strides(self, x, plan, packed, M):
        return _compact_strides(x, M) if packed else _dilated_strides(x, plan)

    @staticmethod
    def _pattern_mask(key_mask, k, plan, packed):
        """A ``(B, Lk)`` mask in the key block's full layout: a packed half holds ``Lk // r`` rows."""
        keys = k.shape[1] * plan.dilation if packed else k.shape[1]
        return _key_mask(key_mask, (k.shape[0], keys), k.device, plan)

    def forward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                        spec: CallSpec) -> Result:
        return self._pattern_forward(q, k, v, plan, spec)

    def forward_pattern_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                             spec: CallSpec, running: Result, *, fresh: bool = False) -> None:
        """The pattern merged into the running fp32 ``out``/``lse`` (full layout) in the kernel's epilogue:
        no compact partial, no separate combine pass. ``fresh``: the epilogue writes (no fill, no read)."""
        _check_fresh(fresh, plan, q, k, spec.packed)
        self._pattern_forward(q, k, v, plan, spec, running, fresh)

    def _pattern_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, running: Result | None = None, fresh: bool = False) -> Result:
        """One launch for the pattern: without ``running`` into new compact tensors (returned), else merged into
        the given running result (written, if ``fresh``). Replayed after the first call of each geometry
        (``replays.py``)."""
        causal, scale, packed, key_mask = spec
        full = running is not None
        out, lse = running if full else (None, None)
        key = None
        if key_mask is None:
            given = (q, k, v, out, lse) if full else (q, k, v)
            key = ("fwd", self._settings(), plan, spec, fresh, replays.geometry(given))
            recipe = replays.RECIPES.get(key)
            if recipe is not None:
                ht, _ = _tables(("plan", plan, packed), lambda: _plan_rows(plan, packed), q.device)
                env = replays.replay(recipe, {"q": q, "k": k, "v": v, "out": out, "lse": lse, "ht": ht}, q.device)
                return env["out"], env["lse"]
        record = [] if key is not None else None
        cfg = self._check(q, k)
        bsz, S, M, heads, dim = self._pattern_geometry(q, k, plan, packed)
        _check_view("v", v, k.shape)
        if full:
            _check_acc("out", out, q.shape)
            _check_acc("lse", lse, q.shape[:3])
            if out.dtype != torch.float32 or lse.dtype != torch.float32:
                raise TypeError(f"out and lse (the running result) must be float32, got {out.dtype} and {lse.dtype}")
            so, sl = _dilated_strides(out, plan), _dilated_strides(lse, plan)
        else:
            rows = q.shape[1] // plan.dilation
            out = torch.empty((bsz, rows, heads, dim), dtype=q.dtype, device=q.device)
            lse = torch.empty((bsz, rows, heads), dtype=torch.float32, device=q.device)
            so, sl = _compact_strides(out, M), _compact_strides(lse, M)
            if record is not None:
                record += [("alloc", "out", out), ("alloc", "lse", lse)]
        mask = self._pattern_mask(key_mask, k, plan, packed)
        v_in, v = v, _unit_last(v)
        ht, _ = _tables(("plan", plan, packed), lambda: _plan_rows(plan, packed), q.device)
        kvs = self._kv_strides
        strides = (_dilated_strides(q, plan), kvs(k, plan, packed, M), kvs(v, plan, packed, M), so, sl)
        self._forward((q, k, v, out, lse), strides, ht, mask, (S, M, M), causal, scale, cfg, merge=full and not fresh,
                      record=record)
        if record is not None:
            replays.remember(key, record, {"q": q, "k": k, "v": v_in, "ht": ht, **({"out": out, "lse": lse} if full else {})})
        return out, lse

    def backward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, saved: Saved, grads: Grads, *, fresh: bool = False) -> None:
        """``fresh``: the kernels store their gradients (no zero fill, no read of the accumulators)."""
        packed = spec.packed
        _check_fresh(fresh, plan, q, k, packed)
        dq, dk, dv = grads
        _check_acc("dq", dq, q.shape)
        _check_acc("dk", dk, k.shape)
        _check_acc("dv", dv, k.shape)
        M = plan.local_segment // plan.dilation
        kvs = self._kv_strides
        self._pattern_backward(q, k, v, plan, spec, saved, grads,
                               (_dilated_strides(dq, plan), kvs(dk, plan, packed, M), kvs(dv, plan, packed, M)),
                               add=not fresh)

    def backward_pattern_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                               spec: CallSpec, saved: Saved) -> Grads:
        """The pattern's gradients stored (not added) into new compact tensors in the inputs' dtype."""
        if not self.parts("bwd", plan, q, k, causal=spec.causal, masked=spec.key_mask is not None) or spec.packed:
            raise ValueError(f"the fused kernel leaves no backward parts for pattern {plan.index} (a ring, a kv head "
                             f"read at two offsets, epilogue_merge or dkdv=False): call backward_pattern")
        M = plan.local_segment // plan.dilation
        grads = dq, dk, dv = new_grad_parts(q, k, v, plan)
        self._pattern_backward(q, k, v, plan, spec, saved, grads,
                               (_compact_strides(dq, M), _compact_strides(dk, M), _compact_strides(dv, M)), add=False)
        return grads

    def _pattern_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                          spec: CallSpec, saved: Saved, grads: Grads, grad_strides: tuple, *, add: bool) -> None:
        """The pattern's three launches (delta, dQ, dK/dV); replayed after the first call of each geometry."""
        causal, scale, packed, key_mask = spec
        out, lse, dout = saved
        key = None
        if key_mask is None:
            key = ("bwd", self._settings(), plan, spec, add,
                   replays.geometry((q, k, v, out, lse, dout, *grads)))  # (the geometry holds each device)
            recipe = replays.RECIPES.get(key)
            if recipe is not None:
                ht, ut = _tables(("plan", plan, packed), lambda: _plan_rows(plan, packed), q.device)
                replays.replay(recipe, {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dq": grads[0],
                                 "dk": grads[1], "dv": grads[2], "ht": ht, "ut": ut}, q.device)
                return
        record = [] if key is not None else None
        given = (q, k, v, out, dout)  # (before _unit_last: a copy made on the way is not a replay's input)
        cfg = self._check(q, k)
        bsz, S, M, heads, dim = self._pattern_geometry(q, k, plan, packed)
        _check_view("v", v, k.shape)
        for name, x in (("out", out), ("dout", dout)):
            _check_view(name, x, q.shape)
        _check_view("lse", lse, q.shape[:3])
        mask = self._pattern_mask(key_mask, k, plan, packed)
        v, out, dout = _unit_last(v), _unit_last(out), _unit_last(dout)
        ht, ut = _tables(("plan", plan, packed), lambda: _plan_rows(plan, packed), q.device)
        ds, kvs = _dilated_strides, self._kv_strides
        strides = (ds(q, plan), kvs(k, plan, packed, M), kvs(v, plan, packed, M), ds(out, plan), ds(lse, plan),
                   ds(dout, plan), *grad_strides)
        self._backward((q, k, v, out, lse, dout, *grads), strides, (ht, ut), mask, (S, M, M), causal, scale, cfg,
                       add=add, record=record)
        if record is not None:
            names = dict(zip(("q", "k", "v", "out", "dout"), given))
            replays.remember(key, record, {**names, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2],
                                           "ht": ht, "ut": ut})


def _check_fresh(fresh: bool, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, packed: bool) -> None:
    """A fresh write leaves whatever it does not cover as it was (garbage): only a covering pattern may."""
    if fresh and (packed or not plan.covers_all(q.shape[2], k.shape[2])):
        raise ValueError(f"fresh=True needs a local pattern that covers every row and head (r = 1, all "
                         f"{q.shape[2]} query and {k.shape[2]} kv heads); pattern {plan.index} "
                         f"(w={plan.segment}, r={plan.dilation}, {len(plan.chunks)} chunks, packed={packed}) does not")


def _check_view(name: str, x: torch.Tensor, shape) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels read the head dim with unit stride. ``supports`` vets q and k; v, out and
    dout are not shown to it and can arrive otherwise (autograd hands ``out.sum()``'s
    gradient over as an expanded all-zero-stride tensor): those rare cases are copied."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _check_acc(name: str, x: torch.Tensor, shape) -> None:
    _check_view(name, x, shape)
    if x.dim() == 4 and x.stride(-1) != 1:
        raise ValueError(f"{name} (an accumulator the kernel writes) must have unit stride in its head dim, "
                         f"got strides {tuple(x.stride())}")
