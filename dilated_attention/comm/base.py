"""The interface the strategies use. A backend only moves bytes and names its group.

Subclasses provide ``_resolve_group`` (which process group) and three
asynchronous primitives returning work handles: ``_batch_p2p`` (a batch of
sends and receives with *global* peer ranks: one pair for a ring step, every
block to every peer for an all-to-all of part of the group), ``_all_gather`` (into a
preallocated tensor) and ``_all_to_all`` (the whole group's all-to-all of one tensor).
Everything else lives here once: batches of transfers to any ranks (``exchange``: ring
steps, the shared rows of causal rings), ring topology, all-to-all over any set of ranks, rank
bookkeeping, and the timeout on every wait.

Every wait honours ``timeout`` (seconds): ``get_backend(..., timeout=s)``, else
the ``DILATED_ATTENTION_TIMEOUT`` environment variable, else the timeout the
user gave ``init_process_group``. On gloo, and on NCCL when a timeout was given
explicitly, waits are timed on the host. On NCCL by default they only order the
compute stream (no host sync per exchange) and NCCL's watchdog enforces the
process group's timeout; the cross-rank signature gather is always timed. On expiry the waiting rank raises ``PeerTimeoutError``
naming the peer it waited for and what it was doing (call number, direction,
pattern, step), so a rank that skipped a call or a backward turns into an error
on every rank that waits for it instead of a hang.

Every exchange of a call also carries the call's stamp (``stamps.py``: configuration
fingerprint, call number, direction; 16 bytes): ring steps as a small tensor to each peer in the
same batch of transfers (so received blocks stay contiguous and callers read them as views),
all-to-alls as one more all-to-all of the stamps (or inside the blocks, after each one's data, where the
caller left room: ``Blocks``, ``stamp_room``), all-gathers after each rank's row (``Blocks``). A rank whose
peer is in another call or configuration raises ``ValueError`` instead of mixing their data.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import sys
import weakref
from abc import ABC, abstractmethod
from datetime import timedelta
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..caches import capturing, register
from .stamps import STAMP_BYTES, WORDS, Ledger, Stamp, block_tail, handshake, verdict

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every backend alive (added by CommBackend.__init__), for live_backend
register("comm.live_backends", _LIVE.__len__)  # held weakly: each goes with its backend


def live_backend(ident: int) -> "CommBackend | None":
    """The backend alive whose ``id()`` is ``ident`` (how a compiled call finds its backend: torch.compile folds
    ``id(backend)`` to a constant on every torch release, but not every release hands a traced function the
    object itself)."""
    return next((backend for backend in list(_LIVE) if id(backend) == ident), None)


TIMEOUT_ENV = "DILATED_ATTENTION_TIMEOUT"


class Pending(Protocol):
    def wait(self) -> None: ...


def install_hint(extra: str) -> str:
    """How to install an optional backend: the package's extra, at the tested versions from a checkout."""
    return (f'pip install "dilated-attention[{extra}]" (from a checkout: '
            f'pip install -c launch/constraints.txt ".[{extra}]")')


class _DropLines(io.TextIOBase):
    """A text stream that passes each whole line written to it on to ``target`` at once, except lines containing
    one of ``noise``; a line is written in one piece, so lines of other threads and processes never split it."""

    def __init__(self, target, noise: tuple[str, ...]) -> None:
        self.target, self.noise, self.partial = target, noise, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        kept = "".join(line + "\n" for line in lines if not any(n in line for n in self.noise))
        if kept:
            self.target.write(kept)
            self.target.flush()
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close_line(self) -> None:
        """Pass on what is left of an unfinished last line."""
        if self.partial and not any(n in self.partial for n in self.noise):
            self.target.write(self.partial)
            self.target.flush()
        self.partial = ""


@contextlib.contextmanager
def without_setup_prints(*noise: str):
    """Run a third-party set-up step without the set-up lines it ``print``s (once per rank in a user's own
    script): lines containing one of ``noise`` are dropped, every other line goes to the real ``sys.stdout``
    as it is written (whichever thread writes it: a tool's failure message printed meanwhile still shows).
    Warnings and log records are not prints: they pass untouched."""
    stream = _DropLines(sys.stdout, noise)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.close_line()


class PeerTimeoutError(TimeoutError):
    """A wait on a peer rank did not complete within the backend's timeout."""


