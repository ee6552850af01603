"""Sequence-parallel training of a Hugging Face causal LM: the pieces a training loop needs.

Used by ``benchmarks/bench_model.py`` (its timed steps) and ``tests/models/test_train_parity.py``
(K ranks give the loss curve of one device). Every rank of a sequence-parallel group holds a
contiguous shard of each sequence:

* labels are shifted on the *whole* sequence before sharding (``shift_labels``): the last token
  of a shard predicts the first token of the next shard, which that rank never sees;
* the loss of a rank is its share of the mean over the whole sequence, ``sum(CE of its tokens) /
  (labelled tokens of the whole batch)``; summed over the ranks it is the model's loss, and so are
  the parameter gradients summed over the ranks (``SequenceParallelLoss``, ``shard_model``);
* the logits are never materialised whole: the loss runs over row tiles of the hidden states
  (``tiled_lm_loss``), DeepSpeed's ``TiledFusedLogitsLoss`` where it imports, else a chunked
  cross-entropy whose chunks are recomputed in the backward;
* at the longest sequences each decoder layer's MLP can run in row tiles too (``tile_mlp``): its
  intermediates (gate, up, activation, product: ``4 x mlp`` values a token) exist for one tile at a
  time and are recomputed tile by tile in the backward (DeepSpeed's ``TiledMLP`` where it imports,
  else each tile under activation checkpointing).

The attention FLOP count of each variant (``attended_pairs``, ``model_flops``) is here too: the
benchmark's model FLOPs utilization counts what each attention really computes.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..comm import CommBackend
from ..distributed import all_reduce_gradients, shard_positions, shard_sequence
from ..patterns import longnet_offsets, padded_length, validate_patterns

IGNORE_INDEX = -100  # transformers' label of a position without a target


# -- model shape and FLOPs --------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's sizes (defaults: about 0.9B parameters)."""

    hidden: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 5632
    vocab: int = 32000

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaShape.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def config(self, max_positions: int, attn_implementation: str | None = None):
        """transformers' ``LlamaConfig`` of this shape (no KV cache, no attention dropout)."""
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.mlp,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, max_position_embeddings=max_positions, use_cache=False,
            attention_dropout=0.0, tie_word_embeddings=False,
        )
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        return config

    def matmul_params(self) -> int:
        """Weights used in matrix products per token: projections, MLP, LM head (not the embedding lookup)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        return self.layers * (attn + 3 * self.hidden * self.mlp) + self.hidden * self.vocab

    def params(self) -> int:
        """All parameters (the matrices, the embedding and the RMSNorm weights)."""
        return self.matmul_params() + self.vocab * self.hidden + (2 * self.layers + 1) * self.hidden


def longnet_schedule(seq_len: int, first: int = 2048, segment_factor: int = 4,
                     rate_factor: int = 2) -> tuple[list[int], list[int]]:
    """LongNet's geometric patterns for ``seq_len`` tokens: ``w = [first, first*4, ...]`` while shorter than
    ``seq_len``, then ``seq_len`` itself; ``r = [1, 2, 4, ...]`` (one rate per segment).

    ``longnet_schedule(131072)`` is ``([2048, 8192, 32768, 131072], [1, 2, 4, 8])``.
    """
    if seq_len <= 0 or first <= 0 or segment_factor < 2 or rate_factor < 1:
        raise ValueError(f"need seq_len, first > 0, segment_factor >= 2 and rate_factor >= 1, got {seq_len}, "
                         f"{first}, {segment_factor}, {rate_factor}")
    segments: list[int] = []
    w = first
    while w < seq_len:
        segments.append(w)
        w *= segment_factor
    segments.append(seq_len)
    return segments, [rate_factor**i for i in range(len(segments))]


def _count_in(start: int, stop: int, rate: int, offset: int) -> int:
    """How many positions ``p`` in ``[start, stop)`` have ``p % rate == offset``."""
    return (stop - 1 - offset) // rate - (start - 1 - offset) // rate


def attended_pairs(seq_len: int, heads: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                   causal: bool = True) -> int:
    """(query, key) pairs one layer of LongNet dilated attention scores, summed over heads and patterns.

    Pattern ``(w, r)``, head ``h``: the sequence is cut in segments of ``w``; in each, the positions
    ``p`` with ``p % r == offset(h)`` (``longnet_offsets``: the library's default head offsets)
    attend to each other: ``m^2`` pairs for ``m`` such positions, ``m (m + 1) / 2`` when causal. A row
    covered by several patterns is counted once per pattern (each pattern's softmax is computed).
    Equals the number of True entries of ``testing.oracle.pattern_masks`` (``tests/models``). A length the
    segments do not tile counts the pairs of its own rows under the patterns of its padded length (as it runs).
    """
    pats = validate_patterns(segment_lengths, dilation_rates, padded_length(segment_lengths, dilation_rates, seq_len))
    total = 0
    for w, r in pats:
        for offset in longnet_offsets(heads, r):
            for start in range(0, seq_len, w):
                m = _count_in(start, min(start + w, seq_len), r, offset)
                total += m * (m + 1) // 2 if causal else m * m
    return total


def dense_causal_pairs(seq_len: int, heads: int) -> int:
    """(query, key) pairs of dense causal attention (the diagonal included), summed over heads."""
    return heads * seq_len * (seq_len + 1) // 2


def model_flops(shape: LlamaShape, tokens: int, pairs_per_layer: int) -> float:
    """FLOPs of one training step (forward + backward) over ``tokens`` tokens, recomputation not counted.

    Matrix products: 6 per weight per token (2 forward, 4 backward). Attention: ``4 D`` per scored
    pair in the forward (``Q K^T`` and ``P V``, 2 each), twice that in the backward.
    """
    return 6.0 * shape.matmul_params() * tokens + 3 * 4.0 * shape.head_dim * pairs_per_layer * shape.layers


# -- labels and the tiled loss ---------------------------------------------------------------------


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets of whole ``(B, N)`` sequences: position ``t`` predicts token ``t + 1``; the last
    position has none (``ignore_index``). Shift *before* sharding: a shard's last target lies in the next
    shard. Matches what transformers' causal-LM loss does inside ``model(..., labels=labels)``."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def _chunk_loss(lm_head: nn.Module, x: torch.Tensor, y: torch.Tensor, normalizer: float) -> torch.Tensor:
    logits = lm_head(x)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the softmax in fp32
    return F.cross_entropy(logits, y, reduction="sum", ignore_index=IGNORE_INDEX) / normalizer


def _deepspeed_tiled(name: str):
    """DeepSpeed's ``ulysses_sp.<name>`` (Arctic Long Sequence Training's tiled pieces), or ``None`` where
    DeepSpeed does not import (or lacks it)."""
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    except Exception:  # ImportError, or DeepSpeed failing to pick an accelerator
        return None
    return getattr(ulysses_sp, name, None)


def _tiled_piece(impl: str, name: str):
    """The DeepSpeed piece ``name`` that ``impl`` selects (``"auto"``: where it imports; ``"deepspeed"``:
    required), ``None`` for the chunked fallback."""
    if impl not in ("auto", "deepspeed", "chunked"):
        raise ValueError(f"impl must be 'auto', 'deepspeed' or 'chunked', got {impl!r}")
    ds = _deepspeed_tiled(name) if impl != "chunked" else None
    if impl == "deepspeed" and ds is None:
        raise ValueError(f"impl='deepspeed' but deepspeed's {name} does not import (pip install deepspeed), "
                         "or pass impl='chunked'")
    return ds


def deepspeed_tiled_loss():
    """DeepSpeed's ``TiledFusedLogitsLoss``, or ``None`` where DeepSpeed does not import (or lacks it)."""
    return _deepspeed_tiled("TiledFusedLogitsLoss")


def tiled_lm_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, normalizer: float,
                  chunk_rows: int = 8192, impl: str = "auto") -> torch.Tensor:
    """``sum(cross_entropy(lm_head(hidden), labels)) / normalizer`` without the whole logits tensor.

    ``hidden`` ``(B, n, hidden)``, ``labels`` ``(B, n)`` (``IGNORE_INDEX`` rows count nothing). The rows go
    through the head ``chunk_rows`` at a time. ``impl``: ``"deepspeed"`` (``TiledFusedLogitsLoss``: each
    tile's backward runs inside the forward), ``"chunked"`` (each tile under activation checkpointing:
    its logits are recomputed in the backward), ``"auto"`` (DeepSpeed's where it imports).
    """
    ds = _tiled_piece(impl, "TiledFusedLogitsLoss")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on (B, n)")
    rows = hidden.shape[0] * hidden.shape[1]
    tiles = max(1, math.ceil(rows / chunk_rows))
    if ds is not None:
        def fn(head, x, y):
            return _chunk_loss(head, x, y.reshape(-1), normalizer)

        return ds.apply(fn, lm_head, hidden, labels, None, tiles, list(lm_head.parameters()), "sum")
    x, y = hidden.reshape(rows, -1), labels.reshape(rows)
    parts = [checkpoint(_chunk_loss, lm_head, xs, ys, normalizer, use_reentrant=False)
             for xs, ys in zip(x.split(chunk_rows), y.split(chunk_rows))]
    return torch.stack(parts).sum()


