"""The two declared kernel interfaces, and the layouts they exchange.

``PatternKernel`` is what strategies (ring, head-parallel) call: all heads of
one pattern on one block, in one go. ``dispatch.select_kernel`` always returns
one: the fused and cuDNN kernels implement it natively (one launch or a few per
pattern), and any ``BlockKernel`` is wrapped in ``chunk_loop.ChunkLoop``, which
drives it chunk by chunk on strided views. A kernel that changes another one
(routing, checks, failure handling) derives from ``wrapper.KernelWrapper``.

``BlockKernel``: a kernel computes softmax attention of one block: ``(q, k, v) -> (out, lse)``.

* ``q``: ``(B, S, M, Hq, D)``; ``k``, ``v``: ``(B, S, Mk, Hk, D)`` with ``Hq % Hk == 0``
  (query head ``i`` reads kv head ``i // (Hq // Hk)``). They are usually strided
  views (dilated rows, head slices) of larger tensors: a kernel either reads them
  through their strides or copies them itself.
* ``causal``: key ``j`` visible to query ``i`` iff ``j <= i`` (needs ``M == Mk``).
* ``out``: ``(B, S, M, Hq, D)`` in ``q.dtype``; ``lse``: ``(B, S, M, Hq)`` fp32,
  natural log, ``-inf`` for a row with no visible key (``out`` is 0 there).
* ``key_mask`` (only given to kernels with ``key_masks = True``): ``None`` or a bool
  ``(B, S, Mk)`` view, ``True`` = that key is excluded (padding); its score is ``-inf``.
* ``backward`` gets the *final* merged ``out`` and ``lse`` of the whole dilated
  attention (not this block's), so ``delta = rowsum(dout * out)`` and
  ``P = exp(s - lse)`` make each block's gradient exact for the merged result.
  It returns ``dq``, ``dk``, ``dv`` (fp32 or input dtype) shaped like q, k, v. The final
  ``lse`` is ``-inf`` for a row with no visible key in any pattern: such rows add nothing.

``PatternKernel`` layouts (``L`` local rows, ``r`` dilation, ``w`` = ``plan.local_segment``,
``M = w // r``, head ``h`` of chunk ``c`` uses offset ``c.offset``):

* Every computing method takes ``(q, k, v, plan, spec)`` first: ``spec``, a ``CallSpec``, says how the call scores
  its keys (``causal``, ``scale``, ``packed``, ``key_mask``); the results it merges into or adds into, and the
  final results a backward reads, come as tuples after it (``running``, ``saved``, ``grads``).
* ``q``: ``(B, L, H, D)`` local queries.
* ``k``, ``v``: ``spec.packed`` False: local ``(B, L, Hk, D)``, dilated on the fly;
  True: a ring buffer half ``(B, L // r, Hp, D)`` from ``views.pack_kv``.
* ``forward_pattern_into`` merges the pattern into the running fp32 ``running = (out, lse)`` in full
  layout (ring steps); ``forward_pattern`` returns it alone in *compact* layout (local patterns' parts): ``out``
  ``(B, L // r, H, D)`` and ``lse`` ``(B, L // r, H)`` fp32 where row
  ``s * M + j`` of head ``h`` is local position ``s * w + offset(h) + r * j``.
  Heads outside the plan's chunks are left unspecified.
* ``spec.key_mask`` (not ``None`` only for kernels with ``key_masks = True``, or padding masks: below): ``None``
  or a bool ``(B, Lk)`` in the *full* layout of the key block, ``True`` = excluded: the local length for
  ``packed=False``, ``L`` (the sender's rows) for ``packed=True``; key row ``j`` of segment ``s`` read with
  offset ``o`` is position ``s * w + o + r * j`` either way.
* A *padding mask* is a ``key_mask`` of one form, on local patterns (``packed=False``): in each
  batch row, the excluded keys are the rows from some position on, and those rows are padding
  whose results the caller discards (packed documents and segment padding, which the library
  makes itself: ``batching.py``). Every dilated view of such a mask keeps a prefix of its keys,
  so a kernel can take it as per-view lengths. A kernel with ``key_masks = False`` may set
  ``padding_masks = True`` to take padding masks only (a kernel with ``key_masks`` takes them whatever it
  says: ``takes_padding_masks``); it may leave the padding rows' results (out, lse, gradients) unspecified.
* backward takes the final merged ``saved = (out, lse, dout)`` in full layout
  (``(B, L, H, D)``, ``(B, L, H)``) and *adds* into fp32 accumulators ``grads = (dq, dk, dv)``, ``dq``
  (full layout) and ``dk``/``dv`` (same layout as ``k``/``v``), or (``backward_pattern_parts``,
  local patterns) returns them in compact layout in the inputs' dtype, ``dk``/``dv`` ``(B, L // r, Hk, D)``.
* ``parts`` says, per local pattern and direction, which of the two a strategy calls: compact parts
  are combined in one pass at the end (``merge.combine_results``/``sum_grads``). A part is a new tensor
  the caller owns: the combine may write the call's result over a rate-1 part (``merge._reused``).
* ``split_block`` answers, per pattern and direction, the causal block of the kernel that runs that pattern's
  causal calls (0: none; ``PatternKernelBase.causal_block`` by default): a kernel whose causal calls are slow on long
  squares sets ``causal_block = b > 0``, and the strategy then splits a causal square of more than
  ``routes.Tuning.whole_blocks * b`` dilated rows into one causal call of its diagonal blocks (at most ``b`` rows
  each) and non-causal calls of the rectangles below them (``ring/square_split.py``), each an ordinary call on views.
* ``stacks`` answers whether local dilated patterns run stacked as one dense pattern (``ring/stacking.py``): kernels
  whose calls on strided views cost more than copying the rows (cuDNN's, flash-attn-4's) say yes.

Members: ``PatternKernel`` declares every member a strategy reads. ``padding_masks``, ``split_block`` and
``stacks`` are optional for a kernel written on its own: ``PatternKernelBase`` gives them their defaults (no
padding masks beyond ``key_masks``, no causal split, no stacking), and a kernel that implements only the required
members (``REQUIRED_MEMBERS``) is given them by ``wrapper.declared`` where it enters (``select_kernel``, a
wrapper). A kernel that changes another one derives from ``wrapper.KernelWrapper``, which answers the optional
members for the kernel it would run (its ``target``), so nothing unwraps a wrapper.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..patterns import PatternPlan


@runtime_checkable
class BlockKernel(Protocol):
    name: str
    key_masks: bool  # accepts ``key_mask=`` (key padding, packed documents)
    deterministic_backward: bool  # the same inputs give bitwise-equal gradients on every run

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """``None`` if this kernel can run on these inputs, else the reason it cannot."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class CallSpec(NamedTuple):
    """How one pattern call scores its keys: what every computing method of ``PatternKernel`` takes after
    ``(q, k, v, plan)`` (layouts in the module doc). A caller makes one per call, or one for all the calls of a
    block that score alike."""

    causal: bool  # key ``j`` visible to query ``i`` iff ``j <= i`` (the pattern's dilated rows)
    scale: float  # the softmax scale
    packed: bool = False  # ``k``/``v`` are a ring buffer half (``views.pack_kv``), else local rows dilated on the fly
    key_mask: torch.Tensor | None = None  # bool ``(B, Lk)``, ``True`` = excluded; ``None``: no key excluded


