"""Minimal reproducers: capture one call into a small JSON, replay it against the fp64 oracle.

A repro file holds what decides a failure, not the data: every input's shape,
strides, storage offset, dtype and device, the patterns, mode, causal, scale,
kernel, backend, world size and a seed; the scalar keywords (``strategy``,
``pad_to_segments``, ``head_offsets``) under ``kwargs``; ``cu_seqlens`` as its list
of (global) document offsets; and ``key_padding_mask`` as a description: its
shape (this rank's rows), the fraction of padded keys, random padded runs, a
padded tail, and, when captured from a real mask, its exact padded runs (global
positions) for the rows the capturing rank held. Replay rebuilds each input with
exactly that layout (a seeded random storage viewed with the recorded strides and
offset; the mask over the whole sequence from the seed, exact runs laid over it,
each rank taking its rows), runs ``dilated_attention`` forward and backward, and
compares the output and the q/k/v gradients with the float64 dense oracle (given
the same mask, documents and padding) under the project's tolerance rule
(``testing/compare.py``). When something differs it narrows it down: each
pattern alone, and the same call with the reference kernel (is it the kernel, or
the strategy around it?). With ``save_tensors`` the real tensors (and the mask) go
to a ``.pt`` beside the JSON and replace the seeded ones on a single process.

Capture from user code::

    from dilated_attention.diagnostics import repro
    repro.capture(q, k, v, [2048, 4096], [1, 2], causal=True, key_padding_mask=pad, path="bad_call.json")

Replay (``python -m dilated_attention.tools.repro``, installed as ``dilated-attention-repro``)::

    dilated-attention-repro replay bad_call.json            # 1 process, or spawned CPU ranks
    torchrun --nproc_per_node=8 -m dilated_attention.tools.repro replay bad_call.json   # the recorded world

File versions: 1 had no ``key_padding_mask``/``cu_seqlens`` (read as none: such files
replay as before); 2 adds them. ``load`` refuses a file newer than it knows (it would
silently drop what it cannot read). A multi-rank capture writes one file per rank
(``NAME.rank<r>.json``); loading one merges the exact mask rows of its siblings.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import get_backend
from ..functional import dilated_attention
from ..kernels.registry import KERNEL_NAMES
from ..launch_utils import leave_process_group
from ..patterns import head_groups, longnet_offsets
from ..testing.compare import rel_err, tolerance
from ..testing.oracle import dense_dilated_attention
from ..testing.spawn import init_local_rank, run_spawned, write_result

VERSION = 2  # 2: key_padding_mask, cu_seqlens (version 1 files have neither)
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MASK_DTYPES = {**_DTYPES, "bool": torch.bool, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
_TENSOR_KWARGS = ("key_padding_mask", "cu_seqlens")  # stored as top-level keys, never under "kwargs"


# -- capture ------------------------------------------------------------------------------------


def describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    """What a repro needs to rebuild a tensor's exact layout (values come from a seed)."""
    return {
        "shape": list(t.shape), "stride": list(t.stride()), "storage_offset": int(t.storage_offset()),
        "dtype": str(t.dtype).replace("torch.", ""), "device": str(t.device),
        "requires_grad": bool(t.requires_grad), "data_ptr_mod_16": int(t.data_ptr() % 16),
    }


def call_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths, dilation_rates, *,
              mode: str = "longnet", causal: bool = False, softmax_scale: float | None = None,
              kernel: Any = "auto", comm: Any = None, **extra: Any) -> dict[str, Any]:
    """The metadata of one ``dilated_attention`` call, in the repro file's vocabulary.

    ``kernel``/``comm`` may be names or objects; ``extra`` (e.g. ``strategy``,
    ``head_offsets``) is stored under ``kwargs`` and passed back on replay.
    """
    meta: dict[str, Any] = {
        "segment_lengths": [int(x) for x in segment_lengths] if _int_list(segment_lengths) else repr(segment_lengths),
        "dilation_rates": [int(x) for x in dilation_rates] if _int_list(dilation_rates) else repr(dilation_rates),
        "mode": mode, "causal": causal, "softmax_scale": softmax_scale,
        "kernel": kernel if isinstance(kernel, str) else getattr(kernel, "name", type(kernel).__name__),
        "backend": None, "world_size": 1, "rank": 0,
        "kwargs": {key: val for key, val in extra.items() if isinstance(val, (str, int, float, bool, type(None)))},
        "grad_enabled": torch.is_grad_enabled(),
    }
    for name, t in (("q", q), ("k", k), ("v", v)):
        meta[name] = describe_tensor(t) if isinstance(t, torch.Tensor) else {"type": type(t).__name__}
    if comm is not None:
        meta["backend"] = comm if isinstance(comm, str) else getattr(comm, "name", type(comm).__name__)
        if not isinstance(comm, str):
            try:
                meta["world_size"], meta["rank"] = int(comm.world_size), int(comm.rank)
            except Exception:  # the backend may be the thing that is broken
                pass
    return meta


