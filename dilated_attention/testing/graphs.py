"""One forward+backward captured into a CUDA graph, the way the harness, the GPU tests and the scaling
benchmark all capture it (README: CUDA graphs); and the compiled step that the harness and the GPU tests
compare with eager under ``torch.compile(mode="reduce-overhead")``."""

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
    saved = {name: getattr(custom_ops, name) for name in ("forward", "backward")}

    def counted(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            runs[name] += 1
            return fn(*args, **kwargs)
        return run

    for name, fn in saved.items():
        setattr(custom_ops, name, counted(name, fn))
    try:
        yield runs
    finally:
        for name, fn in saved.items():
            setattr(custom_ops, name, fn)


def eager_and_compiled(layer: Callable, compiled: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dout: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], Counter]:
    """One forward+backward of ``layer`` and of ``compiled`` (its ``torch.compile``) on fresh leaves of the same
    values: each one's ``[out, dq, dk, dv]``, and the op runs the compiled step made (``op_runs``)."""
    answers = []
    for fn in (layer, compiled):
        torch.compiler.cudagraph_mark_step_begin()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with op_runs() as runs:
            out = fn(*leaves)
            out.backward(dout)
        answers.append([t.clone() for t in (out.detach(), *(x.grad for x in leaves))])
    return answers[0], answers[1], runs


def replay_problem(step: int, runs: Counter) -> str | None:
    """What is wrong with the op runs of compiled step ``step`` (0: the cudagraph tree's warm-up, 1: its
    recording, then replays), or ``None``: the warm-up runs the op once each way (so the count counts), a replay
    not at all."""
    if step == 0 and runs != {"forward": 1, "backward": 1}:
        return f"the warm-up ran the op {dict(runs)} times, not once each way: nothing counted"
    if step >= 2 and runs:
        return f"step {step}: the cudagraph tree ran the op instead of replaying it ({dict(runs)})"
    return None
