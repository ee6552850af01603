"""Minimal reproducers: capture one call into a small JSON, replay it against the fp64 oracle.

A repro file holds what decides a failure, not the data: every input's shape,
strides, storage offset, dtype and device, the patterns, mode, causal, scale,
kernel, backend, world size and a seed; the scalar keywords (``strategy``,
``pad_to_segments``, ``head_offsets``) under ``kwargs``; ``cu_seqlens`` as its list
of (global) document offsets; and ``key_padding_mask`` as a description: its
shape (this rank's rows), the fraction of padded keys, random padded runs, a
padded tail, and, when captured from a real mask, its exact padded runs (global
positions) for the rows the capturing rank held. Replay rebuilds each input with
exactly that layout (a seeded random storage viewed with the recorded strides and
offset; the mask over the whole sequence from the seed, exact runs laid over it,
each rank taking its rows), runs ``dilated_attention`` forward and backward, and
compares the output and the q/k/v gradients with the float64 dense oracle (given
the same mask, documents and padding) under the project's tolerance rule
(``testing/compare.py``). When something differs it narrows it down: each
pattern alone, and the same call with the reference kernel (is it the kernel, or
the strategy around it?). With ``save_tensors`` the real tensors (and the mask) go
to a ``.pt`` beside the JSON and replace the seeded ones on a single process.

Capture from user code::

    from dilated_attention.diagnostics import repro
    repro.capture(q, k, v, [2048, 4096], [1, 2], causal=True, key_padding_mask=pad, path="bad_call.json")

Replay (``python -m dilated_attention.tools.repro``, installed as ``dilated-attention-repro``)::

    dilated-attention-repro replay bad_call.json            # 1 process, or spawned CPU ranks
    torchrun --nproc_per_node=8 -m dilated_attention.tools.repro replay bad_call.json   # the recorded world

File versions: 1 had no ``key_padding_mask``/``cu_seqlens`` (read as none: such files
replay as before); 2 adds them. ``load`` refuses a file newer than it knows (it would
silently drop what it cannot read). A multi-rank capture writes one file per rank
(``NAME.rank<r>.json``); loading one merges the exact mask rows of its siblings.

Its parts: the file format (``repro_file.py``), replay (``repro_replay.py``) and the file in words
(``repro_summary.py``); every name is importable from here.
"""

from .repro_file import (_DTYPES, VERSION, call_extras, call_meta, capture, describe_mask,  # noqa: F401
                         describe_tensor, load, write)
from .repro_replay import (NAMES, SCALE_FLOOR, ZERO_RESIDUE, Report, _judge, build_cu_seqlens,  # noqa: F401
                           build_inputs, build_mask, random_mask, replay_spawned, run_spec, strided_random)
from .repro_summary import describe_call, summary  # noqa: F401

__all__ = ["capture"]
