"""A small LongNet-style causal LM and sequence-parallel training helpers.

An example model, not library API: used by ``launch/train_lm.py`` (torchrun) and
``tests/models/test_lm.py`` (spawned gloo ranks). Sequence parallelism (docs/design.md
section 2): the ranks of a sequence-parallel (SP) group each hold a contiguous
shard of every sequence's tokens and targets. Positions are *global*
(``offset = sp_rank * local_len``), the loss is the mean over the SP group's global tokens (each rank contributes
``sum(local CE) / global token count``; the ring's backward returns K/V grads to
their owner, so summing parameter grads over the SP group gives the exact
gradient of that mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import caches
from ..comm.base import CommBackend
from ..comm.deepspeed import DeepSpeedBackend, ensure_initialized
from ..distributed import all_reduce_gradients, shard_sequence
from ..modules import MultiheadDilatedAttention


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 64
    seq_len: int = 64  # global sequence length N
    embed_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    # one local pattern (fits a shard of 2 ranks) and one spanning the whole sequence
    segment_lengths: tuple[int, ...] = (16, 64)
    dilation_rates: tuple[int, ...] = (1, 2)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "embed_dim", "num_heads", "num_layers", "mlp_ratio"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {val!r}")


class Block(nn.Module):
    """Pre-LN transformer block: causal dilated attention, then an MLP."""

    def __init__(self, cfg: LMConfig, comm: CommBackend | str | None, kernel: str) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.embed_dim)
        self.attn = MultiheadDilatedAttention(
            cfg.embed_dim, cfg.num_heads, cfg.segment_lengths, cfg.dilation_rates,
            causal=True, comm=comm, kernel=kernel,
        )
        self.ln2 = nn.LayerNorm(cfg.embed_dim)
        hidden = cfg.mlp_ratio * cfg.embed_dim
        self.mlp = nn.Sequential(nn.Linear(cfg.embed_dim, hidden), nn.GELU(), nn.Linear(hidden, cfg.embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DilatedLM(nn.Module):
    """Embedding (+ learned positions) -> blocks -> LN -> LM head.

    ``forward(tokens, position_offset)``: ``tokens`` is ``(B, n)``, this rank's
    shard when ``comm`` is set; ``position_offset`` is the global position of
    its first token (0 on one device).
    """

    def __init__(self, cfg: LMConfig, comm: CommBackend | str | None = None, kernel: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.embed_dim)
        self.blocks = nn.ModuleList(Block(cfg, comm, kernel) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.embed_dim)
        self.head = nn.Linear(cfg.embed_dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, n), got {tuple(tokens.shape)}")
        n = tokens.shape[1]
        if position_offset < 0 or position_offset + n > self.cfg.seq_len:
            raise ValueError(
                f"position_offset ({position_offset}) + shard length ({n}) must lie in [0, seq_len={self.cfg.seq_len}]")
        # global positions: a shard's rows are positions [offset, offset + n) of the full sequence
        pos = torch.arange(position_offset, position_offset + n, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- data and sequence-parallel step helpers --------------------------------------------------------


def make_batch(cfg: LMConfig, batch: int, seed: int, step: int = 0,
               kind: str = "random") -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``(inputs, targets)`` of shape ``(batch, seq_len)``, identical on every rank.

    ``kind="random"``: uniform tokens. ``kind="arith"``: ``(start + t * stride) % vocab``
    with a random start and stride per sequence (learnable in context: the loss falls).
    """
    g = torch.Generator().manual_seed(seed * 100003 + step)
    if kind == "random":
        seq = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    elif kind == "arith":
        start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    else:
        raise ValueError(f"kind must be 'random' or 'arith', got {kind!r}")
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def local_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, position_offset: int,
               global_tokens: int) -> torch.Tensor:
    """This rank's share of the SP group's mean loss: ``sum(local CE) / global_tokens``."""
    logits = model(inputs, position_offset)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / global_tokens