def deepspeed_tiled_mlp():
    """DeepSpeed's ``TiledMLP``, or ``None`` where DeepSpeed does not import (or lacks it)."""
    return _deepspeed_tiled("TiledMLP")


def _tiled_forward(original, rows: int, ds):
    """A forward for one MLP module: ``original(module, x)`` over row tiles of ``rows`` rows of ``x``
    (``(..., hidden)``; the MLP acts on each row alone, so the tiles' outputs concatenate to the whole)."""

    def forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        total = x.numel() // x.shape[-1]
        tiles = math.ceil(total / rows)
        if tiles <= 1:
            return original(module, x)
        flat = x.reshape(total, x.shape[-1])
        if ds is None:  # each tile checkpointed: only its input is kept, its intermediates recomputed in the backward
            parts = [checkpoint(original, module, part, use_reentrant=False, preserve_rng_state=False)
                     for part in flat.split(rows)]
            out = torch.cat(parts)
        else:
            # TiledMLP recomputes each tile inside its own backward, where autograd runs without autocast:
            # the tile function re-enters the forward's autocast state so both passes compute alike.
            device = x.device.type
            autocast = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device)

            def tile_fn(mod: nn.Module, part: torch.Tensor) -> torch.Tensor:
                with torch.autocast(device, dtype=dtype, enabled=autocast):
                    return original(mod, part)

            # torch.chunk into `tiles` pieces: each at most `rows` rows, the last one shorter where they do not divide
            out = ds.apply(tile_fn, module, flat, tiles, list(module.parameters()))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def tile_mlp(lm: nn.Module, rows: int = 8192, impl: str = "auto") -> str:
    """Run every decoder layer's MLP of ``lm`` (a causal LM or its base model, ``.layers[i].mlp``) in tiles
    of ``rows`` rows (tokens) along the sequence; returns the implementation used.

    The MLP's intermediates (for Llama: gate, up, SiLU and their product, ``4 x intermediate_size`` values a
    token) then exist for one tile at a time, in the forward and in the backward, which recomputes each tile
    from the MLP's input: at long sequences they are most of a layer's activations. Values and gradients
    are those of the untiled MLP. ``impl``: ``"deepspeed"`` (DeepSpeed's ``TiledMLP``), ``"chunked"``
    (each tile under ``torch.utils.checkpoint``), ``"auto"`` (DeepSpeed's where it imports).

    Patches the forward of this model's MLP modules only (not the class), so parameter names and state
    dicts are unchanged; calling it again re-tiles. Works under per-layer activation checkpointing and
    FSDP2 (``fully_shard`` per decoder layer: the MLP's weights are gathered while the layer runs).
    """
    ds = _tiled_piece(impl, "TiledMLP")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ValueError(f"rows must be a positive int (tokens per tile), got {rows!r}")
    layers = getattr(getattr(lm, "model", lm), "layers", None)
    if layers is None or not all(isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers):
        raise TypeError(f"tile_mlp needs a decoder model whose .layers (or .model.layers) each have an .mlp "
                        f"module, got {type(lm).__name__}")
    for layer in layers:
        mlp = layer.mlp
        # the class's forward, not the instance's: tiling twice re-tiles rather than nesting tiles
        mlp.forward = types.MethodType(_tiled_forward(type(mlp).forward, rows, ds), mlp)
    return "deepspeed" if ds is not None else "chunked"


