"""The interface the ring uses. A backend only moves bytes and names its group.

Subclasses provide three things: ``_resolve_group`` (which process group),
``_batch_send_recv`` (post one send and one receive, asynchronously, with
*global* peer ranks) and ``_all_gather`` (into a preallocated tensor). Ring
topology, rank bookkeeping and the cross-rank consistency check live here once.
"""

from __future__ import annotations

import struct
import zlib
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Pending(Protocol):
    def wait(self) -> Any: ...


class _Works:
    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class CommBackend(ABC):
    """One process group over which sequence shards are spread (rank ``j`` holds shard ``j``)."""

    name = "base"

    def __init__(self, group: dist.ProcessGroup | None = None, *, check_calls: bool = True) -> None:
        """``check_calls``: gather a small signature of every call first, so ranks that disagree
        raise together instead of hanging. It costs one tiny all-gather and a host sync per
        call; turn it off only for a model whose calls are known to agree."""
        self.check_calls = check_calls
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"comm={self.name!r} needs torch.distributed to be initialised "
                "(torchrun + dist.init_process_group, or launch/demo.sh)"
            )
        self._group = self._resolve_group(group)

    # -- what an adapter provides -------------------------------------------------
    def _resolve_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        return group if group is not None else dist.group.WORLD

    @abstractmethod
    def _batch_send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> Pending:
        """Post ``send -> dst`` and ``recv <- src`` (global ranks) as one batch."""

    @abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """1-D ``out`` of ``world * inp.numel()``: group rank ``i``'s flat ``inp`` at block ``i``."""

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

    def ring_peers(self, ring_size: int) -> tuple[int, int, int]:
        """``(position in ring, next group rank, previous group rank)`` for rings of consecutive ranks."""
        start = (self.rank // ring_size) * ring_size
        pos = self.rank - start
        return pos, start + (pos + 1) % ring_size, start + (pos - 1) % ring_size

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> Pending:
        """Post ``send -> dst`` and ``recv <- src`` (group ranks) together; call ``.wait()`` before use."""
        if not send.is_contiguous() or not recv.is_contiguous():
            raise ValueError("ring buffers must be contiguous (pack them with views.pack_kv)")
        return self._batch_send_recv(send, self.global_rank(dst), recv, self.global_rank(src))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(world, *x.shape)``: every group rank's ``x``."""
        flat = x.contiguous().view(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=x.dtype, device=x.device)
        self._all_gather(out, flat)
        return out.view(self.world_size, *x.shape)

    def collective_device(self, like: torch.Tensor) -> torch.device:
        backend = str(dist.get_backend(self._group))
        if "gloo" in backend:
            return torch.device("cpu")
        if like.is_cuda:
            return like.device
        # NCCL-only group but CPU inputs (e.g. a rank's invalid call): the consistency check must
        # still reach every rank, so gather on this rank's current GPU
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    def check_consistent(self, fields: dict[str, int], error: BaseException | None, like: torch.Tensor) -> None:
        """Gather every rank's call signature; raise the same verdict on every rank.

        A rank whose own inputs failed validation re-raises its error; the others
        raise ``ValueError`` naming it. Ranks that disagree (shapes, patterns, ...)
        all raise ``ValueError`` listing each rank's value. No rank is left waiting.
        """
        names = list(fields)
        local = torch.tensor([int(error is None)] + [int(fields[n]) for n in names], dtype=torch.int64)
        local = local.to(self.collective_device(like))
        table = self.all_gather(local).cpu().tolist()
        failed = [r for r, row in enumerate(table) if row[0] == 0]
        if error is not None:
            raise error
        if failed:
            raise ValueError(f"dilated_attention: rank(s) {failed} rejected their inputs (see the error on those ranks)")
        diffs = []
        for i, name in enumerate(names, start=1):
            values = [row[i] for row in table]
            if len(set(values)) > 1:
                diffs.append(f"{name}: " + ", ".join(f"rank {r}={x}" for r, x in enumerate(values)))
        if diffs:
            raise ValueError("dilated_attention: ranks disagree on the call: " + "; ".join(diffs))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


def stable_hash(obj: object) -> int:
    """Same integer on every rank for equal ``repr``s (Python's ``hash`` is salted per process)."""
    return zlib.crc32(repr(obj).encode())


def float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]
