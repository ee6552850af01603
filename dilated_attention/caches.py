"""What the hot path remembers per configuration or geometry: bounded tables and the keys into them.

A call's host work (validation, plans, kernel choice, launch parameters) depends on a handful of properties
that repeat step after step in training, so each is worked out once and looked up after. A table that fills
up starts over: the configurations a run sees are few, a full table means an unusual workload, and starting
over costs less than LRU bookkeeping on every hit.
"""

from __future__ import annotations

from typing import Any


def remember(cache: dict, key: Any, value: Any, kept: int) -> Any:
    """Store ``value`` under ``key`` in ``cache`` (emptied first when it holds ``kept`` entries); return it."""
    if len(cache) >= kept:
        cache.clear()
    cache[key] = value
    return value


def typed(value: Any) -> tuple:
    """A key part that tells apart values equal across types (``True == 1 == 1.0``: a cached answer for a
    valid ``2048`` must not answer for ``2048.0``); a list or tuple element by element."""
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple((type(x), x) for x in value))
    return (type(value), value)


__all__ = ["remember", "typed"]
