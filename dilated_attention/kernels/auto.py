"""``kernel="auto"`` on a GPU: per pattern and direction, the implementation measured fastest there.

The choice is a table lookup, never a guess: ``benchmarks/bench_kernel.py``
times every implementation on each pattern class of its configuration and
writes the winners into ``auto_table.py`` under the GPU's name
(``--write-table``). The key is (direction, dense ``r = 1`` or dilated, causal,
head dim, dtype, rows per segment ``M = w / r``); a key the table does not list
runs the fused kernel. So one configuration always runs the same implementation,
on every rank and every run.

Rows: the winner depends on the segment length (on an H200 the fused forward wins
on LongNet's 2048-row segments, cuDNN's on one 32768-row segment). Entries are
measured at some row counts; a pattern with ``M`` rows uses the entry measured at
the largest row count not above ``M`` (the smallest one when ``M`` is below them
all). A key without rows (tables written before rows were measured) stands for
row count 0.

Determinism: backward entries come in two flavours. ``bwd/...`` holds the
fastest implementation whose backward gave bitwise-equal results run to run in
the measurement (the fused kernel always does); ``bwd-any/...`` the fastest of
all (cuDNN's backward accumulates dQ with atomics). Implementations declare
``deterministic_backward``; a ``bwd/...`` entry naming one that is not is refused
(cuDNN's backward once gave two equal runs in a measurement, yet it is not
reproducible: 5 of 5 repeats differed on an H100, with and without
``torch.use_deterministic_algorithms``). ``AutoKernel`` uses the
deterministic entry unless built with ``allow_nondeterministic`` (or the
environment sets ``DILATED_ATTENTION_NONDETERMINISTIC=1``): the library's
communication backends promise bitwise-identical results, which holds only when
the kernel is deterministic.
"""

from __future__ import annotations

import os
import warnings

import torch

from ..caches import Table, remember
from ..patterns import PatternPlan
from ..views import layout_key
from . import auto_table
from .protocol import PatternKernel
from .wrapper import KernelWrapper

DIRECTIONS = ("fwd", "bwd", "bwd-any")
_PICKS_KEPT = 1024


# a forward entry's stand-in where its implementation cannot run here: the same cuDNN kernel (cudnn-det's
# forward is the frontend's graph; without the frontend, torch's op runs it)
FORWARD_STAND_INS = {"cudnn-det": "cudnn"}