def _as_seconds(timeout: float | timedelta | None, source: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout ({source}) must be seconds (a number) or a timedelta, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout ({source}) must be a positive, finite number of seconds, got {timeout}")
    return float(timeout)


def group_timeout(group: dist.ProcessGroup) -> float:
    """The timeout the process group was created with (30 min if it cannot be read)."""
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # this group has no backend for that device, or an older torch
            continue
    return 1800.0


def resolve_timeout(timeout: float | timedelta | None, group: dist.ProcessGroup) -> float:
    """Explicit argument, else ``DILATED_ATTENTION_TIMEOUT``, else the user's ``init_process_group``
    timeout (the default group's: sub-groups made by other libraries often carry torch's default)."""
    explicit = _as_seconds(timeout, "argument")
    if explicit is not None:
        return explicit
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
        return _as_seconds(value, TIMEOUT_ENV)
    return group_timeout(dist.group.WORLD)


class _Waiting:
    """Work handles plus what a timeout message needs: who we wait for and why.

    ``host``: block the calling thread until done or timed out (gloo always; NCCL when the user set
    a timeout). Otherwise NCCL's wait only orders the compute stream after the transfer (no host
    sync on the hot path) and NCCL's watchdog enforces the process group's own timeout.
    """

    def __init__(self, works: list, timeout: float, host: bool, rank: int, peers: str, what: str) -> None:
        self.works, self.timeout, self.host = works, timeout, host
        self.rank, self.peers, self.what = rank, peers, what

    def wait(self) -> None:
        limit = timedelta(seconds=self.timeout)
        host = self.host and not capturing()  # a captured transfer runs at replay: only the stream can wait
        for work in self.works:
            if not host:
                work.wait()
                continue
            try:
                done = work.wait(limit)
            except Exception as exc:  # gloo raises on expiry; NCCL raises DistBackendError
                text = str(exc)
                if "timed out" in text.lower() or "timeout" in text.lower():
                    raise self._timeout_error() from exc
                raise RuntimeError(f"rank {self.rank}: {self.what} failed waiting for {self.peers}: {text}") from exc
            if done is False:
                raise self._timeout_error()

    def _timeout_error(self) -> PeerTimeoutError:
        return PeerTimeoutError(
            f"rank {self.rank}: {self.peers} did not complete within {self.timeout:g} s ({self.what}). "
            "Every rank of the group must make the same dilated_attention calls (forward and backward) in the "
            f"same order; a peer that skipped or failed one leaves the others waiting. Set the limit with "
            f"get_backend(..., timeout=seconds) or {TIMEOUT_ENV}."
        )


class _Stamped:
    """A wait, then the peers' stamps: compared now (CPU) or logged for the next verdict (device). A wait
    that fails after a mismatch raises the mismatch: the peer's call made other exchanges than ours."""

    def __init__(self, waiting: _Waiting, ledger: Ledger, stamp: Stamp, rows: torch.Tensor, logged: bool) -> None:
        self.waiting, self.ledger, self.stamp, self.rows, self.logged = waiting, ledger, stamp, rows, logged

    def wait(self) -> None:
        try:
            self.waiting.wait()
        except (PeerTimeoutError, RuntimeError) as exc:
            if not self.ledger.deferred(self.rows.device):  # stamps that did arrive still count
                self.ledger.landed(self.stamp, self.rows, self.logged)
            known = self.ledger.error()
            if known is not None:
                raise known from exc
            raise
        self.ledger.landed(self.stamp, self.rows, self.logged)


class Blocks:
    """``data`` ``(A, ...)`` whose block ``m`` travels as one unit (rank ``m``'s row of an all-gather, member ``m``'s
    block of an all-to-all with ``stamp_room``) with a stamp after it: laid out in ``raw`` ``(A, row)``, ``header``
    ``(A, 4)`` int32 after each block's data (``stamps.block_tail``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 raw: torch.Tensor | None = None) -> None:
        per = math.prod(shape[1:])
        step = max(STAMP_BYTES // dtype.itemsize, 1)  # elements in 16 bytes: the stamp, and the data's alignment
        pad = -(-per // step) * step
        self.raw = raw if raw is not None else torch.empty((shape[0], pad + step), dtype=dtype, device=device)
        self.data = self.raw[:, :per].view(shape)
        self.header = block_tail(self.raw)


class CommBackend(ABC):
    """One process group over which sequence shards are spread (rank ``j`` holds shard ``j``)."""

    name = "base"
    # Whole-group all-to-alls as one collective per tensor (``_all_to_all``); ``None``: on GPU tensors only. A batch
    # of point-to-point transfers costs the host a call per transfer, which host-bound GPU steps feel; on CPU
    # (gloo) the batch stays: after gloo's asynchronous all_to_all_single, two-rank jobs aborted at exit
    # ("terminate called without an active exception", 9 of 12 on torch 2.13, none with the batch).
    collective_all_to_all: bool | None = None

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | timedelta | None = None,
                 check_calls: bool | str = True, check_every: int = 64) -> None:
        """``check_calls``: agree on a small signature of each new call configuration first
        (``True``, cached per configuration: the steady state pays no host sync), of every call
        (``"always"``), or never (``False``, and no stamps either). With ``True`` or ``"always"`` every
        exchange carries the call's stamp (``stamps.py``); on GPUs their verdict is gathered at each
        agreement and at least every ``check_every`` calls. ``timeout``: seconds for every wait on a peer.
        Every rank must pass the same values."""
        if check_calls not in (True, False, "always"):
            raise ValueError(f'check_calls must be True, False or "always", got {check_calls!r}')
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be a positive int (calls between verdicts), got {check_every!r}")
        self.check_calls, self.check_every = check_calls, check_every
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"comm={self.name!r} needs torch.distributed to be initialised "
                "(torchrun + dist.init_process_group, or launch/demo.sh)"
            )
        self._group = self._resolve_group(group)
        self.timeout = resolve_timeout(timeout, self._group)
        # Host-side timed waits cost a sync per exchange on GPUs: only when asked for, or on CPU (gloo).
        asked = timeout is not None or bool(os.environ.get(TIMEOUT_ENV))
        self.host_waits = asked or "nccl" not in str(dist.get_backend(self._group))
        _LIVE.add(self)
        self.ledger = Ledger()  # stamps received (stamps.py)

    # -- what an adapter provides -------------------------------------------------
    def _resolve_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        return group if group is not None else dist.group.WORLD

    @abstractmethod
    def _batch_p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
        """Post every ``(tensor, global dst)`` send and ``(tensor, global src)`` receive as one batch."""

    @abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Start: 1-D ``out`` of ``world * inp.numel()`` gets group rank ``i``'s flat ``inp`` at block ``i``."""

    @abstractmethod
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Start: block ``i`` of ``out`` (dim 0, one per group rank) gets group rank ``i``'s block of ``inp`` for
        this rank (both contiguous, shaped alike)."""

    # -- shared by every backend --------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        return self._group

    # A group's ranks never change; torch looks them up per call (~10 us each, ~20 per ring call's host work)
    @functools.cached_property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @functools.cached_property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    @functools.cached_property
    def _global_ranks(self) -> tuple[int, ...]:
        return tuple(dist.get_global_rank(self._group, r) for r in range(self.world_size))

    def global_rank(self, group_rank: int) -> int:
        return self._global_ranks[group_rank]

    def ring_peers(self, ranks: tuple[int, ...]) -> tuple[int, int, int]:
        """``(position in ring, next group rank, previous group rank)`` on the ring ``ranks`` (group ranks)."""
        pos = ranks.index(self.rank)
        return pos, ranks[(pos + 1) % len(ranks)], ranks[(pos - 1) % len(ranks)]

    def _handles(self, work: Any) -> list:
        return [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]

    def stamp(self, call: int, direction: str) -> Stamp | None:
        """What call ``call``'s exchanges in ``direction`` (``"forward"``/``"backward"``) carry; None when
        ``check_calls=False``, and in a CUDA graph capture: every replay would write the same stamp into log
        rows that later calls reuse, so a captured call's exchanges carry none."""
        return self.ledger.stamp(call, direction, self.rank) if self.check_calls and not capturing() else None

    def verify(self) -> None:
        """Raise ``ValueError`` on every rank if any exchange since the last verdict carried a stamp that did
        not match (a collective: every rank of the group calls it, e.g. before saving a checkpoint). On
        CPU tensors mismatches raise at once; on GPUs the agreement gathers this verdict every
        ``check_every`` calls, so call it where a mismatch must not wait for that."""
        device = self.collective_device(torch.empty(0))
        call = self.ledger.call
        what = f"after call {call}: cross-rank check of the call stamps"
        counts = self.all_gather(self.ledger.pending(device), what).cpu().view(-1).tolist()
        error = verdict(self, counts, device, what, f"verify() after call {call}")
        if error is not None:
            raise error

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, what: str = "", *,
                  stamp: Stamp | None = None) -> Pending:
        """Post ``send -> dst`` and ``recv <- src`` (group ranks) together; call ``.wait()`` before use.
        ``stamp``: a 16-byte stamp goes each way in the same batch, and ``wait`` checks the one received."""
        return self.exchange([(send, dst)], [(recv, src)], what or "ring exchange", stamp=stamp)

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                 what: str = "exchange", *, stamp: Stamp | None = None) -> Pending:
        """Post every ``(tensor, group rank)`` send and receive as one batch of point-to-point transfers; call
        ``.wait()`` before using what was received. Two ranks must post their transfers to each other in the
        same order. ``stamp``: a 16-byte stamp to each rank sent to, first in the batch, and one from each rank
        received from, checked on arrival."""
        for kind, pairs in (("send to", sends), ("receive from", recvs)):
            for x, r in pairs:
                if not x.is_contiguous():
                    raise ValueError(f"{what}: the {kind} rank {r} is not contiguous (shape {tuple(x.shape)}, stride "
                                     f"{x.stride()}): transfers move whole tensors; pack ring buffers with "
                                     "views.pack_kv or pass x.contiguous()")
        rows, host_stamped = None, stamp is not None and bool(sends or recvs) and \
            not self.ledger.deferred((sends or recvs)[0][0].device)
        if host_stamped:  # stamps first: data only between ranks in the same call (stamps.handshake)
            sends, recvs = handshake(self, stamp, list(sends), list(recvs), what)
            rows = torch.zeros(0, WORDS, dtype=torch.int32)  # (checked: a failed wait raises a mismatch found)
        to = list(dict.fromkeys(r for _, r in sends))
        of = list(dict.fromkeys(r for _, r in recvs))
        out_ops = [(x, self.global_rank(r)) for x, r in sends]
        in_ops = [(x, self.global_rank(r)) for x, r in recvs]
        if stamp is not None and (to or of) and not host_stamped:
            device = (sends or recvs)[0][0].device
            rows = self.ledger.landing(stamp, len(of), device)
            header = stamp.header(device)
            out_ops[:0] = [(header, self.global_rank(r)) for r in to]
            in_ops[:0] = [(rows[i], self.global_rank(r)) for i, r in enumerate(of)]
        works = self._batch_p2p(out_ops, in_ops) if out_ops or in_ops else []
        if len(to) == len(of) == 1:
            peers = f"the exchange with rank {of[0]} (receive) and rank {to[0]} (send)"
        else:
            peers = f"the exchange with ranks {of} (receive) and {to} (send)"
        waiting = self._waiting(works, peers, what)
        return waiting if rows is None else _Stamped(waiting, self.ledger, stamp, rows, logged=not host_stamped)

    def _waiting(self, works: Any, peers: str, what: str) -> _Waiting:
        return _Waiting(self._handles(works), self.timeout, self.host_waits, self.rank, peers, what)

    def all_gather(self, x: torch.Tensor, what: str = "all-gather", *, host: bool = True,
                   stamp: Stamp | None = None) -> torch.Tensor:
        """``(world, *x.shape)``: every group rank's ``x``. ``host=False``: a stream-ordered wait
        (for results only kernels read; the signature gather reads its result on the host).
        ``stamp``: each rank's row carries it, and every row's is checked."""
        if stamp is not None:
            mine = Blocks((1, *x.shape), x.dtype, x.device)
            mine.data[0].copy_(x)
            mine.header.copy_(stamp.header(x.device).expand_as(mine.header))
            flat = mine.raw.view(-1)
        else:
            flat = x.contiguous().view(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=x.dtype, device=x.device)
        if stamp is not None:
            rows = Blocks((self.world_size, *x.shape), x.dtype, x.device, out.view(self.world_size, -1))
            if not self.ledger.deferred(out.device):
                rows.header.zero_()  # what a failed wait leaves there: "nothing arrived"
        waiting = _Waiting(self._handles(self._all_gather(out, flat)), self.timeout, host, self.rank,
                           "an all-gather over the group", what)
        if stamp is None:
            waiting.wait()
            return out.view(self.world_size, *x.shape)
        _Stamped(waiting, self.ledger, stamp, rows.header, logged=False).wait()
        return rows.data

    def all_to_all(self, sends: Sequence[torch.Tensor], ranks: tuple[int, ...], what: str = "all-to-all", *,
                   stamp: Stamp | None = None, stamp_room: bool = False) -> tuple[list[torch.Tensor], Pending]:
        """Start an all-to-all of each tensor of ``sends`` among group ranks ``ranks`` (this rank among them).

        Each tensor is contiguous with dim 0 indexed by position in ``ranks``: block ``m`` goes to
        ``ranks[m]``. Returns ``(received, pending)``: tensors of the same shapes, block ``m`` from
        ``ranks[m]`` once ``pending.wait()`` returns. The received blocks of a tensor are contiguous
        one after the other, so a caller whose rows follow the blocks gets them as a view. Over the
        whole group each tensor is one collective all-to-all, and ``stamp`` (16 bytes to each peer) one
        more (on GPUs: ``collective_all_to_all``); otherwise every tensor goes in one batch of point-to-point
        transfers with the stamp as a separate small transfer of the same batch. ``stamp_room``: the caller left
        the last 16 bytes of each block of ``sends[0]`` free (``Blocks.raw``): the stamp travels there,
        inside the transfers (each all-to-all costs the host a launch). Either way the stamps are checked on
        arrival.
        """
        for x in sends:
            if x.shape[0] != len(ranks) or not x.is_contiguous():
                raise ValueError(f"all_to_all needs contiguous tensors with dim 0 = {len(ranks)} ranks, "
                                 f"got shape {tuple(x.shape)}")
        got = [torch.empty_like(x) for x in sends]
        collective = sends[0].is_cuda if self.collective_all_to_all is None else self.collective_all_to_all
        by_exchange = ranks != tuple(range(self.world_size)) or not collective
        # (on the host an exchange swaps the stamps before the data: stamps.handshake)
        if stamp is not None and stamp_room and not (by_exchange and not self.ledger.deferred(sends[0].device)):
            return got, self._stamped_inside(sends, got, ranks, what, stamp)
        return got, self._post_all_to_all(sends, got, ranks, what, stamp)

    def _post_all_to_all(self, sends: Sequence[torch.Tensor], got: list[torch.Tensor], ranks: tuple[int, ...],
                         what: str, stamp: Stamp | None = None) -> Pending:
        """``all_to_all``'s transfers of ``sends`` into ``got``, ``stamp`` beside them."""
        me = ranks.index(self.rank)
        collective = sends[0].is_cuda if self.collective_all_to_all is None else self.collective_all_to_all
        if ranks != tuple(range(self.world_size)) or not collective:
            peers = [(m, r) for m, r in enumerate(ranks) if m != me]
            pending = self.exchange([(x[m], r) for m, r in peers for x in sends],
                                    [(y[m], r) for m, r in peers for y in got], what, stamp=stamp)
            for x, y in zip(sends, got):
                y[me].copy_(x[me])
            return pending
        # the whole group: one collective per tensor (a batch of point-to-point transfers costs the host a
        # call per transfer), its own block copied by the collective
        works = [self._all_to_all(y, x) for x, y in zip(sends, got)]
        rows = None
        if stamp is not None and len(ranks) > 1:
            device = sends[0].device
            rows = self.ledger.landing(stamp, len(ranks), device)  # (this rank's own stamp lands too)
            works.append(self._all_to_all(rows, stamp.header(device, len(ranks))))
        waiting = self._waiting([w for work in works for w in self._handles(work)],
                                f"the all-to-all of ranks {list(ranks)}", what)
        return waiting if rows is None else _Stamped(waiting, self.ledger, stamp, rows, logged=True)

    def _stamped_inside(self, sends: Sequence[torch.Tensor], got: list[torch.Tensor], ranks: tuple[int, ...],
                        what: str, stamp: Stamp) -> Pending:
        """``all_to_all`` of ``sends`` into ``got`` with the stamp in the last 16 bytes of each block of the first:
        written there before the transfers, checked where it lands (on the host a row still 0 after a failed wait
        says that nothing arrived there)."""
        device = sends[0].device
        block_tail(sends[0]).copy_(stamp.header(device, len(ranks)))
        rows = block_tail(got[0])
        if not self.ledger.deferred(device):
            rows.zero_()
        return _Stamped(self._post_all_to_all(sends, got, ranks, what), self.ledger, stamp, rows, logged=False)

    def collective_device(self, like: torch.Tensor) -> torch.device:
        """Where small control tensors must live for this group's collectives."""
        backend = str(dist.get_backend(self._group))
        if "gloo" in backend:
            return torch.device("cpu")
        if like.is_cuda:
            return like.device
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    def check_device(self, name: str, x: torch.Tensor) -> str | None:
        """Why ``x`` cannot travel over this group (e.g. CPU tensors on an NCCL-only group), else None."""
        backend = str(dist.get_backend(self._group))
        if x.device.type == "cpu" and "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
            return (f"{name} is on the CPU but comm={self.name!r} runs on an NCCL process group, which only moves "
                    "CUDA tensors: move the inputs to this rank's GPU")
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, timeout={self.timeout:g}s)"
