"""Distributed health check: can every ring neighbour reach the next one, and how fast?

Run on every rank of an initialised world (``scripts/diagnose.py ring --distributed``
under torchrun). For each communication backend:

1. **link pings**: for every ring size the library can use (each divisor ``G >= 2``
   of the world), every directed link ``rank i -> rank i+1`` (and the ring's
   wrap-around) is tested alone, one link position at a time, with a payload the
   receiver verifies;
2. **ring exchange** through the backend's own ``send_recv`` (the call the ring
   makes) and an **all-gather** through its ``all_gather``;
3. **bandwidth** (GB/s) per link for ring-buffer sizes, all links at once as in
   the ring, next to what the topology says the link should give
   (``nvidia-smi topo -m``: NVLink ``NV#`` vs PCIe ``PIX/PXB/PHB/NODE/SYS``;
   another host: the network).

Every wait runs against a timeout on a watchdog thread, so a hang becomes a
sentence ("rank 5 -> rank 6 did not complete within 30 s") instead of a job
that sits until the scheduler kills it. After a timeout the process group is
unusable: the CLI prints what it saw and exits.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import get_backend


class HealthTimeout(RuntimeError):
    """A communication step did not finish within the timeout (the message names the link)."""


@dataclass
class Check:
    backend: str
    check: str
    ok: bool
    detail: str
    gbps: float | None = None

    def text(self) -> str:
        return f"{self.backend:10s} {self.check:34s} {'ok' if self.ok else 'FAIL'}  {self.detail}"


def with_timeout(fn: Callable[[], Any], timeout: float, what: str, device: torch.device) -> Any:
    """Run ``fn`` (which issues and waits for communication) on a watchdog thread; raise ``HealthTimeout``."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            box["value"] = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # NCCL's wait() only orders streams: finish on the host
        except BaseException as exc:  # reported on the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name=f"health: {what}").start()
    if not done.wait(timeout):
        raise HealthTimeout(f"{what} did not complete within {timeout:g} s")
    if "error" in box:
        raise RuntimeError(f"{what} failed: {type(box['error']).__name__}: {box['error']}") from box["error"]
    return box.get("value")


