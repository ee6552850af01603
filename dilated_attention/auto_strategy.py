"""``strategy="auto"``: the team size ``A`` the scaling benchmark measured fastest.

``A = 1`` is the ring, ``A = world`` head-parallel, anything between the hybrid (docs/design.md
section 2). The rule is a table of what ``benchmarks/bench_scaling.py`` measured, per kind of
pattern set, causality and shard layout, on 2 x H200 with flash-attn-4 installed at 32768 tokens per
GPU, stream-ordered waits, eagerly and replayed in a CUDA graph (``benchmarks/run_scaling.sh --worlds 1,2,4
--strategies ring,head --layouts contiguous,zigzag --peers torch_cp,ulysses --cuda-graph``,
``benchmarks/results/scaling_h200_x2.json``; forward+backward ms, eager / replayed):

==========================  =============  =============  =============  =============  ==========  =========
patterns                             ring           head    ring zigzag    head zigzag  contiguous  zigzag
==========================  =============  =============  =============  =============  ==========  =========
LongNet, non-causal           16.9 / 13.4    16.3 / 15.1    24.3 / 15.1    17.7 / 16.0  ring        head
LongNet, causal                13.3 / 8.0    13.1 / 10.4    21.9 / 10.1    15.6 / 11.3  ring        head
full attention, non-causal  106.6 / 106.1  104.8 / 104.9  107.0 / 107.1  105.7 / 105.5  tie: head   tie: head
full attention, causal        60.6 / 58.1    57.5 / 56.1    58.4 / 57.1    58.3 / 57.1  head        tie: head
==========================  =============  =============  =============  =============  ==========  =========

The same run at K=4 (``scaling_h200_x4.json``) chooses the same in every row.
The last two columns are the choice per layout (``benchmarks/plot_scaling.py``'s ``auto_choices``, which
``tests/test_strategy.py`` applies to runs pinned under ``tests/data``): each strategy's worse ratio to the fastest
over the two modes, the smallest winning, "tie" where the ring is within 3% of it: a tie goes to the strategy
whose peak memory is more than 10% lower, else to the ring. Both modes count because
eager LongNet steps are host-bound at this size: how fast the host issues them moves their eager times by
up to 15% between machines (the non-causal ring 14.1-16.9 ms on three H200 hosts, replayed 13.4 on each),
while a captured step, or one whose host runs ahead of the GPU inside a model, costs its replayed time.
2 x H100 with flash-attn-4 (``scaling_h100_x2.json``) chooses the same in every row. A GPU model measured to
choose otherwise gets its own table by the device's name (``MEASURED_ON``).

A job whose ranks see different GPU models may resolve ``"auto"`` differently: the cross-rank agreement
compares the resolved team (``planning.py``), so every rank raises instead of exchanging mismatched
blocks.
A tie goes to the ring, the simpler strategy (no all-to-all, no condition on the heads, no
change of layout), unless the other holds clearly less memory: on full attention the ring peaks
at 4.0x the rank's own bytes (K/V blocks in flight and fp32 dK/dV accumulators), head at 1.9x
non-causal and 2.6x causal (the head-layout q, k, v, out it keeps), on both GPU models.
"Full" means a rate-1 pattern spans ranks (dense attention across shards);
LongNet's spanning patterns are dilated (rate > 1), so most of its work is local and a ring
moves ``1/r`` of the keys. Where head is measured best but cannot run (the ranks do not divide
the heads) or the job spans nodes (the all-to-all would cross the network), the hybrid takes its
place when a team exists, else the ring.
"""

from __future__ import annotations

from .patterns import SHARD_LAYOUTS as LAYOUTS
from .patterns import hybrid_team_size

# (dense: a rate-1 pattern spans ranks, causal, layout) -> strategy measured fastest (the table above).
MEASURED = {
    (False, False, "contiguous"): "ring",
    (False, True, "contiguous"): "ring",  # spanning pattern head-swapped (swapped.py); 1.30x head's speed in a graph
    (True, False, "contiguous"): "head",  # within 3% of the ring, at half its peak memory
    (True, True, "contiguous"): "head",  # the contiguous causal ring waits on its last rank
    (False, False, "zigzag"): "head",  # zigzag turns mid-length segments into rings
    (False, True, "zigzag"): "head",
    (True, False, "zigzag"): "head",  # within 3% of the ring, at half its peak memory
    (True, True, "zigzag"): "head",  # the balanced ring within 3% of it, at 1.5x its peak memory
}
# GPU model (``torch.cuda.get_device_name``) -> its measured choices, where they differ from ``MEASURED`` (none of
# the measured models does: 2 x H100 and 2 x H200 choose the same)
MEASURED_ON: dict[str, dict[tuple[bool, bool, str], str]] = {}


def pattern_spans(segment_lengths, dilation_rates, seq_len: int, shard_len: int) -> tuple[bool, bool]:
    """``(spans, dense)`` of a pattern set over a sequence of ``seq_len`` cut in shards of
    ``shard_len`` rows: some segment (clamped to the sequence) is longer than a shard, and one of
    those has rate 1."""
    long = [r for w, r in zip(segment_lengths, dilation_rates) if min(w, seq_len) > shard_len]
    return bool(long), any(r == 1 for r in long)


def auto_team_size(world: int, heads: int, kv_heads: int, *, causal: bool, spans: bool, dense: bool,
                   local_world: int = 0, layout: str = "contiguous", whole_sequence: bool = False,
                   gpu: str | None = None) -> int:
    """Ranks per all-to-all team for ``strategy="auto"`` (1: ring, ``world``: head, between: hybrid).

    ``spans``/``dense``: see ``pattern_spans``. ``local_world``: ranks per node (``LOCAL_WORLD_SIZE``,
    0 unknown). ``layout``: how the shards hold the sequence. ``whole_sequence``: the segments do not
    tile the shards, which head-parallel pads locally (a ring moves the rows to padded shards first).
    Packed documents choose by the usual rule: every strategy runs them. ``gpu``: the device's model name, whose own measured choices
    apply where ``MEASURED_ON`` has them (else the 2 x H200 table). ``kv_heads`` does not change the
    choice: every measurement had ``kv_heads == heads``.
    """
    if world < 1 or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"need world >= 1 and kv heads dividing heads, got world={world}, heads={heads}, "
                         f"kv_heads={kv_heads}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if world == 1:
        return 1
    head_ok = heads % world == 0
    if whole_sequence:
        return world if head_ok else 1  # else the ring, on padded shards
    if not spans:
        return 1  # every pattern is local: the ring exchanges nothing
    if MEASURED_ON.get(gpu, MEASURED)[dense, causal, layout] == "ring":
        return 1
    across_nodes = 1 < local_world < world
    if head_ok and not across_nodes:
        return world
    return hybrid_team_size(world, heads, local_world) or (world if head_ok else 1)
