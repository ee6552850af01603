"""One forward+backward captured into a CUDA graph, the way the harness, the GPU tests and the scaling
benchmark all capture it (README: CUDA graphs)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Callable, TypeVar

import torch

from .. import custom_ops

T = TypeVar("T")


def capture(step: Callable[[], T], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` run ``warmup`` times on a side stream (kernels compile, plans settle and, with ``comm``, the ranks
    check the call), then captured into one CUDA graph: ``(graph, what the captured run returned)``. The graph
    reads the tensors ``step`` uses where they lie: they must live as long as it. With ``comm`` every rank calls
    this at the same point (the warm-up exchanges)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


@contextlib.contextmanager
def op_runs() -> Iterator[Counter]:
    """Counts, under ``"forward"`` and ``"backward"``, the runs of the compiled ops' bodies (``custom_ops``): a
    call that a cudagraph tree replays runs neither."""
    runs: Counter = Counter()
    saved = {name: getattr(custom_ops._f, name) for name in ("forward", "backward")}

    def counted(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            runs[name] += 1
            return fn(*args, **kwargs)
        return run

    for name, fn in saved.items():
        setattr(custom_ops._f, name, counted(name, fn))
    try:
        yield runs
    finally:
        for name, fn in saved.items():
            setattr(custom_ops._f, name, fn)


__all__ = ["capture", "op_runs"]
