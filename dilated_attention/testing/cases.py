"""The harness's cases: what one multi-rank case is (``Case``), the battery of them per world size
(``cases``, ``zigzag_cases``), and how one rank runs one (``run_case``) against the float64 dense oracle.

Every case builds global inputs from a seed (identical on all ranks), computes the float64 dense oracle, shards
the sequence, runs the call on the group's ranks through a backend, and compares this rank's rows of the output
and of the q/k/v gradients. ``Result`` is one rank's verdict on one case or check (``testing/harness.py``
runs them all).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .. import memory
from ..comm import get_backend
from ..distributed import shard_indices
from ..functional import dilated_attention
from ..ring import routes
from .compare import as_layout, rel_err, tolerance
from .oracle import dense_dilated_attention

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str = "longnet"
    causal: bool = False
    heads: int = 4
    kv_heads: int = 4
    local_len: int = 16
    batch: int = 2
    dim: int = 8
    dtype: str = "float64"
    layout: str = "contiguous"  # any of testing.compare.LAYOUTS
    kernel: str = "auto"
    strategy: str = "ring"
    masked: bool = False  # a random key_padding_mask (about a quarter of the keys)
    docs: tuple[int, ...] | None = None  # cu_seqlens over the global sequence (batch 1)
    shards: str = "contiguous"  # the shard layout (dilated_attention's layout=): which rows each rank holds
    head_chunks: bool = False  # run the heads in as many chunks as there are kv heads (memory.py's rule forced)
    shared: bool = False  # causal rings share their cross blocks at any length (``routes.tuned(share_min_rows=0)``)
    head_offsets: str = "spread"  # dilated_attention's head_offsets=

    @property
    def seq_len(self) -> int:
        return self.world * self.local_len


@dataclass
class Result:
    case: str
    backend: str
    rank: int
    world: int
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    message: str = ""


def cases(world: int, device_type: str = "cpu") -> list[Case]:
    """The battery for one world size (global length ``world * 16``)."""
    n = 16 * world
    spanning = ((8, 16, n), (1, 2, 4))  # local, shard-sized, and (world > 1) spanning every rank
    out = []
    for mode in ("longnet", "grouped"):
        for causal in (False, True):
            tag = f"{mode}-{'causal' if causal else 'full'}"
            out.append(Case(f"P{world}-{tag}", world, *spanning, mode=mode, causal=causal))
            out.append(Case(f"P{world}-{tag}-gqa-transposed", world, *spanning, mode=mode, causal=causal,
                            heads=6, kv_heads=2, layout="transposed"))
    out.append(Case(f"P{world}-head-slice-mqa", world, *spanning, heads=3, kv_heads=1, layout="head_slice", causal=True))
    out.append(Case(f"P{world}-dilation-above-heads", world, (16, n), (1, 8), heads=4))
    if world % 2 == 0 and world > 2:
        out.append(Case(f"P{world}-disjoint-rings", world, (8, 32, n), (2, 2, 4), causal=True))
    if n > 16:
        out.append(Case(f"P{world}-segment-clamped", world, (4, 4 * n), (1, 4), causal=True))
    for layout in ("strided_head_dim", "permuted", "storage_offset", "zero_stride"):
        out.append(Case(f"P{world}-{layout}", world, *spanning, causal=layout != "permuted", layout=layout))
    # head-parallel (all-to-all) and hybrid (all-to-all in teams, ring across): 12 heads split over
    # 1-4 ranks; kv heads 4 (split at P=2/4, expanded at P=3) and 1 (one kv head per rank)
    heads = 12 if 12 % world == 0 else 8 * world
    strategies = ["head"] + (["hybrid"] if world >= 4 else [])
    for strategy in strategies:
        for mode in ("longnet", "grouped"):
            out.append(Case(f"P{world}-{strategy}-{mode}-causal-gqa", world, *spanning, mode=mode, causal=True,
                            heads=heads, kv_heads=4, layout="transposed", strategy=strategy))
        out.append(Case(f"P{world}-{strategy}-mqa", world, *spanning, heads=heads, kv_heads=1, strategy=strategy))
        out.append(Case(f"P{world}-{strategy}-bfloat16", world, *spanning, causal=True, heads=heads, kv_heads=4,
                        dtype="bfloat16", dim=16, strategy=strategy))
    low = ["float32", "bfloat16"] + (["float16"] if device_type == "cuda" else [])
    for dt in low:
        out.append(Case(f"P{world}-{dt}", world, *spanning, causal=True, heads=4, kv_heads=2, dtype=dt, dim=16))
    # grouped mode in low precision too: on GPUs this is the fused kernel inside the ring
    out.append(Case(f"P{world}-grouped-bfloat16", world, *spanning, mode="grouped", heads=6, kv_heads=3,
                    dtype="bfloat16", dim=32, layout="transposed"))
    # masks: a key padding mask on the ring (spanning patterns read the visiting block's mask
    # rows), packed documents spanning ranks and internal padding with the head strategy
    for causal in (False, True):
        out.append(Case(f"P{world}-ring-key-padding-{'causal' if causal else 'full'}", world, *spanning,
                        causal=causal, heads=4, kv_heads=2, masked=True, layout="transposed"))
        out.append(Case(f"P{world}-head-docs-{'causal' if causal else 'full'}", world, (4, 8, 16), (1, 2, 4),
                        causal=causal, heads=heads, kv_heads=4, batch=1, masked=causal, strategy="head",
                        docs=(0, 5, 5, n // 2 + 3, n)))
    out.append(Case(f"P{world}-head-padded", world, (8, 32), (1, 2), causal=True, heads=heads, kv_heads=4,
                    local_len=12, strategy="head"))
    # packed documents on the ring: each document dealt over the ranks on its own (ring/documents.py)
    out.append(Case(f"P{world}-ring-docs-causal", world, (4, 8, 16), (1, 2, 4), causal=True, heads=4, kv_heads=2,
                    batch=1, masked=True, docs=(0, 1, 1, 3, n // 2, n - 3, n), layout="transposed"))
    # shards the segments do not tile, on the ring: the rows move to padded shards (ring/padding.py)
    out.append(Case(f"P{world}-ring-padded-causal", world, (8, 32), (1, 2), causal=True, heads=4, kv_heads=2,
                    local_len=12, layout="transposed"))
    out.append(Case(f"P{world}-masked-bfloat16", world, *spanning, causal=True, heads=4, kv_heads=2, dim=16,
                    dtype="bfloat16", masked=True))
    # head chunks (memory.py): each kv group's heads in turn, written into slices of one result
    out.append(Case(f"P{world}-ring-head-chunks-causal", world, *spanning, causal=True, heads=8, kv_heads=4,
                    layout="transposed", head_chunks=True))
    out.append(Case(f"P{world}-ring-head-chunks-key-padding", world, *spanning, heads=4, kv_heads=2, masked=True,
                    dtype="bfloat16", dim=16, head_chunks=True))
    out.append(Case(f"P{world}-head-chunks-head-docs", world, (4, 8, 16), (1, 2, 4), causal=True, heads=heads,
                    kv_heads=4, batch=1, strategy="head", docs=(0, 5, 5, n // 2 + 3, n), head_chunks=True))
    # the head strategy in chunks swaps one chunk's heads at a time (head_parallel.py), the backward again
    out.append(Case(f"P{world}-head-chunks-full", world, (n,), (1,), heads=heads, kv_heads=4, strategy="head",
                    layout="transposed", head_chunks=True))
    out.append(Case(f"P{world}-head-chunks-longnet-causal", world, *spanning, causal=True, heads=heads,
                    kv_heads=3, strategy="head", masked=True, head_chunks=True))  # 2, 4 ranks: kv heads expanded
    # causal rings on contiguous blocks sharing their cross blocks: full attention, dilated rings kept whole by key padding
    out.append(Case(f"P{world}-ring-shared-dilated-causal", world, *spanning, causal=True, heads=6, kv_heads=2,
                    layout="transposed", masked=True, shared=True))
    out.append(Case(f"P{world}-ring-shared-full-causal", world, (n,), (1,), causal=True, shared=True))
    out.append(Case(f"P{world}-ring-shared-key-padding", world, *spanning, causal=True, heads=4, kv_heads=2,
                    masked=True, dtype="bfloat16", dim=16, shared=True))
    out.append(Case(f"P{world}-ring-shared-head-chunks", world, (n,), (1,), causal=True, heads=8, kv_heads=4,
                    layout="transposed", head_chunks=True, shared=True))  # each kv group's heads a ring of its own
    if world >= 4:  # the ring across teams of the hybrid, each team a block of its lane's rows
        out.append(Case(f"P{world}-hybrid-head-chunks-causal", world, *spanning, causal=True, heads=heads,
                        kv_heads=4, strategy="hybrid", head_chunks=True))
        out.append(Case(f"P{world}-hybrid-shared-full-causal", world, (n,), (1,), causal=True, heads=heads,
                        kv_heads=4, strategy="hybrid", shared=True))
    if world > 1:
        out.extend(zigzag_cases(world))
        out.append(Case(f"P{world}-zigzag-ring-head-chunks", world, (8, 2 * n), (1, 2), causal=True, heads=6,
                        kv_heads=3, shards="zigzag", head_chunks=True))
        out.append(Case(f"P{world}-zigzag-head-chunks", world, (8, 2 * n), (1, 2), causal=True, heads=heads,
                        kv_heads=2, strategy="head", shards="zigzag", dtype="bfloat16", dim=16, head_chunks=True))
    return out


def zigzag_cases(world: int) -> list[Case]:
    """The zigzag shard layout (rank ``j`` holds chunks ``j`` and ``2P - 1 - j``): full attention, LongNet-like
    patterns (local, spanning some chunks, spanning all; at P = 3 the segment of chunks 2-3 lies on one rank),
    dilation, GQA, key masks, causal and not, ring and head (hybrid at P = 4)."""
    n = 16 * world
    longnet = ((8, 16, n), (1, 2, 4))
    heads = 12 if 12 % world == 0 else 8 * world
    out = []
    for causal in (False, True):
        tag = "causal" if causal else "full"
        out.append(Case(f"P{world}-zigzag-ring-dense-{tag}", world, (n,), (1,), causal=causal, shards="zigzag"))
        out.append(Case(f"P{world}-zigzag-ring-longnet-{tag}", world, *longnet, causal=causal, heads=6, kv_heads=2,
                        layout="transposed", shards="zigzag"))
        out.append(Case(f"P{world}-zigzag-head-longnet-{tag}", world, *longnet, causal=causal, heads=heads,
                        kv_heads=4, strategy="head", shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-ring-dilated-grouped", world, (16, 2 * n), (4, 8), mode="grouped", causal=True,
                    heads=4, kv_heads=1, shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-ring-key-padding", world, *longnet, causal=True, heads=4, kv_heads=2, masked=True,
                    shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-head-docs", world, (4, 8, 16), (1, 2, 4), causal=True, heads=heads, kv_heads=4,
                    batch=1, masked=True, strategy="head", docs=(0, 5, 5, n // 2 + 3, n), shards="zigzag"))
    out.append(Case(f"P{world}-zigzag-ring-bfloat16", world, *longnet, causal=True, heads=4, kv_heads=2, dim=16,
                    dtype="bfloat16", shards="zigzag"))
    if world >= 4:
        out.append(Case(f"P{world}-zigzag-hybrid-causal", world, *longnet, causal=True, heads=heads, kv_heads=4,
                        masked=True, strategy="hybrid", shards="zigzag"))
    return out


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = 1 if case.layout == "zero_stride" else case.batch  # then expanded: every batch row alike
    shape_q = (batch, case.seq_len, case.heads, case.dim)
    shape_kv = (batch, case.seq_len, case.kv_heads, case.dim)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).expand(case.batch, -1, -1, -1)
               for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, torch.randn((case.batch, *shape_q[1:]), generator=g, dtype=torch.float64)


def _masks(case: Case, seed: int) -> dict:
    """``key_padding_mask`` (global) and ``cu_seqlens`` keywords of a case."""
    kw = {}
    if case.masked:
        g = torch.Generator().manual_seed(seed + 1)
        kw["key_padding_mask"] = torch.rand(case.batch, case.seq_len, generator=g) < 0.25
    if case.docs is not None:
        kw["cu_seqlens"] = torch.tensor(case.docs, dtype=torch.int32)
    return kw


def _oracle(case: Case, q, k, v, dout, dtype, seed: int):
    """Dense attention in ``dtype`` on CPU: output and q/k/v gradients (float64 = the oracle)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = dense_dilated_attention(*leaves, case.segment_lengths, case.dilation_rates, mode=case.mode, causal=case.causal,
                                  head_offsets=case.head_offsets, **_masks(case, seed))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return [t.double() for t in (out, *grads)]


