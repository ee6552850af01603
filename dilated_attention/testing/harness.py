"""The one multi-rank battery every communication backend passes (docs/design.md section 7).

Every case (``testing/cases.py``) builds global inputs from a seed (identical on all ranks),
computes the float64 dense oracle, shards the sequence, runs the ring on the group's
ranks through each backend, and compares this rank's rows of the output and of
the q/k/v gradients. Backends must also agree bit for bit with each other. Checks of
faults and graphs (``testing/rank_checks.py``) and ranks out of step (``testing/out_of_step.py``:
every rank must raise ``ValueError`` naming the call and the difference) run as steps too.

This module is the runner: it lists the steps, bounds each one, agrees its outcome across ranks
and prints progress. Runs inside an initialised process group:

* CPU, under pytest: ``run_spawned(...)`` spawns gloo ranks once for all cases;
* GPUs: ``torchrun --nproc_per_node=K -m dilated_attention.testing.harness --backend collective``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..launch_utils import init_distributed
# the parts of the battery, importable from here as before
from .cases import DTYPES, Case, Result, cases, run_case, zigzag_cases  # noqa: F401
from .exchanges import recorded_exchanges  # noqa: F401
from .out_of_step import (Drift, check_stamps_change_nothing, drift_strategies, drifts,  # noqa: F401
                          run_drift, run_out_of_step)
from .rank_checks import (check_compiled_graphs, check_cuda_graph, check_disagreement,  # noqa: F401
                          check_one_rank_invalid, check_unchecked_calls)
from .spawn import spawn_ranks


# -- the battery: steps every rank runs in the same order, each bounded, their outcome agreed ----------------


GROUPS = ("cases", "checks", "graphs", "out-of-step")  # what --only selects
CASE_TIMEOUT = 300.0  # seconds one step may take on a rank (first kernel builds and compiles included)
WATCHDOG_MARGIN = 1.5  # a rank still in a step after this many case timeouts ends itself


@dataclass(frozen=True)
class Step:
    """One unit of the battery: ``run()`` gives this rank's results; every rank of the size-``world`` group runs
    it, then they agree on its outcome."""

    group: str  # one of GROUPS
    world: int
    label: str
    run: Callable[[], list[Result]]


class HarnessStopped(RuntimeError):
    """A step left a rank waiting for a peer that had failed or hung: the run cannot go on."""


def _case_step(case: Case, index: int, backends: list[str], group, device: torch.device) -> Callable[[], list[Result]]:
    def run() -> list[Result]:
        results, tensors = [], {}
        rank = dist.get_rank(group)
        for name in backends:
            try:
                res, got = run_case(case, name, group, device, 1000 * case.world + index)
                tensors[name] = got
            except Exception as exc:  # report, keep going: one failure must not hide the rest
                res = Result(case.name, name, rank, case.world, False, message=f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
            results.append(res)
        if len(tensors) > 1:
            first, ref = next(iter(tensors.items()))
            same = all(all(torch.equal(a, b) for a, b in zip(ref, t)) for t in tensors.values())
            results.append(Result(case.name + "[bitwise]", "+".join(tensors), rank, case.world, same,
                                  message="" if same else f"backends differ from {first}"))
        return results
    return run


def _guarded_step(check: Callable, label: str, *args) -> Callable[[], list[Result]]:
    """A check as a step: its result(s), or a failed result naming what it raised."""
    def run() -> list[Result]:
        try:
            got = check(*args)
        except Exception as exc:
            group = args[1]
            return [Result(label, args[0], dist.get_rank(group), dist.get_world_size(group), False,
                           message=f"{type(exc).__name__}: {exc}"[:500])]
        return got if isinstance(got, list) else [got]
    return run


def battery_steps(backends: list[str], device: torch.device, size: int, group, *, out_of_step: bool = False
                  ) -> list[Step]:
    """Every step at world size ``size`` (the same list on every rank)."""
    steps = [Step("cases", size, f"{case.name} [{','.join(backends)}]", _case_step(case, i, backends, group, device))
             for i, case in enumerate(cases(size, device.type))]
    if size > 1:
        for name in backends:
            for check in (check_disagreement, check_one_rank_invalid, check_unchecked_calls):
                steps.append(Step("checks", size, f"{check.__name__} [{name}] P{size}",
                                  _guarded_step(check, check.__name__, name, group, device)))
    if size > 1 and device.type == "cuda":
        for name in backends:
            steps.append(Step("graphs", size, f"cuda-graph [{name}] P{size}",
                              _guarded_step(check_cuda_graph, "cuda-graph", name, group, device)))
        steps.append(Step("graphs", size, f"compiled-reduce-overhead [{backends[0]}] P{size}",  # one backend: compiling costs
                          _guarded_step(check_compiled_graphs, "compiled-reduce-overhead", backends[0], group, device)))
    if size > 1 and out_of_step:
        for name in backends:
            steps.append(Step("out-of-step", size, f"out-of-step [{name}] P{size}",
                              lambda name=name: run_out_of_step([name], group, device)))
    return steps


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (``0 <= i < n``) -> ``(i, n)``; ``ValueError`` naming the form otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be i/n with integers 0 <= i < n (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard must be i/n with 0 <= i < n (e.g. 0/2), got {text!r}")
    return i, n


def _watchdog(label: str, rank: int, seconds: float) -> threading.Timer:
    """Ends this process if the step outlives ``seconds``: it waits for a peer that failed or hangs (a blocking
    transfer cannot be interrupted), so its peers' agreement learns of it instead of waiting forever."""
    def stop() -> None:
        print(f"[harness] rank {rank}: {label} did not finish within {seconds:g} s (a peer failed before the "
              "transfer this rank waits in, or hangs): stopping this rank", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


def _agree(results: list[Result], side, label: str, timeout: float) -> list[Result]:
    """Every rank's verdict on the step (over ``side``, a gloo group apart from the transfers under test): if any
    rank failed, every rank records the step failed, naming who failed and why. ``HarnessStopped`` where a peer
    did not report in time (it hangs, or its watchdog ended it)."""
    verdict = {"rank": dist.get_rank(side), "failed": [f"{r.case} [{r.backend}]: {r.message}"[:300] for r in results if not r.ok]}
    everyone: list = [None] * dist.get_world_size(side)
    try:
        dist.all_gather_object(everyone, verdict, group=side)
    except Exception as exc:
        raise HarnessStopped(f"{label}: a peer did not report within {timeout:g} s (it failed or hangs): "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    others = [f"rank {v['rank']}: {line}" for v in everyone if v["rank"] != verdict["rank"] for line in v["failed"]]
    if others and all(r.ok for r in results):  # failed elsewhere: recorded here too, so every rank reports it
        results = results + [Result(label, "peers", verdict["rank"], dist.get_world_size(side), False,
                                    message="; ".join(others)[:500])]
    return results


def run_battery(backends: list[str], device: torch.device, world_sizes: list[int] | None = None,
                progress: bool = False, out_of_step: bool = False, *, only: list[str] | None = None,
                shard: tuple[int, int] = (0, 1), case_timeout: float = CASE_TIMEOUT,
                select: Callable[[Step], bool] | None = None) -> list[Result]:
    """Every step for every world size that fits, on this rank (call on all ranks of the world): ``only`` keeps the
    named ``GROUPS``, ``shard=(i, n)`` every ``n``-th step from the ``i``-th (counted over the whole run),
    ``select`` the steps it accepts. Each step is bounded by ``case_timeout`` seconds and its outcome agreed by
    every rank of its group, so a failure on one rank is reported by all and the run goes on; a rank left
    waiting by a failed or hung peer ends (``HarnessStopped`` on the others), never hangs."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    world_sizes = world_sizes or list(range(1, world + 1))
    results: list[Result] = []
    sizes = []
    for size in world_sizes:
        # collective calls: every rank takes part. The agreement travels on gloo, apart from the transfers tested
        group = dist.new_group(list(range(size)))
        side = dist.new_group(list(range(size)), backend="gloo", timeout=timedelta(seconds=case_timeout))
        sizes.append((size, group, side))
    plan = []
    for size, group, side in sizes:
        steps = battery_steps(backends, device, size, group, out_of_step=out_of_step)
        plan.extend((step, side) for step in steps)
    plan = [(step, side) for i, (step, side) in enumerate(plan) if i % shard[1] == shard[0]
            and (not only or step.group in only) and (select is None or select(step))]
    start, entered = time.monotonic(), set()
    for i, (step, side) in enumerate(plan):
        if rank >= step.world:
            continue
        if step.world not in entered:  # ranks arrive from other sizes' steps: no step's clock runs while waiting
            dist.monitored_barrier(side, timeout=timedelta(hours=2), wait_all_ranks=True)  # (a dead peer: raises)
            entered.add(step.world)
        # a little later than the peers' agreement gives up on this rank: they report first, then this one
        timer = _watchdog(step.label, rank, case_timeout * WATCHDOG_MARGIN)
        try:
            got = step.run()
        finally:
            timer.cancel()
        got = _agree(got, side, step.label, case_timeout)
        results.extend(got)
        if progress and rank == 0:
            bad = [r for r in got if not r.ok]
            print(f"[harness {i + 1}/{len(plan)} {time.monotonic() - start:6.0f} s] P{step.world} {step.label}: "
                  + ("ok" if not bad else "FAIL " + "; ".join(f"{r.case} [{r.backend}]: {r.message}"[:300]
                                                            for r in bad)), flush=True)
    return results


# -- spawning gloo ranks on one machine (pytest, demo) ------------------------------------------


def _battery(rank: int, world_size: int, backends: list[str]) -> list[dict]:
    return [asdict(r) for r in run_battery(backends, torch.device("cpu"))]


def spawn_battery(backends: list[str], world_size: int = 4, env: Mapping[str, str | None] | None = None
                  ) -> list[Result]:
    """The battery on ``world_size`` spawned gloo ranks (``env``: their environment's changes, ``spawn_ranks``'s)."""
    return [Result(**x) for part in spawn_ranks(_battery, world_size, backends, env=env) for x in part]


# -- torchrun entry point ------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    lines = [f"{'case':44s} {'backend':28s} {'P':>2s} {'rank':>4s}  {'max rel err (out/dq/dk/dv)':40s} ok"]
    for r in results:
        errs = ("/".join(f"{r.errors[n]:.1e}" for n in ("out", "dq", "dk", "dv")) if "out" in r.errors
                else r.message[:40])
        lines.append(f"{r.case:44s} {r.backend:28s} {r.world:2d} {r.rank:4d}  {errs:40s} {'ok' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes world sizes separated by commas (e.g. 2,4), got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be positive world sizes, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", choices=["collective", "fairscale", "deepspeed"],
                        help="repeat to test several (and check they agree bitwise); default collective")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="world sizes to run, e.g. 4 or 2,4 (default: 1 to the number of ranks)")
    parser.add_argument("--only", action="append", choices=GROUPS,
                        help="run only this group of steps (repeat for several; default: all)")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="run every N-th step from the I-th (0 <= I < N), to split a run over several jobs")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT, metavar="SECONDS",
                        help=f"bound on one step on a rank (default {CASE_TIMEOUT:g}): a rank that outlives it "
                             "(waiting for a peer that failed) stops, and the run stops on every rank")
    args = parser.parse_args(argv)
    if args.case_timeout <= 0:
        parser.error(f"--case-timeout must be positive, got {args.case_timeout}")
    env = init_distributed(args.device)
    sizes = [p for p in (args.sizes or range(1, dist.get_world_size() + 1)) if p <= dist.get_world_size()]
    try:
        results = run_battery(args.backend or ["collective"], env.device, sizes, progress=True, out_of_step=True,
                              only=args.only, shard=args.shard, case_timeout=args.case_timeout)
    except HarnessStopped as exc:  # peers are gone or stuck: no teardown (it would wait for them)
        print(f"[harness] rank {dist.get_rank()}: stopped: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [asdict(r) for r in results])
    all_results = [Result(**x) for part in everyone for x in part]
    failed = [r for r in all_results if not r.ok]
    if dist.get_rank() == 0:
        print(format_table(all_results))
        print(f"{len(all_results) - len(failed)} passed, {len(failed)} failed")
    env.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
