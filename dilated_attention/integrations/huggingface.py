"""Hugging Face Transformers: dilated attention as an ``attn_implementation``.

::

    from transformers import AutoModelForCausalLM, LlamaConfig
    from dilated_attention.integrations.huggingface import register_dilated_attention

    name = register_dilated_attention(segment_lengths=[2048, 8192], dilation_rates=[1, 2])
    model = AutoModelForCausalLM.from_config(LlamaConfig(...), attn_implementation=name)
    # or AutoModelForCausalLM.from_pretrained(path, attn_implementation=name), or model.set_attn_implementation(name)

Every model whose attention layers go through transformers' ``AttentionInterface``
(Llama, Qwen2/3, Mistral without sliding window, ...) then computes
``dilated_attention`` with the registered patterns in each layer: the model's
own ``scaling`` and causal flag, its GQA heads as they are (no ``repeat_kv``).

Padding: a 2D ``attention_mask`` (1 = token, 0 = padding; left or right) becomes
``key_padding_mask``; padded rows' outputs are whatever the model makes of a
zero attention output (ignore them, as for every implementation). With ``comm``
each rank passes its shard of the mask (``shard_sequence(mask, comm)``), kept
even where that shard has no padding so that the ranks agree on the call.

Packed documents (padding-free training, transformers' ``DataCollatorWithFlattening``):
the documents of a row are found as flash-attention does in transformers, and
each runs alone (``dilated_attention(..., cu_seqlens=...)``: segments restart at
its first token, nothing attends across a boundary):

* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments of the model call
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``; offsets into
  the flattened ``batch * seq_len`` tokens) are used as they are, else
* without a padding ``attention_mask``, a document starts wherever ``position_ids``
  do not continue (``position_ids[t] != position_ids[t - 1] + 1``: the rule of
  transformers' packed-sequence masks, so the result equals its ``sdpa`` run on
  each document alone). Rows of a batch larger than one are documents too.

Sequence parallel: register with ``comm=`` (a backend name or object); every rank
of the group feeds its shard of the sequence and the shard's *global* positions,
``model(input_ids=shard_sequence(ids, comm), position_ids=shard_positions(N, comm)[None])``,
then sums parameter gradients over the group (``all_reduce_gradients``) before
the optimizer step. Logits, loss and gradients equal single-device training.
Packed documents under sequence parallelism: one row (batch 1), each rank feeds
its slice of the packed ``position_ids`` (``shard_sequence(position_ids, comm)``),
and either the global document offsets, the same on every rank, as
``cu_seq_lens_q=cu_seq_lens_k=cu`` (int32, ``[0, ..., N]``), or nothing more:
where the positions restart, the ranks gather every shard's positions (one
all-gather per new ``position_ids`` tensor) and find the documents on the whole
row. A shard past the first that starts at position 0 while no shard restarts
inside is taken for local positions fed by mistake, and every rank raises a
``ValueError`` saying so. Documents run on every strategy (the ring deals each
one over the ranks).

What the attention cannot do raises a ``ValueError`` naming it: attention-weight
dropout (``config.attention_dropout`` must be 0), a KV cache that makes the key
length differ from the query length (generation: pass ``use_cache=False`` for
training and prefill), 4D or custom masks, sliding-window / chunked / soft-capping
/ sink attention, ``cu_seq_lens_q != cu_seq_lens_k``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import caches
from ..comm import CommBackend, resolve_comm
from ..distributed import shard_indices
from ..functional import dilated_attention

# Arguments of dilated_attention that this adapter sets from the model's call; every other
# keyword (mode, kernel, head_offsets, ...) may be fixed at registration.
_SET_PER_CALL = {"q", "k", "v", "segment_lengths", "dilation_rates", "causal", "softmax_scale", "comm",
                 "key_padding_mask", "cu_seqlens"}
# Keyword arguments transformers passes for features a dilated pattern cannot express (None = not in use).
_UNSUPPORTED = {"sliding_window": "sliding-window attention", "softcap": "attention logit soft-capping",
                "s_aux": "attention sinks"}
_HASH_MOD = (1 << 61) - 1  # positions of a batch's rows in one int64 (exact for one row)
_HASH_BASE = 1_000_003


class _PerTensor:
    """One cached result per ``position_ids`` tensor (the model passes the same tensor to every layer):
    the host reads (and, with ``comm``, the gather) happen once per forward, not once per layer."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, tuple, Any, tuple | None] | None = None

    def get(self, t: torch.Tensor, key: tuple, compute: Callable[[], Any], also: torch.Tensor | None = None) -> Any:
        """``compute()``, or its result for the same tensor ``t`` (unchanged since) and ``key``. ``also``: another
        tensor the result reads, matched the same way (by identity: a dead tensor's ``id`` is reused)."""
        entry = self._entry
        if entry is not None and _same(entry[0], t) and entry[1] == key and _same(entry[3], also):
            return entry[2]
        value = compute()
        self._entry = (_tracked(t), key, value, _tracked(also))
        return value


