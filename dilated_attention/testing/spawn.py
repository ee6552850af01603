"""Run a function on spawned gloo ranks and collect what each rank returns.

``spawn_ranks(fn, world, *args)`` starts ``world`` CPU processes in one gloo
group, calls ``fn(rank, world, *args)`` on each, and returns the per-rank return
values (JSON round-tripped: dicts, lists, numbers, strings). ``fn`` must be a
module-level function (it is pickled by name).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from .harness import init_local_rank, run_spawned


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    init_local_rank(rank, world_size, port)
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each run on its own gloo rank."""
    out_dir = run_spawned(_entry, world_size, fn, args)
    results = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results
