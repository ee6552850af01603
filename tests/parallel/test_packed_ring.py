"""Packed documents (``cu_seqlens``) on the ring and the hybrid: every document dealt over the ranks on its own.

The layout (``ring.documents``) is checked without ranks: every row of every caller shard lands once on the rank and
row its document runs at, and comes back. Spawned gloo ranks run document mixes (a one-token document, an empty one,
documents shorter than the smallest segment, ending on a shard boundary, longer than a shard; both causal flags,
both shard layouts, GQA, grouped mode, key padding, head chunks, bfloat16, the hybrid) against the float64 oracle of
each document alone. The balance of causal work is counted from the plans alone (no timing).
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from dilated_attention.patterns import plan_patterns
from dilated_attention.planning import document_alone, document_shard
from dilated_attention.ring.documents import plan_documents, undeal
from dilated_attention.testing.spawn import spawn_ranks


def _simple_shard(world: int, rng: random.Random):
    """Any shard that holds a document, dealt in zigzag halves or not at random (both in one call)."""
    def shard(rows: int) -> tuple[int, bool]:
        s = -(-rows // world)
        zigzag = world > 1 and rng.random() < 0.5
        return (max(s + s % 2, 2) if zigzag else s), zigzag
    return shard


@pytest.mark.parametrize("seed", range(40))
def test_every_row_lands_once_where_its_document_runs(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4])
    caller_zigzag = world > 1 and rng.random() < 0.5
    local = rng.choice([4, 6, 8, 12])
    n = local * world
    docs = [0, *sorted(rng.sample(range(1, n), rng.randint(0, min(5, n - 1)))), n]
    if rng.random() < 0.5:
        docs.insert(1, docs[1])  # an empty document
    shard = functools.cache(_simple_shard(world, rng))  # (the same choices on every rank)
    alone = (lambda n: n + n % 2, lambda rows: rows * rows) if rng.random() < 0.5 else None  # whole documents too
    plans = [plan_documents(docs, local, r, world, caller_zigzag, shard, alone) for r in range(world)]
    values = torch.arange(n) + 100
    shards = [values[undeal(r, torch.arange(local), local, world, caller_zigzag)] for r in range(world)]
    rows = [torch.full((p.rows,), -1) for p in plans]
    for r in range(world):
        for peer in range(world):  # what a rank sends a peer, the peer expects, in the same order
            assert len(plans[r].sends[peer]) == len(plans[peer].receives[r])
            rows[peer][plans[peer].receives[r]] = shards[r][plans[r].sends[peer]]
    placed = []
    for rank, plan in enumerate(plans):
        for g in plan.groups:
            if not g.alone and rank:
                continue  # (dealt groups: the same on every rank)
            for j, (a, b) in enumerate(g.spans):
                whole = torch.full((g.shard * (1 if g.alone else world),), -1)
                if g.alone:
                    whole[:] = rows[rank][g.first + j * g.shard:g.first + (j + 1) * g.shard]
                for r in range(0 if g.alone else world):
                    whole[undeal(r, torch.arange(g.shard), g.shard, world, g.zigzag)] = \
                        rows[r][g.first + j * g.shard:g.first + (j + 1) * g.shard]
                expected = torch.full(whole.shape, -1)
                expected[:b - a] = values[a:b]  # the document from its first row, then pad rows
                assert torch.equal(whole, expected), (docs, world, g, j)
                placed.append((a, b))
    assert sorted(placed) == [(a, b) for a, b in zip(docs, docs[1:]) if b > a]  # every document once
    for r in range(world):
        assert torch.equal(plans[r].pad_rows, rows[r] < 0)
        back = torch.full((local,), -1)  # and back: the same lists read the other way
        for peer in range(world):
            back[plans[r].sends[peer]] = rows[peer][plans[peer].receives[r]]
        assert torch.equal(back, shards[r])


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dilated_attention.testing.harness import Case, run_case

    n = 16 * world
    mixed = (0, 1, 1, 3, 16, n - 3, n)  # one token, empty, shorter than a segment, ends on a shard boundary
    crossing = (0, 10, n - 4, n)  # a document longer than a shard, crossing shard (and zigzag chunk) boundaries
    short = (*range(0, n - 9, 7), n - 4, n)  # short documents: most run whole on one rank each (balanced)
    segments = ((4, 8, 16), (1, 2, 4))
    cases = [Case("full-gqa", world, *segments, heads=4, kv_heads=2, batch=1, docs=mixed),
             Case("causal-masked", world, *segments, causal=True, masked=True, heads=4, kv_heads=2, batch=1,
                  docs=mixed, layout="transposed"),
             Case("zigzag-shards-causal", world, *segments, causal=True, heads=4, kv_heads=2, batch=1, docs=crossing,
                  shards="zigzag"),
             Case("zigzag-shards-full", world, (4, 8, n), (1, 2, 4), heads=4, kv_heads=1, batch=1, docs=crossing,
                  shards="zigzag"),
             Case("spanning-grouped", world, (4, 8, n), (1, 2, 4), mode="grouped", causal=True, heads=6, kv_heads=3,
                  batch=1, docs=crossing),
             Case("short-documents", world, *segments, causal=True, masked=True, heads=4, kv_heads=2, batch=1,
                  docs=short, layout="transposed"),
             Case("short-documents-full-bfloat16", world, *segments, heads=4, kv_heads=1, batch=1, docs=short,
                  dtype="bfloat16", dim=16, shards="zigzag"),
             Case("torchscale-offsets", world, *segments, causal=True, heads=6, kv_heads=2, batch=1, docs=crossing,
                  head_offsets="torchscale"),
             Case("head-chunks-bfloat16", world, *segments, causal=True, heads=4, kv_heads=2, batch=1, docs=mixed,
                  head_chunks=True, dtype="bfloat16", dim=16)]
    if world == 3:  # a 9-row document whose zigzag halves no shard tiles: dealt in consecutive blocks
        cases.append(Case("zigzag-untileable", world, (2, 24, 6), (1, 1, 3), causal=True, masked=True, heads=3,
                          kv_heads=3, batch=1, local_len=25, docs=(0, 55, 64, 75)))
    if world == 4:  # a 2-row document that only shards of every segment's multiple tile (48 rows a rank)
        cases.append(Case("every-segment-local", world, (16, 12, 3), (1, 4, 1), masked=True, heads=4, kv_heads=4,
                          batch=1, local_len=6, docs=(0, 2, 8, 20, 20, 24)))
        cases.append(Case("hybrid-odd-shards", world, (8, 12), (1, 1), causal=True, masked=True, heads=8, kv_heads=4,
                          batch=1, local_len=11, docs=(0, 2, 2, 25, 31, 44), strategy="hybrid", dtype="float32"))
        cases.append(Case("hybrid-head-chunks", world, *segments, causal=True, heads=8, kv_heads=4, batch=1,
                          docs=mixed, strategy="hybrid", head_chunks=True))  # each group's own chunks
        cases.append(Case("hybrid", world, *segments, causal=True, masked=True, heads=8, kv_heads=4, batch=1,
                          docs=mixed, strategy="hybrid"))
    res: dict = {}
    for i, case in enumerate(cases):
        got, _ = run_case(case, "collective", dist.group.WORLD, torch.device("cpu"), 1400 + i)
        res[case.name] = (got.ok, got.message)
    return res  # (without pad_to_segments, an untiled document raises: tests/test_masks.py)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_rings_match_the_oracle(world):
    for rank, res in enumerate(spawn_ranks(_worker, world)):
        for name, (ok, message) in res.items():
            assert ok, f"rank {rank}, {name}: {message}"


def _log_uniform_documents(rng: random.Random, total: int, shortest: int) -> list[int]:
    docs = [0]
    while docs[-1] < total:
        length = int(math.exp(rng.uniform(math.log(shortest), math.log(total))))
        docs.append(min(total, docs[-1] + length))
    return docs


def rank_work(docs, world: int, segments, rates, zigzag: bool, heads: int = 16) -> tuple[list[int], list[int]]:
    """The causal (query, key) pairs each rank computes for the packed row ``docs``, pad rows included (the
    kernels run them) and of the documents' own rows alone, from the documents' layout (dealt documents and each
    rank's whole ones) and each group's plans."""
    shard = document_shard(segments, rates, True, world, 1, heads, heads, causal=zigzag)
    alone = document_alone(segments, rates, True)
    work, useful = [0] * world, [0] * world
    for rank in range(world):
        for g in plan_documents(docs, docs[-1] // world, rank, world, False, shard, alone).groups:
            if not g.alone and rank:
                continue  # (dealt groups: the same on every rank, counted once for all)
            rows = g.shard * (1 if g.alone else world)
            plans = plan_patterns(segments, rates, seq_len=rows, local_len=g.shard, num_heads=heads,
                                  num_kv_heads=heads, layout="zigzag" if g.zigzag else "contiguous")
            for r in ([rank] if g.alone else range(world)):
                held = torch.arange(g.shard) if g.alone else undeal(r, torch.arange(g.shard), g.shard, world, g.zigzag)
                for plan in plans:
                    at = held % plan.segment
                    for offset in plan.head_offsets(heads):
                        query = at % plan.dilation == offset
                        pairs = (at - offset) // plan.dilation + 1
                        work[r] += len(g.spans) * int(pairs[query].sum())
                        useful[r] += sum(int(pairs[query & (held < b - a)].sum()) for a, b in g.spans)
    return work, useful


@pytest.mark.parametrize("world", [2, 4, 8])
def test_causal_packed_work_is_balanced(world):
    """Documents of log-uniform lengths from 1,024 tokens to the whole row: the heaviest rank's work over the
    mean, dealing each document in zigzag halves (what causal packed rings do) against consecutive blocks. The
    work counts the pad rows a document's padded length adds (one device pads the same), which the kernels
    compute; the documents' own rows alone are printed beside it (the pad rows end a document: zigzag deals them
    to the first ranks' second halves)."""
    total = 65536
    longnet = ((2048, 8192, 32768, 65536), (1, 2, 4, 8))
    full = ((total,), (1,))
    for name, (segments, rates) in (("LongNet", longnet), ("full attention", full)):
        for seed in range(3):
            docs = _log_uniform_documents(random.Random(seed), total, 1024)
            ratio = {}
            for zigzag in (True, False):
                for kind, work in zip(("all", "own"), rank_work(docs, world, segments, rates, zigzag)):
                    ratio[zigzag, kind] = max(work) / (sum(work) / world)
            print(f"K={world} {name} mix {seed} ({len(docs) - 1} documents): max/mean {ratio[True, 'all']:.3f} "
                  f"(documents' own rows {ratio[True, 'own']:.3f}; dealt in consecutive blocks "
                  f"{ratio[False, 'all']:.3f})")
            assert ratio[True, "all"] <= 1.10


def _moved_share(rank: int, world: int) -> dict:
    from dilated_attention import memory
    from dilated_attention.comm import get_backend
    from dilated_attention.memory import own_bytes
    from dilated_attention.planning import CallOptions, prepare

    rule = memory.set_memory_bound(memory.DEFAULT_SCRATCH_SHARE, 0)  # the rule from any size (large calls' rule)
    try:
        local, heads, kv_heads, dim = 512, 16, 8, 8
        q, k = torch.randn(1, local, heads, dim), torch.randn(1, local, kv_heads, dim)
        docs = _log_uniform_documents(random.Random(7), local * world, 64)
        options = CallOptions((64, 256, 1024), (1, 2, 4), causal=True, strategy="ring",
                              cu_seqlens=torch.tensor(docs, dtype=torch.int32))
        spec, _ = prepare(q, k, k, get_backend("collective"), None, options)
    finally:
        memory.set_memory_bound(*rule)
    documents = spec.documents
    chunks = len(documents.heads) or 1
    units = [documents.moves(u, torch.device("cpu")).rows for u in range(len(documents.units))]
    own = own_bytes(local, heads, kv_heads, dim, 4)
    return {"share": max(own_bytes(rows, heads, kv_heads, dim, 4) for rows in units) / chunks / own,
            "all": own_bytes(documents.rows, heads, kv_heads, dim, 4) / own, "chunks": chunks,
            "units": len(units), "buckets": documents.buckets_count}


@pytest.mark.parametrize("world", [2, 4])
def test_large_packed_calls_hold_a_tenth_of_their_own_bytes_twice(world):
    """From the head-chunk rule's floor on, documents move a group at a time, in head chunks: the copies a packed
    ring holds besides an unpacked one's stay within ``memory.DOCUMENT_SHARE`` of the call's own bytes where the kv
    heads allow, so its peak stays within about 1.1x of the unpacked call's (which holds 1.4x its own bytes). The
    plan's figures, no device."""
    from dilated_attention.memory import DOCUMENT_SHARE

    for rank, res in enumerate(spawn_ranks(_moved_share, world)):
        print(f"K={world} rank {rank}: moved at once {res['share']:.3f} of own bytes ({res['units']} units, "
              f"{res['chunks']} head chunks; all at once {res['all']:.2f})")
        assert res["units"] == res["buckets"] > 1
        assert res["share"] <= DOCUMENT_SHARE or res["chunks"] == 8
        assert res["share"] < res["all"] / 4


def _planned_for_shapes(rank: int, world: int) -> str:
    from dilated_attention.comm import get_backend
    from dilated_attention.planning import CallOptions, schedule

    q = torch.randn(1, 16, 4, 8)
    options = CallOptions((4, 8, 16), (1, 2, 4), strategy="ring",
                          cu_seqlens=torch.tensor([0, 5, 16 * world], dtype=torch.int32))
    try:  # a compiled graph's fake implementation plans from shapes alone
        schedule(q, q, q, get_backend("collective"), options, shapes_only=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_packed_rings_under_torch_compile_raise_naming_the_way_out():
    for message in spawn_ranks(_planned_for_shapes, 2):
        assert "not supported under torch.compile" in message and "strategy='head'" in message