def _tracked(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (weakref.ref(t), t._version)


def _same(tracked: tuple | None, t: torch.Tensor | None) -> bool:
    """Whether ``t`` is the tensor ``tracked`` names, unchanged since (or both are absent)."""
    if tracked is None or t is None:
        return tracked is None and t is None
    return tracked[0]() is t and tracked[1] == t._version


def _as_rows(position_ids: Any, bsz: int, n: int) -> torch.Tensor | None:
    """``position_ids`` as ``(bsz, n)``, or ``None`` when absent or shaped otherwise (e.g. multimodal RoPE)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point():
        return None
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[1] != n or position_ids.shape[0] not in (1, bsz):
        return None
    return position_ids.expand(bsz, n)


def _breaks(rows: torch.Tensor) -> torch.Tensor:
    """``(B, N)`` bool: where the positions do not continue the previous token's (a document starts)."""
    out = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    out[:, 1:] = rows[:, 1:] != rows[:, :-1] + 1
    return out


def _offsets_from_positions(rows: torch.Tensor) -> torch.Tensor | None:
    """int32 document offsets (host) of the flattened ``(B, N)`` rows, or ``None`` when every row is one document."""
    starts = _breaks(rows)
    starts[:, 0] = True
    flat = starts.flatten().nonzero().flatten().cpu()
    if flat.numel() == rows.shape[0]:
        return None
    return torch.cat([flat, torch.tensor([rows.numel()])]).to(torch.int32)


def _given_offsets(kwargs: dict) -> torch.Tensor | None:
    """The collator's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flash-attention kwargs) as one int32 host tensor."""
    given = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k")]
    given = [torch.as_tensor(t).flatten() for t in given if t is not None]
    if not given:
        return None
    if len(given) == 2 and given[0] is not given[1] and not torch.equal(given[0].cpu(), given[1].cpu()):
        raise ValueError("dilated attention is self-attention over one sequence: cu_seq_lens_q must equal "
                         f"cu_seq_lens_k, got {given[0].tolist()} and {given[1].tolist()}")
    offsets = given[0]
    if offsets.is_floating_point():
        raise ValueError(f"cu_seq_lens_q/cu_seq_lens_k must be integer document offsets, got {offsets.dtype}")
    return offsets.to("cpu", torch.int32)  # read on the host by every call: copied once


def _row_hash(values: list[int]) -> int:
    h = 0
    for x in reversed(values):
        h = (h * _HASH_BASE + x % _HASH_MOD) % _HASH_MOD
    return h


class DilatedAttentionForTransformers:
    """The callable registered in ``AttentionInterface`` (signature of transformers' attention functions).

    ``(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)``
    with ``query`` ``(B, H, N, D)``, ``key``/``value`` ``(B, Hkv, N, D)``; returns
    ``(attn_output (B, N, H, D), None)`` (weights are never materialised).
    """

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 comm: CommBackend | None, options: dict[str, Any]) -> None:
        self.segment_lengths = list(segment_lengths)
        self.dilation_rates = list(dilation_rates)
        self.comm = comm
        self.options = options
        self._per_positions = _PerTensor()
        self._per_offsets = _PerTensor()

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        if dropout:
            raise ValueError(f"dilated attention has no attention-weight dropout (the weights are never "
                             f"materialised), got dropout={dropout}: set config.attention_dropout = 0.0")
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"dilated attention does not support {what} ({name}={kwargs[name]!r})")
        if query.shape[2] != key.shape[2]:
            raise ValueError(
                f"dilated attention needs the whole sequence in every call: query length {query.shape[2]} != "
                f"key length {key.shape[2]} (a KV cache during generation); pass use_cache=False")
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"dilated attention takes only a 2D padding attention_mask (B, N), got shape "
                                 f"{tuple(attention_mask.shape)}")
            key_mask = ~attention_mask.bool()  # transformers: True = attend; ours: True = pad
        bsz, n = query.shape[0], query.shape[2]
        cu_seqlens = self._documents(kwargs, bsz, n, padded=key_mask is not None, like=query)
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)  # transformers' own rule (see its sdpa_attention_forward)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            # as SDPA under autocast: attention runs in the autocast dtype (RoPE leaves q and k in fp32)
            q, k, v = (t.to(torch.get_autocast_dtype(device_type)) for t in (q, k, v))
        if cu_seqlens is not None and bsz > 1:  # documents of every row as one packed row (offsets: flattened)
            q, k, v = (t.reshape(1, bsz * n, *t.shape[2:]) for t in (q, k, v))
            key_mask = None if key_mask is None else key_mask.reshape(1, bsz * n)
        out = dilated_attention(
            q, k, v, self.segment_lengths, self.dilation_rates, causal=causal, softmax_scale=scaling,
            key_padding_mask=key_mask, cu_seqlens=cu_seqlens, comm=self.comm, **self.options,
        )
        return out.reshape(bsz, n, *out.shape[2:]), None

    def _documents(self, kwargs: dict, bsz: int, n: int, padded: bool, like: torch.Tensor) -> torch.Tensor | None:
        """``cu_seqlens`` for this call (``None``: every row is one sequence); with ``comm``, the positions check."""
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if isinstance(cu_q, torch.Tensor) and (cu_k is None or isinstance(cu_k, torch.Tensor)):
            given = self._per_offsets.get(cu_q, ("offsets",), lambda: _given_offsets(kwargs), also=cu_k)
        else:
            given = _given_offsets(kwargs)
        positions = kwargs.get("position_ids")
        rows = _as_rows(positions, bsz, n)
        if self.comm is None:
            if given is not None:
                return given
            if rows is None or padded:  # transformers' masks look for packed documents only without padding
                return None
            return self._per_positions.get(positions, ("docs", bsz, n), lambda: _offsets_from_positions(rows))
        world = self.comm.world_size
        if given is not None:  # the global offsets (the same on every rank): trusted, nothing gathered
            if bsz != 1:
                raise ValueError(f"packed documents with sequence parallelism need one packed row (batch size 1), "
                                 f"got batch size {bsz}")
            if given.numel() < 2 or int(given[-1]) != n * world:
                raise ValueError(
                    f"sequence parallel: cu_seq_lens_q/cu_seq_lens_k must be the global document offsets of the "
                    f"whole packed sequence ({world} shards of {n} = {n * world} tokens, the same on every rank), "
                    f"got offsets ending at {int(given[-1]) if given.numel() else None}")
            return given
        if rows is None:
            return None
        return self._per_positions.get(positions, ("shards", bsz, n, padded),
                                       lambda: self._check_shards(rows, padded, like))

    def _check_shards(self, rows: torch.Tensor, padded: bool, like: torch.Tensor) -> torch.Tensor | None:
        """Sequence parallel without document offsets: the packed row's document offsets, or ``None`` where the
        shards' positions continue each other (one sequence).

        Every rank gathers a summary of every shard (batch size, restarts inside, first and last
        positions) and raises the same verdict, so none is left waiting in the next exchange:
        a shard past the first fed local positions ``0..L-1`` (wrong RoPE, silently). Where the positions
        restart (packed documents), the ranks gather every shard's positions and find the documents on the
        whole row, as on one device.
        """
        backend = self.comm
        first, last = rows[:, 0].tolist(), rows[:, -1].tolist()
        inside = bool(_breaks(rows).any()) if rows.shape[1] > 1 else False
        mine = [rows.shape[0], int(inside), int(all(x == 0 for x in first)),
                _row_hash(first), _row_hash([x + 1 for x in last])]
        table = backend.all_gather(torch.tensor(mine, dtype=torch.int64, device=backend.collective_device(like)),
                                   "position_ids check of the shards").cpu().tolist()
        if len({row[0] for row in table}) != 1:
            raise ValueError(f"sequence parallel: the ranks' batch sizes differ ({[row[0] for row in table]})")
        crossed = [r for r in range(1, len(table)) if table[r][3] != table[r - 1][4]]  # position breaks at a shard
        inside_ranks = [r for r, row in enumerate(table) if row[1]]
        local = [r for r in crossed if table[r][2]]
        if local and not inside_ranks:  # (in a packed row a rank may start with a document)
            raise ValueError(
                f"sequence parallel: rank(s) {local} got position_ids starting at 0, but their shards start "
                "further into the sequence; pass position_ids=shard_positions(seq_len, comm)[None] "
                "(dilated_attention.distributed). If packed documents start there, pass their global offsets as "
                "cu_seq_lens_q=cu_seq_lens_k=<int32 [0, ..., seq_len], the same on every rank> to the model call")
        if padded or not (inside_ranks or crossed):  # (transformers looks for documents only without padding)
            return None
        if rows.shape[0] != 1:
            raise ValueError(f"packed documents with sequence parallelism need one packed row (batch size 1), got "
                             f"batch size {rows.shape[0]}")
        shards = backend.all_gather(rows[0].to(torch.int64).to(backend.collective_device(like)),
                                    "position_ids of the packed row's shards").cpu()
        world, n = shards.shape
        whole = torch.empty(world * n, dtype=torch.int64)
        for rank in range(world):
            whole[shard_indices(world * n, world, rank, self.options.get("layout", "contiguous"))] = shards[rank]
        return _offsets_from_positions(whole[None])


