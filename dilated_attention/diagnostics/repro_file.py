"""The repro file: ``capture`` one call into a small JSON (``call_meta``, ``describe_tensor``, ``describe_mask``,
``call_extras``), ``write`` it and ``load`` it back (any version up to ``VERSION``, merging a multi-rank capture's
sibling files). What the file holds and how it is replayed: ``repro.py``.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import torch

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
