"""Calls that run but most likely do not compute what the caller meant: each warns once, at the caller's line.

* a sequence shorter than a segment: the segment is clamped to the sequence (``docs/design.md`` section 1);
* ``(B, H, N, D)`` passed for ``(B, N, H, D)``, where the shape tells: more "heads" than "tokens", and
  segments clamped to the few "tokens" (or more "heads" than any model has);
* with ``comm``, every rank passing the same ``q`` (the whole sequence, not its shard): the ranks compare a
  few sampled values of ``q`` in the exchange that agrees on a new configuration (``consistency.agree``), so
  a steady training loop pays nothing.

Each message is the same for every call of a configuration, so Python's default filter shows it once per
line of the caller; ``warnings.filterwarnings("ignore", category=MisuseWarning)`` silences them all.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from . import caches
from .callers import user_stacklevel
from .patterns import padded_length

# more query heads than any model uses: a "head" count above this is a sequence length
MAX_PLAUSIBLE_HEADS = 1024
SAMPLES = 8  # values of q each rank contributes to the agreement of a new configuration


class MisuseWarning(UserWarning):
    """A call that runs, but most likely not as meant (the message says what to change)."""


def check_shape(shape: torch.Size, seq_len: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                *, pad: bool, documents: bool) -> None:
    """Warn about a heads-first layout or a clamped segment, from ``q``'s shape and the sequence's (global)
    length ``seq_len``. ``documents``: packed documents, each clamping the segments on its own (as meant)."""
    try:
        key = (tuple(int(s) for s in shape), int(seq_len), tuple(int(w) for w in segment_lengths),
               tuple(int(r) for r in dilation_rates), bool(pad), bool(documents))
    except (TypeError, ValueError):
        return  # validated, with a clear error, by the pattern checks
    message = _shape_message(*key)
    if message is not None:
        warnings.warn(message, MisuseWarning, stacklevel=user_stacklevel())


@caches.memoize("misuse.shape_messages", 256)  # asked per new schedule; a process sees few shapes
def _shape_message(shape: tuple[int, ...], seq_len: int, segments: tuple[int, ...], rates: tuple[int, ...],
                   pad: bool, documents: bool) -> str | None:
    if len(shape) != 4 or not segments or len(segments) != len(rates) or min(segments + rates) <= 0:
        return None
    heads, longest = shape[2], max(segments)
    if heads > seq_len and (longest > seq_len or heads > MAX_PLAUSIBLE_HEADS):
        return (f"dilated_attention: q of shape {shape} is read as (B, N, H, D): {seq_len} tokens and {heads} heads, "
                f"so segments longer than {seq_len} are clamped to {seq_len}. If the heads come first (B, H, N, D), "
                "pass q.transpose(1, 2) (likewise k and v)")
    if documents:
        return None
    try:
        length = padded_length(segments, rates, seq_len) if pad else seq_len
    except ValueError:
        return None  # raised, with the reason, by the pattern checks
    if longest > length:
        return (f"dilated_attention: the sequence is shorter than segment_lengths' largest, {longest} tokens; "
                "a segment longer than the sequence is clamped to it (attention over the whole sequence, dilated "
                "by its rate). Pass segment_lengths no longer than the sequence to keep the patterns you meant, or "
                "silence this with warnings.filterwarnings('ignore', category=dilated_attention.misuse.MisuseWarning)")
    return None


def data_sample(q: torch.Tensor | None) -> torch.Tensor:
    """``(SAMPLES + 1,)`` int64 on ``q``'s device: 1, then the bits of ``SAMPLES`` values of ``q`` at fixed
    positions spread over its rows; all zeros for ``None`` (a configuration already agreed: nothing is read)
    or a tensor that is not a 4-d floating-point one."""
    if (not isinstance(q, torch.Tensor) or q.dim() != 4 or q.numel() == 0 or not q.dtype.is_floating_point
            or q.device.type == "meta"):
        device = q.device if isinstance(q, torch.Tensor) and q.device.type != "meta" else "cpu"
        return torch.zeros(SAMPLES + 1, dtype=torch.int64, device=device)
    b, n, h, d = q.shape
    i = range(SAMPLES)
    where = torch.tensor([[j % b for j in i], [j * (n - 1) // (SAMPLES - 1) for j in i], [(5 * j) % h for j in i],
                          [(3 * j) % d for j in i]]).to(q.device, non_blocking=True)
    values = q.detach()[where[0], where[1], where[2], where[3]].to(torch.float64).view(torch.int64)
    return torch.cat([values.new_ones(1), values])


def check_identical_shards(samples: list[list[int]]) -> None:
    """Every rank's ``data_sample`` (gathered): warn if all ranks read the same non-constant values."""
    if len(samples) < 2 or any(row[0] != 1 for row in samples):
        return
    if all(row == samples[0] for row in samples) and len(set(samples[0][1:])) > 1:
        warnings.warn(
            f"dilated_attention: every one of the {len(samples)} ranks passed the same q: with comm each rank passes "
            "its own shard of the sequence (rank j the tokens [j*N/P, (j+1)*N/P), e.g. "
            "dilated_attention.distributed.shard_sequence(x, comm)), not the whole sequence; identical shards "
            "compute attention over P copies of it. If they are meant to be equal, silence this with "
            "warnings.filterwarnings('ignore', category=dilated_attention.misuse.MisuseWarning)",
            MisuseWarning, stacklevel=user_stacklevel())