def ring_sizes(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0]


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """``(next, previous)`` group rank on the ring of ``size`` consecutive ranks holding ``rank``."""
    start = (rank // size) * size
    pos = rank - start
    return start + (pos + 1) % size, start + (pos - 1) % size


def _link_pings(comm, device, timeout, drop_links) -> list[Check]:
    """Each directed ring link alone, for every ring size: ``src`` sends its rank, ``dst`` checks it.

    Link position ``i`` of every ring runs at once (rings are disjoint); every rank walks the
    same (size, position) sequence, so the two ends of a link always meet.
    """
    out = []
    rank, group = comm.rank, comm.group
    for size in ring_sizes(comm.world_size):
        start = (rank // size) * size
        for i in range(size):
            src, dst = start + i, start + (i + 1) % size
            what = f"rank {src} -> rank {dst}"
            if rank == src:
                payload = torch.full((16,), float(src), device=device)
                if (src, dst) in drop_links:  # a simulated dead link (tests, demos): the send never completes
                    with_timeout(lambda: time.sleep(2 * timeout + 5), timeout, what, device)
                with_timeout(lambda: dist.isend(payload, comm.global_rank(dst), group=group).wait(), timeout, what,
                             device)
            elif rank == dst:
                got = torch.full((16,), -1.0, device=device)
                with_timeout(lambda: dist.irecv(got, comm.global_rank(src), group=group).wait(), timeout, what,
                             device)
                ok = bool((got.cpu() == src).all())
                out.append(Check(comm.name, f"ping {what} (ring of {size})", ok,
                                 "payload verified" if ok else f"wrong payload: got {got[0].item()}"))
    return out


def _exchange(comm, device, timeout) -> list[Check]:
    out = []
    for size in ring_sizes(comm.world_size):
        nxt, prv = ring_neighbours(comm.rank, size)
        send = torch.full((64,), float(comm.rank), device=device)
        recv = torch.full_like(send, -1.0)
        what = f"ring exchange (ring of {size}): rank {comm.rank} -> rank {nxt}, rank {prv} -> rank {comm.rank}"
        with_timeout(lambda: comm.send_recv(send, nxt, recv, prv).wait(), timeout, what, device)
        ok = bool((recv.cpu() == prv).all())
        out.append(Check(comm.name, f"send_recv ring of {size}", ok,
                         f"got rank {prv}'s buffer" if ok else f"expected {prv}, got {recv[0].item()}"))
    mine = torch.full((8,), float(comm.rank), device=device)
    gathered = with_timeout(lambda: comm.all_gather(mine), timeout, f"all_gather over {comm.world_size} ranks", device)
    want = torch.arange(comm.world_size, dtype=torch.float32).repeat_interleave(8).view(comm.world_size, 8)
    ok = bool(torch.equal(gathered.cpu().float(), want))
    out.append(Check(comm.name, f"all_gather of {comm.world_size}", ok, "every rank's block in order" if ok
                     else "blocks out of order or wrong"))
    return out


def _bandwidth(comm, device, timeout, sizes_bytes, iters) -> list[Check]:
    """All ring links at once (ring of the whole world), as the ring runs: GB/s of this rank's outgoing link."""
    out = []
    world = comm.world_size
    if world < 2:
        return out
    nxt, prv = ring_neighbours(comm.rank, world)
    for nbytes in sizes_bytes:
        n = max(nbytes // 2, 1)
        send = torch.ones(n, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)

        def step():
            comm.send_recv(send, nxt, recv, prv).wait()

        def timed() -> list[float]:
            step()  # warm-up (communicator set-up, first touch)
            times = []
            for _ in range(iters):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            return times

        times = with_timeout(timed, timeout, f"bandwidth {nbytes / 2**20:g} MiB rank {comm.rank} -> rank {nxt}", device)
        sec = statistics.median(times)
        gbps = send.numel() * send.element_size() / sec / 1e9
        out.append(Check(comm.name, f"bandwidth {nbytes / 2**20:g} MiB -> rank {nxt}", True,
                         f"{gbps:.2f} GB/s (median of {iters}, {sec * 1e3:.3f} ms)", gbps))
    return out


def check_backend(name: str, device: torch.device, *, timeout: float = 30.0, sizes_bytes=(2**20, 16 * 2**20, 64 * 2**20),
                  iters: int = 5, drop_links: set[tuple[int, int]] | None = None) -> list[Check]:
    """Every check for one backend, on this rank; raises ``HealthTimeout``/``RuntimeError`` on the first hang."""

    comm = with_timeout(lambda: get_backend(name), timeout, f"creating the {name} backend", device)
    results = _link_pings(comm, device, timeout, drop_links or set())
    results += _exchange(comm, device, timeout)
    results += _bandwidth(comm, device, timeout, sizes_bytes, iters)
    return results


def installed_backends() -> list[str]:
    names = ["collective"]
    for name, module in (("fairscale", "fairscale"), ("deepspeed", "deepspeed")):
        try:
            __import__(module)
            names.append(name)
        except Exception:  # not installed or broken: not checked (env_report says which)
            pass
    return names


# -- topology ---------------------------------------------------------------------------------------------

# Rough unidirectional GB/s a healthy link of each kind gives a large P2P copy.
PER_NVLINK_GBPS = 20.0
EXPECTED_GBPS = {"PIX": 20.0, "PXB": 15.0, "PHB": 10.0, "NODE": 10.0, "SYS": 6.0}


def topology_matrix() -> dict[tuple[int, int], str] | None:
    """``{(gpu_i, gpu_j): "NV18" | "PIX" | ...}`` from ``nvidia-smi topo -m``, or ``None`` if unavailable."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_topology(text)


def parse_topology(text: str) -> dict[tuple[int, int], str] | None:
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines() if line.strip()]
    # the header lists the columns (GPU0 GPU1 ... CPU Affinity); row GPU0 starts "GPU0 X ..."
    header = next((line for line in lines if line.split()[:1] == ["GPU0"] and line.split()[1:2] != ["X"]), None)
    if header is None:
        return None
    cols = [c for c in header.split() if re.fullmatch(r"GPU\d+", c)]
    matrix = {}
    for line in lines:
        parts = line.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]):
            continue
        i = int(parts[0][3:])
        for col, cell in zip(cols, parts[1:1 + len(cols)]):
            matrix[(i, int(col[3:]))] = cell
    return matrix or None


def expected_gbps(kind: str) -> float | None:
    m = re.fullmatch(r"NV(\d+)", kind)
    if m:
        return PER_NVLINK_GBPS * int(m.group(1))
    return EXPECTED_GBPS.get(kind)


def physical_gpu(local_rank: int) -> int | None:
    """The ``nvidia-smi`` index of this rank's GPU (``CUDA_VISIBLE_DEVICES`` remaps it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return local_rank
    ids = [x.strip() for x in visible.split(",")]
    if local_rank < len(ids) and ids[local_rank].isdigit():
        return int(ids[local_rank])
    return None  # UUIDs or MIG names: no index to look up


def link_table(bandwidth: list[list[Check]], hosts: list[str], gpus: list[int | None],
               topo: dict[tuple[int, int], str] | None) -> list[str]:
    """Rank 0's table: per link and size, measured GB/s next to the topology's expectation."""
    lines = []
    world = len(hosts)
    for src in range(world):
        dst = (src + 1) % world
        if hosts[src] != hosts[dst]:
            kind, expect = "network (other host)", None
        elif topo is not None and gpus[src] is not None and gpus[dst] is not None:
            kind = topo.get((gpus[src], gpus[dst]), "?")
            expect = expected_gbps(kind)
        else:
            kind, expect = ("same host" if topo is None else "unknown"), None
        for c in bandwidth[src]:
            verdict = ""
            if expect is not None and c.gbps is not None and c.check.startswith("bandwidth") and c.gbps < 0.25 * expect:
                verdict = f"  SLOW: a healthy {kind} link gives ~{expect:.0f} GB/s"
            lines.append(f"rank {src} -> rank {dst} [{kind}{'' if expect is None else f', ~{expect:.0f} GB/s'}] "
                         f"{c.check.split(' -> ')[0]}: {c.gbps:.2f} GB/s{verdict}")
    return lines


def host_info() -> str:
    return socket.gethostname()
