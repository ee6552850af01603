"""Fuzzing against the fp64 oracle: random valid calls must match it, random invalid ones must raise.

A valid case is a repro spec (``repro.py``): random batch, shards, heads, GQA,
head dim, 1-3 patterns (local, shard-sized, spanning ranks, clamped), both modes,
causal or not, a scale, a dtype, a kernel, a world size (with a strategy), and for
each of q/k/v a layout from ``testing/compare.LAYOUTS`` (transposed, head-sliced,
storage offsets, zero strides, strided head dim, ...). Independently, about 30% of
cases each (``OPTION_RATE``) add a ``key_padding_mask`` (a density, random padded
runs, a padded tail: whole rows or segments padded at times), packed documents
(``cu_seqlens`` with random lengths, zero-length ones and lengths the segments do
not tile; batch 1) and a sequence length the segments do not tile (internal
padding); with several ranks those run on any strategy, the heads divisible by
the ranks. Those cases
run on the kernels that take key masks (``MASK_KERNELS``). It is run through
``repro.run_spec``, so the first mismatch is already a repro file: replaying it
runs the very same tensors (same strides, offsets and seeded values).

An invalid case breaks exactly one rule of docs/design.md (a segment that does not
divide the sequence, a dilation that does not divide a segment, mixed dtypes,
a bool where an int belongs, ...) and must raise ``ValueError``/``TypeError``.

Multi-rank cases run on gloo ranks spawned on this machine (``fuzz_spawned``),
each case on the first ``world`` ranks; rank 0 decides when to stop and every
rank follows, so nothing waits for a peer that has left.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

from ..comm import get_backend
from ..functional import dilated_attention
from ..kernels.guard import STICKY
from ..launch_utils import leave_process_group
from ..misuse import MisuseWarning
from ..patterns import hybrid_team_size, padded_length, validate_patterns
from ..testing.compare import LAYOUTS, as_layout
from ..testing.spawn import init_local_rank, run_spawned, write_result
from . import repro
from .repro import describe_tensor

CPU_KERNELS = ("auto", "reference", "sdpa")
# The project's rule (testing/compare.py) with one change: fp32 results may also be off by 1e-5 (not 1e-6)
# relative. Random patterns often share keys (a position covered by several patterns, duplicated keys),
# and combining fp32 partials through their log-sum-exps costs a few 1e-6 there, while dense plain
# torch, one softmax, happens to stay near 1e-7: the 2x-plain bound is then tighter than fp32 itself.
# Likewise bf16 may be off by 2e-2: with sets of two keys the softmax gradient cancels, and the bf16
# rounding of the final `out` that backward's delta = rowsum(dout * out) uses (as in flash-attention)
# can then exceed 2x plain bf16 torch. A wrong row, head, scale or mask is off by O(0.1-1).
FLOORS = {"float32": 1e-5, "bfloat16": 2e-2}
CPU_DTYPES = ("float64", "float32", "bfloat16")
OPTION_RATE = 0.3  # each of: key_padding_mask, packed documents, an untiled length (independently)
MASK_KERNELS = ("auto", "reference", "fused")  # take key masks; sdpa/cudnn raise ValueError on masked calls
SEGMENTS = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)  # free choices for untiled lengths (64: often clamped)
MAX_PADDED = 160  # keep the dense oracle small: a padded length (sequence or document) at most this


@dataclass(frozen=True)
class CaseMix:
    """Which random calls a fuzz run draws: valid ones on these kernels, dtypes and device, each of the options
    (a key mask, packed documents, an untiled length) at ``option_rate``; invalid ones at ``invalid_fraction``."""

    kernels: tuple[str, ...] = CPU_KERNELS
    dtypes: tuple[str, ...] = CPU_DTYPES
    device: str = "cpu"
    invalid_fraction: float = 0.2
    option_rate: float = OPTION_RATE


@dataclass
class FuzzResult:
    cases: int = 0
    valid: int = 0
    invalid: int = 0
    skipped: int = 0  # valid cases a named kernel declined (e.g. SDPA on CUDA in fp32): its answer, not a bug
    seconds: float = 0.0
    failure: str | None = None  # plain-language finding of the first failing case
    repro_path: str | None = None
    lines: list[str] = field(default_factory=list)
    options: dict[str, int] = field(default_factory=dict)  # valid cases per option (spec_options)

    @property
    def ok(self) -> bool:
        return self.failure is None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_desc(shape, layout: str, dtype: torch.dtype, rng: random.Random) -> dict[str, Any]:
    """Strides and storage offset of ``as_layout`` on a tensor of ``shape`` (values come later from the seed)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    t = as_layout(torch.zeros(shape, dtype=dtype), layout, generator=gen)
    return describe_tensor(t)