def run_case(case: Case, backend_name: str, group, device: torch.device, seed: int):
    """Run one case on this rank; returns ``(Result, tensors)`` (tensors for the bitwise check)."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    q, k, v, dout = _inputs(case, seed)
    names = ("out", "dq", "dk", "dv")
    oracle = _oracle(case, q, k, v, dout, torch.float64, seed)
    dtype = DTYPES[case.dtype]
    if case.dtype == "float64":
        tol = {n: tolerance(dtype, None) for n in names}
    else:
        plain = _oracle(case, q, k, v, dout, dtype, seed)
        tol = {n: tolerance(dtype, rel_err(p, o)) for n, p, o in zip(names, plain, oracle)}
    rows = shard_indices(case.seq_len, case.world, rank, case.shards)
    g = torch.Generator(device=device).manual_seed(seed)
    local = [as_layout(t[:, rows].to(device=device, dtype=dtype), case.layout, generator=g).requires_grad_()
             for t in (q, k, v)]
    masks = _masks(case, seed)
    if "key_padding_mask" in masks:
        masks["key_padding_mask"] = masks["key_padding_mask"][:, rows].to(device)
    if "cu_seqlens" in masks:
        masks["cu_seqlens"] = masks["cu_seqlens"].to(device)
    rule = memory.BOUND.key
    if case.head_chunks:
        memory.set_memory_bound(0.0, 0)
    try:
        with routes.tuned(share_min_rows=0) if case.shared else contextlib.nullcontext():
            out = dilated_attention(*local, case.segment_lengths, case.dilation_rates, mode=case.mode,
                                    causal=case.causal, comm=comm, kernel=case.kernel, strategy=case.strategy,
                                    layout=case.shards, head_offsets=case.head_offsets, **masks)
            grads = torch.autograd.grad(out, local, dout[:, rows].to(device=device, dtype=dtype))
    finally:
        memory.set_memory_bound(*rule)
    got = [t.detach().cpu() for t in (out, *grads)]
    errors = {n: rel_err(g, o[:, rows]) for n, g, o in zip(names, got, oracle)}
    ok = all(errors[n] <= tol[n] for n in names) and all(torch.isfinite(g).all().item() for g in got)
    res = Result(case.name, backend_name, rank, case.world, ok, errors, tol)
    if not ok:
        res.message = "error above tolerance: " + ", ".join(
            f"{n} {errors[n]:.2e} > {tol[n]:.2e}" for n in names if not errors[n] <= tol[n])
    return res, got