def _int_list(x) -> bool:
    try:
        return all(isinstance(i, int) and not isinstance(i, bool) for i in x)
    except TypeError:
        return False


def capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths, dilation_rates, *,
            path: str | os.PathLike | None = None, directory: str | os.PathLike | None = None,
            save_tensors: bool = False, error: BaseException | str | None = None, seed: int = 0,
            mode: str = "longnet", causal: bool = False, softmax_scale: float | None = None,
            kernel: Any = "auto", comm: Any = None, key_padding_mask: Any = None, cu_seqlens: Any = None,
            **kwargs: Any) -> str:
    """Write a repro of ``dilated_attention(q, k, v, segment_lengths, dilation_rates, ...)``; returns its path.

    Call it with the arguments of the failing call (on every rank when ``comm`` is
    given: each rank writes its own file, suffixed ``.rank<r>``, ``path`` included). ``error``: the
    exception (or text) seen. ``save_tensors``: also save q, k, v (and the mask) as ``.pt``.
    ``key_padding_mask`` is recorded exactly (its padded runs), ``cu_seqlens`` as its offsets;
    scalar keywords (``strategy``, ``pad_to_segments``, ``head_offsets``) under ``kwargs``.
    Nothing here talks to other ranks (a failing call may be one the ranks disagree on).
    """
    spec = call_meta(q, k, v, segment_lengths, dilation_rates, mode=mode, causal=causal,
                     softmax_scale=softmax_scale, kernel=kernel, comm=comm, **kwargs)
    rank, world = int(spec.get("rank") or 0), int(spec.get("world_size") or 1)
    spec.update(call_extras(key_padding_mask, cu_seqlens, rank=rank, world=world))
    spec["seed"] = int(seed)
    if error is not None:
        spec["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    tensors = {"q": q.detach(), "k": k.detach(), "v": v.detach()} if save_tensors else None
    if tensors is not None and isinstance(key_padding_mask, torch.Tensor):
        tensors["key_padding_mask"] = key_padding_mask.detach()
    if path is not None and world > 1 and not _RANK_FILE.search(os.fspath(path)):
        stem, ext = os.path.splitext(os.fspath(path))
        path = f"{stem}.rank{rank}{ext or '.json'}"
    return write(spec, directory=directory, path=path, tensors=tensors)


_RANK_FILE = re.compile(r"\.rank(\d+)\.json$")


def _runs(row: torch.Tensor, start: int) -> list[list[int]]:
    """``[[a, b), ...]``: the runs of True in a 1-D bool ``row``, as positions offset by ``start``."""
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.nonzero(padded[1:] != padded[:-1]).flatten().tolist()
    return [[start + a, start + b] for a, b in zip(edges[::2], edges[1::2])]


def describe_mask(mask: Any, *, rank: int = 0, world: int = 1) -> dict[str, Any] | None:
    """A ``key_padding_mask`` in the repro file's vocabulary (``None`` for none).

    ``shape``/``dtype`` as given (this rank's rows), ``density`` (fraction padded), and
    ``exact``: one piece per rank whose rows are known, with the padded runs of each batch
    row in global positions (rank ``r`` of ``world`` holds rows ``[r L, (r + 1) L)``).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        return {"type": type(mask).__name__}
    m = mask.detach().cpu()
    desc: dict[str, Any] = {"shape": list(m.shape), "dtype": str(m.dtype).replace("torch.", "")}
    if m.dim() == 2 and m.numel():
        b = m != 0  # any dtype: nonzero = padded (an invalid dtype is still replayed as that dtype)
        lo = rank * m.shape[1]
        desc["density"] = round(float(b.double().mean()), 6)
        desc["exact"] = [{"rows": [lo, lo + m.shape[1]], "padded": [_runs(row, lo) for row in b]}]
    return desc


def call_extras(key_padding_mask: Any = None, cu_seqlens: Any = None, *, rank: int = 0,
                world: int = 1) -> dict[str, Any]:
    """The tensor keywords of a call as repro keys: ``key_padding_mask`` (``describe_mask``) and
    ``cu_seqlens`` (its offsets as a list; ``cu_seqlens_dtype`` when not int32, so replay raises alike)."""
    extras: dict[str, Any] = {"key_padding_mask": describe_mask(key_padding_mask, rank=rank, world=world),
                              "cu_seqlens": None}
    if isinstance(cu_seqlens, torch.Tensor):
        extras["cu_seqlens"] = cu_seqlens.detach().cpu().tolist()
        if cu_seqlens.dtype != torch.int32:
            extras["cu_seqlens_dtype"] = str(cu_seqlens.dtype).replace("torch.", "")
    elif cu_seqlens is not None:  # not a tensor: replayed as the same Python value (the call raises TypeError)
        plain = isinstance(cu_seqlens, (list, tuple, int, float, str))
        extras["cu_seqlens"] = cu_seqlens if plain else repr(cu_seqlens)
        extras["cu_seqlens_dtype"] = "python"
    return extras


def summary(spec: dict[str, Any], path: str | None = None) -> list[str]:
    """A repro file as aligned lines for a person: the call, each tensor's layout, masks, the error, and the
    command that replays it (``repro show``; ``--json`` prints the file itself)."""
    rows: list[tuple[str, str]] = []
    world, rank = int(spec.get("world_size") or 1), int(spec.get("rank") or 0)
    if path is not None:
        rows.append(("file", path))
    rows.append(("call", f"dilated_attention(q, k, v, segment_lengths={spec.get('segment_lengths')}, "
                         f"dilation_rates={spec.get('dilation_rates')})"))
    options = {name: spec[name] for name in ("mode", "causal", "softmax_scale", "kernel") if name in spec}
    options.update(spec.get("kwargs") or {})
    rows.append(("options", ", ".join(f"{name}={value!r}" for name, value in options.items()) or "none"))
    rows.append(("ranks", "one process" if world == 1 else f"rank {rank} of {world}, backend {spec.get('backend')}"))
    for name in ("q", "k", "v"):
        t = spec.get(name) or {}
        if not t:
            continue
        shape = "x".join(str(x) for x in t.get("shape", []))
        layout = f"stride {tuple(t.get('stride', []))}, offset {t.get('storage_offset', 0)}"
        address = t.get("data_ptr_mod_16")
        rows.append((name, f"{shape} {t.get('dtype')} on {t.get('device')}, {layout}"
                           + ("" if address in (None, 0) else f", address {address} bytes past 16-byte alignment")
                           + (", requires_grad" if t.get("requires_grad") else "")))
    mask = spec.get("key_padding_mask")
    if mask:
        rows.append(("key_padding_mask", f"{'x'.join(map(str, mask.get('shape', [])))} {mask.get('dtype', '')}, "
                                         f"{100 * mask.get('density', 0):.1f}% padded"))
    docs = spec.get("cu_seqlens")
    if docs is not None:
        if isinstance(docs, list) and len(docs) > 1:
            lengths = [b - a for a, b in zip(docs, docs[1:])] if all(isinstance(x, int) for x in docs) else docs
            rows.append(("cu_seqlens", f"{len(docs) - 1} documents, lengths {lengths}"))
        else:
            rows.append(("cu_seqlens", repr(docs)))
    if spec.get("tensors"):
        rows.append(("tensors", f"saved in {spec['tensors']}"))
    rows.append(("error", spec.get("error") or "none recorded"))
    rows.append(("replay", f"dilated-attention-repro replay {path or 'FILE'}"
                           + ("" if world == 1 else f"  (or torchrun --nproc_per_node={world} "
                                                    f"-m dilated_attention.tools.repro replay ...)")))
    width = max(len(name) for name, _ in rows)
    return [f"{name:>{width}s}  {text}" for name, text in rows]


def write(spec: dict[str, Any], *, directory: str | os.PathLike | None = None, path: str | os.PathLike | None = None,
          tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write ``spec`` as JSON (under ``directory`` with a fresh name, or at ``path``); returns the path."""
    spec = {"version": VERSION, "seed": 0, **spec}
    rank = int(spec.get("rank") or 0)
    if path is None:
        directory = os.fspath(directory or "dilated_attention_repro")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(directory, f"repro-{stamp}-{os.getpid()}")
        if int(spec.get("world_size") or 1) > 1:
            path += f".rank{rank}"
        path += ".json"
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if tensors:
        pt = os.path.splitext(path)[0] + ".pt"
        torch.save({n: t.detach().cpu() for n, t in tensors.items()}, pt)
        spec["tensors"] = os.path.basename(pt)
    with open(path, "w") as f:
        json.dump(spec, f, indent=1, default=str)
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a repro file (any version up to ``VERSION``), merging a multi-rank capture's sibling files' mask rows."""
    with open(path) as f:
        spec = json.load(f)
    for key in ("q", "k", "v", "segment_lengths", "dilation_rates"):
        if key not in spec:
            raise ValueError(f"{path} is not a repro file: it has no {key!r}")
    version = spec.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"{path}: repro version must be a positive int, got {version!r}")
    if version > VERSION:
        raise ValueError(f"{path} is a version {version} repro file; this library reads versions up to {VERSION} "
                         "(replaying it here would drop what it cannot read): update dilated_attention")
    spec.setdefault("key_padding_mask", None)  # version 1: neither key, i.e. no mask and no documents
    spec.setdefault("cu_seqlens", None)
    spec["_path"] = os.fspath(path)
    _merge_rank_files(spec, os.fspath(path))
    return spec


def _merge_rank_files(spec: dict[str, Any], path: str) -> None:
    """A rank's capture knows its own mask rows: add the exact rows of ``NAME.rank<r>.json`` siblings."""
    desc, world = spec.get("key_padding_mask"), int(spec.get("world_size") or 1)
    match = _RANK_FILE.search(path)
    if world < 2 or match is None or not isinstance(desc, dict) or not desc.get("exact"):
        return
    known = {tuple(piece["rows"]) for piece in desc["exact"]}
    for r in range(world):
        sibling = f"{path[:match.start()]}.rank{r}.json"
        if r == int(match.group(1)) or not os.path.exists(sibling):
            continue
        try:
            with open(sibling) as f:
                other = json.load(f).get("key_padding_mask") or {}
        except (OSError, ValueError):
            continue
        if other.get("shape") != desc.get("shape"):
            continue
        for piece in other.get("exact") or []:
            if tuple(piece["rows"]) not in known:
                known.add(tuple(piece["rows"]))
                desc["exact"].append(piece)


# -- rebuilding inputs ------------------------------------------------------------------------------


def _extent(shape, stride, offset) -> int:
    return offset + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0) + 1


