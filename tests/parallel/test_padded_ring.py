"""Rings over shards the segments do not tile: the sequence padded at its end, as one device pads it.

Each rank's rows move to padded shards the patterns tile (``ring.layout.Padded``, ``ring/padding.py``), the pad
keys masked and the pad rows dropped: every rank's rows and gradients equal the single-device call's. Spawned gloo
ranks run such shards (local and spanning patterns, causal, GQA, key padding, bfloat16, head chunks, the hybrid
strategy) against the float64 oracle, and count the row moves; the shard choice and the moves are checked without
ranks.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention.patterns import padded_length, plan_patterns
from dilated_attention.ring.layout import Padded, padded_shard
from dilated_attention.testing.spawn import spawn_ranks


def _fits(segments, rates, world):
    def fits(rows: int) -> bool:
        try:
            plan_patterns(segments, rates, seq_len=rows * world, local_len=rows, num_heads=4, num_kv_heads=4)
        except ValueError:
            return False
        return True
    return fits


@pytest.mark.parametrize("segments,rates,local,world,shard", [
    ((8, 32), (1, 2), 18, 2, 32),   # 36 rows padded to 64: two shards of 32
    ((8, 64), (1, 4), 20, 2, 24),   # 40 rows tile (64 clamped to 40), shards of 20 do not: 48 rows, shards of 24
    ((8, 48), (1, 2), 18, 3, 48),   # every pattern local at 48
    ((16, 64), (1, 2), 12, 4, 16),  # the 64 rows a spanning pattern over four shards of 16
])
def test_padded_shards_are_the_fewest_rows_the_patterns_tile(segments, rates, local, world, shard):
    least = padded_length(segments, rates, local * world)
    fits = _fits(segments, rates, world)
    got = padded_shard(lambda rows: rows * world >= least and fits(rows), local, world, least, segments)
    assert got == shard
    assert not any(rows * world >= least and fits(rows) for rows in range(local, shard))


@pytest.mark.parametrize("rows,local,shard,world", [(36, 18, 32, 2), (54, 18, 48, 3), (48, 12, 16, 4)])
def test_row_moves_cover_every_row_once_both_ways(rows, local, shard, world):
    padded = Padded(rows, local, shard, world)
    for to_padded, mine, theirs in ((True, local, shard), (False, shard, local)):
        moved = []
        for rank in range(world):
            sends, receives = padded.moves(rank, to_padded)
            for peer, a, b, at in sends:
                moved.append((rank * mine + a, rank * mine + b))
                # the peer receives the same rows from this rank, at the place the send names
                assert (rank, at, at + b - a) in padded.moves(peer, to_padded)[1]
        covered = sorted(moved)
        assert covered[0][0] == 0 and covered[-1][1] == rows
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:])), covered  # each row once


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dilated_attention import dilated_attention
    from dilated_attention.comm import get_backend
    from dilated_attention.testing.harness import Case, recorded_exchanges, run_case

    n = 16 * world
    cases = [Case("local-and-spanning", world, (8, n), (1, 2), local_len=18),
             Case("causal-gqa", world, (8, 2 * n), (1, 4), causal=True, heads=8, kv_heads=2, local_len=20),
             Case("masked-bfloat16", world, (8, n), (1, 2), causal=True, masked=True, dtype="bfloat16", dim=16,
                  local_len=18, layout="transposed"),
             Case("head-chunks", world, (8, n), (1, 2), heads=8, kv_heads=4, head_chunks=True, local_len=18)]
    if world == 4:
        cases.append(Case("hybrid", world, (8, n), (1, 2), causal=True, strategy="hybrid", local_len=18))
    if world == 3:  # 30 rows that only shards of 192 tile (every pattern local: 64 divides no shorter length)
        cases.append(Case("every-segment-local", world, (12, 64), (3, 8), causal=True, masked=True, heads=4,
                          kv_heads=2, local_len=10, dtype="float32"))
    res: dict = {}
    with recorded_exchanges("padded shards") as moves:
        for i, case in enumerate(cases):
            before = len(moves)
            got, _ = run_case(case, "collective", dist.group.WORLD, torch.device("cpu"), 1100 + i)
            res[case.name] = (got.ok, got.message, len(moves) - before)
    q = torch.randn(1, 18, 2, 8, dtype=torch.float64)
    try:  # pad_to_segments=False keeps the length rule, naming the lengths passed
        dilated_attention(q, q, q, [8, n], [1, 2], comm=get_backend("collective"), strategy="ring",
                          pad_to_segments=False)
        res["unpadded"] = "no error"
    except ValueError as exc:
        res["unpadded"] = str(exc)
    return res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_padded_rings_match_the_oracle(world):
    for rank, res in enumerate(spawn_ranks(_worker, world)):
        unpadded = res.pop("unpadded")
        assert "divisible" in unpadded or "tile" in unpadded, unpadded
        for name, (ok, message, moves) in res.items():
            assert ok, f"rank {rank}, {name}: {message}"
            assert moves > 0, (rank, name)  # rows moved to the padded shards and back, both directions
