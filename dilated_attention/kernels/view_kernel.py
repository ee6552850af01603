"""Zero-copy pattern kernel on any fused-attention ops: strided dilated views straight into the ops.

``ViewKernel`` is a ``PatternKernel`` (layouts in ``protocol.py``) on ``AttentionOps``, a forward and a backward of
softmax attention on 4D ``(B', h, M, D)`` views: cuDNN's (``cudnn.CudnnOps``, ``cudnn.CudnnKernel``), the cuDNN
frontend's (``cudnn_frontend.CudnnFrontendOps``), flash-attn-4's (``flash4.Flash4Ops``, ``flash4.Flash4Kernel``);
tests substitute plain-torch ops with the same contract to check the view logic on CPU.
For each pattern it hands the ops *views* of the caller's tensors: the dilated rows of a head chunk are
``x.view(B, S, M, r, H, D)[:, :, :, o, h0:h1]``, and chunks whose addresses step by a constant amount (every
LongNet head-offset run of one size, every ring buffer) are stacked into the batch dimension of one call, so a
pattern is a handful of calls (LongNet ``r = 16``, one segment: 16 head chunks, one call; a configuration where the
ops refuse such a stacked call runs chunk by chunk from then on). Forward returns the ops' own output as the
pattern's compact ``out`` (a strided view) when one call covered the pattern, else copies the outputs into it;
backward feeds the *final* merged ``out`` and ``lse`` (exact gradients, as ``protocol.py`` explains) and adds the
ops' gradients into the fp32 accumulators (one Triton pass per target, ``merge.add_into_``). The groups, views and
call plans (planned once per geometry, then replayed) live in ``cudnn_calls.py``; this module runs them.

What is copied, and why (everything else is read in place):

* an operand whose view the ops cannot read (head dim not unit-stride, a stride or
  address not 16-byte aligned, a zero stride) is copied to a compact tensor;
* backward ``lse`` always goes in as a packed ``(B', h, M, 1)`` fp32 tensor
  (small; some cuDNN versions address softmax stats as packed whatever the
  strides say), with ``-inf`` as the ops read it (``AttentionOps.lse_neginf``);
* backward ``out``/``dout`` are read in place only when they have exactly ``q``'s
  strides; otherwise ``q``, ``out`` and ``dout`` are all copied compact. torch's
  backward graph cache keys on q/k/v only (some versions), so ``out``/``dout``
  strides must be a function of q's: they are always equal to them. Ops whose
  plans key on every tensor's strides (``own_strides``: the frontend's) read each
  in place wherever it is readable: q, k, v as views of a packed projection, with
  out and dout dense.

GQA runs natively (a call has ``h`` query heads and ``h / g`` kv heads). Ops that set ``padding_masks`` also take
each call's rows before the padding (``used=``, ``(B',)`` int32, counted from the mask's view of the call's keys),
and the kernel then takes padding masks (``protocol.py``) on local patterns.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import torch

from .. import caches
from ..callers import user_stacklevel
from ..merge import add_into_, merge_pattern_
from ..patterns import PatternPlan
from ..views import layout_key, new_grad_parts
from .cudnn_calls import (_adopt, _backward_calls, _compact_4d, _forward_calls, _Group, _groups, _padding, _singles,
                          _stacks)
from .protocol import CallSpec, Grads, PatternKernelBase, Result, Saved, clear_grads_


def check_causal_block(block: int) -> int:
    """``block`` if it is a valid ``causal_block`` (an int >= 0), else ``ValueError``/``TypeError``."""
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"causal_block must be an int (0: never split), got {type(block).__name__}")
    if block < 0:
        raise ValueError(f"causal_block must be >= 0 (0: never split), got {block}")
    return block


class AttentionOps(ABC):
    """Softmax attention, forward and backward, on 4D ``(B', h, M, D)`` views (``B'``: the calls' stacked batch,
    ``h`` query heads, ``h / g`` kv heads): what ``ViewKernel`` runs a pattern's calls on.

    A subclass sets ``name`` and ``deterministic_backward`` (the kernel's) and may change the defaults below."""

    name: str
    deterministic_backward: bool  # the same inputs give bitwise-equal gradients on every run
    own_strides: bool = False  # out/dout may have strides of their own (else they must have q's: ``ViewKernel``)
    padding_masks: bool = False  # forward/backward take ``used=`` (module doc): the kernel takes padding masks
    stacks_patterns: bool = True  # local dilated patterns run stacked as one dense pattern (``stacking.py``)
    lse_neginf: float | None = None  # what an uncovered row's lse (-inf) becomes in the backward's packed copy

    @abstractmethod
    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """``None`` if these ops can run on inputs like these (``(B, N, H, D)``), else the reason they cannot."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                out: torch.Tensor | None = None, **used) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: ``(B', h, M, D)`` and ``lse`` ``(B', h, M)`` fp32 (a trailing unit dim allowed).
        ``out``: a view shaped like q the ops may write the result to (and return); ``used``: module doc."""

    @abstractmethod
    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse4: torch.Tensor, *, causal: bool, scale: float, into: tuple[torch.Tensor, ...] | None = None,
                 **used) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` shaped like q, k, v from the final ``out`` and packed ``lse4`` ``(B', h, M, 1)`` fp32.
        ``into``: views the ops may write them to (and return); ``used``: module doc."""


# ---------------------------------------------------------------------------
# Stacked calls the ops refused

# Configurations where the ops refused a call stacking several chunks: they run chunk by
# chunk from then on (the same choice every time, so results stay reproducible).
_REFUSED = caches.keys("cudnn.refused", 1024)
# Configurations whose stacked backward ran whole once: their calls' gradients are stored as each call
# returns (nothing is redone chunk by chunk after a refusal, so nothing is added twice), which frees each
# call's gradients before the next call allocates its own (a group's calls held all of theirs before).
_PROVEN = caches.keys("cudnn.proven_backward", 1024)


def _config_key(q, k, plan: PatternPlan, packed: bool, causal: bool, ops: str) -> tuple:
    return (ops, plan, packed, causal, layout_key(q), layout_key(k))


def _refuse(key: tuple, exc: BaseException, name: str) -> None:
    if key not in _REFUSED:
        _REFUSED.add(key)
        warnings.warn(f"{name} kernel: the op refused a call stacking head chunks ({str(exc)[:300]}); "
                      f"running this configuration chunk by chunk", stacklevel=user_stacklevel())


class ViewKernel(PatternKernelBase):
    """``PatternKernel`` on ``AttentionOps`` with zero-copy strided views (see module doc)."""

    key_masks = False  # masked work runs on the fused kernel (AutoKernel routes it there)

    def __init__(self, ops: AttentionOps, *, grads: tuple[str, ...] = ("dq", "dk", "dv"),
                 causal_block: int = 0) -> None:
        """``grads``: which gradients the backward adds (``cudnn.CudnnDkdvKernel`` keeps dK/dV only).
        Name and determinism are the ops'. ``causal_block``: causal squares of more than four times this many
        dilated rows are split into causal blocks of at most this many and non-causal rectangles by the strategy
        (``protocol.py``); 0: never."""
        if not isinstance(ops, AttentionOps):
            raise TypeError(f"ops must be an AttentionOps (kernels/view_kernel.py), got {type(ops).__name__}")
        self.causal_block = check_causal_block(causal_block)
        self.ops = ops
        self.name = ops.name
        self.deterministic_backward = ops.deterministic_backward
        # padding masks (``protocol.py``) where the ops take each call's unpadded rows (``used=``): flash-attn-4's
        self.padding_masks = ops.padding_masks
        # the ops plan every tensor's strides: out/dout need not have q's to be read in place
        self.own_strides = ops.own_strides
        # what an uncovered row's lse (-inf) becomes in the packed copy each backward call reads (the ops' rule)
        self.lse_neginf = ops.lse_neginf
        bad = [g for g in grads if g not in ("dq", "dk", "dv")]
        if bad or not grads:
            raise ValueError(f"grads must be a non-empty subset of ('dq', 'dk', 'dv'), got {grads}")
        self.grads = tuple(grads)

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        reason = self.ops.supports(q, k)
        if reason is not None:
            return reason
        if q.dim() != 4 or k.dim() != 4:
            return f"expects (B, N, H, D) inputs, got shapes {tuple(q.shape)} and {tuple(k.shape)}"
        if k.dtype != q.dtype or k.device != q.device:
            return f"q and k must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}"
        dim = q.shape[-1]
        if dim % 8 or not 8 <= dim <= 256 or k.shape[-1] != dim:
            return f"head dim must be a multiple of 8 in [8, 256] (equal for q and k), got {dim} and {k.shape[-1]}"
        return None

    def _check(self, q, k) -> None:
        reason = self.supports(q, k)
        if reason is not None:
            raise ValueError(f"{self.name} kernel cannot run: {reason}")

    @staticmethod
    def _kv_role(packed: bool) -> str:
        return "packed" if packed else "kv"

    def _geometry(self, q, k, plan: PatternPlan, packed: bool) -> None:
        n, w, r = q.shape[1], plan.local_segment, plan.dilation
        if n % w or w % r:
            raise ValueError(f"plan segment {w} / dilation {r} do not tile {n} local rows")
        if packed and (k.shape[1] != n // r or n != w):
            raise ValueError(f"packed k must have L // r = {n // r} rows and one local segment, "
                             f"got {k.shape[1]} rows and segment {w} of {n}")

    def _check_mask(self, key_mask: torch.Tensor | None, q: torch.Tensor, packed: bool) -> None:
        """A key mask is taken only as a padding mask (``protocol.py``), on local patterns, by ops that take it."""
        if key_mask is None:
            return
        if not self.padding_masks:
            raise ValueError(f"{self.name} kernel takes no key mask; run masked calls on kernel='fused' or 'reference'")
        if packed:
            raise ValueError(f"{self.name} kernel takes padding masks on local patterns only, not on ring buffers; "
                             f"run masked ring calls on kernel='fused' or 'reference'")
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != tuple(q.shape[:2]):
            raise ValueError(f"key_mask must be a bool (B, L) = {tuple(q.shape[:2])} tensor, got {key_mask.dtype} "
                             f"of shape {tuple(key_mask.shape)}")

    def forward_pattern_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                             spec: CallSpec, running: Result, *, fresh: bool = False) -> None:
        merge_pattern_(*running, plan, *self.forward_pattern(q, k, v, plan, spec), fresh=fresh)

    def forward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                        spec: CallSpec) -> Result:
        self._check(q, k)
        self._geometry(q, k, plan, spec.packed)
        self._check_mask(spec.key_mask, q, spec.packed)
        key = _config_key(q, k, plan, spec.packed, spec.causal, self.name)
        if key in _REFUSED or not _stacks(plan):
            return self._forward(q, k, v, plan, _singles(plan), spec)
        try:
            return self._forward(q, k, v, plan, _groups(plan), spec)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # the ops refused a stacked call: chunk by chunk (no side effects yet)
            _refuse(key, exc, self.name)
            return self._forward(q, k, v, plan, _singles(plan), spec)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                 groups: tuple[_Group, ...], spec: CallSpec) -> Result:
        bsz, n, heads, dim = q.shape
        shapes = ((bsz, n // plan.dilation, heads, dim), (bsz, n // plan.dilation, heads))
        calls = _forward_calls((q, k, v), plan, groups, self._kv_role(spec.packed), shapes, spec.key_mask)
        buffers = self._buffers(shapes, q) if len(calls) != 1 else None
        tensors = (q, k, v, *(buffers or ()))
        for call in calls:
            nt, tsz = len(call.tsz), call.tsz
            args = [operand.on(tensors) if in_place else _compact_4d(operand.on(tensors), nt)
                    for operand, in_place in call.operands]
            into = call.into.on(tensors) if buffers is not None and call.into is not None else None
            o4, l4 = self.ops.forward(*args, causal=spec.causal, scale=spec.scale, out=into,
                                      **_padding(call.keys, spec.key_mask))
            l4 = l4.reshape(o4.shape[:3])  # some torch versions add a trailing unit dim
            if buffers is None:  # the only call: cuDNN's out (or lse) may be the whole result, no copy
                adopted = [_adopt(x, tsz, call.merged, plan, call.group, shape)
                           for x, shape in ((o4, shapes[0]), (l4, shapes[1]))]
                buffers = tuple(a if a is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
                                for a, x, shape in zip(adopted, (o4, l4), shapes))
                for t, a, x in zip(call.targets, adopted, (o4, l4)):
                    if a is None:
                        t.on((q, k, v, *buffers)).copy_(x.view(*tsz, *x.shape[1:]) if nt else x[0])
                continue
            for t, x in zip(call.targets, (o4, l4)):
                if x is not into:  # (the frontend wrote out in place)
                    t.on(tensors).copy_(x.view(*tsz, *x.shape[1:]) if nt else x[0])
        if buffers is None:  # a plan without chunks
            buffers = self._buffers(shapes, q)
        return buffers

    @staticmethod
    def _buffers(shapes, q):
        return (torch.empty(shapes[0], dtype=q.dtype, device=q.device),
                torch.empty(shapes[1], dtype=torch.float32, device=q.device))

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        """Yes for local patterns: cuDNN's results are compact tensors in the inputs' dtype already."""
        return plan.leaves_parts(direction, k.shape[2]) and (direction == "fwd" or self.grads == ("dq", "dk", "dv"))

    def stacks(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Where the ops gain from it (``AttentionOps.stacks_patterns``): a dilated pattern is a few small calls on
        views, stacked patterns are one (``stacking.py``)."""
        return self.ops.stacks_patterns

    def _check_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, packed: bool,
                        saved: Saved, grads: Grads | tuple[()] = ()) -> None:
        self._check(q, k)
        self._geometry(q, k, plan, packed)
        out, lse, dout = saved
        named = (("out", out, q), ("dout", dout, q), ("v", v, k), *zip(("dq", "dk", "dv"), grads, (q, k, k)))
        for name, x, like in named:
            if tuple(x.shape) != tuple(like.shape):
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(like.shape)}")
        if tuple(lse.shape) != tuple(q.shape[:3]):
            raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {tuple(q.shape[:3])}")

    def backward_pattern(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                         spec: CallSpec, saved: Saved, grads: Grads, *, fresh: bool = False) -> None:
        packed = spec.packed
        self._check_backward(q, k, v, plan, packed, saved, grads)
        self._check_mask(spec.key_mask, q, packed)
        mine = tuple(g for name, g in zip(("dq", "dk", "dv"), grads) if name in self.grads)
        # fresh and covering every row and head: cuDNN's gradients are *written* into the accumulators, no
        # fill and no read (a kv head two groups share gets the second one added); otherwise fill, then add
        written: set[int] | None = set() if fresh and not packed and plan.covers_all(q.shape[2], k.shape[2]) else None
        if fresh and written is None:
            clear_grads_(*mine)
        self._backward_groups((q, k, v, *saved, *grads), plan, spec, written, False)

    def backward_pattern_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan,
                               spec: CallSpec, saved: Saved) -> Grads:
        """The pattern's gradients in new compact tensors: cuDNN writes them there (the frontend's backward)
        or they are copied from its results; nothing is accumulated."""
        if spec.packed or not self.parts("bwd", plan, q, k, causal=spec.causal, masked=False):
            raise ValueError(f"{self.name} kernel leaves no backward parts for pattern {plan.index} (a ring, a kv head "
                             f"read at two offsets, or not every gradient): call backward_pattern")
        self._check_backward(q, k, v, plan, False, saved)
        self._check_mask(spec.key_mask, q, False)
        grads = new_grad_parts(q, k, v, plan)
        self._backward_groups((q, k, v, *saved, *grads), plan, spec, None, True)
        return grads

    def _backward_groups(self, tensors: tuple[torch.Tensor, ...], plan: PatternPlan, spec: CallSpec,
                         written: set[int] | None, compact: bool) -> None:
        q, k, out, dout = tensors[0], tensors[1], tensors[3], tensors[5]
        kv = self._kv_role(spec.packed)
        # q, out and dout may be read in place together: out/dout of q's dtype, and of q's strides unless the ops
        # plan every tensor's
        joint = all((self.own_strides or x.stride() == q.stride()) and x.dtype == q.dtype for x in (out, dout))
        key = _config_key(q, k, plan, spec.packed, spec.causal, self.name)
        stacked, proven = key not in _REFUSED, key in _PROVEN
        for g in _groups(plan) if stacked else _singles(plan):
            retry = stacked and not proven and len(g.chunks) > 1  # a refusal would redo it chunk by chunk
            try:
                self._backward_group(tensors, plan, g, kv, joint, spec, written, compact, store_late=retry)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # nothing of this group was stored yet: its chunks one by one
                if not retry:
                    raise
                _refuse(key, exc, self.name)
                for c in g.chunks:
                    self._backward_group(tensors, plan, _Group((c,), (0, 0, 0, 0)), kv, joint, spec, written,
                                         compact)
        if key not in _REFUSED:  # every group ran stacked
            _PROVEN.add(key)

    def _backward_group(self, tensors: tuple[torch.Tensor, ...], plan: PatternPlan, g: _Group, kv: str, joint: bool,
                        spec: CallSpec, written: set[int] | None, compact: bool, store_late: bool = False) -> None:
        """One group's calls, each call's gradients stored as it returns (``store_late``: only once every call
        succeeded). ``written``: the kv heads already holding gradients in a fresh backward (``None``:
        accumulate everything). ``compact``: the targets are compact parts, stored (an op that wrote them in
        place needs no copy). Either way the stores run in the same order on the same values."""
        dtype = tensors[0].dtype
        kv_heads = {h for c in g.chunks for h in range(c.k0, c.k1)}
        first_kv = written is not None and not kv_heads & written

        def store(name: str, target: torch.Tensor, grad: torch.Tensor) -> None:
            if compact:
                target.copy_(grad)
            else:  # each query row and head written once, or added
                add_into_(target, grad, fresh=written is not None and (name == "dq" or first_kv))

        pending = []
        for call in _backward_calls(tensors, plan, g, kv, joint, compact, spec.key_mask):
            nt, tsz = len(call.tsz), call.tsz
            q4, k4, v4, o4, g4 = (operand.on(tensors) if in_place else _compact_4d(operand.on(tensors), nt, dtype)
                                  for operand, in_place in call.operands)
            l4 = _compact_4d(call.lse.on(tensors), nt, torch.float32, self.lse_neginf).unsqueeze(-1)
            into = tuple(operand.on(tensors) for operand in call.into) if call.into is not None else None
            grads = self.ops.backward(g4, q4, k4, v4, o4, l4, causal=spec.causal, scale=spec.scale, into=into,
                                      **_padding(call.keys, spec.key_mask))
            done = [(name, target.on(tensors), grad.view(*tsz, *grad.shape[1:]) if nt else grad[0])
                    for i, ((name, target), grad) in enumerate(zip(call.targets, grads))
                    if name in self.grads and not (into is not None and grad is into[i])]
            del grads
            if store_late:
                pending += done
            else:
                while done:  # popped: no name keeps a stored gradient alive into the next call
                    store(*done.pop(0))
        for item in pending:
            store(*item)
        if written is not None and not compact:
            written |= kv_heads
