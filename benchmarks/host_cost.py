"""What one step costs the host: the time to issue it, and the CUDA kernels it launches.

An eager step is host-bound when issuing its kernels takes longer than the GPU takes to run them: then the
GPU waits on Python. ``issue_ms`` times the issue alone (the GPU is drained first, so a full launch queue
never blocks the host, and the GPU is not waited on after); ``back_to_back_ms`` times steps issued one after
another, as a training loop issues its layers (the host issues a step while the GPU runs the one before, so the
issue costs time only where it exceeds the GPU's); ``kernel_launches`` counts the kernels one step runs on the
GPU (the torch profiler's device kernels: the library's, the communication's, and copies that run as kernels).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


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


__all__ = ["back_to_back_ms", "issue_ms", "kernel_launches"]


if __name__ == "__main__":  # a module the benchmarks import; run alone it only explains itself
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Imported by bench_kernel.py, "
                            "bench_scaling.py and profile_pipeline.py; nothing to run on its own.").parse_args()
    print(__doc__)