def table_key(direction: str, dilation: int, causal: bool, dim: int, dtype: torch.dtype,
              rows: int | None = None) -> str:
    """``direction/dense|dilated/full|causal/D<dim>/<dtype>[/M<rows>]``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    key = (f"{direction}/{'dense' if dilation == 1 else 'dilated'}/{'causal' if causal else 'full'}"
           f"/D{dim}/{str(dtype).removeprefix('torch.')}")
    return key if rows is None else f"{key}/M{rows}"


def _by_rows(choices: dict[str, str]) -> dict[str, list[tuple[int, str]]]:
    """Choices grouped by their key without rows: ``{key: [(rows, implementation), ...]}``, rows ascending."""
    grouped: dict[str, list[tuple[int, str]]] = {}
    for key, name in choices.items():
        base, _, last = key.rpartition("/")
        if last.startswith("M") and last[1:].isdigit():
            grouped.setdefault(base, []).append((int(last[1:]), name))
        else:
            grouped.setdefault(key, []).append((0, name))
    return {k: sorted(v) for k, v in grouped.items()}


def _nearest_below(entries: list[tuple[int, str]] | None, rows: int) -> str | None:
    """The entry measured at the largest row count not above ``rows`` (else the smallest)."""
    if not entries:
        return None
    below = [name for r, name in entries if r <= rows]
    return below[-1] if below else entries[0][1]


def nondeterministic_allowed() -> bool:
    return os.environ.get("DILATED_ATTENTION_NONDETERMINISTIC", "0").lower() in ("1", "true", "yes", "on")


class AutoKernel(KernelWrapper):
    """A ``PatternKernel`` that forwards each pattern to the implementation its table names (``target``);
    ``inner`` is the fused kernel, the default."""

    def __init__(self, impls: dict[str, PatternKernel], choices: dict[str, str], *,
                 allow_nondeterministic: bool = False) -> None:
        if "fused" not in impls:
            raise ValueError(f"AutoKernel needs a 'fused' implementation (the default), got {sorted(impls)}")
        unknown = sorted({c for c in choices.values() if c not in impls})
        if unknown:
            raise ValueError(f"auto table names implementations {unknown} not among {sorted(impls)}")
        # Two equal runs in a measurement do not prove a backward deterministic: implementations
        # declare it (cuDNN's adds dQ with atomics), and a deterministic entry may only name those.
        racy = sorted({f"{key} -> {name}" for key, name in choices.items()
                       if key.startswith("bwd/") and not impls[name].deterministic_backward})
        if racy:
            raise ValueError(f"auto table's deterministic backward entries name implementations whose backward "
                             f"is not deterministic: {racy}")
        super().__init__(impls["fused"])
        self.name = "auto"
        self.impls, self.choices = impls, dict(choices)
        self._rows = _by_rows(self.choices)
        self._skipped: set[tuple[str, str]] = set()
        self._picks = Table(_PICKS_KEPT)
        self.allow_nondeterministic = allow_nondeterministic
        self.deterministic_backward = not allow_nondeterministic or all(
            impls[name].deterministic_backward for key, name in choices.items() if key.startswith("bwd-any/"))

    def pick(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor,
             masked: bool = False) -> PatternKernel:
        """The implementation for this pattern and direction (``"fwd"`` or ``"bwd"``); masked work runs fused.
        Asked twice per pattern and direction on every call: remembered per geometry (what ``supports`` reads)."""
        if masked:
            return self.impls["fused"]
        key = (direction, plan, causal, layout_key(q), layout_key(k))
        impl = self._picks.get(key)
        return impl if impl is not None else remember(self._picks, key, self._pick(direction, plan, causal, q, k))

    target = pick  # where each call goes: the table's choice

    def _pick(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor
              ) -> PatternKernel:
        dim, dtype, rows = q.shape[-1], q.dtype, plan.local_segment // plan.dilation
        name = None
        if direction == "bwd" and self.allow_nondeterministic:
            name = _nearest_below(self._rows.get(table_key("bwd-any", plan.dilation, causal, dim, dtype)), rows)
        if name is None:
            name = _nearest_below(self._rows.get(table_key(direction, plan.dilation, causal, dim, dtype)), rows)
        impl = self.impls[name or "fused"]
        reason = impl.supports(q, k)
        if reason is None:
            return impl
        # e.g. the table names cudnn-det and the frontend is missing: a forward runs the same cuDNN kernel
        # through torch's op (its stand-in) if it can, else fused
        stand_in = FORWARD_STAND_INS.get(name) if direction == "fwd" else None
        if stand_in is not None and (stand_in not in self.impls or self.impls[stand_in].supports(q, k) is not None):
            stand_in = None
        if (name, reason) not in self._skipped:
            self._skipped.add((name, reason))
            warnings.warn(f"auto: the measured choice {name!r} for {direction} of w={plan.local_segment}, "
                          f"r={plan.dilation} cannot run here ({reason}); running {stand_in or 'fused'!r}",
                          stacklevel=3)
        return self.impls[stand_in or "fused"]


def device_choices(device: torch.device) -> dict[str, str]:
    """The shipped table's choices for this GPU model (empty if it was never measured)."""
    name = torch.cuda.get_device_name(device)
    return dict(auto_table.TABLE.get(name, {}).get("choices", {}))


__all__ = ["AutoKernel", "DIRECTIONS", "device_choices", "nondeterministic_allowed", "table_key"]
