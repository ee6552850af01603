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

Sequence parallel: register with ``comm=`` (a backend name or object); every rank
of the group feeds its shard of the sequence and the shard's *global* positions,
``model(input_ids=shard_sequence(ids, comm), position_ids=shard_positions(N, comm)[None])``,
then sums parameter gradients over the group (``all_reduce_gradients``) before
the optimizer step. Logits, loss and gradients equal single-device training.

What the attention cannot do raises a ``ValueError`` naming it: attention-weight
dropout (``config.attention_dropout`` must be 0), a KV cache that makes the key
length differ from the query length (generation: pass ``use_cache=False`` for
training and prefill), 4D or custom masks, packed sequences detected from
``position_ids``, sliding-window / soft-capping / sink attention. A 2D padding
``attention_mask`` becomes ``key_padding_mask``.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn

from ..comm import CommBackend, resolve_comm
from ..functional import dilated_attention

# Arguments of dilated_attention that this adapter sets from the model's call; every other
# keyword (mode, kernel, head_offsets, ...) may be fixed at registration.
_SET_PER_CALL = {"q", "k", "v", "segment_lengths", "dilation_rates", "causal", "softmax_scale", "comm",
                 "key_padding_mask", "cu_seqlens"}
# Keyword arguments transformers passes for features a dilated pattern cannot express (None = not in use).
_UNSUPPORTED = {"sliding_window": "sliding-window attention", "softcap": "attention logit soft-capping",
                "s_aux": "attention sinks"}


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
        self._positions_checked = comm is None

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
        extra: dict[str, Any] = {}
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"dilated attention takes only a 2D padding attention_mask (B, N), got shape "
                                 f"{tuple(attention_mask.shape)}")
            extra["key_padding_mask"] = ~attention_mask.bool()  # transformers: True = attend; ours: True = pad
        if not self._positions_checked:
            self._check_positions(kwargs.get("position_ids"), query)
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)  # transformers' own rule (see its sdpa_attention_forward)
        out = dilated_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            self.segment_lengths, self.dilation_rates, causal=causal, softmax_scale=scaling, comm=self.comm,
            **extra, **self.options,
        )
        return out, None

    def _check_positions(self, position_ids: torch.Tensor | None, like: torch.Tensor) -> None:
        """First call with ``comm``: catch a shard fed local positions ``0..L-1`` (wrong RoPE, silently).

        The verdict is gathered so that every rank raises together (none is left waiting in the ring).
        """
        backend = self.comm
        local = (backend.rank > 0 and position_ids is not None
                 and bool((position_ids[..., 0] == 0).all()))
        flags = backend.all_gather(torch.tensor([int(local)], device=backend.collective_device(like)))
        self._positions_checked = True
        if flags.any():
            ranks = [r for r, f in enumerate(flags.flatten().tolist()) if f]
            raise ValueError(
                f"sequence parallel: rank(s) {ranks} got position_ids starting at 0, but their shards start "
                "further into the sequence; pass position_ids=shard_positions(seq_len, comm)[None] "
                "(dilated_attention.distributed)")


def _padding_only_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                       mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """The mask transformers builds for this attention: ``None``, or the 2D padding mask when there is padding.

    The causal structure comes from the ``causal`` flag; any other structure
    (packed sequences, sliding windows, chunks, overlays) changes ``mask_function``
    and cannot be honoured, so it raises instead of being dropped silently.
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, flash_attention_mask

    if mask_function is not None and mask_function not in (causal_mask_function, bidirectional_mask_function):
        raise ValueError(
            "dilated attention can apply only causal or full attention plus a 2D padding mask; this model call "
            "asks for more (packed sequences detected from position_ids, sliding-window or chunked attention, "
            "or a custom mask overlay)")
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                attention_mask=attention_mask)


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
    fn = DilatedAttentionForTransformers(lengths, rates, resolve_comm(comm), options)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _padding_only_mask)
    return name


__all__ = ["register_dilated_attention", "DilatedAttentionForTransformers"]
