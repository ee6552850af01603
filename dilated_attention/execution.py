"""Execution: a planned call's computation, forward and backward, and its autograd boundary.

``forward`` computes a call from its ``planning.Schedule`` and returns what ``backward`` needs: gather the key
mask across ranks, swap sequence for heads inside teams (``head_parallel.py``; in head chunks where the schedule
says so), run every pattern by its route, locally or as a ring (``ring/``) over the rank's block or the whole sequence's
batches (``batching.py``), and swap back. ``backward`` is its exact gradient, from the final ``out`` and ``lse``.
Eager calls wrap the pair in ``Attention`` (an ``autograd.Function`` that ``torch.func`` transforms); under
``torch.compile`` the same pair runs inside ``custom_ops.py``'s ops.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch._functorch.utils import unwrap_dead_wrappers

from .batching import batch_rows, caller_rows, run_mask
from .comm.base import CommBackend
from .consistency import settle
from .head_parallel import (heads_to_sequence, heads_to_sequence_backward, member_rows, sequence_to_heads,
                            sequence_to_heads_backward)
from .memory import HeadRange
from .merge import accum_dtype
from .planning import Schedule
from .ring.block import block_backward, block_forward
from .ring.padding import move_documents, move_rows
from .ring.routes import RingCall


def unit_head_dim(x: torch.Tensor) -> torch.Tensor:
    """Kernels and private SDPA ops read the head dim with unit stride: copy the rare input that has not."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def attend(spec: Schedule, call: int, q, k, v, key_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the sequence this rank attends over: its block of rings across teams, or the
    whole sequence with internal padding and packed documents.

    Padded rows are zero queries and keys; their keys are masked and their outputs dropped, so
    results and gradients equal the unpadded ones. Each document runs alone (its segments start
    at its first row; nothing crosses documents); documents of equal padded length share a launch.
    """
    if spec.batches is None:
        return forward_by_heads(spec.heads, spec.rings(call), q, k, v, key_mask)
    runs = [forward_by_heads(spec.heads, spec.rings(call, b), batch_rows(q, b), batch_rows(k, b), batch_rows(v, b),
                             run_mask(key_mask, b, q)) for b in spec.batches]
    bsz, n = q.shape[:2]
    return (caller_rows([o for o, _ in runs], spec.batches, n, bsz, copy=True),
            caller_rows([lse for _, lse in runs], spec.batches, n, bsz))


def attend_backward(spec: Schedule, call: int, q, k, v, key_mask, results: tuple):
    """The gradient of ``attend`` for ``results`` ``(out, lse, dout)``. Pad rows' outputs were dropped, so
    ``(0, -inf)`` (an uncovered row) stands in for them: their ``dout`` is 0, so they add nothing either way."""
    if spec.batches is None:
        return backward_by_heads(spec.heads, spec.rings(call), q, k, v, key_mask, results)
    out, lse, dout = results
    grads = [backward_by_heads(spec.heads, spec.rings(call, b), batch_rows(q, b), batch_rows(k, b),
                               batch_rows(v, b), run_mask(key_mask, b, q),
                               (batch_rows(out, b), batch_rows(lse, b, float("-inf")), batch_rows(dout, b)))
             for b in spec.batches]
    bsz, n = q.shape[:2]
    return tuple(caller_rows([g[i] for g in grads], spec.batches, n, bsz) for i in range(3))


def forward_by_heads(heads: tuple[HeadRange, ...], rings: tuple[RingCall, ...], q, k, v, key_mask
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_forward`` over every head range in turn, each writing its heads of one ``(out, lse)``."""
    if not heads:
        return block_forward(q, k, v, key_mask, rings[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device)
    for r, ring in zip(heads, rings):
        block_forward(r.query(q), r.kv(k), r.kv(v), key_mask, ring, into=(r.query(out), r.query(lse)))
    return out, lse


def backward_by_heads(heads: tuple[HeadRange, ...], rings: tuple[RingCall, ...], q, k, v, key_mask, results: tuple
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_backward`` over every head range in turn for ``results`` ``(out, lse, dout)``, each writing its heads
    of ``(dq, dk, dv)`` (a kv head's query heads are all in its range, so each gradient element is written once)."""
    if not heads:
        return block_backward(q, k, v, key_mask, results, rings[0])
    out, lse, dout = results
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    for r, ring in zip(heads, rings):
        block_backward(r.query(q), r.kv(k), r.kv(v), key_mask, (r.query(out), r.query(lse), r.query(dout)), ring,
                       into=(r.query(grads[0]), r.kv(grads[1]), r.kv(grads[2])))
    return grads


def gather_mask(backend: CommBackend, mask: torch.Tensor | None, call: int, team: int, zigzag: bool
                 ) -> torch.Tensor | None:
    """Every rank's key mask rows, as one ``(B, N)`` mask of the whole sequence in block order: each team's
    rows as its all-to-all lays them out (``member_rows``), teams in order. That is the natural order, except
    for zigzag rings, where block ``b`` holds its two chunks (ring steps read a block's, or a chunk's, mask
    rows as a slice)."""
    if mask is None:
        return None
    parts = backend.all_gather(mask.to(torch.uint8), f"call {call}: key_padding_mask all-gather",
                               host=backend.host_waits, stamp=backend.stamp(call, "forward"))
    teams = parts.unflatten(0, (-1, team)).unbind(0)
    return torch.cat([member_rows(rows, zigzag) for rows in teams], dim=1).bool()


def _padded_rows(spec: Schedule, call: int, x: torch.Tensor, to_padded: bool, direction: str, fill=0
                 ) -> torch.Tensor:
    """``x``'s rows moved to the padded shards of ``spec.padded`` or back (``ring/padding.py``)."""
    what = f"call {call}, {direction}: rows {'to' if to_padded else 'from'} the padded shards"
    return move_rows(x, spec.padded, spec.backend, to_padded, what, spec.backend.stamp(call, direction), fill)


def _units(spec: Schedule, key_padding_mask):
    """The documents' units of work (``ring/documents.py``): per unit of groups and head range, ``(unit, heads,
    groups)``, ``heads`` ``None`` for all, ``groups`` per group its schedule (the head range's), a
    function viewing the unit's document rows as the group's batch rows, and whether it runs with a key mask (a
    group planned unmasked: no pad rows, and the caller passed none)."""
    documents = spec.documents
    chunks = documents.heads or (None,)  # (else a group's own head chunks run inside its call)
    for u, (g0, g1) in enumerate(documents.units):
        mine = [(g, part) for g, part in zip(documents.groups, spec.parts) if g0 <= g.bucket < g1]
        for i, heads in enumerate(chunks):
            groups = []
            for group, part in mine:
                def rows(x: torch.Tensor, g=group, first=mine[0][0].first) -> torch.Tensor:
                    return x[:, g.first - first:g.first - first + g.rows].view(len(g.spans), g.shard, *x.shape[2:])

                groups.append((part if heads is None else part.chunk(i), rows,
                               group.pads or key_padding_mask is not None))
            yield u, heads, groups


def _to_documents(spec: Schedule, call: int, unit: int, xs: list[torch.Tensor], key_padding_mask, direction: str
                  ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``xs`` moved to a unit's document rows, and the rows' key mask: the caller's moved with them, or only the pad
    rows (which every rank knows of its own rows)."""
    moves = spec.documents.moves(unit, xs[0].device)
    what = f"call {call}, {direction}: rows to the documents' rings"
    masks = [] if key_padding_mask is None else [key_padding_mask.to(torch.uint8)]
    moved = move_documents(xs + masks, moves, spec.backend, what, spec.backend.stamp(call, direction),
                           fills=(0,) * len(xs) + (1,))
    return (moved[:-1], moved[-1].bool()) if masks else (moved, moves.pads)


def _to_caller(spec: Schedule, call: int, unit: int, xs: list[torch.Tensor], into: list[torch.Tensor],
               direction: str) -> None:
    what = f"call {call}, {direction}: rows back from the documents' rings"
    move_documents(xs, spec.documents.moves(unit, xs[0].device), spec.backend, what,
                   spec.backend.stamp(call, direction), into=into)


def _heads(heads, x: torch.Tensor, kv: bool = False) -> torch.Tensor:
    return x if heads is None else (heads.kv(x) if kv else heads.query(x))


def documents_forward(spec: Schedule, call: int, q, k, v, key_padding_mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Packed documents on rings: per unit (of groups, and of heads), the rows moved to where each document runs,
    every group's ring call, and the outputs moved back. Only the groups' own saved tensors are kept: the backward
    moves the inputs again."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    saved = []
    for unit, heads, groups in _units(spec, key_padding_mask):
        (qd, kd, vd), mask = _to_documents(spec, call, unit, [_heads(heads, q), _heads(heads, k, True),
                                                              _heads(heads, v, True)], key_padding_mask, "forward")
        out_d = torch.empty(qd.shape, dtype=qd.dtype, device=qd.device)
        for part, rows, masked in groups:
            part_out, part_saved = forward(part, call, rows(qd), rows(kd), rows(vd), rows(mask) if masked else None)
            rows(out_d).copy_(part_out)
            saved += part_saved
        _to_caller(spec, call, unit, [out_d], [_heads(heads, out)], "forward")
    return out, saved


def documents_backward(spec: Schedule, call: int, q, k, v, key_padding_mask, results: tuple):
    out, saved, dout = results
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
    saved = list(saved)
    for unit, heads, groups in _units(spec, key_padding_mask):
        xs = [_heads(heads, x, kv) for x, kv in ((q, False), (k, True), (v, True), (out, False), (dout, False))]
        (qd, kd, vd, outd, doutd), mask = _to_documents(spec, call, unit, xs, key_padding_mask, "backward")
        grads_d = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qd, kd, vd)]
        for part, rows, masked in groups:
            count = saved_count(part, masked)
            part_saved, saved = saved[:count], saved[count:]
            for g, part_grad in zip(grads_d, backward(part, call, rows(qd), rows(kd), rows(vd),
                                                      rows(mask) if masked else None,
                                                      (rows(outd), part_saved, rows(doutd)))):
                rows(g).copy_(part_grad)
        _to_caller(spec, call, unit, grads_d, [_heads(heads, g, kv) for g, kv in zip(grads, (False, True, True))],
                   "backward")
    return tuple(grads)


def saved_count(spec: Schedule, masked: bool) -> int:
    """How many tensors ``forward`` saves for a ring call (no documents, no padded shards)."""
    return int(spec.backend is not None and masked) + (1 if spec.team == 1 or spec.heads else 5)


def forward(spec: Schedule, call: int, q, k, v, key_padding_mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The computation: ``(out, saved)``, ``saved`` being the tensors it made that ``backward`` needs
    (the q/k/v/mask/out/lse the attention saw, where they are not the caller's)."""
    if spec.documents is not None:
        return documents_forward(spec, call, q, k, v, key_padding_mask)
    if spec.padded is not None:  # shards the segments do not tile: the call on padded shards, pad keys masked
        inputs = [_padded_rows(spec, call, x, True, "forward") for x in (q, k, v)]
        if key_padding_mask is not None:
            inputs.append(_padded_rows(spec, call, key_padding_mask, True, "forward", fill=True))
        else:  # only the pad rows, which every rank knows of its own shard: nothing to move
            first, rows = spec.backend.rank * spec.padded.shard, spec.padded.shard
            pads = torch.arange(first, first + rows, device=q.device) >= spec.padded.rows
            inputs.append(pads.repeat(q.shape[0], 1))
        out, saved = forward(replace(spec, padded=None), call, *inputs)
        return _padded_rows(spec, call, out, False, "forward"), [*inputs, out, *saved]
    q, k, v = unit_head_dim(q), unit_head_dim(k), unit_head_dim(v)
    saved, mask = [], key_padding_mask
    if spec.backend is not None and mask is not None:
        mask = gather_mask(spec.backend, mask, call, spec.team, spec.zigzag)
        saved.append(mask)
    if spec.team == 1:
        out, lse = attend(spec, call, q, k, v, mask)
        settle(spec.backend)  # a peer in another call or configuration raises here (stamps)
        return out, saved + [lse]
    swap = spec.swap(call)
    if spec.heads:  # one chunk's heads at a time; the backward swaps them again (head_parallel.py)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = q.new_empty((q.shape[0], q.shape[1] * spec.team, spec.split.local_heads), dtype=accum_dtype(q.dtype))
        for i, part in enumerate(spec.heads):
            out_h, part_lse = attend(spec.chunk(i), call, *sequence_to_heads(q, k, v, swap, part), mask)
            part.query(lse).copy_(part_lse)
            heads_to_sequence(out_h, swap, part, into=out)
        settle(spec.backend)
        return out, saved + [lse]
    qh, kh, vh = sequence_to_heads(q, k, v, swap)
    out_h, lse = attend(spec, call, qh, kh, vh, mask)
    out = heads_to_sequence(out_h, swap)
    settle(spec.backend)
    return out, saved + [qh, kh, vh, out_h, lse]


def backward(spec: Schedule, call: int, q, k, v, key_padding_mask, results: tuple
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``forward``'s ``out`` for ``dout``, ``results`` being ``(out, saved, dout)`` (exact: the
    kernels' backward on the final out/lse)."""
    if spec.documents is not None:
        return documents_backward(spec, call, q, k, v, key_padding_mask, results)
    out, saved, dout = results
    if spec.padded is not None:  # (``forward``): the padded call's gradients, moved back
        q, k, v, mask, out, *saved = saved
        grads = backward(replace(spec, padded=None), call, q, k, v, mask,
                         (out, saved, _padded_rows(spec, call, dout, True, "backward")))
        return tuple(_padded_rows(spec, call, g, False, "backward") for g in grads)
    saved = list(saved)
    mask = saved.pop(0) if spec.backend is not None and key_padding_mask is not None else key_padding_mask
    if spec.team == 1:
        (lse,) = saved
        q, k, v = unit_head_dim(q), unit_head_dim(k), unit_head_dim(v)
        grads = attend_backward(spec, call, q, k, v, mask, (out, lse, dout))
        settle(spec.backend)
        return grads
    swap = spec.swap(call)
    if spec.heads:  # one chunk's heads at a time, swapped again (``forward``)
        (lse,) = saved
        adds = spec.split.kv_heads % spec.team != 0  # a kv head several members read: its chunks add
        into = (q.new_empty(q.shape), *((k.new_zeros if adds else k.new_empty)(k.shape) for _ in "kv"))
        for i, part in enumerate(spec.heads):
            qh, kh, vh, out_h, dout_h = sequence_to_heads(q, k, v, swap, part, (out, dout), "backward")
            grads = list(attend_backward(spec.chunk(i), call, qh, kh, vh, mask, (out_h, part.query(lse), dout_h)))
            del qh, kh, vh, out_h, dout_h
            sequence_to_heads_backward(grads, swap, k.shape, part, into)
        settle(spec.backend)
        return into
    qh, kh, vh, out_h, lse = saved
    grads = list(attend_backward(spec, call, qh, kh, vh, mask, (out_h, lse, heads_to_sequence_backward(dout, swap))))
    grads = sequence_to_heads_backward(grads, swap, k.shape)  # (frees the head-layout gradients as it goes)
    settle(spec.backend)
    return grads


def saved_like(spec: Schedule, q, k, key_padding_mask) -> list[torch.Tensor]:
    """Empty tensors shaped as ``forward``'s ``saved`` (for a custom op's fake implementation)."""
    if spec.padded is not None:
        rows = spec.padded.shard
        q, k = (x.new_empty((x.shape[0], rows, *x.shape[2:])) for x in (q, k))
        mask = q.new_empty(q.shape[:2], dtype=torch.bool)
        return [q, k, k.new_empty(k.shape), mask, q.new_empty(q.shape),
                *saved_like(replace(spec, padded=None), q, k, mask)]
    bsz, local, heads, dim = q.shape
    acc = accum_dtype(q.dtype)
    saved = []
    if spec.backend is not None and key_padding_mask is not None:
        saved.append(key_padding_mask.new_empty((bsz, local * spec.backend.world_size)))
    if spec.team == 1:
        return saved + [q.new_empty((bsz, local, heads), dtype=acc)]
    n, hl, hk = local * spec.team, spec.split.local_heads, spec.split.local_kv_heads
    if spec.heads:
        return saved + [q.new_empty((bsz, n, hl), dtype=acc)]
    return saved + [q.new_empty((bsz, n, hl, dim)), k.new_empty((bsz, n, hk, dim)), k.new_empty((bsz, n, hk, dim)),
                    q.new_empty((bsz, n, hl, dim)), q.new_empty((bsz, n, hl), dtype=acc)]


def double_backward_error() -> RuntimeError:
    return RuntimeError(
        "dilated_attention does not support double backward (backward with create_graph=True, e.g. "
        "gradient penalties or torch.autograd.grad(..., create_graph=True)): its backward is hand-written "
        "and not itself differentiable"
    )


def vmap_folded(apply, info, in_dims, spec: Schedule, *args):
    """A vmap rule: rows of a batch are independent, so the vmapped dim folds into the batch dim
    (one call, no loop); tensors not vmapped are repeated."""
    if spec.backend is not None:
        raise RuntimeError("torch.func.vmap over dilated_attention with comm is not supported (every rank must "
                           "exchange whole calls): vmap single-device calls, or fold the vmapped dim into the "
                           "batch dim yourself")
    size = info.batch_size

    def fold(x, dim):
        if not isinstance(x, torch.Tensor):
            return x
        x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
        return x.flatten(0, 1)

    outs = apply(*(fold(x, d) for x, d in zip(args, in_dims)))
    return tuple(t.unflatten(0, (size, -1)) for t in outs), (0,) * len(outs)


class Attention(torch.autograd.Function):
    """The one autograd boundary of an eager call: ``forward``, and ``backward`` as its gradient.

    ``forward`` + ``setup_context`` (what ``torch.func`` needs): the tensors ``forward`` makes for the
    backward are outputs, marked non-differentiable.
    """

    @classmethod
    def apply(cls, *args):
        # Function.apply re-binds arguments with inspect.signature on every call of a setup_context
        # Function (~30 us); forward has no defaults to bind, so outside torch.func go straight to C++.
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    @staticmethod
    def forward(q, k, v, key_padding_mask, spec: Schedule, call: int):
        out, saved = forward(spec, call, q, k, v, key_padding_mask)
        return (out, *saved)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, key_padding_mask, spec, call = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zero "gradients" for the saved outputs: only out's is used
        ctx.save_for_backward(q, k, v, key_padding_mask, *output)
        # torch.func transforms run every backward with grad mode on: remember whether one is active
        ctx.spec, ctx.call, ctx.under_torch_func = spec, call, torch._C._are_functorch_transforms_active()

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, key_padding_mask, out, *saved = ctx.saved_tensors
        if ctx.under_torch_func:  # a Function, so vmap batches it; differentiating it raises
            grads = AttentionBackward.apply(dout, q, k, v, key_padding_mask, out, ctx.spec, ctx.call, *saved)
        elif torch.is_grad_enabled():  # plain autograd: only create_graph=True runs a backward with grad mode on
            raise double_backward_error()
        else:
            grads = backward(ctx.spec, ctx.call, q, k, v, key_padding_mask, (out, saved, dout))
        return (*grads, None, None, None)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            "dilated_attention does not support forward-mode AD (torch.func.jvp, torch.autograd.forward_ad): "
            "its derivative is a hand-written backward; use reverse mode (backward, torch.func.grad / vjp)"
        )

    @staticmethod
    def vmap(info, in_dims, q, k, v, key_padding_mask, spec: Schedule, call: int):
        return vmap_folded(Attention.apply, info, in_dims, spec, q, k, v, key_padding_mask, spec, call)


class AttentionBackward(torch.autograd.Function):
    """``backward`` as a Function of its own under ``torch.func`` (which runs every backward with grad
    mode on): ``vmap`` batches it too (per-sample gradients), and differentiating it raises."""

    @staticmethod
    def forward(dout, q, k, v, key_padding_mask, out, spec: Schedule, call: int, *saved):
        return backward(spec, call, q, k, v, key_padding_mask, (out, saved, dout))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise double_backward_error()

    @staticmethod
    def vmap(info, in_dims, dout, q, k, v, key_padding_mask, out, spec: Schedule, call: int, *saved):
        return vmap_folded(AttentionBackward.apply, info, in_dims, spec, dout, q, k, v, key_padding_mask, out,
                            spec, call, *saved)
