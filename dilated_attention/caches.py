"""Every cache the library keeps per process, in one registry: ``cache_info()`` and ``clear_caches()``.

A call's host work (validation, plans, kernel choice, launch parameters) depends on a handful of properties
that repeat step after step in training, so each is worked out once and looked up after. A module makes each
of its caches here, under a name (``table``, ``keys``, ``memoize``), with a bound: a ``Table`` that fills up
starts over (the configurations a run sees are few, a full table means an unusual workload, and starting
over costs less than LRU bookkeeping on every hit).

``cache_info()`` tells what each cache holds against its bound (debugging memory); ``clear_caches()``
empties them all, e.g. after the environment a kernel choice reads changed (a package installed, a GPU
setting). Emptying costs only the time to work things out again: no result changes.

What a CUDA graph capture reads is another matter: a captured kernel or copy re-reads the memory it was given
at every replay, long after the call, so whatever a capture is handed from a cache is also held by
``held_for_graphs`` for the life of the process (never emptied: freeing it would hand a live graph freed memory).
And device memory a cache keeps past a call is allocated under ``kept``: in the library's own memory pool, never
in the pool of a CUDA graph that ``torch.compile(mode="reduce-overhead")`` is warming up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch


class CacheInfo(NamedTuple):
    """What one cache holds: ``size`` entries of at most ``bound`` (``None``: held for the life of the process,
    as what refers to its entries is, and not emptied by ``clear_caches``)."""

    size: int
    bound: int | None


@dataclass(frozen=True)
class _Entry:
    size: Callable[[], int]
    bound: int | None
    clear: Callable[[], None] | None  # None (with bound None): held for the life of the process


_REGISTRY: dict[str, _Entry] = {}


class Table(dict):
    """A dict that empties itself before it would hold more than ``kept`` entries."""

    def __init__(self, kept: int) -> None:
        super().__init__()
        self.kept = kept

    def __setitem__(self, key: Any, value: Any) -> None:
        if len(self) >= self.kept and key not in self:
            self.clear()
        super().__setitem__(key, value)


class KeySet(set):
    """A set that empties itself before it would hold more than ``kept`` keys (what was seen once: a warning
    given, a configuration refused)."""

    def __init__(self, kept: int) -> None:
        super().__init__()
        self.kept = kept

    def add(self, key: Any) -> None:
        if len(self) >= self.kept and key not in self:
            self.clear()
        super().add(key)


def register(name: str, size: Callable[[], int], bound: int | None = None,
             clear: Callable[[], None] | None = None) -> None:
    """List a cache kept elsewhere under ``name``: ``size()`` its entries, at most ``bound``, ``clear()`` empties
    it; without a bound and ``clear``, a table held for the life of the process (listed, never emptied)."""
    if (bound is None) != (clear is None):
        raise ValueError(f"cache {name!r}: a bounded cache can be emptied, an unbounded one is held (got bound "
                         f"{bound}, clear {clear})")
    _REGISTRY[name] = _Entry(size, bound, clear)


def table(name: str, kept: int) -> Table:
    """A new registered ``Table`` of at most ``kept`` entries."""
    cache = Table(kept)
    register(name, cache.__len__, kept, cache.clear)
    return cache


def keys(name: str, kept: int) -> KeySet:
    """A new registered ``KeySet`` of at most ``kept`` keys."""
    seen = KeySet(kept)
    register(name, seen.__len__, kept, seen.clear)
    return seen


def memoize(name: str, maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)``, registered under ``name``."""

    def decorate(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register(name, lambda: cached.cache_info().currsize, maxsize, cached.cache_clear)
        return cached

    return decorate


def remember(cache: dict, key: Any, value: Any) -> Any:
    """Store ``value`` under ``key`` in ``cache`` and return it (a lookup's miss path in one expression)."""
    cache[key] = value
    return value


def capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a CUDA graph (``torch.cuda.graph``):
    the host cannot read the device then, and what is captured replays without Python."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


_HELD_FOR_GRAPHS: dict = {}
register("caches.held_for_graphs", _HELD_FOR_GRAPHS.__len__)


def held_for_graphs(key: Any, make: Callable[[], Any]) -> Any:
    """The value kept under ``key`` for the life of the process, made by ``make()`` the first time: what a
    captured graph reads (a lookup table, the pinned host copy a captured transfer re-reads) must outlive every
    graph, and equal keys share one value across captures. Only for small values read during captures."""
    hit = _HELD_FOR_GRAPHS.get(key)
    return hit if hit is not None else remember(_HELD_FOR_GRAPHS, key, make())


def rows_on(name: str, rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``rows`` (int lists of one length) as a ``dtype`` tensor on ``device``, through a pinned host copy (no
    host wait, and legal in a capture). In a capture the host copy is held for good under ``(name, rows)``: the
    captured copy re-reads it at every replay."""
    def host() -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype, pin_memory=device.type == "cuda")

    made = held_for_graphs((name, tuple(map(tuple, rows))), host) if capturing() else host()
    return made.to(device, non_blocking=True)


_KEPT_POOLS: dict[int, Any] = {}
register("caches.kept_pools", _KEPT_POOLS.__len__)  # held: one memory pool per device


@contextlib.contextmanager
def kept(device: torch.device) -> Iterator[None]:
    """Device memory allocated under it outlives the call (a cache's device tables, the stamps' log): on CUDA it
    goes to the library's own memory pool. A cudagraph tree (``torch.compile(mode="reduce-overhead")``) warms a
    graph up eagerly with every allocation routed to the graph's pool, and hands out again, at its next recording,
    pool memory no graph output holds; allocations go to the innermost pool in use (``pools_nest``). Not in a
    capture: what a capture allocates belongs to its graph."""
    if device.type != "cuda" or capturing() or not hasattr(torch.cuda, "use_mem_pool"):
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _KEPT_POOLS.get(index)
    if pool is None:
        pool = remember(_KEPT_POOLS, index, torch.cuda.MemPool())
    with torch.cuda.use_mem_pool(pool, device=index):
        yield


def kept_table(name: str, cache: Table, key: Any, make: Callable[[], Any], device: torch.device) -> Any:
    """``make()``'s device tables, kept in ``cache`` under ``key`` and made under ``kept``. In a capture, a cache
    entry is also held for good under ``(name, key)`` (a captured kernel reads it at every replay); without one,
    the tables are the call's own (a pinned host copy held for good, and its captured copy, fill them at every
    replay), not a cache entry."""
    hit = cache.get(key)
    if capturing():
        return make() if hit is None else held_for_graphs((name, key), lambda: hit)
    if hit is None:
        with kept(device):
            hit = remember(cache, key, make())
    return hit


@memoize("caches.pools_nest", 16)
def pools_nest(index: int) -> bool:
    """Whether CUDA device ``index``'s allocator routes an allocation to the innermost of two memory pools in use
    (what ``kept`` relies on inside a cudagraph tree's warm-up; older torch releases searched them oldest
    first). Found by allocating under two pools, once per device."""
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda.MemPool, "snapshot"):
        return False
    outer, inner = torch.cuda.MemPool(), torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(outer, device=index), torch.cuda.use_mem_pool(inner, device=index):
        probe = torch.empty(1, device=torch.device("cuda", index))
    at = probe.data_ptr()
    inside = any(seg["address"] <= at < seg["address"] + seg["total_size"] for seg in inner.snapshot())
    del probe
    return inside


def typed(value: Any) -> tuple:
    """A key part that tells apart values equal across types (``True == 1 == 1.0``: a cached answer for a
    valid ``2048`` must not answer for ``2048.0``); a list or tuple element by element."""
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple((type(x), x) for x in value))
    return (type(value), value)


def cache_info() -> dict[str, CacheInfo]:
    """Every per-process cache of the library by name (``module.what``): its entries and bound (``None``: held
    for the life of the process)."""
    return {name: CacheInfo(entry.size(), entry.bound) for name, entry in sorted(_REGISTRY.items())}


def clear_caches() -> None:
    """Empty every per-process cache (``cache_info`` lists them); later calls work out again what they need."""
    for entry in _REGISTRY.values():
        if entry.clear is not None:
            entry.clear()
