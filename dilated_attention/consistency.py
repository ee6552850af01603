"""Cross-rank agreement on a call before its first exchange (docs/design.md section 3).

Ranks that disagree on a call (shapes, patterns, dtype, whether a backward
follows, ...) would otherwise pair up wrong messages and hang or compute
garbage. Before its first exchange a call gathers a small signature from every
rank; every rank then raises the same verdict, naming the differing values.

Agreed signatures are kept per backend by the call layer (``planning.CallState``; ``check_calls=True``): a steady
training loop repeats one configuration and pays nothing after the first call.
A rank whose own inputs are invalid always joins the gather (and raises its
own error); if the others skip it because their configuration is cached, the
wait ends at the backend's timeout on every rank instead of hanging.

What the cache cannot see (a rank that switches to another agreed configuration,
runs another call's backward, or skips a call) the stamps see: every exchange
carries the call's fingerprint and number (``comm/stamps.py``). On CPU tensors a
rank raises when its forward or backward ends (``settle``); on GPUs the stamps are
compared on the device and their verdict rides in this gather, which then also runs
every ``check_every`` calls, or when asked (``verify``): every rank raises the same error.
"""

from __future__ import annotations

import json
import zlib

import torch

from . import misuse
from .caches import capturing
from .comm.base import CommBackend, PeerTimeoutError
from .comm.stamps import fingerprint, flatten, verdict


def call_signature(q, k, v, segment_lengths, dilation_rates, **options) -> dict:
    """What every rank must agree on, as plain JSON-able values (unreadable parts become None)."""
    def safe(fn):
        try:
            return fn()
        except Exception:  # this rank failed validation anyway; its error is reported separately
            return None

    tensors = {"q": q, "k": k, "v": v}
    sig = {
        name: safe(lambda t=t: {"shape": list(t.shape), "dtype": str(t.dtype), "device": t.device.type})
        for name, t in tensors.items()
    }
    grad = torch.is_grad_enabled()
    sig["requires_grad"] = {name: safe(lambda t=t: bool(grad and t.requires_grad)) for name, t in tensors.items()}
    sig["segment_lengths"] = safe(lambda: [int(x) for x in segment_lengths])
    sig["dilation_rates"] = safe(lambda: [int(x) for x in dilation_rates])
    for key, value in options.items():
        sig[key] = safe(lambda value=value: value if value is None or isinstance(value, (bool, int, float, str))
                        else repr(value))
    return sig


def signature_text(sig: dict) -> str:
    """A ``call_signature`` as the text ranks compare (and the stamps' fingerprint is taken of)."""
    return json.dumps(sig, sort_keys=True)


def agree(comm: CommBackend, state, text: str, error: BaseException | None, like: torch.Tensor) -> None:
    """Raise the same verdict on every rank for the call whose signature is ``text`` (``signature_text``):
    this rank's own error, a peer's failure, ranks out of step since the last verdict, or a disagreement.
    ``state``: the backend's calls (``state.calls``, this one's number) and agreed signatures (``state.agreed``),
    which the call layer keeps (``planning.CallState``)."""
    calls = state.calls
    comm.ledger.begin(calls, fingerprint(text), text)  # the forward's stamps carry its fingerprint
    due = comm.ledger.deferred(like.device) and calls % comm.check_every == 0
    if error is None and comm.check_calls is True and text in state.agreed and not due:
        return
    if capturing():  # a CUDA graph capture: the gather reads the device on the host, which a capture forbids
        if error is not None:
            raise error
        if comm.check_calls is True and text in state.agreed:
            return  # the periodic verdict waits for the next call outside a capture
        if comm.check_calls == "always":
            raise ValueError(
                f"dilated_attention call {calls} is being captured into a CUDA graph with check_calls='always', "
                "which checks every call across ranks on the host: pass check_calls=True (checked once per "
                "configuration, before the capture) or False to get_backend")
        raise ValueError(
            f"dilated_attention call {calls} is being captured into a CUDA graph before its configuration was "
            "checked across ranks: run the same call once outside the capture first (the warm-up "
            "torch.cuda.graph needs anyway), or pass check_calls=False to get_backend")
    device = comm.collective_device(like)
    what = f"call {calls}: cross-rank check of the call signature"
    mine = torch.tensor([int(error is None), zlib.crc32(text.encode()), len(text)], dtype=torch.int64)
    sample = misuse.data_sample(like if text not in state.agreed else None)  # compared apart: may differ
    try:
        table = comm.all_gather(torch.cat([mine.to(device), comm.ledger.pending(device), sample.to(device)]),
                                what).cpu().tolist()
    except PeerTimeoutError as exc:
        if error is not None:  # the others took a cached path: our own error is the news
            raise error from exc
        raise
    out_of_step = verdict(comm, [row[3] for row in table], device, what, f"the cross-rank check of call {calls}")
    if error is not None:
        raise error
    if out_of_step is not None:
        raise out_of_step
    failed = [r for r, row in enumerate(table) if row[0] == 0]
    if failed:
        raise ValueError(f"dilated_attention: rank(s) {failed} rejected their inputs (see the error on those ranks)")
    if len({row[1] for row in table}) == 1:
        misuse.check_identical_shards([row[-len(sample):] for row in table])
        state.agreed.add(text)
        return
    # They differ: gather the signatures themselves so the message shows the values.
    width = max(row[2] for row in table)
    raw = torch.zeros(width, dtype=torch.uint8)
    raw[: len(text)] = torch.tensor(list(text.encode()), dtype=torch.uint8)
    rows = comm.all_gather(raw.to(device), what).cpu()
    sigs = [flatten(json.loads(bytes(row[: table[r][2]].tolist()).decode())) for r, row in enumerate(rows)]
    diffs = []
    for key in sigs[0]:
        values = [s.get(key) for s in sigs]
        if any(v != values[0] for v in values):
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(values)))
    raise ValueError("dilated_attention: ranks disagree on the call: " + "; ".join(diffs))


def settle(comm: CommBackend | None) -> None:
    """The end of a call's forward or backward on this rank: raise a mismatch its stamps showed (CPU)."""
    if comm is not None and comm.ledger.mismatch is not None:
        raise comm.ledger.error()