def _tiles(segs, rates, n: int) -> bool:
    try:
        validate_patterns(segs, rates, n)
        return True
    except ValueError:
        return False


def _padded(segs, rates, n: int) -> int:
    return padded_length(segs, rates, n) if n > 0 else 0


def _free_patterns(rng: random.Random, m: int) -> tuple[list[int], list[int]]:
    segs = [rng.choice(SEGMENTS) for _ in range(m)]
    return segs, [rng.choice([r for r in _divisors(w) if r <= 8]) for w in segs]


def _documents(rng: random.Random, n: int) -> list[int]:
    """Random global document offsets ``[0, ..., n]``: 1-5 documents, zero-length ones at times."""
    cu = [0] + sorted(rng.randint(0, n) for _ in range(rng.randint(0, 4))) + [n]
    if rng.random() < 0.3:  # a zero-length document (possibly first or last)
        i = rng.randrange(len(cu))
        cu.insert(i, cu[i])
    return cu


def spec_options(spec: dict[str, Any]) -> list[str]:
    """The options a valid spec exercises (``FuzzResult.options`` counts them)."""
    world = int(spec.get("world_size") or 1)
    kwargs = spec.get("kwargs") or {}
    segs, rates = spec["segment_lengths"], spec["dilation_rates"]
    n = spec["q"]["shape"][1] * world
    found = [f"world {world}"]
    if world > 1:
        found.append(f"strategy {kwargs.get('strategy', 'auto')}")
    if spec.get("key_padding_mask") is not None:
        found.append("key_padding_mask")
    cu = spec.get("cu_seqlens")
    if cu is not None:
        found.append("cu_seqlens")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if 0 in lengths:
            found.append("zero-length document")
        if any(d and not _tiles(segs, rates, d) for d in lengths):
            found.append("padded document")
    elif not _tiles(segs, rates, n):
        found.append("untiled length")
    if kwargs.get("pad_to_segments") is False:
        found.append("pad_to_segments=False")
    if world > 1:
        found += [f"{o} (world > 1)" for o in ("key_padding_mask", "cu_seqlens", "untiled length") if o in found]
    return found


