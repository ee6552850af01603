"""What one step costs the host: the time to issue it, and the CUDA kernels it launches.

An eager step is host-bound when issuing its kernels takes longer than the GPU takes to run them: then the
GPU waits on Python. ``issue_ms`` times the issue alone (the GPU is drained first, so a full launch queue
never blocks the host, and the GPU is not waited on after); ``back_to_back_ms`` times steps issued one after
another, as a training loop issues its layers (the host issues a step while the GPU runs the one before, so the
issue costs time only where it exceeds the GPU's); ``kernel_launches`` counts the kernels one step runs on the
GPU (the torch profiler's device kernels: the library's, the communication's, and copies that run as kernels);
``host_timeline`` says when, within a lone step's issue, the host enters and leaves given functions: how long
the GPU waits before the first kernel, or between forward and backward, and on what.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from typing import Callable, Sequence


def issue_ms(step: Callable[[], None], reps: int = 5, before: Callable[[], None] | None = None) -> float:
    """Median host milliseconds to issue ``step`` over ``reps`` runs, the GPU drained before each (``before``:
    run first each time too, e.g. a barrier, so that every rank starts together)."""
    import torch

    times = []
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def back_to_back_ms(step: Callable[[], None], reps: int = 20, warmup: int = 3) -> float:
    """Milliseconds per ``step`` over ``reps`` steps issued back to back on the GPU (after ``warmup`` steps and a
    drain; drained again at the end): a loop's pace, where the host issues a step while the GPU runs the last."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def kernel_launches(step: Callable[[], None]) -> int:
    """CUDA kernels one ``step`` runs (one profiled step, after the GPU is drained)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA
               and not evt.name.startswith(("Memcpy", "Memset")))


def host_timeline(step: Callable[[], None], points: Sequence[tuple[object, str, str | Callable[..., str]]],
                  reps: int = 10, warmup: int = 3) -> list[tuple[str, float]]:
    """Host milliseconds from the start of a lone ``step`` (the GPU drained first, when there is one) to each entry
    (``label>``) and return (``label<``) of the functions ``points`` name, ``(owner, attribute, label)`` (the
    attribute where callers look it up: a module's own name for an imported function), and to the step's end
    (``issued``): the median over ``reps`` steps, in call order. ``label`` may be a function of the call's
    arguments (e.g. a kernel call's op name). Raises ``ValueError`` where steps mark different sequences (a step
    that plans on its first call: raise ``warmup``). Every attribute is restored after."""
    import torch

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    marks: list[tuple[str, float]] = []

    def marked(fn, label):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = label(*args, **kwargs) if callable(label) else label
            marks.append((name + ">", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((name + "<", time.perf_counter()))
        return wrapper

    # (a class's own attribute is put back; one it inherits is removed again)
    saved = [(owner, attr, inspect.getattr_static(owner, attr), isinstance(owner, type) and attr not in vars(owner))
             for owner, attr, _ in points]
    for owner, attr, fn, _ in saved:
        if isinstance(fn, (staticmethod, classmethod)) or not callable(fn):
            where = getattr(owner, "__name__", type(owner).__name__)
            raise TypeError(f"host_timeline marks functions and methods; {where}.{attr} is {type(fn).__name__}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    runs = []
    try:
        for (owner, attr, label), (_, _, fn, _) in zip(points, saved):
            setattr(owner, attr, marked(fn, label))
        for i in range(warmup + reps):
            sync()
            marks.clear()
            t0 = time.perf_counter()
            step()
            marks.append(("issued", time.perf_counter()))
            if i >= warmup:
                runs.append([(name, (t - t0) * 1e3) for name, t in marks])
    finally:
        for owner, attr, fn, inherited in reversed(saved):
            if inherited:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)
        sync()
    labels = [name for name, _ in runs[0]]
    if any([name for name, _ in run] != labels for run in runs):
        raise ValueError("host_timeline: the steps marked different sequences of calls; raise warmup so that "
                         "every timed step runs the same code")
    return [(name, statistics.median(run[i][1] for run in runs)) for i, name in enumerate(labels)]


__all__ = ["back_to_back_ms", "host_timeline", "issue_ms", "kernel_launches"]


if __name__ == "__main__":  # a module the benchmarks import; run alone it only explains itself
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Imported by bench_kernel.py, "
                            "bench_scaling.py and profile_pipeline.py; nothing to run on its own.").parse_args()
    print(__doc__)