# The oldest and newest minor releases tested: the attention and mask interfaces exist from 5.0 on, and the
# mask compositions of every release between are recognised below. Older releases raise, newer ones warn.
TESTED_TRANSFORMERS = ("5.0", "5.25")
SUPPORTED_TRANSFORMERS = "transformers>=5.0,<5.26"  # the pip requirement of those releases (the hf extra)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _version_note() -> str:
    oldest, newest = TESTED_TRANSFORMERS
    return (f"transformers {_transformers_version()} (this integration supports {oldest} to {newest}; "
            f"install one of those: pip install '{SUPPORTED_TRANSFORMERS}')")


def _cells(fn: Callable) -> dict[str, Any]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


_MASK_CODES: dict | None = None
caches.register("huggingface.mask_codes", lambda: len(_MASK_CODES or ()))  # held: code objects of one release


def _mask_codes() -> dict:
    """The code object of each mask-function factory of ``transformers.masking_utils`` -> what it means.

    transformers composes a layer's mask from small closures (``and_masks``, packed-sequence
    remapping, overlays); their code objects identify them whatever the composition order, which
    changes between releases. A factory a release lacks is simply absent.
    """
    global _MASK_CODES
    if _MASK_CODES is None:
        import transformers.masking_utils as mu

        one = torch.zeros(1, 1, dtype=torch.long)
        base = mu.causal_mask_function
        factories = {  # name of the factory -> (how to build one instance, meaning)
            "and_masks": (lambda f: f(base), "and"),
            "or_masks": (lambda f: f(base), "a custom mask overlay (or_masks)"),
            "remap_positions_for_packed_sequence": (lambda f: f(base, one), "remap"),
            "packed_sequence_mask_function": (lambda f: f(one), "documents"),
            "sliding_window_overlay": (lambda f: f(1), "sliding-window attention"),
            "sliding_window_bidirectional_overlay": (lambda f: f(1), "sliding-window attention"),
            "chunked_overlay": (lambda f: f(1, one[0]), "chunked attention"),
            "blockwise_overlay": (lambda f: f(one), "block-wise attention (block_sequence_ids)"),
            "padding_mask_function": (lambda f: f(one.bool()), "padding"),
        }
        codes: dict = {}
        for name, (build, meaning) in factories.items():
            factory = getattr(mu, name, None)
            if factory is None:
                continue
            try:
                codes[build(factory).__code__] = meaning
            except Exception:  # a factory whose signature changed: unknown, so refused below
                continue
        codes[mu.causal_mask_function.__code__] = "causal"
        codes[mu.bidirectional_mask_function.__code__] = "full"
        _MASK_CODES = codes
    return _MASK_CODES