def random_spec(rng: random.Random, *, world: int = 1, kernels=CPU_KERNELS, dtypes=CPU_DTYPES,
                device: str = "cpu", backend: str | None = None, max_local: int = 32,
                option_rate: float = OPTION_RATE) -> dict[str, Any]:
    """A random valid call for ``world`` ranks, as a repro spec."""
    use_mask, use_docs, untiled = (rng.random() < option_rate for _ in range(3))
    mask_kernels = [k for k in kernels if k in MASK_KERNELS]
    if not mask_kernels:  # e.g. --kernels sdpa: no kernel takes masks, so no masked case
        use_mask = use_docs = untiled = False
    kernel = rng.choice(mask_kernels if use_mask or use_docs or untiled else list(kernels))
    dtype = rng.choice(list(dtypes))
    if kernel == "fused" and dtype == "float64":
        dtype = "float32"  # the fused kernel has no fp64 path (auto would pick another kernel)
    low = dtype in ("bfloat16", "float16")
    whole = world > 1 and (use_docs or untiled)  # documents or padding: on the head strategy, or on rings
    heads = rng.choice([h for h in (1, 2, 3, 4, 6, 8) if not whole or h % world == 0])
    kv_heads = rng.choice(_divisors(heads))
    dim = rng.choice([32, 64] if kernel == "fused" else [8, 16, 32])
    batch = 1 if use_docs else rng.choice([1, 2])
    mode = rng.choice(["longnet", "longnet", "grouped"])
    m = rng.randint(1, min(3, heads) if mode == "grouped" else 3)
    kwargs: dict[str, Any] = {}
    if world > 1:
        if whole:  # (rings: each document dealt over the ranks, or the rows on padded shards)
            strategy = rng.choice(["head", "auto", "ring"] + (["hybrid"] if hybrid_team_size(world, heads) else []))
        else:
            strategy = rng.choice(["auto", "auto", "ring"] + (["head"] if heads % world == 0 else [])
                                  + (["hybrid"] if hybrid_team_size(world, heads) else []))
        kwargs["strategy"] = strategy
    segs: list[int] = []
    if untiled:
        # free segments, then a length they do not tile (internal padding), the padded length kept small
        shortest = -(-4 // world) if low else 1  # low precision: at least 4 keys in some set (below)
        for _ in range(20):
            segs, rates = _free_patterns(rng, m)
            lengths = [x for x in range(shortest, max_local + 1) if not _tiles(segs, rates, world * x)
                       and _padded(segs, rates, world * x) <= MAX_PADDED]
            if lengths:
                local = rng.choice(lengths)
                break
            segs = []
    free = bool(segs)
    if not free:
        local = rng.choice([x for x in (4, 6, 8, 12, 16, 24, 32) if x <= max_local])
        # effective segments: tiles of the shard (w' | L) or whole-shard multiples spanning ranks (L | w', w' | N)
        choices = [w for w in _divisors(local)] + [local * g for g in _divisors(world) if g > 1]
        segs, rates = [], []
        for _ in range(m):
            w = rng.choice(choices)
            spans = w > local
            rate_choices = [r for r in _divisors(w) if r <= 8 and (not spans or local % r == 0)]
            r = rng.choice(rate_choices)
            if w == world * local and rng.random() < 0.3:
                w = world * local * rng.choice([2, 3])  # longer than the sequence: clamped to N
            segs.append(w)
            rates.append(r)
    n = world * local
    # Sets of 1-2 keys: the gradients are almost pure cancellation, and "2x plain torch" in low precision
    # becomes a coin toss. Keep at least 4 keys per set in one pattern every head sees (longnet), or in
    # every pattern (grouped: each head sees only its group's pattern).
    few = [i for i, (w, r) in enumerate(zip(segs, rates)) if min(w, n) // r < 4]
    if low and few and (mode == "grouped" or len(few) == len(segs)):
        for i in (few if mode == "grouped" else few[-1:]):
            if min(segs[i], n) >= 4:
                rates[i] = 1  # the same segment (tiling unchanged), every key in it
            else:
                segs[i], rates[i] = (4 if free else local), 1  # free patterns: n >= 4 (shortest above)
    cu_seqlens = None
    if use_docs:
        for _ in range(20):
            cu_seqlens = _documents(rng, n)
            if all(_padded(segs, rates, b - a) <= MAX_PADDED for a, b in zip(cu_seqlens, cu_seqlens[1:])):
                break
        else:
            cu_seqlens = [0, n]
    if untiled or use_docs:
        if rng.random() < 0.3:
            kwargs["pad_to_segments"] = True  # the default, named
    elif rng.random() < 0.1:
        kwargs["pad_to_segments"] = False  # the length is tiled: no padding needed, none done
    torch_dtype = repro._DTYPES[dtype]
    spec: dict[str, Any] = {
        "version": repro.VERSION, "seed": rng.randrange(10**6),
        "segment_lengths": segs, "dilation_rates": rates, "mode": mode, "causal": rng.random() < 0.5,
        "softmax_scale": None if rng.random() < 0.6 else round(rng.uniform(0.05, 1.0), 4),
        "kernel": kernel, "backend": backend if world > 1 else None, "world_size": world, "rank": 0,
        "kwargs": kwargs, "floor": dict(FLOORS), "key_padding_mask": None, "cu_seqlens": cu_seqlens,
    }
    if use_mask:  # drawn from the seed over the whole sequence; each rank takes its rows
        spec["key_padding_mask"] = {"shape": [batch, local], "dtype": "bool",
                                    "density": rng.choice([0.0, 0.1, 0.25, 0.5, 0.9]),
                                    "runs": rng.choice([0, 0, 1, 2]), "tail": rng.random() < 0.5}
    for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        desc = _layout_desc((batch, local, h, dim), rng.choice(LAYOUTS), torch_dtype, rng)
        desc.update(device=device, requires_grad=True)
        spec[name] = desc
    if kernel == "fused":  # its documented input rule: unit stride in the head dim for q and k
        for name in ("q", "k"):
            if spec[name]["stride"][-1] != 1:
                spec[name] = {**_layout_desc((batch, local, spec[name]["shape"][2], dim), "transposed", torch_dtype,
                                             rng), "device": device, "requires_grad": True}
    return spec


# -- invalid calls --------------------------------------------------------------------------------


def random_invalid(rng: random.Random) -> tuple[str, Callable[[], Any]]:
    """``(what is wrong, a call that must raise ValueError/TypeError)``."""
    b, n, h, d = rng.choice([1, 2]), rng.choice([8, 16, 24]), rng.choice([2, 4]), rng.choice([4, 8])
    g = torch.Generator().manual_seed(rng.randrange(2**31))

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k = t(b, n, h, d), t(b, n, h, d)
    segs, rates = [n // 2, n], [1, 2]
    cases: list[tuple[str, Callable[[], Any]]] = [
        (f"segment {n // 2 + 1} does not divide sequence {n} (padding off)",
         lambda: dilated_attention(q, k, k, [n // 2 + 1], [1], pad_to_segments=False)),
        ("float key_padding_mask", lambda: dilated_attention(q, k, k, segs, rates, key_padding_mask=t(b, n))),
        ("key_padding_mask of the wrong length",
         lambda: dilated_attention(q, k, k, segs, rates, key_padding_mask=torch.zeros(b, n + 1, dtype=torch.bool))),
        ("int64 cu_seqlens", lambda: dilated_attention(q[:1], k[:1], k[:1], segs, rates,
                                                       cu_seqlens=torch.tensor([0, n]))),
        ("2-D cu_seqlens", lambda: dilated_attention(q[:1], k[:1], k[:1], segs, rates,
                                                     cu_seqlens=torch.tensor([[0, n]], dtype=torch.int32))),
        ("cu_seqlens with batch 2", lambda: dilated_attention(
            t(2, n, h, d), t(2, n, h, d), t(2, n, h, d), segs, rates,
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32))),
        ("decreasing cu_seqlens", lambda: dilated_attention(
            q[:1], k[:1], k[:1], segs, rates, cu_seqlens=torch.tensor([0, n // 2 + 1, n // 2, n], dtype=torch.int32))),
        ("cu_seqlens as a list", lambda: dilated_attention(q[:1], k[:1], k[:1], segs, rates, cu_seqlens=[0, n])),
        ("int64 key_padding_mask", lambda: dilated_attention(q, k, k, segs, rates,
                                                             key_padding_mask=torch.zeros(b, n, dtype=torch.int64))),
        ("1-D key_padding_mask", lambda: dilated_attention(q, k, k, segs, rates,
                                                           key_padding_mask=torch.zeros(b * n, dtype=torch.bool))),
        ("non-bool pad_to_segments", lambda: dilated_attention(q, k, k, segs, rates, pad_to_segments=1)),
        ("unknown strategy", lambda: dilated_attention(q, k, k, segs, rates, strategy="ulysses")),
        ("sdpa named for a masked call", lambda: dilated_attention(
            q, k, k, segs, rates, kernel="sdpa", key_padding_mask=torch.zeros(b, n, dtype=torch.bool))),
        ("cu_seqlens not ending at the length", lambda: dilated_attention(
            q[:1], k[:1], k[:1], segs, rates, cu_seqlens=torch.tensor([0, n - 1], dtype=torch.int32))),
        (f"dilation {n // 2 + 1} does not divide segment {n // 2}",
         lambda: dilated_attention(q, k, k, [n // 2], [n // 2 + 1])),
        ("unequal pattern lists", lambda: dilated_attention(q, k, k, segs, [1])),
        ("no pattern", lambda: dilated_attention(q, k, k, [], [])),
        ("zero dilation", lambda: dilated_attention(q, k, k, [n], [0])),
        ("negative segment", lambda: dilated_attention(q, k, k, [-n], [1])),
        ("float segment", lambda: dilated_attention(q, k, k, [float(n)], [1])),
        ("bool dilation", lambda: dilated_attention(q, k, k, [n], [True])),
        ("string patterns", lambda: dilated_attention(q, k, k, "16", "1")),
        ("kv heads do not divide query heads", lambda: dilated_attention(t(b, n, 3, d), k, k, segs, rates)),
        ("mixed dtypes", lambda: dilated_attention(q, k.double(), k.double(), segs, rates)),
        ("3-D query", lambda: dilated_attention(q[0], k, k, segs, rates)),
        ("integer tensors", lambda: dilated_attention(q.long(), k.long(), k.long(), segs, rates)),
        ("unknown mode", lambda: dilated_attention(q, k, k, segs, rates, mode="dilated")),
        ("non-bool causal", lambda: dilated_attention(q, k, k, segs, rates, causal="yes")),
        ("negative scale", lambda: dilated_attention(q, k, k, segs, rates, softmax_scale=-0.5)),
        ("NaN scale", lambda: dilated_attention(q, k, k, segs, rates, softmax_scale=math.nan)),
        ("string scale", lambda: dilated_attention(q, k, k, segs, rates, softmax_scale="0.1")),
        ("unknown kernel", lambda: dilated_attention(q, k, k, segs, rates, kernel="cutlass")),
        ("kernel of the wrong type", lambda: dilated_attention(q, k, k, segs, rates, kernel=3)),
        ("k and v shapes differ", lambda: dilated_attention(q, k, t(b, n, h, d + 1), segs, rates)),
        ("sequence lengths differ", lambda: dilated_attention(q, t(b, n + 8, h, d), t(b, n + 8, h, d), segs, rates)),
        ("grouped mode with fewer heads than patterns",
         lambda: dilated_attention(t(b, n, 1, d), t(b, n, 1, d), t(b, n, 1, d), segs, rates, mode="grouped")),
        ("empty batch", lambda: dilated_attention(t(0, n, h, d), t(0, n, h, d), t(0, n, h, d), segs, rates)),
        ("q is not a tensor", lambda: dilated_attention(q.tolist(), k, k, segs, rates)),
        ("unknown backend name", lambda: dilated_attention(q, k, k, segs, rates, comm="mpi")),
    ]
    return rng.choice(cases)


def check_invalid(what: str, call: Callable[[], Any]) -> str | None:
    """``None`` if ``call`` raised ValueError/TypeError with a message, else the finding."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        return None if str(exc).strip() else f"invalid call ({what}) raised {type(exc).__name__} with no message"
    except Exception as exc:
        return f"invalid call ({what}) raised {type(exc).__name__} instead of ValueError/TypeError: {exc}"
    return f"invalid call ({what}) was accepted: it must raise ValueError or TypeError"


# -- the loop ------------------------------------------------------------------------------------------


def _finding(spec, rep) -> str:
    summary = rep.raised or ", ".join(
        f"{n} rel err {rep.errors[n]:.1e} > {rep.tolerance[n]:.1e}" for n in rep.errors
        if not rep.errors[n] <= rep.tolerance[n])
    more = repro.describe_call(spec)
    return (f"kernel {spec['kernel']!r}, {spec['q']['dtype']}, world {spec['world_size']}, {spec['mode']} "
            f"causal={spec['causal']} patterns {spec['segment_lengths']} x {spec['dilation_rates']}"
            f"{', ' + more if more else ''}: {summary}")


def _progress(total: int | None, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="case", dynamic_ncols=True, mininterval=1.0)


def fuzz(cases: int | None = 100, seconds: float | None = None, *, seed: int = 0, mix: CaseMix = CaseMix(),
         out_dir: str = "fuzz_repro", progress: bool = False, kernel_override: Any = None,
         quiet: bool = True) -> FuzzResult:
    """Single process: ``cases`` cases or ``seconds`` of them (whichever ends first), stop at the first failure.

    ``mix``: which calls are drawn (``CaseMix``). ``kernel_override``: run every valid case with this kernel object
    instead (used to show that the fuzzer finds a planted bug). ``quiet``: the library's warnings about
    calls that run but may not be meant (``misuse.MisuseWarning``: clamped segments, ...), which random cases
    raise by design, are not shown.
    """
    with _quieted(quiet):
        return _loop(None, {1: None}, cases, seconds, seed, mix, out_dir, progress, kernel_override, "collective")


@contextlib.contextmanager
def _quieted(quiet: bool) -> Iterator[None]:
    with warnings.catch_warnings():
        if quiet:
            warnings.filterwarnings("ignore", category=MisuseWarning)
        yield


def _loop(world_group: Any, comms_by_world: dict[int, Any], cases: int | None, seconds: float | None, seed: int,
          mix: CaseMix, out_dir: str, progress: bool, kernel_override: Any, backend: str) -> FuzzResult:
    """The run on this rank (``world_group``: every rank's group, ``None`` in one process; ``comms_by_world``: the
    backend of each world size's ranks, ``None`` where this rank is not one of them)."""
    import torch.distributed as dist

    distributed = world_group is not None
    rank = dist.get_rank() if distributed else 0
    rng = random.Random(seed)  # the same sequence on every rank
    res = FuzzResult()
    bar = _progress(cases if seconds is None else None, progress and rank == 0)
    start = time.monotonic()
    worlds = sorted(comms_by_world)
    while True:
        go = (cases is None or res.cases < cases) and (seconds is None or time.monotonic() - start < seconds)
        if distributed:  # rank 0's clock decides for everyone
            flag = torch.tensor([int(go)])
            dist.broadcast(flag, 0, group=world_group)
            go = bool(flag.item())
        if not go:
            break
        res.cases += 1
        if rng.random() < mix.invalid_fraction:
            what, call = random_invalid(rng)
            if rank == 0:
                finding = check_invalid(what, call)
                res.invalid += 1
                if finding is not None:
                    res.failure = finding
            bad = _agree(res.failure is not None, world_group)
            if bad:
                if rank == 0:
                    res.repro_path = _write_text(out_dir, f"invalid-{res.cases}.txt", res.failure)
                break
            _tick(bar)
            continue
        world = rng.choice(worlds)
        spec = random_spec(rng, world=world, kernels=mix.kernels, dtypes=mix.dtypes, device=mix.device,
                           backend=backend if world > 1 else None, option_rate=mix.option_rate)
        res.valid += 1
        for option in spec_options(spec):
            res.options[option] = res.options.get(option, 0) + 1
        failed, finding, lines = False, None, []
        comm = comms_by_world[world] if rank < world else None
        if rank < world:
            rep = repro.run_spec(spec, comm=comm, device=mix.device, kernel=kernel_override, narrow=False)
            declined = rep.raised is not None and rep.raised.startswith("ValueError: kernel=") and \
                "cannot run on these inputs" in rep.raised
            res.skipped += int(declined)
            failed = not rep.ok and not declined
            if failed:
                finding = _finding(spec, rep)
        if _agree(failed, world_group):
            # narrow down on the failing case only, on every rank of the case's group: replay is collective
            # there, and one rank may fail where the others pass (deciding per rank left them waiting).
            # Not after a fault that leaves the CUDA context unusable: every later CUDA call fails too.
            if rank < world:
                if not _sticky(rep.raised):
                    rep = repro.run_spec(spec, comm=comm, device=mix.device, kernel=kernel_override, narrow=True)
                lines = rep.text().splitlines()
            res.failure, res.lines = _collect(finding, lines, world_group)
            if rank == 0:
                spec = {**spec, "error": res.failure}
                if kernel_override is not None:
                    spec["kernel"] = getattr(kernel_override, "name", str(kernel_override))
                res.repro_path = repro.write(spec, path=os.path.join(out_dir, f"fuzz-case-{res.cases}.json"))
            break
        _tick(bar)
    res.seconds = time.monotonic() - start
    if bar is not None:
        bar.close()
    return res


def _sticky(raised: str | None) -> bool:
    return raised is not None and STICKY.search(raised) is not None


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)


def _agree(flag: bool, group) -> bool:
    if group is None:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _collect(finding, lines, group):
    if group is None:
        return finding, lines
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (finding, lines), group=group)
    first = next((f for f, _ in everyone if f), None)
    return first, [line for _, ls in everyone for line in ls]


def _write_text(out_dir: str, name: str, text: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write(text + "\n")
    return path


# -- spawned gloo ranks on this machine --------------------------------------------------------------


def _spawn_worker(rank, world, port, kwargs, out_dir_results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_rank(rank, world, port)
    try:
        worlds = kwargs.pop("world_sizes")
        backend = kwargs.pop("backend")
        comms = {}
        for w in worlds:  # new_group is collective: every rank creates every group
            if w == 1:
                comms[w] = None  # one rank: the single-device path, no backend
                continue
            group = dist.new_group(list(range(w)))
            comms[w] = get_backend(backend, group) if rank < w else None
        with _quieted(kwargs.pop("quiet")):
            res = _loop(dist.group.WORLD, comms, backend=backend, **kwargs)
    except Exception as exc:
        res = FuzzResult(failure=f"fuzzer crashed on rank {rank}: {type(exc).__name__}: {exc}")
    write_result(out_dir_results, rank, asdict(res))
    leave_process_group(barrier=False)


def fuzz_spawned(world_sizes: Iterable[int] = (1, 2, 4), cases: int | None = 100, seconds: float | None = None, *,
                 seed: int = 0, mix: CaseMix = CaseMix(), out_dir: str = "fuzz_repro", progress: bool = False,
                 backend: str = "collective", quiet: bool = True) -> FuzzResult:
    """Fuzz over several world sizes on ``max(world_sizes)`` gloo ranks spawned on this machine (CPU: ``mix``'s
    device is not read); ``mix`` and ``quiet`` as for ``fuzz``."""
    world_sizes = sorted(set(int(w) for w in world_sizes))
    if not world_sizes or world_sizes[0] < 1:
        raise ValueError(f"world_sizes must be positive ints, got {world_sizes}")
    kwargs = dict(world_sizes=world_sizes, cases=cases, seconds=seconds, seed=seed, mix=replace(mix, device="cpu"),
                  out_dir=os.path.abspath(out_dir), progress=progress, kernel_override=None, backend=backend,
                  quiet=quiet)
    res, *others = (FuzzResult(**x) for x in run_spawned(_spawn_worker, world_sizes[-1], kwargs))
    for other in others:
        if other.failure and not res.failure:
            res.failure = other.failure
    return res
