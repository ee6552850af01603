"""Counting the torch operations a call dispatches (the host-budget tests: counts, never times)."""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    """Counts the aten operations dispatched inside it (``ops``: name -> count), except under ``paused()``: work
    that runs as one kernel on a GPU (a Triton launch in the interpreter, a stand-in op) is counted as such."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def total(self) -> int:
        return sum(self.ops.values())

    def most(self, n: int) -> str:
        """The ``n`` most dispatched operations, as ``name count, ...``."""
        return ", ".join(f"{name} {count}" for name, count in self.ops.most_common(n))
