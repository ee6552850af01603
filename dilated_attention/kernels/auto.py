"""``kernel="auto"`` on a GPU: per pattern and direction, the implementation measured fastest there.

The choice is a table lookup, never a guess: ``benchmarks/bench_kernel.py``
times every implementation on each pattern class of its configuration and
writes the ranking into ``auto_table.py`` under the GPU's name
(``--write-table``). The key is (direction, dense ``r = 1`` or dilated, causal,
head dim, dtype, length class of the segment rows ``M = w / r``); a key the table does
not list runs the fused kernel. So one configuration always runs the same implementation,
on every rank and every run.

Length class: the winner depends on the segment length (on an H100 cuDNN's deterministic
backward wins on LongNet's causal 2048-row segments, flash-attn-4's on its 4096-8192-row ones
and on full attention over 65536 rows), so keys end in ``/short`` (``M <= SHORT_ROWS``), ``/mid`` (``M <= LONG_ROWS``)
or ``/long`` (longer segments, full attention). A table measured before the mid class has
no ``/mid`` keys: its ``/short`` entry answers those rows (it covered them then). Tables
written before classes keyed rows as ``/M<rows>``: such an entry stands for the class of its
rows (of several in one class, the one measured at the most rows), and a key with neither
stands for every class that has no entry of its own.

Ranking: an entry is a name or a tuple of names, fastest first; the first that can run
here is taken (flash-attn-4 not installed, or a GPU it does not support: the next one).
``dispatch`` offers only the implementations available on the device, so ``auto``
never names one that is not.

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
from ..callers import user_stacklevel
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


SHORT_ROWS = 2048  # segment rows up to this are the "short" class (LongNet's first segments)
LONG_ROWS = 8192  # segment rows above this are the "long" class (long dense segments, full attention)
LENGTH_CLASSES = ("short", "mid", "long")
# a class a table has no entry for reads the entry of the class that covered its rows before it existed
CLASS_FALLBACK = {"mid": "short"}


def length_class(rows: int) -> str:
    """``"short"`` for a segment of at most ``SHORT_ROWS`` rows, ``"mid"`` up to ``LONG_ROWS``, else ``"long"``."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return "short" if rows <= SHORT_ROWS else "mid" if rows <= LONG_ROWS else "long"


def table_key(direction: str, dilation: int, causal: bool, dim: int, dtype: torch.dtype,
              rows: int | None = None) -> str:
    """``direction/dense|dilated/full|causal/D<dim>/<dtype>[/short|long]`` (the class of ``rows``)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    key = (f"{direction}/{'dense' if dilation == 1 else 'dilated'}/{'causal' if causal else 'full'}"
           f"/D{dim}/{str(dtype).removeprefix('torch.')}")
    return key if rows is None else f"{key}/{length_class(rows)}"


def lookup_keys(key: str) -> tuple[str, ...]:
    """The keys that answer a classed ``key``, first found first: its own, its class's fallback
    (``CLASS_FALLBACK``), the key without a class."""
    base, _, cls = key.rpartition("/")
    fallback = (f"{base}/{CLASS_FALLBACK[cls]}",) if cls in CLASS_FALLBACK else ()
    return (key, *fallback, base)


def ranked(entry: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A table entry as its names, fastest first (an entry is one name or several)."""
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"a table entry must be a name or a non-empty sequence of names, got {entry!r}")
    return names


