"""The interface the strategies use. A backend only moves bytes and names its group.

Subclasses provide ``_resolve_group`` (which process group) and three
asynchronous primitives returning work handles: ``_batch_p2p`` (a batch of
sends and receives with *global* peer ranks: one pair for a ring step, one per
peer for an all-to-all inside a team), ``_all_gather`` (into a preallocated
tensor) and ``_all_to_all`` (the whole group, equal blocks).
Everything else lives here once: ring topology, all-to-all over any set of
ranks, rank bookkeeping, and the timeout on every wait.

Every wait honours ``timeout`` (seconds): ``get_backend(..., timeout=s)``, else
the ``DILATED_ATTENTION_TIMEOUT`` environment variable, else the timeout the
user gave ``init_process_group``. On gloo, and on NCCL when a timeout was given
explicitly, waits are timed on the host. On NCCL by default they only order the
compute stream (no host sync per exchange) and NCCL's watchdog enforces the
process group's timeout; the cross-rank signature gather is always timed. On expiry the waiting rank raises ``PeerTimeoutError``
naming the peer it waited for and what it was doing (call number, direction,
pattern, step), so a rank that skipped a call or a backward turns into an error
on every rank that waits for it instead of a hang.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

TIMEOUT_ENV = "DILATED_ATTENTION_TIMEOUT"


class Pending(Protocol):
    def wait(self) -> None: ...


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
        for work in self.works:
            if not self.host:
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


class CommBackend(ABC):
    """One process group over which sequence shards are spread (rank ``j`` holds shard ``j``)."""

    name = "base"

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | timedelta | None = None,
                 check_calls: bool | str = True) -> None:
        """``check_calls``: agree on a small signature of each new call configuration first
        (``True``, cached per configuration: the steady state pays nothing), of every call
        (``"always"``), or never (``False``). ``timeout``: seconds for every wait on a peer."""
        if check_calls not in (True, False, "always"):
            raise ValueError(f'check_calls must be True, False or "always", got {check_calls!r}')
        self.check_calls = check_calls
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
        self.calls = 0  # calls made through this backend: names the call in timeout messages
        self.agreed: set = set()  # call signatures every rank has agreed on (consistency.py)

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
        """Start: block ``i`` of ``inp`` (dim 0, equal blocks) goes to group rank ``i``; block ``i`` of ``out`` comes from it."""

    # -- shared by every backend --------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        return self._group

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self._group, group_rank)

    def ring_peers(self, ranks: tuple[int, ...]) -> tuple[int, int, int]:
        """``(position in ring, next group rank, previous group rank)`` on the ring ``ranks`` (group ranks)."""
        pos = ranks.index(self.rank)
        return pos, ranks[(pos + 1) % len(ranks)], ranks[(pos - 1) % len(ranks)]

    def _handles(self, work: Any) -> list:
        return [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, what: str = "") -> Pending:
        """Post ``send -> dst`` and ``recv <- src`` (group ranks) together; call ``.wait()`` before use."""
        if not send.is_contiguous() or not recv.is_contiguous():
            raise ValueError("ring buffers must be contiguous (pack them with views.pack_kv)")
        works = self._batch_p2p([(send, self.global_rank(dst))], [(recv, self.global_rank(src))])
        peers = f"the exchange with rank {src} (receive) and rank {dst} (send)"
        return self._waiting(works, peers, what or "ring exchange")

    def _waiting(self, works: Any, peers: str, what: str) -> _Waiting:
        return _Waiting(self._handles(works), self.timeout, self.host_waits, self.rank, peers, what)

    def all_gather(self, x: torch.Tensor, what: str = "all-gather", *, host: bool = True) -> torch.Tensor:
        """``(world, *x.shape)``: every group rank's ``x``. ``host=False``: a stream-ordered wait
        (for results only kernels read; the signature gather reads its result on the host)."""
        flat = x.contiguous().view(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=x.dtype, device=x.device)
        _Waiting(self._handles(self._all_gather(out, flat)), self.timeout, host, self.rank,
                 "an all-gather over the group", what).wait()
        return out.view(self.world_size, *x.shape)

    def all_to_all(self, x: torch.Tensor, ranks: tuple[int, ...], what: str = "all-to-all"
                   ) -> tuple[torch.Tensor, Pending]:
        """Start an all-to-all among group ranks ``ranks`` (this rank among them).

        ``x``: contiguous, dim 0 indexed by position in ``ranks`` (block ``m`` goes to ``ranks[m]``).
        Returns ``(received, pending)``: block ``m`` of ``received`` comes from ``ranks[m]`` once
        ``pending.wait()`` returns.
        """
        if x.shape[0] != len(ranks) or not x.is_contiguous():
            raise ValueError(f"all_to_all needs a contiguous tensor with dim 0 = {len(ranks)} ranks, "
                             f"got shape {tuple(x.shape)}")
        out = torch.empty_like(x)
        peers = f"the all-to-all with ranks {list(ranks)}"
        if list(ranks) == list(range(self.world_size)):  # the whole group: the library's tuned collective
            return out, self._waiting(self._all_to_all(out, x), peers, what)
        me = ranks.index(self.rank)
        out[me].copy_(x[me])
        others = [(m, self.global_rank(r)) for m, r in enumerate(ranks) if m != me]
        works = self._batch_p2p([(x[m], g) for m, g in others], [(out[m], g) for m, g in others]) if others else []
        return out, self._waiting(works, peers, what)

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