Result = tuple[torch.Tensor, torch.Tensor]  # ``(out, lse)``
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ``(dq, dk, dv)``
Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the final merged ``(out, lse, dout)`` a backward reads


@runtime_checkable
class PatternKernel(Protocol):
    """All heads of one pattern on one (local or ring) block: every member a strategy reads (layouts, and which
    members are optional, in the module doc)."""

    name: str
    key_masks: bool  # accepts ``key_mask=`` (see the module doc)
    padding_masks: bool  # accepts padding masks (module doc) even where ``key_masks`` is False
    deterministic_backward: bool  # the same inputs give bitwise-equal gradients on every run

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """``None`` if this kernel can run on these inputs, else the reason it cannot."""

    def split_block(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor) -> int:
        """The causal block (module doc) of ``plan``'s causal calls in ``direction`` (``"fwd"``/``"bwd"``); 0: the
        strategy splits no causal square."""

    def stacks(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether local dilated patterns run stacked as the one dense pattern ``plan`` in ``direction``
        (``ring/stacking.py``)."""

    def forward_pattern(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, spec: CallSpec,
    ) -> Result:
        """The pattern's ``(out, lse)`` alone, in compact layout (module doc)."""

    def forward_pattern_into(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, spec: CallSpec,
        running: Result, *, fresh: bool = False,
    ) -> None:
        """``forward_pattern`` merged into the running fp32 result ``running = (out, lse)``, ``(B, L, H, D)`` and
        ``(B, L, H)`` (full layout), in place: what ring steps, and local patterns that leave no part, call.
        ``fresh``: ``out``/``lse`` hold no result yet (their contents are ignored, as if 0 and ``-inf``);
        callers pass it only for a pattern that ``covers_all`` heads, which may then write instead of merge
        (no fill, no read)."""

    def backward_pattern(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, spec: CallSpec,
        saved: Saved, grads: Grads, *, fresh: bool = False,
    ) -> None:
        """Adds this pattern's gradients for the final ``saved = (out, lse, dout)`` into ``grads = (dq, dk, dv)``.
        ``fresh``: they hold nothing yet (contents ignored, as if zeros); only for a pattern that ``covers_all``
        heads."""

    def parts(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
              masked: bool) -> bool:
        """Whether this local pattern's result in ``direction`` (``"fwd"``/``"bwd"``) comes as a compact part
        (``forward_pattern`` / ``backward_pattern_parts``) that the strategy combines with the other patterns'
        in one pass at the end (``merge.combine_results``/``sum_grads``), rather than merged into the running
        result in place (``forward_pattern_into`` / ``backward_pattern``). A kernel that accumulates in its
        epilogue says no; it may say yes only where ``plan.leaves_parts(direction, ...)``."""

    def backward_pattern_parts(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan, spec: CallSpec, saved: Saved,
    ) -> Grads:
        """This local pattern's ``(dq, dk, dv)`` in compact layout ``(B, L // r, heads, D)`` (kv heads for dk/dv),
        in the inputs' dtype; called only where ``parts("bwd", ...)`` said yes (others raise ``ValueError``)."""


class PatternKernelBase:
    """``PatternKernel``'s optional members at their defaults: a kernel class derives from it and implements the
    required ones (``REQUIRED_MEMBERS``), setting only the optional ones it changes."""

    padding_masks: bool = False  # (a kernel with ``key_masks`` takes padding masks whatever this says)
    causal_block: int = 0  # what ``split_block`` answers: 0, never split

    def split_block(self, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor) -> int:
        """This kernel's ``causal_block``, for every pattern and direction."""
        return self.causal_block

    def stacks(self, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
        """No: patterns run one by one."""
        return False


def causal_block(kernel: PatternKernel, direction: str, plan: PatternPlan, q: torch.Tensor, k: torch.Tensor) -> int:
    """The causal block (module doc) of the kernel that runs ``plan``'s causal calls in ``direction``; 0: none."""
    return kernel.split_block(direction, plan, q, k)


def stacks(kernel: PatternKernel, direction: str, plan: PatternPlan, causal: bool, q: torch.Tensor,
           k: torch.Tensor) -> bool:
    """Whether local dilated patterns run stacked as the one dense pattern ``plan`` in ``direction``
    (``ring/stacking.py``; module doc)."""
    return kernel.stacks(direction, plan, causal, q, k)


def takes_padding_masks(kernel: PatternKernel) -> bool:
    """Whether ``kernel`` takes padding masks (module doc): any kernel with ``key_masks``, and those that say so."""
    return kernel.key_masks or kernel.padding_masks


def takes_masks(kernel: PatternKernel, padding_only: bool) -> bool:
    """Whether ``kernel`` takes a call's key masks: any (``key_masks``), or padding masks only
    (``padding_masks``) where the call's masks are all padding."""
    return kernel.key_masks or (padding_only and kernel.padding_masks)


# What every PatternKernel has (named in select_kernel's error for an object that implements only part of it),
# and what ``PatternKernelBase`` (or ``wrapper.declared``) gives one that lacks it
REQUIRED_MEMBERS = ("name", "key_masks", "deterministic_backward", "supports", "forward_pattern",
                    "forward_pattern_into", "backward_pattern", "parts", "backward_pattern_parts")
OPTIONAL_MEMBERS = ("padding_masks", "split_block", "stacks")


class Op(str, Enum):
    """A computing method of ``PatternKernel``, as a wrapper sees each call (``wrapper.KernelWrapper.call``);
    equal to the method's name."""

    FORWARD = "forward_pattern"
    FORWARD_INTO = "forward_pattern_into"
    BACKWARD = "backward_pattern"
    BACKWARD_PARTS = "backward_pattern_parts"

    __str__ = str.__str__  # (the method's name, in messages)
    __format__ = str.__format__


# Each computing method's positional arguments (its one keyword: ``fresh``, of the two that merge or add) and
# direction: what a wrapper sees of every call (``wrapper.KernelWrapper.call``).
CALL_ARGUMENTS = {
    Op.FORWARD: ("q", "k", "v", "plan", "spec"),
    Op.FORWARD_INTO: ("q", "k", "v", "plan", "spec", "running"),
    Op.BACKWARD: ("q", "k", "v", "plan", "spec", "saved", "grads"),
    Op.BACKWARD_PARTS: ("q", "k", "v", "plan", "spec", "saved"),
}
DIRECTION = {Op.FORWARD: "fwd", Op.FORWARD_INTO: "fwd", Op.BACKWARD: "bwd", Op.BACKWARD_PARTS: "bwd"}
# the names of the tensors the tuple arguments hold
_TUPLE_NAMES = {"running": ("out", "lse"), "saved": ("out", "lse", "dout"), "grads": ("dq", "dk", "dv")}


def call_tensors(op: Op, args: tuple) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a call of ``op`` (``args``: its positional arguments), by name: ``q``, ``k``, ``v``, the
    spec's ``key_mask`` if any, then those of ``running``/``saved``/``grads`` (what a wrapper checks or reports)."""
    found = []
    for name, arg in zip(CALL_ARGUMENTS[op], args):
        if name == "spec":
            if arg.key_mask is not None:
                found.append(("key_mask", arg.key_mask))
        elif name in _TUPLE_NAMES:
            found.extend(zip(_TUPLE_NAMES[name], arg))
        elif name != "plan":
            found.append((name, arg))
    return found


def run(op: Op, kernel: PatternKernel, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``kernel``'s method ``op`` called with ``args`` (its positional arguments, ``CALL_ARGUMENTS[op]``) and
    ``kwargs`` (``fresh``, where the caller gave it): how a wrapper passes a call on."""
    match op:
        case Op.FORWARD:
            return kernel.forward_pattern(*args, **kwargs)
        case Op.FORWARD_INTO:
            return kernel.forward_pattern_into(*args, **kwargs)
        case Op.BACKWARD:
            return kernel.backward_pattern(*args, **kwargs)
        case Op.BACKWARD_PARTS:
            return kernel.backward_pattern_parts(*args, **kwargs)
    raise ValueError(f"op must be one of {[o.value for o in Op]}, got {op!r}")


def clear_result_(out: torch.Tensor, lse: torch.Tensor) -> None:
    """The empty running result (0, ``-inf``): what rows no pattern covers hold (``ring/block.py``)."""
    out.zero_()
    lse.fill_(float("-inf"))


def clear_grads_(*grads: torch.Tensor) -> None:
    """Zeroed accumulators: how a kernel without a write-once path honours ``fresh`` in the backward."""
    for g in grads:
        g.zero_()