def normalize_choices(choices: dict[str, str | tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """``choices`` keyed by length class: a ``/M<rows>`` key becomes its class's key (of several in one class,
    the one measured at the most rows; a class key itself wins), keys without rows stay; entries as tuples."""
    out: dict[str, tuple[str, ...]] = {}
    measured_at: dict[str, int] = {}
    for key, entry in choices.items():
        base, _, last = key.rpartition("/")
        if last.startswith("M") and last[1:].isdigit():
            rows, key = int(last[1:]), f"{base}/{length_class(int(last[1:]))}"
            if key in out and (key not in measured_at or measured_at[key] > rows):
                continue  # a class key, or a legacy one measured at more rows, already answers
            measured_at[key] = rows
        else:
            measured_at.pop(key, None)
        out[key] = ranked(entry)
    return out


def available_choices(choices: dict[str, str | tuple[str, ...]], names) -> dict[str, tuple[str, ...]]:
    """``choices`` with only the implementations in ``names`` (those available here); emptied entries dropped."""
    kept = {key: tuple(n for n in ranked(entry) if n in names) for key, entry in choices.items()}
    return {key: entry for key, entry in kept.items() if entry}


def nondeterministic_allowed() -> bool:
    return os.environ.get("DILATED_ATTENTION_NONDETERMINISTIC", "0").lower() in ("1", "true", "yes", "on")


class AutoKernel(KernelWrapper):
    """A ``PatternKernel`` that forwards each pattern to the implementation its table names (``target``);
    ``inner`` is the fused kernel, the default."""

    def __init__(self, impls: dict[str, PatternKernel], choices: dict[str, str], *,
                 allow_nondeterministic: bool = False) -> None:
        if "fused" not in impls:
            raise ValueError(f"AutoKernel needs a 'fused' implementation (the default), got {sorted(impls)}")
        choices = normalize_choices(choices)
        unknown = sorted({n for entry in choices.values() for n in entry if n not in impls})
        if unknown:
            raise ValueError(f"auto table names implementations {unknown} not among {sorted(impls)}")
        # Two equal runs in a measurement do not prove a backward deterministic: implementations
        # declare it (cuDNN's adds dQ with atomics), and a deterministic entry may only name those.
        racy = sorted({f"{key} -> {name}" for key, entry in choices.items() for name in entry
                       if key.startswith("bwd/") and not impls[name].deterministic_backward})
        if racy:
            raise ValueError(f"auto table's deterministic backward entries name implementations whose backward "
                             f"is not deterministic: {racy}")
        super().__init__(impls["fused"])
        self.name = "auto"
        self.impls, self.choices = impls, choices
        self._skipped: set[tuple[str, str]] = set()
        self._picks = Table(_PICKS_KEPT)
        self.allow_nondeterministic = allow_nondeterministic
        self.deterministic_backward = not allow_nondeterministic or all(
            impls[name].deterministic_backward for key, entry in choices.items() if key.startswith("bwd-any/")
            for name in entry)

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

    def _entry(self, direction: str, plan: PatternPlan, causal: bool, dim: int, dtype: torch.dtype
               ) -> tuple[str, ...] | None:
        """The table's ranking for this pattern: its length class's key, else its fallbacks (``lookup_keys``)."""
        rows = plan.local_segment // plan.dilation
        for key in lookup_keys(table_key(direction, plan.dilation, causal, dim, dtype, rows)):
            if key in self.choices:
                return self.choices[key]
        return None

    def _pick(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor
              ) -> PatternKernel:
        dim, dtype = q.shape[-1], q.dtype
        names = None
        if direction == "bwd" and self.allow_nondeterministic:
            names = self._entry("bwd-any", plan, causal, dim, dtype)
        if names is None:
            names = self._entry(direction, plan, causal, dim, dtype)
        names = names or ("fused",)
        # each ranked name, then (a forward) its stand-in: e.g. the table names cudnn-det and the frontend is
        # missing, so the same cuDNN forward runs through torch's op; last, fused
        candidates = [c for name in names for c in (name, FORWARD_STAND_INS.get(name) if direction == "fwd" else None)
                      if c is not None and c in self.impls] + ["fused"]
        first_reason = None
        for name in candidates:
            reason = self.impls[name].supports(q, k)
            if reason is None:
                break
            first_reason = first_reason or reason
        if name != names[0] and (names[0], first_reason) not in self._skipped:
            self._skipped.add((names[0], first_reason))
            warnings.warn(f"auto: the measured choice {names[0]!r} for {direction} of w={plan.local_segment}, "
                          f"r={plan.dilation} cannot run here ({first_reason}); running {name!r}",
                          stacklevel=user_stacklevel())
        return self.impls[name]


def table_gap(gpu: str, available) -> str | None:
    """Why ``auto`` may miss the fastest implementation on GPU model ``gpu``, given the implementations
    ``available`` here: no table for it, or one measured without some of them (its ``measured`` list); else None."""
    entry = auto_table.TABLE.get(gpu)
    if entry is None:
        return f"no kernel table was measured on {gpu}, so kernel='auto' runs the fused kernel everywhere"
    missing = sorted(set(available) - set(entry.get("measured", available)))
    if missing:
        return f"the kernel table of {gpu} was measured without {missing} (available here): kernel='auto' never runs them"
    return None


def device_choices(device: torch.device) -> dict[str, str]:
    """The shipped table's choices for this GPU model (empty if it was never measured)."""
    name = torch.cuda.get_device_name(device)
    return dict(auto_table.TABLE.get(name, {}).get("choices", {}))