class SequenceParallelLoss(nn.Module):
    """A causal LM whose forward returns this rank's share of the loss, computed tile by tile.

    ``forward(input_ids, position_ids, labels, normalizer)``: ``input_ids``/``labels`` this rank's shard
    (labels already shifted on the whole sequence), ``position_ids`` the shard's global positions,
    ``normalizer`` the labelled tokens of the whole batch. Wrap this module (not the causal LM) when
    sharding with FSDP2, so that the LM head's weights are gathered for the whole tiled loss.
    """

    def __init__(self, lm: nn.Module, chunk_rows: int = 8192, loss_impl: str = "auto") -> None:
        super().__init__()
        self.lm = lm
        self.chunk_rows = chunk_rows
        self.loss_impl = loss_impl

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                normalizer: float, **model_kwargs) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **model_kwargs).last_hidden_state
        return tiled_lm_loss(hidden, self.lm.lm_head, labels, normalizer, self.chunk_rows, self.loss_impl)


# -- model, sharding, optimizer --------------------------------------------------------------------


def build_llama(shape: LlamaShape, attn_implementation: str, max_positions: int, seed: int,
                device: torch.device | str = "cpu", checkpointing: bool = True, offload: bool = False) -> nn.Module:
    """``LlamaForCausalLM`` of ``shape`` in float32 with random weights drawn from ``seed`` on ``device``
    (the same weights on every rank), in training mode; ``checkpointing``: each decoder layer's activations
    are recomputed in the backward (``offload``: what it keeps goes to pinned host memory; on a CPU device it
    is there already, and nothing changes)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        lm = LlamaForCausalLM(shape.config(max_positions, attn_implementation))
    lm.train()
    offload = offload and torch.device(device).type != "cpu"  # (and there is no pinned memory to copy into)
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(lm, "activation_checkpointing_enable"):
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
        elif offload:
            raise ValueError("offloading checkpoints needs transformers' activation_checkpointing_enable (>= 5.24)")
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return lm


def shard_model(module: SequenceParallelLoss, bf16: bool, mesh=None) -> SequenceParallelLoss:
    """FSDP2 over the ranks of ``mesh`` (default: the world): each decoder layer, then the rest (embedding,
    final norm, LM head) at the root. Weights, gradients and optimizer state stay float32 (the master
    copy); ``bf16``: the layers compute in bfloat16 (gathered weights bf16, gradients reduced in float32).

    The ranks hold different tokens of the *same* sequences, and each rank's loss is its share of the
    whole: gradients are summed over the ranks, not averaged (divide factor 1, a plain SUM reduction:
    what gloo can do too).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in module.lm.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for m in module.modules():
        if hasattr(m, "set_gradient_divide_factor") and hasattr(m, "unshard"):  # the FSDP modules
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return module


