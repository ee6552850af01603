"""``torch.library`` custom ops: what ``torch.compile`` sees of ``dilated_attention``.

Under ``torch.compile`` a call is one opaque op, ``dilated_attention::attend``, whose arguments are
tensors and primitives, and its gradient a second one, ``dilated_attention::attend_backward``
(``torch.library.register_autograd``). Both are thin wrappers around the one code path of an eager call
(``planning.prepare``, ``execution.forward`` / ``backward``). At run time they plan the call, agree on it
across ranks, gather key masks and run the rings and all-to-alls, none of which enters the traced graph.
Their fake implementations plan from shapes alone (so invalid shapes raise while tracing) and
return empty tensors.

The forward op returns ``out`` and what the backward needs beyond the op's inputs and ``out``
(``lse``; the gathered key mask; for head-parallel strategies the swapped q/k/v and their output;
the call number that the backward's exchanges and timeout messages name): the eager path saves the same
tensors. ``cu_seqlens`` values are data, read inside the ops at run time (so a compiled graph serves any
document split; the backward op reads them again: one small host copy).

Under ``torch.compile(mode="reduce-overhead")`` a cudagraph tree captures the ops with the code around them and
replays the attention too. It warms a graph up eagerly with allocations routed to the graph's memory pool, and
hands out again, at its next recording, pool memory no graph output holds; so what a call keeps past itself (the
cross-rank stamps' device log and headers, the merges' and the fused kernel's device tables) is allocated in
the library's own pool (``caches.kept``). Packed documents read ``cu_seqlens`` on the host, which a capture
cannot (nor can ``check_calls="always"``'s agreement), and a torch whose allocator does not route to the
innermost pool (``caches.pools_nest``) would put the kept memory in the graph's: those calls trace to a second
pair of ops, ``attend_ungraphed``, tagged ``cudagraph_unsafe``, which inductor runs between its graphs.

A ``CommBackend`` or kernel object travels as a string key into ``_OBJECTS`` (held for the life of
the process, as the compiled graph is); names (``"collective"``, ``"auto"``) travel as themselves. The key is
made at trace time by a function torch.compile assumes constant; torch before 2.13 hands such a function
constants only, so a backend goes in by its ``id`` (found among the live backends), and a kernel object needs
torch 2.13 (before it, pass a kernel name).
"""

from collections.abc import Callable

import torch

from . import caches
from .comm import CommBackend, resolve_comm
from .comm.base import live_backend
from .execution import backward, forward, saved_like
from .planning import CallOptions, prepare, schedule
from .validation import check_flags, check_scale_type

# torch.library.custom_op and register_autograd arrived in torch 2.4; without them a compiled call
# runs the eager path (graph breaks around it).
AVAILABLE = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")
# (a torch without the tag graphs every op: a call that cannot be captured fails loudly there)
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
GRAPHED, UNGRAPHED = "attend", "attend_ungraphed"  # op pairs a cudagraph tree captures, and runs between graphs
_OBJECTS: dict[str, object] = {}
# A forward's call number travels to its backward as a tensor on the call's device (a CPU output would split the
# graph a cudagraph tree captures), and on the host here, by the tensor's address.
_CALL_NUMBERS = caches.table("custom_ops.call_numbers", 4096)
# kept for the life of the process (a compiled graph refers to its entries): listed, never emptied
caches.register("custom_ops.objects", _OBJECTS.__len__)
def _object_key(obj) -> str:
    """``obj``'s registry key, ``obj`` registered under it."""
    key = f"#{type(obj).__name__}@{id(obj):x}"
    _OBJECTS[key] = obj
    return key


def _backend_key(ident: int) -> str:
    """The registry key of the live backend whose ``id()`` is ``ident``."""
    backend = live_backend(ident)
    if backend is None:  # (a CommBackend subclass whose __init__ skipped CommBackend.__init__)
        raise TypeError(f"comm: no live CommBackend has id {ident:#x}; a CommBackend subclass must call "
                        "CommBackend.__init__ (or pass comm by name)")
    return _object_key(backend)