def check_mask_function(mask_function: Callable | None) -> None:
    """Raise unless ``mask_function`` is causal or full attention, optionally on packed documents.

    Walks transformers' composition of closures; anything else (sliding windows, chunks,
    custom overlays, or a composition this transformers release makes differently) raises a
    ``ValueError`` that names it instead of being dropped silently.
    """
    if mask_function is None:
        return
    codes, stack = _mask_codes(), [mask_function]
    while stack:
        fn = stack.pop()
        meaning = codes.get(getattr(fn, "__code__", None))
        if meaning in ("causal", "full", "documents", "padding"):
            continue
        if meaning == "and":
            parts = _cells(fn).get("mask_functions")
            if isinstance(parts, tuple):
                stack.extend(parts)
                continue
        elif meaning == "remap":
            inner = _cells(fn).get("mask_function")
            if callable(inner):
                stack.append(inner)
                continue
        elif meaning is not None:
            raise ValueError(f"dilated attention can apply only causal or full attention, a 2D padding mask and "
                             f"packed documents; this model's layer asks for {meaning}")
        raise ValueError(
            f"dilated attention cannot tell what this layer's attention mask is: {_version_note()} builds it from "
            f"{getattr(fn, '__qualname__', fn)!r}, which the integration does not recognise")


def _mask_interface(comm: CommBackend | None) -> Callable:
    def padding_only_mask(batch_size: int, q_length: int | None = None, kv_length: int = 0, q_offset: int = 0,
                          kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
                          **kwargs: Any):
        """The mask transformers builds for this attention: ``None``, or the 2D padding mask.

        The query side is not read: early 5.x releases pass it as ``cache_position`` (in ``kwargs``), later
        ones as ``q_length`` and ``q_offset``.

        The causal structure comes from the ``causal`` flag and packed documents from the
        positions (see the attention); any other structure (sliding windows, chunks, overlays)
        changes ``mask_function`` and cannot be honoured, so it raises instead of being dropped
        silently. With ``comm`` a given mask is kept even without padding, so that every rank
        passes one (the ranks must agree on whether a call is masked).
        """
        check_mask_function(mask_function)
        if attention_mask is None:
            return None
        attention_mask = attention_mask[:, -kv_length:]
        if comm is None and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask

    return padding_only_mask


