"""Document batching: the rows a whole-sequence call runs as one batch, and back.

Where a rank holds the whole sequence (one device, or the head strategy), padding and packed documents are
local matters: a sequence the segments do not tile is padded to the shortest length they tile, and packed
documents (``cu_seqlens``) of equal padded length run as the batch rows of one launch (``Batch``).
``batch_rows`` lays the caller's rows out that way, ``caller_rows`` brings results back (pad rows dropped), and
``run_mask`` masks the pad keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .patterns import PatternPlan, padded_length


@dataclass(frozen=True)
class Batch:
    """Rows that run as one batch on a whole sequence: padded to ``length`` rows.

    ``spans``: ``None`` for the caller's batch as it is, else one ``(start, end)`` row range of
    the packed sequence per batch row (documents of equal padded length).
    """

    length: int
    spans: tuple[tuple[int, int], ...] | None
    plans: tuple[tuple[PatternPlan, ...], ...]  # per head range (``Schedule.heads``)
    rings: tuple = ()  # per head range, its routes (``ring.routes.RingPlan``); () when planned for shapes only

    @property
    def count(self) -> int:
        """Batch rows per caller's batch row: one per document, or 1."""
        return len(self.spans) if self.spans else 1


def whole_batches(segment_lengths, dilation_rates, n: int, docs, pad: bool, plan) -> tuple[Batch, ...]:
    """The schedule on a whole sequence of ``n`` rows; ``plan(length)`` makes the pattern plans."""
    if docs is None:
        length = padded_length(segment_lengths, dilation_rates, n) if pad else n
        return (Batch(length, None, (plan(length),)),)
    groups: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(docs, docs[1:]):
        if end > start:
            length = padded_length(segment_lengths, dilation_rates, end - start) if pad else end - start
            groups.setdefault(length, []).append((start, end))
    return tuple(Batch(length, tuple(spans), (plan(length),)) for length, spans in sorted(groups.items()))


def back_to_back(batch: Batch) -> bool:
    """Documents (batch size 1) that need no padding and follow each other: rows are a view, no mask."""
    spans = batch.spans
    return all(b - a == batch.length for a, b in spans) and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def batch_rows(x: torch.Tensor, batch: Batch, fill: float = 0.0) -> torch.Tensor:
    """``x`` ``(B, N, ...)`` laid out as ``batch`` runs: padded to its length, and with documents one
    batch row group per span (span-major: span ``i`` is rows ``[i B, (i + 1) B)``)."""
    pad = (0, 0) * (x.dim() - 2)
    if batch.spans is None:
        grow = batch.length - x.shape[1]
        return x if grow == 0 else F.pad(x, pad + (0, grow), value=fill)
    if back_to_back(batch):  # documents of exactly the batch length, one after another: a view
        return x[0, batch.spans[0][0]:batch.spans[-1][1]].unflatten(0, (len(batch.spans), batch.length))
    return torch.cat([F.pad(x[:, a:b], pad + (0, batch.length - (b - a)), value=fill) for a, b in batch.spans])


def caller_rows(parts: list[torch.Tensor], batches: tuple[Batch, ...], n: int, bsz: int,
            copy: bool = False) -> torch.Tensor:
    """The inverse of ``batch_rows`` over every batch: the caller's ``(B, n, ...)`` rows (pad rows dropped).

    ``copy``: a new tensor, never a view (the output: a view made inside an autograd.Function may not
    be modified in place).
    """
    if batches[0].spans is None:
        if parts[0].shape[1] == n:
            return parts[0]
        return parts[0][:, :n].clone(memory_format=torch.contiguous_format) if copy else parts[0][:, :n]
    pieces = {}
    for part, batch in zip(parts, batches):
        for i, (a, b) in enumerate(batch.spans):
            pieces[a] = part[i * bsz:(i + 1) * bsz, :b - a]
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=1)


def pads(batch: Batch, n: int) -> bool:
    """Whether ``batch`` runs with padding rows (so with a padding mask): a sequence of ``n`` rows padded, or a
    document shorter than its batch rows (whole documents need no mask: separate batch rows keep them apart)."""
    return batch.length != n if batch.spans is None else any(b - a != batch.length for a, b in batch.spans)


def run_mask(key_mask: torch.Tensor | None, batch: Batch, q: torch.Tensor) -> torch.Tensor | None:
    if batch.spans is None and batch.length == q.shape[1]:
        return key_mask
    if key_mask is None and not pads(batch, q.shape[1]):
        return None
    mask = key_mask if key_mask is not None else torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
    return batch_rows(mask, batch, True)  # pad keys are masked