def _pools_nest(index: int | None) -> bool:
    """``caches.pools_nest`` for CUDA device ``index`` (``None``: the current one), asked at trace time."""
    return caches.pools_nest(torch.cuda.current_device() if index is None else index)


def op_name(q: torch.Tensor, cu_seqlens: torch.Tensor | None, comm=None) -> str:
    """The op pair a compiled call traces to: ``GRAPHED`` where a cudagraph tree may capture it (not with packed
    documents or ``check_calls="always"``, whose host reads a capture forbids)."""
    host_reads = cu_seqlens is not None or getattr(comm, "check_calls", None) == "always"
    graphable = not host_reads and (not q.is_cuda or _pools_nest(q.device.index))
    return GRAPHED if graphable else UNGRAPHED


def _assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)``: the mark it sets, without importing Dynamo, which costs a
    second at import and, imported after ``init_process_group``, keeps the default group alive past
    ``destroy_process_group`` (tests/test_compile.py checks that the mark is the one torch sets)."""
    fn._dynamo_marked_constant = True
    return fn


if AVAILABLE:
    _pools_nest = _assume_constant_result(_pools_nest)
    # Run at trace time (the registry write must happen before the graph runs), result baked in; Dynamo
    # guards on the objects themselves (``id`` included), so another backend or kernel recompiles. A backend
    # goes in by its id: torch < 2.13 cannot hand an assumed-constant function an object, only constants.
    _object_key = _assume_constant_result(_object_key)
    _backend_key = _assume_constant_result(_backend_key)


def _key(obj) -> str:
    """A primitive standing for ``obj``: ``""`` for None, a name as itself, an object by a registry key."""
    if obj is None:
        return ""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, CommBackend):
        return _backend_key(id(obj))
    return _object_key(obj)


def _lookup(key: str):
    return None if key == "" else _OBJECTS.get(key, key)


def _options(segment_lengths, dilation_rates, mode, causal, softmax_scale, pad_to_segments, head_offsets, strategy,
             kernel, layout, key_padding_mask, cu_seqlens) -> CallOptions:
    """The op's flat arguments as the call's options (``kernel`` looked up from its key)."""
    return CallOptions(segment_lengths, dilation_rates, mode, causal, softmax_scale, key_padding_mask, cu_seqlens,
                       pad_to_segments, head_offsets, strategy, _lookup(kernel), layout)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, options: CallOptions) -> torch.Tensor:
    """``dilated_attention`` under ``torch.compile``: the op call (traced), everything else inside it."""
    (segment_lengths, dilation_rates, mode, causal, softmax_scale, key_padding_mask, cu_seqlens, pad_to_segments,
     head_offsets, strategy, kernel, layout) = options
    # Type errors the op's schema would blur (a bool is not a scale; an int is not a flag), as eager raises them.
    check_flags(causal, pad_to_segments, strategy, layout)
    check_scale_type(softmax_scale)
    softmax_scale = None if softmax_scale is None else float(softmax_scale)
    for name, t in (("key_padding_mask", key_padding_mask), ("cu_seqlens", cu_seqlens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if comm is not None and not isinstance(comm, (str, CommBackend)):
        resolve_comm(comm)  # raises its TypeError
    requires_grad = [torch.is_grad_enabled() and t.requires_grad for t in (q, k, v)]
    op = getattr(torch.ops.dilated_attention, op_name(q, cu_seqlens, comm))
    out, _ = op(
        q, k, v, key_padding_mask, cu_seqlens, list(segment_lengths), list(dilation_rates), mode, causal,
        softmax_scale, pad_to_segments, head_offsets, _key(comm), strategy, _key(kernel), layout, requires_grad)
    return out


def _attend_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None, segment_lengths: list[int], dilation_rates: list[int], mode: str,
                 causal: bool, softmax_scale: float | None, pad_to_segments: bool, head_offsets: str, comm: str,
                 strategy: str, kernel: str, layout: str, requires_grad: list[bool]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    options = _options(segment_lengths, dilation_rates, mode, causal, softmax_scale, pad_to_segments, head_offsets,
                       strategy, kernel, layout, key_padding_mask, cu_seqlens)
    backend = resolve_comm(_lookup(comm))
    spec, call = prepare(q, k, v, backend, requires_grad, options)
    out, saved = forward(spec, call, q, k, v, key_padding_mask)
    number = torch.full((), call, dtype=torch.int64, device=q.device)
    _CALL_NUMBERS[number.data_ptr()] = call
    # Contiguous, as the fake implementation promises (inductor asserts output strides).
    return out.contiguous(), [t.contiguous() for t in saved] + [number]


def _attend_fake(q, k, v, key_padding_mask, cu_seqlens, segment_lengths, dilation_rates, mode, causal,
                 softmax_scale, pad_to_segments, head_offsets, comm, strategy, kernel, layout, requires_grad):
    options = _options(segment_lengths, dilation_rates, mode, causal, softmax_scale, pad_to_segments, head_offsets,
                       strategy, kernel, layout, key_padding_mask, cu_seqlens)
    spec = schedule(q, k, v, resolve_comm(_lookup(comm)), options, shapes_only=True)
    saved = saved_like(spec, q, k, key_padding_mask)
    return q.new_empty(q.shape), saved + [torch.empty((), dtype=torch.int64, device=q.device)]


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   key_padding_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, out: torch.Tensor,
                   saved: list[torch.Tensor], segment_lengths: list[int], dilation_rates: list[int], mode: str,
                   causal: bool, softmax_scale: float | None, pad_to_segments: bool, head_offsets: str, comm: str,
                   strategy: str, kernel: str, layout: str, requires_grad: list[bool]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(segment_lengths, dilation_rates, mode, causal, softmax_scale, pad_to_segments, head_offsets,
                       strategy, kernel, layout, key_padding_mask, cu_seqlens)
    # The forward planned this call successfully: the same plan (no new agreement, no debug record).
    spec = schedule(q, k, v, resolve_comm(_lookup(comm)), options, record=False)
    grads = backward(spec, _call_number(saved[-1]), q, k, v, key_padding_mask, (out, saved[:-1], dout))
    return tuple(g.contiguous() for g in grads)


def _backward_fake(dout, q, k, v, key_padding_mask, cu_seqlens, out, saved, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _call_number(number: torch.Tensor) -> int:
    """The forward's call number, which the backward's exchanges and messages name: read on the host from
    ``_CALL_NUMBERS`` (reading the device would wait for it), else from ``number`` (outside a capture)."""
    known = _CALL_NUMBERS.get(number.data_ptr())
    if known is not None:
        return known
    return 0 if caches.capturing() else int(number)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, key_padding_mask, cu_seqlens, *options = inputs
    out, saved = output
    ctx.save_for_backward(q, k, v, key_padding_mask, cu_seqlens, out, *saved)
    ctx.options = options


def _register(name: str, tags: tuple) -> None:
    """The op pair ``dilated_attention::{name}`` and ``{name}_backward`` (one implementation, ``tags``)."""
    torch.library.custom_op(f"dilated_attention::{name}", mutates_args=(), tags=tags)(_attend_impl) \
        .register_fake(_attend_fake)
    torch.library.custom_op(f"dilated_attention::{name}_backward", mutates_args=(), tags=tags)(_backward_impl) \
        .register_fake(_backward_fake)
    backward = getattr(torch.ops.dilated_attention, f"{name}_backward")

    def grad(ctx, dout, _saved_grads):
        q, k, v, key_padding_mask, cu_seqlens, out, *saved = ctx.saved_tensors
        grads = backward(dout, q, k, v, key_padding_mask, cu_seqlens, out, saved, *ctx.options)
        return (*grads, None, None) + (None,) * len(ctx.options)

    torch.library.register_autograd(f"dilated_attention::{name}", grad, setup_context=_setup_context)


if AVAILABLE:
    _register(GRAPHED, ())
    _register(UNGRAPHED, _TAGS)