def make_optimizer(params, lr: float = 3e-4, warmup_steps: int = 10, total_steps: int = 1000,
                   weight_decay: float = 0.1, min_lr_ratio: float = 0.1):
    """AdamW (betas 0.9/0.95) with ``lr`` reached linearly over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio * lr`` at ``total_steps``: ``(optimizer, scheduler)``. Step the scheduler after the optimizer."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def learnable_tokens(batch: int, seq_len: int, vocab: int, seed: int, step: int) -> torch.Tensor:
    """``(batch, seq_len)`` int64 tokens, the same on every rank: arithmetic sequences ``(a + s t) % vocab``
    with a random start ``a`` and stride ``s`` in 1..7 per row (learnable in context: the loss falls)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def sequence_parallel_batch(tokens: torch.Tensor, comm: CommBackend | None,
                            device: torch.device | str) -> dict:
    """The model inputs of this rank from the whole ``(B, N)`` token batch (the same on every rank):
    its shard of ``input_ids`` and of the labels shifted on the whole sequence, its global ``position_ids``,
    and ``normalizer`` = labelled tokens of the whole batch. ``comm=None``: one device, the whole sequence."""
    labels = shift_labels(tokens)
    normalizer = int((labels != IGNORE_INDEX).sum())
    n = tokens.shape[1]
    if comm is None or comm.world_size == 1:
        positions = torch.arange(n)[None]
    else:
        tokens, labels = shard_sequence(tokens, comm), shard_sequence(labels, comm)
        positions = shard_positions(n, comm)[None]
    return {"input_ids": tokens.to(device), "position_ids": positions.to(device), "labels": labels.to(device),
            "normalizer": normalizer}