def _check_version() -> None:
    """Refuse releases older than the oldest supported one (no attention interface); warn on newer, untested
    ones."""
    version = _transformers_version()
    try:
        minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:  # a development build: trust the mask check
        return
    tested = [tuple(int(x) for x in v.split(".")) for v in TESTED_TRANSFORMERS]
    if minor < tested[0]:
        raise RuntimeError(f"dilated attention's Hugging Face integration needs a newer {_version_note()}")
    if minor > tested[-1]:
        warnings.warn(f"untested {_version_note()}; a layer whose mask it cannot read raises a ValueError",
                      stacklevel=3)


def register_dilated_attention(
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    comm: str | CommBackend | None = None,
    name: str = "dilated_attention",
    **options: Any,
) -> str:
    """Register dilated attention with transformers under ``name``; returns ``name``.

    Use it as ``attn_implementation=name`` (``from_config``, ``from_pretrained``)
    or ``model.set_attn_implementation(name)``. ``comm``: sequence parallel over
    that backend's group (every rank registers the same settings). ``options``:
    further keywords of ``dilated_attention`` fixed for every layer (``mode``,
    ``kernel``, ``head_offsets``, ...). Registering a name again replaces its
    settings; use one name per setting.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    _check_version()
    if not isinstance(name, str) or not name or name in ("eager", "sdpa", "flex_attention") \
            or name.startswith(("flash_attention", "paged")):
        raise ValueError(f"name must be a new attention implementation name, got {name!r}")
    lengths, rates = list(segment_lengths), list(dilation_rates)
    if not lengths or len(lengths) != len(rates):
        raise ValueError(f"segment_lengths and dilation_rates must be non-empty and of equal length, "
                         f"got {lengths} and {rates}")
    accepted = set(inspect.signature(dilated_attention).parameters) - _SET_PER_CALL
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(f"register_dilated_attention got unsupported keyword(s) {unknown}; "
                        f"accepted: {sorted(accepted)} (causal, scale and masks come from the model)")
    backend = resolve_comm(comm)
    fn = DilatedAttentionForTransformers(lengths, rates, backend, options)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _mask_interface(backend))
    return name


__all__ = ["register_dilated_attention"]
