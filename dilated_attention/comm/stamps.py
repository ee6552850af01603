"""Call stamps: 16 bytes that travel with every exchange of a call, so ranks out of step raise.

The cross-rank agreement (``consistency.py``) is cached per configuration: a steady training loop
pays no host sync for it. A rank that then switches to another configuration agreed earlier with
the same shapes (``causal``, scale, mode, head offsets, patterns whose buffers have the same
size), runs the backward of another call than its peers, or skips a call would exchange blocks
of the right size and compute a wrong result without any error. So every exchange of a call
carries a stamp, four int32 words::

    [configuration fingerprint, call number, direction | poisoned << 8, sender's group rank]

(the fingerprint is the crc32 of the agreed call signature; backward stamps carry 0 there, their
call number and direction identify them) and the receiver compares each stamp it gets with its own.
Ring steps send it as a 16-byte tensor in the same batched send/receive as the block; all-to-alls
carry it inside their blocks where the caller left room (``block_tail``: the causal ring's swapped
patterns, whose tensors travel packed in one buffer anyway), else as one more small all-to-all
beside theirs (of part of the group, as a transfer in their batch); the key-mask all-gather appends
it to each rank's row.

Where the comparison happens:

* CPU tensors (gloo): on the host, right after each wait; it costs nothing there. A mismatch
  does not stop the call: its remaining exchanges go on with stamps marked ``poisoned``, so every
  rank that exchanges with this one during the call learns of it too, and each raises
  ``ValueError`` when its forward or backward ends (``settle``). A wait that fails after a
  mismatch (the peers' calls made different exchanges) raises the mismatch, within the timeout.
* CUDA tensors: received stamps land in a log on the device; nothing is compared or read on the
  host per call. The cross-rank agreement (a new configuration, ``check_calls="always"``, and
  every ``check_every``-th call) compares the log on the device and gathers the count with the
  row it gathers anyway, so every rank of the group raises the same ``ValueError`` there;
  ``CommBackend.verify()`` asks for that verdict at any point every rank reaches.

Configurations whose exchanged buffers differ in size must not meet in the transport: gloo aborts the process
("Received data size doesn't match expected size", in a thread of its own, before Python sees anything). So
on the host (CPU tensors) an exchange first swaps stamps with each of its peers, both ways (``handshake``), and
moves data only between ranks whose stamps name the same configuration, call and direction (then its buffers
have the same sizes on both sides); each side of a link decides alike, so no transfer is left without its
partner. On GPUs the data moves with the stamps in one batch (no host sync): a size mismatch there times out
on NCCL's watchdog, and same-sized drifts raise at the verdict.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import astuple, dataclass

import torch

from ..caches import kept

DIRECTIONS = {"forward": 1, "backward": 2}
_NAMES = {code: name for name, code in DIRECTIONS.items()}
WORDS = 4  # int32 words per stamp
STAMP_BYTES = 4 * WORDS
_POISONED = 1 << 8
_LOG_ROWS = 1024  # rows per chunk of the device log
_TEMPLATES = 64  # header templates a ledger keeps (``Ledger.template``)


def fingerprint(text: str) -> int:
    """The crc32 of a signature as a signed int32 word, never 0 (0 stands for "no configuration")."""
    crc = zlib.crc32(text.encode())
    return (crc - (1 << 32) if crc >= 1 << 31 else crc) or 1


def flatten(sig: dict, prefix: str = "") -> dict[str, object]:
    """``{"q": {"shape": ...}}`` -> ``{"q.shape": ...}``: the fields a message names."""
    out = {}
    for key, value in sig.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(frozen=True)
class Mismatch:
    """A stamp that did not match the receiver's: who received it in which call, and what it said."""

    rank: int
    call: int
    direction: int
    fingerprint: int
    peer: int
    peer_call: int
    peer_direction: int
    peer_fingerprint: int
    poisoned: int

    def row(self) -> list[int]:
        return [1, *astuple(self)]

    @classmethod
    def from_row(cls, row: list[int]) -> Mismatch | None:
        return cls(*row[1:]) if row[0] else None

    def describe(self, signatures: dict[int, str]) -> str:
        """One sentence naming the call, the ranks and, where both configurations are known, the fields."""
        own = f"in call {self.call} ({_NAMES.get(self.direction, '?')}), rank {self.rank} received data from rank {self.peer}"
        same_call = (self.peer_call, self.peer_direction) == (self.call, self.direction)
        if not same_call:
            own += f"'s call {self.peer_call} ({_NAMES.get(self.peer_direction, 'unknown direction')})"
        if self.peer_fingerprint != self.fingerprint and self.fingerprint and self.peer_fingerprint:
            mine, theirs = signatures.get(self.fingerprint), signatures.get(self.peer_fingerprint)
            if mine is None or theirs is None:
                return own + ", of a different configuration"
            a, b = flatten(json.loads(mine)), flatten(json.loads(theirs))
            order = sorted([(self.rank, a), (self.peer, b)], key=lambda item: item[0])
            diffs = [f"{key}: " + ", ".join(f"rank {r}={s.get(key)}" for r, s in order)
                     for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
            return own + ", whose configuration differs: " + "; ".join(diffs)
        if same_call and self.poisoned:
            return (own + ", which had found ranks out of step earlier in this call (the error on the ranks that "
                    "found it names the difference)")
        return own if not same_call else own + " with a stamp that does not match"


class Stamp:
    """One direction of one call on this rank: the words it sends and expects back."""

    __slots__ = ("ledger", "call", "direction", "fingerprint", "rank", "_made")

    def __init__(self, ledger: Ledger, call: int, direction: int, fingerprint: int, rank: int) -> None:
        self.ledger, self.call, self.direction, self.fingerprint, self.rank = ledger, call, direction, fingerprint, rank
        self._made: dict[tuple[torch.device, int], torch.Tensor] = {}

    def header(self, device: torch.device, copies: int = 0) -> torch.Tensor:
        """``(4,)`` int32 on ``device`` (``copies > 0``: ``(copies, 4)``, one row per peer of an all-to-all): what
        this rank sends. On the host it says whether this rank has found a mismatch already; on a device it is
        made once per call, direction and shape, by one kernel from a template (no host sync, no host copy)."""
        words = [self.fingerprint, self.call, self.direction, self.rank]
        if device.type == "cpu":
            if self.ledger.mismatch is not None:
                words[2] |= _POISONED
            made = torch.tensor(words, dtype=torch.int32)
            return made.repeat(copies, 1) if copies else made
        made = self._made.get((device, copies))
        if made is None:
            base, unit = self.ledger.template(device, self.fingerprint, self.direction, self.rank, copies)
            with kept(device):  # held by the ledger past the call
                made = self._made[device, copies] = torch.add(base, unit, alpha=self.call)
        return made


class Ledger:
    """A backend's record of the stamps it received: a host verdict (CPU) or a device log (CUDA)."""

    def __init__(self) -> None:
        self.defer = False  # True: log and compare at the next verdict on the host too (tests the device path)
        self.mismatch: Mismatch | None = None  # found on the host, raised by settle()
        self.signatures: dict[int, str] = {}  # fingerprint -> agreed signature (to name differing fields)
        self._current: tuple[int, int] = (0, 0)  # (call, fingerprint) of the call agreed last
        self._stamp: Stamp | None = None
        self._chunks: list[torch.Tensor] = []  # the device log: rows of received stamps
        self._used = 0  # rows used in the last chunk
        self._expect: list[tuple[int, int, int] | None] = []  # per log row: (fingerprint, call, direction)
        self._templates: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (``template``)

    # -- what the agreement and the exchanges call ------------------------------------
    def template(self, device: torch.device, fp: int, direction: int, rank: int, copies: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base, unit)`` on ``device``, shaped like a header with ``copies`` rows: a header of call ``c`` is
        ``base + c * unit``. Made once per configuration, direction and shape, through a pinned host copy (an
        asynchronous one: a pageable copy would wait for the stream)."""
        key = (device, fp, direction, rank, copies)
        made = self._templates.get(key)
        if made is None:
            if len(self._templates) >= _TEMPLATES:  # configurations come and go: start over
                self._templates.clear()
            rows = [[fp, 0, direction, rank], [0, 1, 0, 0]]
            host = torch.tensor(rows, dtype=torch.int32, pin_memory=device.type == "cuda")
            with kept(device):
                both = host.to(device, non_blocking=True)
                made = tuple(x.expand(copies, -1).contiguous() if copies else x for x in both)
            self._templates[key] = made
        return made

    @property
    def call(self) -> int:
        """The number of the call agreed last (``begin``)."""
        return self._current[0]

    def begin(self, call: int, fp: int, text: str) -> None:
        """The call about to run has configuration ``text`` (fingerprint ``fp``)."""
        self._current = (call, fp)
        self.signatures.setdefault(fp, text)

    def stamp(self, call: int, direction: str, rank: int) -> Stamp:
        code = DIRECTIONS[direction]
        held = self._stamp
        if held is not None and (held.call, held.direction) == (call & 0x7FFFFFFF, code):
            return held
        fp = self._current[1] if code == DIRECTIONS["forward"] and self._current[0] == call else 0
        self._stamp = Stamp(self, call & 0x7FFFFFFF, code, fp, rank)  # an int32 word (wraps after 2**31 calls)
        return self._stamp

    def deferred(self, device: torch.device) -> bool:
        return self.defer or device.type != "cpu"

    def landing(self, stamp: Stamp, n: int, device: torch.device) -> torch.Tensor:
        """``(n, 4)`` int32 to receive ``n`` peers' stamps into: rows of the device log (deferred), else
        zeros (a row still 0 after a failed wait says that nothing arrived)."""
        if not self.deferred(device):
            return torch.zeros(n, WORDS, dtype=torch.int32, device=device)
        last = self._chunks[-1] if self._chunks else None
        if last is None or last.device != device or self._used + n > len(last):
            if last is not None:  # the rest of the old chunk stays unused
                self._expect.extend([None] * (len(last) - self._used))
            with kept(device):  # the log outlives the call
                self._chunks.append(torch.empty(max(_LOG_ROWS, n), WORDS, dtype=torch.int32, device=device))
            self._used = 0
        rows = self._chunks[-1][self._used:self._used + n]
        self._used += n
        self._expect.extend([(stamp.fingerprint, stamp.call, stamp.direction)] * n)
        return rows

    def landed(self, stamp: Stamp, rows: torch.Tensor, logged: bool) -> None:
        """The peers' stamps are in ``rows`` (after the wait). ``logged``: ``rows`` came from ``landing``."""
        if self.deferred(rows.device):
            if not logged:
                self.landing(stamp, len(rows), rows.device).copy_(rows)
            return
        for word in rows.tolist():
            if word[2] == 0:  # nothing arrived here (the wait failed)
                continue
            direction, poisoned = word[2] & 0xFF, int(bool(word[2] & _POISONED))
            if ((word[0], word[1], direction) != (stamp.fingerprint, stamp.call, stamp.direction) or poisoned) \
                    and self.mismatch is None:
                self.mismatch = Mismatch(stamp.rank, stamp.call, stamp.direction, stamp.fingerprint,
                                         word[3], word[1], direction, word[0], poisoned)

    def error(self) -> ValueError | None:
        """The host-found mismatch as the error to raise (and forget), if any."""
        found, self.mismatch = self.mismatch, None
        return None if found is None else ValueError(explain(found.describe(self.signatures)))

    # -- the verdict (consistency.py gathers it) ----------------------------------------
    def pending(self, device: torch.device) -> torch.Tensor:
        """``(1,)`` int64 on ``device``: received stamps that did not match since the last verdict.
        Compares the device log without reading it (the caller's gather is the sync)."""
        count = torch.tensor([int(self.mismatch is not None)], dtype=torch.int64).to(device)
        rows = self._log_rows()
        if rows is None:
            return count
        valid = [e is not None for e in self._expect]
        expect = torch.tensor([e or (0, 0, 0) for e in self._expect], dtype=torch.int32).to(rows.device)
        bad = (rows[:, :3] != expect).any(1) & torch.tensor(valid).to(rows.device)
        return count + bad.sum().to(device, torch.int64).view(1)

    def first(self, rank: int) -> list[int]:
        """This rank's first mismatch as a row of ints (``Mismatch.row``; all 0 when it has none)."""
        if self.mismatch is not None:
            return self.mismatch.row()
        rows = self._log_rows()
        if rows is not None:
            for word, expect in zip(rows.cpu().tolist(), self._expect):
                if expect is not None and tuple(word[:3]) != expect:
                    return Mismatch(rank, expect[1], expect[2], expect[0], word[3], word[1], word[2] & 0xFF,
                                    word[0], 0).row()
        return [0] * (1 + len(Mismatch.__dataclass_fields__))

    def reset(self) -> None:
        """After a verdict: every logged row has been read (the gather synchronised), so reuse the log."""
        self.mismatch = None
        self._expect.clear()
        del self._chunks[1:]
        self._used = 0

    def _log_rows(self) -> torch.Tensor | None:
        if not self._expect:
            return None
        full = self._chunks[:-1]
        return torch.cat([*full, self._chunks[-1][:self._used]]) if full else self._chunks[-1][:self._used]


def block_tail(buffer: torch.Tensor) -> torch.Tensor:
    """``(A, 4)`` int32 view of the last 16 bytes of each block ``buffer[m]`` of a contiguous buffer whose blocks
    are a multiple of 16 bytes: where an all-to-all's stamp travels inside the transfers
    (``CommBackend.all_to_all(..., stamp_room=True)``)."""
    return buffer.view(buffer.shape[0], -1)[:, -(STAMP_BYTES // buffer.element_size()):].view(torch.int32)


def explain(what: str) -> str:
    return (f"dilated_attention: ranks out of step: {what}. Every rank must make the same dilated_attention calls, "
            "forward and backward, in the same order (a configuration agreed once is not agreed again before each "
            'call; check_calls="always" does that, at a host sync per call)')


def verdict(comm, counts: list[int], device: torch.device, what: str, when: str) -> ValueError | None:
    """Every rank's count of stamps that did not match (gathered): the error every rank raises, if any.
    All ranks see the same counts, so all of them take part in the second gather or none does."""
    if not any(counts):
        comm.ledger.reset()
        return None
    mine = torch.tensor(comm.ledger.first(comm.rank), dtype=torch.int64)
    records = comm.all_gather(mine.to(device), what).cpu().tolist()
    comm.ledger.reset()
    found = [(r, Mismatch.from_row(row)) for r, row in enumerate(records) if row[0]]
    if not found:  # (a count without a record cannot happen; say what is known)
        return ValueError(explain(f"rank(s) {[r for r, c in enumerate(counts) if c]} received stamps that did "
                                  f"not match (found by {when})"))
    text = found[0][1].describe(comm.ledger.signatures)
    return ValueError(explain(f"{text} (found by {when}; rank(s) {[r for r, _ in found]} received such data)"))


def handshake(comm, stamp: Stamp, sends: list, recvs: list, what: str) -> tuple[list, list]:
    """Host path of ``CommBackend.exchange``: swap stamps with every peer of the exchange, both ways, wait, and
    compare them (the ledger records a mismatch, raised when the call settles); returns the ``(tensor, group
    rank)`` sends and receives to post: those with peers whose stamp names this rank's configuration, call and
    direction. A receive left out is zeroed (the call goes on to its end, so that its other peers hear of the
    mismatch through poisoned stamps, and computes on zeros, never on stale memory)."""
    peers = sorted({r for _, r in sends} | {r for _, r in recvs})
    device = (sends or recvs)[0][0].device
    rows = comm.ledger.landing(stamp, len(peers), device)
    header = stamp.header(device)
    works = comm._batch_p2p([(header, comm.global_rank(r)) for r in peers],
                            [(rows[i], comm.global_rank(r)) for i, r in enumerate(peers)])
    try:
        comm._waiting(works, f"the stamps of ranks {peers}", what).wait()
    except (TimeoutError, RuntimeError) as exc:  # a peer in another call made other exchanges
        comm.ledger.landed(stamp, rows, logged=False)
        known = comm.ledger.error()
        if known is not None:
            raise known from exc
        raise
    comm.ledger.landed(stamp, rows, logged=False)
    own = (stamp.fingerprint, stamp.call, stamp.direction)
    # the same test on both sides of a link (poisoned and rank bits left out): both move its data, or neither
    agreed = {r for r, word in zip(peers, rows.tolist()) if (word[0], word[1], word[2] & 0xFF) == own}
    for x, r in recvs:
        if r not in agreed:
            x.zero_()
    return [(x, r) for x, r in sends if r in agreed], [(x, r) for x, r in recvs if r in agreed]