def packed_offsets(seq_len: int, shortest: int, seed: int) -> list[int]:
    """Document offsets of one packed row of ``seq_len`` tokens: lengths log-uniform from ``shortest`` to
    ``seq_len`` tokens (the last document cut to fit), drawn from ``seed``."""
    rng = torch.Generator().manual_seed(seed)
    offsets = [0]
    while offsets[-1] < seq_len:
        length = math.exp(math.log(shortest) + float(torch.rand((), generator=rng)) * math.log(seq_len / shortest))
        offsets.append(min(seq_len, offsets[-1] + int(length)))
    return offsets


def packed_batch(offsets: Sequence[int], vocab: int, seed: int, step: int, comm: CommBackend | None,
                 device: torch.device | str) -> dict:
    """``sequence_parallel_batch`` of one packed row (padding-free training, as ``DataCollatorWithFlattening``
    makes it): documents at ``offsets``, each an arithmetic sequence of its own with positions from 0 and its own
    next-token targets, and the global document offsets as flash-attention's varlen keywords
    (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``), which transformers hands to the attention."""
    lengths = torch.tensor(offsets).diff()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.arange(offsets[-1]) - torch.tensor(offsets[:-1])[doc]
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (len(lengths),), generator=g)
    stride = torch.randint(1, 8, (len(lengths),), generator=g)
    tokens = ((start[doc] + stride[doc] * positions) % vocab)[None]
    labels = shift_labels(tokens)
    labels[0, torch.tensor(offsets[1:]) - 1] = IGNORE_INDEX  # a document's last token predicts nothing
    normalizer = int((labels != IGNORE_INDEX).sum())
    positions = positions[None]
    if comm is not None and comm.world_size > 1:
        tokens, labels, positions = (shard_sequence(x, comm) for x in (tokens, labels, positions))
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    longest = int(lengths.max())
    return {"input_ids": tokens.to(device), "position_ids": positions.to(device), "labels": labels.to(device),
            "normalizer": normalizer, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


def train_step(module: nn.Module, opt: torch.optim.Optimizer, scheduler, batch: dict, *,
               loss_group=None, grad_comm: CommBackend | None = None, autocast_bf16: bool = False,
               clip: float | None = 1.0) -> float:
    """One optimizer step of a ``SequenceParallelLoss`` (FSDP2-sharded or not); returns the whole batch's loss.

    ``loss_group``: the process group whose ranks' loss shares add up to the loss (None: one process).
    ``grad_comm``: sum the gradients over this group by hand (an unsharded model run sequence parallel;
    FSDP2 sums them itself, see ``shard_model``). ``autocast_bf16``: forward under bf16 autocast (an
    unsharded model with float32 weights). ``clip``: the gradients' global norm is clipped to it.
    """
    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast_bf16):
        loss = module(**batch)
    loss.backward()
    if grad_comm is not None:
        all_reduce_gradients(module, grad_comm)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    opt.step()
    scheduler.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().float().reshape(1)
    if loss_group is not None:
        torch.distributed.all_reduce(total, group=loss_group)
    return total.item()