def reported_loss(loss: torch.Tensor, sp_group: dist.ProcessGroup | None,
                  dp_group: dist.ProcessGroup | None = None) -> float:
    """Mean loss over the global batch: sum the shares over SP, average over DP."""
    x = loss.detach().float().reshape(1).clone()
    if sp_group is not None:
        dist.all_reduce(x, group=sp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(x, group=dp_group)
        x /= dist.get_world_size(dp_group)
    return x.item()


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")


def reference_losses(cfg: LMConfig, steps: int, batch: int, seed: int, optimizer: str = "adam",
                     lr: float = 1e-2, state: dict | None = None) -> list[float]:
    """Single-process training on the full sequences: the losses SP training must reproduce."""
    model = build_model(cfg, None, seed, state=state)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses = []
    for step in range(steps):
        inputs, targets = make_batch(cfg, batch, seed, step)
        loss = local_loss(model, inputs, targets, 0, inputs.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def build_model(cfg: LMConfig, comm: CommBackend | str | None, seed: int, kernel: str = "auto",
                state: dict | None = None) -> DilatedLM:
    """Same initial weights for every ``comm`` (weights drawn from ``seed`` before any comm work)."""
    torch.manual_seed(seed)
    model = DilatedLM(cfg, comm=comm, kernel=kernel)
    if state is not None:
        model.load_state_dict(state)
    return model


def sp_train(cfg: LMConfig, comm: CommBackend, steps: int, batch: int, seed: int, optimizer: str = "adam",
             lr: float = 1e-2, kernel: str = "auto") -> list[float]:
    """Plain sequence-parallel training over ``comm``'s group (no data parallel); per-step global losses."""
    model = build_model(cfg, comm, seed, kernel)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    local_len = cfg.seq_len // comm.world_size
    losses = []
    for step in range(steps):
        inputs, targets = make_batch(cfg, batch, seed, step)
        loss = local_loss(model, shard_sequence(inputs, comm), shard_sequence(targets, comm),
                          comm.rank * local_len, inputs.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        all_reduce_gradients(model, comm)  # each rank holds its tokens' part of the grad
        opt.step()
        losses.append(reported_loss(loss, comm.group))
    return losses


# -- DeepSpeed: ZeRO with our ring on DeepSpeed's sequence-parallel group -------------------------


def deepspeed_config(zero_stage: int, micro_batch: int, bf16: bool = False) -> dict:
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # a plain torch optimizer (no DeepSpeed op build)
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def deepspeed_setup(cfg: LMConfig, sp_size: int, zero_stage: int, micro_batch: int, seed: int,
                    optimizer: str = "adam", lr: float = 1e-2, kernel: str = "auto", bf16: bool = False):
    """``(engine, comm, dp_rank, dp_size)`` with our ring on DeepSpeed's SP group (``comm`` None if sp_size 1).

    DeepSpeed's documented Ulysses protocol: ``parallel_state_sp`` is the ``mpu``
    (``get_sequence_parallel_group`` / ``get_sequence_data_parallel_group`` ...).
    Given it, the engine (and ZeRO 1/2) reduces grads over the sequence x data
    group and divides by ``dp = world / sp``: sum over SP, mean over DP -- what
    our per-rank loss shares need. SP groups are consecutive ranks.
    """
    import deepspeed  # (optional: imported only by the DeepSpeed path)
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    ensure_initialized()
    if sp_size < 1 or dist.get_world_size() % sp_size:
        raise ValueError(f"sp_size must divide the world size {dist.get_world_size()}, got {sp_size}")
    comm = None  # sp_size 1: plain data parallel, no ring
    if sp_size > 1:
        if getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None) is None:
            parallel_state_sp.initialize_sequence_parallel(sp_size)
        comm = DeepSpeedBackend()  # picks DeepSpeed's SP group
        if comm.world_size != sp_size:
            raise RuntimeError(f"DeepSpeed's sequence-parallel group has {comm.world_size} ranks, expected {sp_size}")
    model = build_model(cfg, comm, seed, kernel)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=deepspeed_config(zero_stage, micro_batch, bf16),
        mpu=parallel_state_sp if sp_size > 1 else None,
    )
    dp_size = dist.get_world_size() // sp_size
    dp_rank = dist.get_rank() // sp_size
    return engine, comm, dp_rank, dp_size


def deepspeed_train(cfg: LMConfig, sp_size: int, zero_stage: int, steps: int, batch: int, seed: int,
                    optimizer: str = "adam", lr: float = 1e-2, kernel: str = "auto") -> list[float]:
    """SP x DP training through a DeepSpeed engine; global batch ``batch`` split over DP."""
    dp_size = dist.get_world_size() // sp_size
    if batch % dp_size:
        raise ValueError(f"batch ({batch}) must be divisible by the data-parallel size ({dp_size})")
    micro = batch // dp_size
    engine, comm, dp_rank, dp_size = deepspeed_setup(cfg, sp_size, zero_stage, micro, seed, optimizer, lr, kernel)
    sp_rank = comm.rank if comm is not None else 0
    local_len = cfg.seq_len // sp_size
    shard = (lambda x: x) if comm is None else (lambda x: shard_sequence(x, comm))
    dp_group = _dp_group(sp_size)
    losses = []
    for step in range(steps):
        inputs, targets = make_batch(cfg, batch, seed, step)
        rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
        inputs, targets = inputs[rows], targets[rows]
        loss = local_loss(engine, shard(inputs), shard(targets),
                          sp_rank * local_len, inputs.numel())
        engine.backward(loss)
        engine.step()
        losses.append(reported_loss(loss, comm.group if comm is not None else None, dp_group))
    return losses


_DP_GROUPS: dict[int, dist.ProcessGroup] = {}
# made collectively (every rank at once), so kept for the life of the process: listed, never emptied
caches.register("models.lm.data_parallel_groups", _DP_GROUPS.__len__)


def _dp_group(sp_size: int) -> dist.ProcessGroup:
    """Ranks with the same SP position (collective the first time: call on every rank)."""
    if sp_size not in _DP_GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = None
        for pos in range(sp_size):
            g = dist.new_group(list(range(pos, world, sp_size)))
            if rank % sp_size == pos:
                mine = g
        _DP_GROUPS[sp_size] = mine
    return _DP_GROUPS[sp_size]
