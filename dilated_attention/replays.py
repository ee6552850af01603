"""Replays: a kernel call's launches worked out once per geometry, then replayed (``kernels/fused.py``).

An eager step issues each pattern's launches anew, and the host work around them (checks, strides, constexprs,
Triton's argument specialization) took longer than the GPU work of LongNet's small causal calls. The first call
of a geometry (whatever the caller keys it by: settings, plan, flags, and every tensor's shape, strides, dtype
and 16-byte alignment, ``geometry``) runs as written and records what it allocated and launched; later calls of
that geometry allocate the same and call the same compiled kernels with the same integers
(``triton_support.Prepared``): the same launches, so the same bits.
"""

from __future__ import annotations

import torch

from . import caches
from .triton_support import Prepared

RECIPES = caches.table("replays.recipes", 1024)  # a caller's key (kind, settings, plan, flags, geometry) -> replay


def geometry(tensors) -> tuple:
    """What a launch's arguments and specialization read of ``tensors``: shape, strides, dtype, 16-byte alignment,
    device (its index, -1 for CPU)."""
    return tuple([(x.shape, x.stride(), x.dtype, x.data_ptr() & 15, x.get_device()) for x in tensors])  # (inlined)


def remember(key: tuple, record: list, names: dict[str, torch.Tensor]) -> None:
    """Keep ``record`` as ``key``'s replay. ``record``: a call's ``("alloc", name, tensor)`` and ``("launch", jitted
    kernel, grid, args, constexprs, launch options)`` entries in order, each launch's tensor arguments (or None)
    before its other ones. Every tensor argument must be named: one of ``names`` (the call's inputs and tables)
    or an allocation; a call that launched on a tensor made on the way (a copy) or saw one tensor under two
    names is not kept."""
    ids = {id(t): name for name, t in names.items()}
    if len(ids) < len(names):
        return
    allocs, steps = [], []
    for entry in record:
        if entry[0] == "alloc":
            _, name, t = entry
            ids[id(t)] = name
            allocs.append((name, tuple(t.shape), t.dtype))
            continue
        _, fn, grid, args, meta, options = entry
        n = 0
        while n < len(args) and (args[n] is None or isinstance(args[n], torch.Tensor)):
            n += 1
        if any(a is not None and id(a) not in ids for a in args[:n]):
            return
        slots = tuple(None if a is None else ids[id(a)] for a in args[:n])
        steps.append((Prepared(fn, grid, meta, **options), slots, args[n:]))
    RECIPES[key] = (tuple(allocs), tuple(steps))


def replay(recipe: tuple, env: dict, device: torch.device) -> dict:
    """Run a kept replay with ``env``'s tensors by name (its allocations added to ``env``, which is returned)."""
    allocs, steps = recipe
    for name, shape, dtype in allocs:
        env[name] = torch.empty(shape, dtype=dtype, device=device)
    for launch, slots, rest in steps:
        launch(*[None if s is None else env[s] for s in slots], *rest)
    return env