def strided_random(desc: dict[str, Any], generator: torch.Generator, device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor with ``desc``'s shape, strides and storage offset over a random (never zero) storage."""
    shape, stride, offset = desc["shape"], desc["stride"], int(desc.get("storage_offset", 0))
    storage = torch.randn(_extent(shape, stride, offset), generator=generator, dtype=torch.float64)
    return storage.to(device=device, dtype=dtype).as_strided(shape, stride, offset)


def _dtype(spec) -> torch.dtype:
    name = spec["q"].get("dtype", "float32")
    if name not in _DTYPES:
        raise ValueError(f"repro dtype must be one of {tuple(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _saved_tensors(spec: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The ``.pt`` of real tensors beside the JSON (single process only), if there is one."""
    pt = spec.get("tensors")
    if pt and int(spec.get("world_size") or 1) == 1:
        here = os.path.join(os.path.dirname(spec.get("_path", ".")), pt)
        if os.path.exists(here):
            return torch.load(here)
    return None


def build_inputs(spec: dict[str, Any], rank: int, device) -> tuple[torch.Tensor, ...]:
    """This rank's ``q, k, v`` (leaves that require grad, recorded layouts) and ``dout`` (contiguous)."""
    dtype = _dtype(spec)
    seed = int(spec.get("seed", 0))
    saved = _saved_tensors(spec)
    if saved is not None:
        qkv = [saved[n].to(device).requires_grad_() for n in ("q", "k", "v")]
        g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + 3)
        dout = torch.randn(qkv[0].shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        return (*qkv, dout)
    out = []
    for i, name in enumerate(("q", "k", "v")):
        g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + i)
        out.append(strided_random(spec[name], g, device, dtype).requires_grad_())
    g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + 3)
    dout = torch.randn(spec["q"]["shape"], generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return (*out, dout)


def random_mask(desc: dict[str, Any], seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """The seeded bool ``(batch, seq_len)`` mask a description stands for (the same on every rank).

    Each key is padded with probability ``density``; then, per batch row, ``runs`` random runs
    ``[a, b)`` are padded (a run may cover the whole row) and, with ``tail``, a random-length tail
    (0 up to the whole row: a batch of unequal lengths).
    """
    g = torch.Generator().manual_seed(seed * 7919 + 50)  # apart from every rank's q/k/v/dout streams
    mask = torch.rand(batch, seq_len, generator=g, dtype=torch.float64) < float(desc.get("density", 0.0))
    for b in range(batch):
        for _ in range(int(desc.get("runs", 0))):
            a, c = sorted(int(x) for x in torch.randint(0, seq_len + 1, (2,), generator=g))
            mask[b, a:c] = True
        if desc.get("tail"):
            mask[b, seq_len - int(torch.randint(0, seq_len + 1, (1,), generator=g)):] = True
    return mask


def build_mask(spec: dict[str, Any], rank: int, device) -> tuple[Any, torch.Tensor | None]:
    """``(this rank's key_padding_mask, the whole sequence's bool mask for the oracle)``, or ``(None, None)``.

    The whole mask is drawn from the seed (``random_mask``) with the recorded exact runs laid
    over the rows they cover; rank ``r`` takes rows ``[r L, (r + 1) L)``.
    """
    desc = spec.get("key_padding_mask")
    if desc is None:
        return None, None
    if "type" in desc:  # not a tensor at capture: replay something that is not one either
        return f"<{desc['type']}>", None
    world = int(spec.get("world_size") or 1)
    shape = list(desc.get("shape") or spec["q"]["shape"][:2])
    dtype = _MASK_DTYPES.get(desc.get("dtype", "bool"), torch.bool)
    saved = _saved_tensors(spec)
    if saved is not None and "key_padding_mask" in saved:
        mask = saved["key_padding_mask"]
        whole = (mask != 0).cpu() if mask.dim() == 2 else None
        return mask.to(device), whole
    if len(shape) != 2:
        return torch.zeros(shape, dtype=dtype, device=device), None
    batch, local = shape
    whole = random_mask(desc, int(spec.get("seed", 0)), batch, local * world)
    for piece in desc.get("exact") or []:
        lo, hi = piece["rows"]
        whole[:, lo:hi] = False
        for b, runs in enumerate(piece["padded"][:batch]):
            for a, c in runs:
                whole[b, a:c] = True
    mine = whole[:, rank * local:(rank + 1) * local]
    return mine.to(device=device, dtype=dtype), whole


def build_cu_seqlens(spec: dict[str, Any], device) -> Any:
    """The recorded ``cu_seqlens`` as the call gets it (int32 unless another dtype was recorded)."""
    offsets = spec.get("cu_seqlens")
    if offsets is None:
        return None
    name = spec.get("cu_seqlens_dtype", "int32")
    if name == "python":
        return offsets
    return torch.tensor(offsets, dtype=_MASK_DTYPES.get(name, torch.int32), device=device)


def describe_call(spec: dict[str, Any]) -> str:
    """The keywords beyond the patterns, in a few words (for report lines and fuzz findings)."""
    parts = []
    kwargs = spec.get("kwargs") or {}
    for key in ("strategy", "pad_to_segments", "head_offsets"):
        if key in kwargs:
            parts.append(f"{key}={kwargs[key]!r}")
    desc = spec.get("key_padding_mask")
    if isinstance(desc, dict):
        if "type" in desc:
            parts.append(f"key_padding_mask of type {desc['type']}")
        else:
            how = [f"density {desc.get('density', 0)}"]
            how += [f"{desc['runs']} run(s)"] if desc.get("runs") else []
            how += ["a tail"] if desc.get("tail") else []
            how += [f"exact rows {[p['rows'] for p in desc['exact']]}"] if desc.get("exact") else []
            parts.append(f"key_padding_mask {desc.get('dtype', 'bool')} {desc.get('shape')} ({', '.join(how)})")
    if spec.get("cu_seqlens") is not None:
        cu = spec["cu_seqlens"]
        parts.append(f"cu_seqlens {cu if not isinstance(cu, list) or len(cu) <= 12 else cu[:6] + ['...'] + cu[-2:]}")
    return ", ".join(parts)


# -- replay -------------------------------------------------------------------------------------------

NAMES = ("out", "dq", "dk", "dv")


@dataclass
class Report:
    """One rank's verdict on one replayed call."""

    rank: int
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    raised: str | None = None
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(f"[rank {self.rank}] {line}" for line in self.lines)


def _gather_global(x: torch.Tensor, comm) -> torch.Tensor:
    """Concatenate every rank's rows (dim 1) of ``x`` (a local contiguous copy) on CPU."""
    if comm is None:
        return x.detach().double().cpu()
    local = x.detach().contiguous()
    return torch.cat(list(comm.all_gather(local).cpu().double().unbind(0)), dim=1)


def _call_kwargs(spec: dict[str, Any], mask: Any, cu_seqlens: Any) -> dict[str, Any]:
    """Keywords for ``dilated_attention`` beyond the patterns, comm and kernel."""
    kwargs = {key: val for key, val in (spec.get("kwargs") or {}).items() if key not in _TENSOR_KWARGS}
    if spec.get("key_padding_mask") is not None:
        kwargs["key_padding_mask"] = mask
    if spec.get("cu_seqlens") is not None:
        kwargs["cu_seqlens"] = cu_seqlens
    return kwargs


def _oracle_kwargs(spec: dict[str, Any], whole_mask: torch.Tensor | None) -> dict[str, Any]:
    """The oracle's view of the same call: the whole sequence's mask and the global document offsets."""
    kwargs = spec.get("kwargs") or {}
    return dict(head_offsets=kwargs.get("head_offsets", "spread"), pad_to_segments=kwargs.get("pad_to_segments", True),
                key_padding_mask=whole_mask, cu_seqlens=spec.get("cu_seqlens"))


def _oracle(spec, q, k, v, dout, dtype, segs, rates, extra=None):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*leaves, segs, rates, mode=spec.get("mode", "longnet"),
                                  causal=bool(spec.get("causal", False)), softmax_scale=spec.get("softmax_scale"),
                                  **(extra or {}))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return [t.detach().double() for t in (out, *grads)]


def _document(spec, pos: int) -> tuple[int, int] | None:
    """``(document index, its first position)`` of global position ``pos`` under ``cu_seqlens``."""
    cu = spec.get("cu_seqlens")
    if not isinstance(cu, list) or not all(isinstance(x, int) for x in cu):
        return None
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        if a <= pos < b:
            return i, a
    return None


def _covering(spec, heads: int, seq_len: int, pos: int, head: int) -> list[int]:
    """Patterns whose dilated set contains (position, head) (docs/design.md section 1); ``pos`` counts from
    the start of its document (segments restart at each one)."""
    segs, rates = spec["segment_lengths"], spec["dilation_rates"]
    rule = (spec.get("kwargs") or {}).get("head_offsets", "spread")
    found = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        if spec.get("mode", "longnet") == "grouped":
            h0, h1 = head_groups(heads, len(segs))[i]
            if h0 <= head < h1 and pos % r == i % r:
                found.append(i)
        elif pos % r == longnet_offsets(heads, r, rule)[head]:
            found.append(i)
    return found


def _run_once(spec, comm, device, kernel, segs, rates, inputs, extra=None):
    q, k, v, dout = inputs
    leaves = [q, k, v]  # leaves built by build_inputs (autograd.grad does not accumulate into them)
    kwargs = extra if extra is not None else _call_kwargs(spec, None, None)
    out = dilated_attention(*leaves, segs, rates, mode=spec.get("mode", "longnet"), causal=bool(spec.get("causal")),
                            softmax_scale=spec.get("softmax_scale"), comm=comm, kernel=kernel, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    if out.is_cuda:
        torch.cuda.synchronize()
    return [t.detach().cpu() for t in (out, *grads)]


# Inputs are standard normal by construction, so the terms summed into any output or gradient are
# O(1) or larger. Errors are relative to max(|oracle|, 1): a result the oracle gives as (near) zero,
# e.g. dq when every row sees one key, is judged in absolute terms instead of dividing rounding
# residue (1e-7 in fp32) by zero.
SCALE_FLOOR = 1.0
ZERO_RESIDUE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _judge(spec, comm, rank, got, oracle, plain, dtype, local_len):
    # A rank's rows are judged as part of the whole result (what one device would return): errors are
    # relative to the whole tensor's scale and the bound comes from plain torch on the whole tensor.
    # Judging a shard on its own scale made a shard of one or two rows, where the gradient nearly
    # cancels, fail on rounding that the same rows pass on one device.
    rows = slice(rank * local_len, (rank + 1) * local_len)
    errors, tols, bad = {}, {}, []
    for name, g, o, p in zip(NAMES, got, oracle, plain):
        scale = float(o.abs().max().clamp_min(SCALE_FLOOR)) if o.numel() else SCALE_FLOOR
        if bool(torch.isfinite(g).all()):
            errors[name] = float((g.double() - o[:, rows]).abs().max()) / scale if g.numel() else 0.0
        else:
            errors[name] = float("inf")
        tols[name] = tolerance(dtype, None if dtype == torch.float64 else rel_err(p, o, floor=SCALE_FLOOR))
        floor = (spec.get("floor") or {}).get(str(dtype).replace("torch.", ""))
        if floor is not None:
            tols[name] = max(tols[name], float(floor))
        if float(o.abs().max()) < 1e-8:
            # analytically zero (every row sees one key, so the softmax gradient cancels): plain torch may
            # hit exact zeros by luck, so "2x plain" means nothing; allow rounding residue instead
            tols[name] = max(tols[name], ZERO_RESIDUE[dtype])
        if not errors[name] <= tols[name]:
            bad.append(name)
    return errors, tols, bad


def _worst(spec, got, oracle, rank, local_len, name, whole_mask=None) -> str:
    idx = NAMES.index(name)
    g, o = got[idx].double(), oracle[idx][:, rank * local_len:(rank + 1) * local_len]
    diff = (g - o).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    b, row, head, _ = (int(i) for i in torch.nonzero(diff == diff.max())[0])
    pos = rank * local_len + row
    heads, seq = oracle[0].shape[2], oracle[0].shape[1]
    where = f"batch {b}, position {pos}, head {head}"
    doc = _document(spec, pos)
    start = 0
    if doc is not None:
        start = doc[1]
        where += f" (document {doc[0]}, its position {pos - start})"
    if whole_mask is not None and whole_mask.shape[0] > b and whole_mask.shape[1] > pos:
        where += f" (its key {'is' if bool(whole_mask[b, pos]) else 'is not'} padded; " \
                 f"{int(whole_mask[b].sum())} of {whole_mask.shape[1]} keys padded in batch row {b})"
    if name == "out" or name == "dq":
        where += f" (covered by patterns {_covering(spec, heads, seq, pos - start, head)})"
    return where


def run_spec(spec: dict[str, Any], *, comm=None, device=None, kernel: Any = None, narrow: bool = True) -> Report:
    """Replay ``spec`` on this rank (all ranks of ``comm`` must call it); returns this rank's ``Report``."""
    rank = comm.rank if comm is not None else 0
    world = comm.world_size if comm is not None else 1
    device = torch.device(device) if device is not None else torch.device("cpu")
    kernel = kernel if kernel is not None else spec.get("kernel", "auto")
    rep = Report(rank, True)
    if isinstance(kernel, str) and kernel not in KERNEL_NAMES:
        rep.lines.append(f"kernel {kernel!r} is not a library kernel name; replaying with kernel='auto'")
        kernel = "auto"
    dtype = _dtype(spec)
    segs, rates = list(spec["segment_lengths"]), list(spec["dilation_rates"])
    inputs = build_inputs(spec, rank, device)
    mask, whole_mask = build_mask(spec, rank, device)
    extra = _call_kwargs(spec, mask, build_cu_seqlens(spec, device))
    oextra = _oracle_kwargs(spec, whole_mask)
    q, k, v, dout = inputs
    local_len = q.shape[1]
    g_q, g_k, g_v, g_d = (_gather_global(t, comm) for t in inputs)
    kname = getattr(kernel, "name", kernel)
    rep.lines.append(f"{spec.get('mode', 'longnet')} causal={bool(spec.get('causal'))} patterns {segs} x {rates}, "
                     f"q {tuple(q.shape)} stride {tuple(q.stride())}, k {tuple(k.shape)} stride {tuple(k.stride())}, "
                     f"{dtype}, kernel {kname}, world {world}, device {device}")
    more = describe_call(spec)
    if more:
        rep.lines.append(more)
    if isinstance(mask, torch.Tensor) and whole_mask is not None:
        rep.lines.append(f"key_padding_mask: {int(whole_mask.sum())} of {whole_mask.numel()} keys padded, "
                         f"{int(whole_mask.all(1).sum())} of {whole_mask.shape[0]} batch rows wholly")
    if spec.get("error"):
        rep.lines.append(f"recorded error: {spec['error'].splitlines()[0][:300]}")
    try:
        got = _run_once(spec, comm, device, kernel, segs, rates, inputs, extra)
    except Exception as exc:
        rep.ok, rep.raised = False, f"{type(exc).__name__}: {exc}"
        rep.lines.append(f"FAIL: the call raised {rep.raised.splitlines()[0][:400]}")
        return rep
    try:
        oracle = _oracle(spec, g_q, g_k, g_v, g_d, torch.float64, segs, rates, oextra)
        plain = oracle if dtype == torch.float64 else _oracle(spec, g_q, g_k, g_v, g_d, dtype, segs, rates, oextra)
    except Exception as exc:  # the library accepted a call the oracle cannot evaluate
        rep.ok, rep.raised = False, f"the call ran, but the oracle raised {type(exc).__name__}: {exc}"
        rep.lines.append(f"FAIL: {rep.raised.splitlines()[0][:400]}")
        return rep
    rep.errors, rep.tolerance, bad = _judge(spec, comm, rank, got, oracle, plain, dtype, local_len)
    rep.lines.append("vs fp64 oracle: " + ", ".join(
        f"{n} {rep.errors[n]:.1e}{'' if n not in bad else ' > ' + format(rep.tolerance[n], '.1e') + ' DIFFERS'}"
        for n in NAMES))
    if not bad:
        rep.lines.append("ok: output and gradients within the tolerance rule")
    else:
        rep.ok = False
        for name in bad:
            rep.lines.append(f"{name} differs most at {_worst(spec, got, oracle, rank, local_len, name, whole_mask)}")
    # narrowing must be collective: every rank runs the same calls even if only one rank failed
    any_bad = not rep.ok
    if comm is not None:
        flags = comm.all_gather(torch.tensor([int(any_bad)], device=device)).cpu()
        any_bad = bool(flags.any())
    if narrow and any_bad:
        _narrow(spec, comm, device, kernel, segs, rates, inputs, oracle, rep, rank, local_len, dtype,
                (g_q, g_k, g_v, g_d), extra, oextra)
    return rep


def _narrow(spec, comm, device, kernel, segs, rates, inputs, oracle, rep, rank, local_len, dtype, whole, extra,
            oextra):
    """Which pattern, and is it the kernel? (every rank runs the same calls)"""
    culprits = []
    for i, (w, r) in enumerate(zip(segs, rates)):
        if len(segs) == 1:
            break
        if spec.get("mode", "longnet") == "grouped":
            break  # a lone pattern changes the head groups: no like-for-like comparison
        try:
            got = _run_once(spec, comm, device, kernel, [w], [r], inputs, extra)
            o1 = _oracle(spec, *whole, torch.float64, [w], [r], oextra)
            p1 = o1 if dtype == torch.float64 else _oracle(spec, *whole, dtype, [w], [r], oextra)
            _, _, bad = _judge(spec, comm, rank, got, o1, p1, dtype, local_len)
        except Exception as exc:
            bad = [f"raised {type(exc).__name__}"]
        if bad:
            culprits.append(f"pattern {i} (segment {w}, dilation {r}): {', '.join(bad)}")
    if culprits:
        rep.lines.append("alone, these patterns differ: " + "; ".join(culprits))
    elif len(segs) > 1 and spec.get("mode", "longnet") != "grouped":
        rep.lines.append("every pattern alone is right: the combination of patterns differs")
    if getattr(kernel, "name", kernel) != "reference":
        try:
            got = _run_once(spec, comm, device, "reference", segs, rates, inputs, extra)
            plain = oracle if dtype == torch.float64 else _oracle(spec, *whole, dtype, segs, rates, oextra)
            _, _, bad = _judge(spec, comm, rank, got, oracle, plain, dtype, local_len)
        except Exception as exc:
            bad = [f"raised {type(exc).__name__}: {exc}"]
        if bad:
            rep.lines.append(f"the reference kernel differs too ({', '.join(bad)}): the fault is outside the kernel "
                             "(strategy, merge, communication)")
        else:
            rep.lines.append(f"the reference kernel is right: the fault is in kernel {getattr(kernel, 'name', kernel)!r}")


# -- entry points for the CLI ----------------------------------------------------------------------------


def _spawned_worker(rank, world, port, spec, device, backend, out_dir):
    torch.set_num_threads(1)
    init_local_rank(rank, world, port)
    try:
        rep = run_spec(spec, comm=get_backend(backend), device=device)
    except Exception as exc:
        rep = Report(rank, False, raised=repr(exc), lines=[f"FAIL: replay raised {exc!r}"])
    write_result(out_dir, rank, rep.__dict__)
    leave_process_group(barrier=False)


def replay_spawned(spec: dict[str, Any], backend: str | None = None) -> list[Report]:
    """Replay a multi-rank repro on this machine: ``world_size`` gloo ranks on CPU."""
    world = int(spec.get("world_size") or 1)
    return [Report(**x) for x in run_spawned(_spawned_worker, world, spec, "cpu",
                                             backend or spec.get("backend") or "collective")]


__all__ = ["Report", "build_cu_seqlens", "build_inputs", "build_mask", "call_extras", "call_meta", "capture",
           "describe_call", "describe_mask", "describe_tensor", "load", "random_mask", "replay_spawned", "run_spec",
           "strided_random", "write"]
