#!/usr/bin/env python
"""Train a tiny, randomly initialised Hugging Face Llama with dilated attention (no downloads).

    python launch/hf_llama_train.py                                  # one process (CPU, or one GPU)
    torchrun --nproc_per_node=2 launch/hf_llama_train.py             # sequence parallel: gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node=8 launch/hf_llama_train.py --seq-len 65536 --hidden 1024 --heads 16 \\
        --kv-heads 4 --layers 4 --segments 2048,8192,65536 --rates 1,2,4 --dtype bf16   # GPUs

Under torchrun every rank holds a contiguous shard of each sequence: it feeds its
tokens with their *global* positions (``shard_positions``, so RoPE sees the true
positions), its loss is its share of the mean over all tokens, and parameter
gradients are summed over the ranks (``all_reduce_gradients``) before the
optimizer step. The losses equal single-process training (``tests/integrations/test_huggingface.py``).
Rank 0 prints the loss of every step and tokens/s. The data is learnable
(arithmetic sequences), so the loss falls.

``--packed``: padding-free training on documents of random lengths packed into
one row of ``batch * seq_len`` tokens (what ``DataCollatorWithFlattening`` makes):
``position_ids`` restart at each document and the document offsets go in as
``cu_seq_lens_q``/``cu_seq_lens_k``; each document attends only to itself, its
segments starting at its first token. Under torchrun each rank feeds its slice of
the packed row and positions with the *global* offsets (a document may span
ranks; every ``--strategy`` runs documents).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, _ROOT)

from dilated_attention.comm import CommBackend, get_backend  # noqa: E402
from dilated_attention.distributed import all_reduce_gradients, shard_positions, shard_sequence  # noqa: E402
from dilated_attention.integrations.huggingface import register_dilated_attention  # noqa: E402
from dilated_attention.launch_utils import RankZeroParser, init_distributed, int_list  # noqa: E402




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = RankZeroParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="global tokens per sequence")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--segments", type=int_list, default=[32, 128], help="segment lengths, e.g. 32,128")
    p.add_argument("--rates", type=int_list, default=[1, 2], help="dilation rates, e.g. 1,2")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--strategy", choices=["auto", "ring", "head", "hybrid"], default="auto",
                   help="how the ranks share the attention (dilated_attention's strategy=)")
    p.add_argument("--attn", choices=["dilated", "sdpa"], default="dilated",
                   help="sdpa: transformers' dense causal attention, for comparison (one process only)")
    p.add_argument("--packed", action="store_true",
                   help="pack documents of random lengths (8 to seq-len tokens) into one row of batch * seq-len")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "vocab", "hidden", "layers", "heads", "kv_heads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads}), "
                f"and --heads by --kv-heads ({args.kv_heads})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.attn != "dilated" and world > 1:
        p.error(f"--attn {args.attn} runs on one process only (sequence parallelism needs dilated attention)")
    if args.seq_len % world:
        p.error(f"--seq-len ({args.seq_len}) must be divisible by the number of ranks ({world})")
    from dilated_attention.patterns import validate_patterns

    try:  # the patterns' own rules, checked before any process group exists
        validate_patterns(args.segments, args.rates, args.seq_len)
    except (TypeError, ValueError) as exc:
        p.error(f"--segments/--rates: {exc}")
    return args


def build_model(args: argparse.Namespace, comm: CommBackend | None):
    """The same random initial weights on every rank (drawn from ``args.seed``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.attn == "dilated":
        name = register_dilated_attention(args.segments, args.rates, comm=comm, kernel=args.kernel,
                                          strategy=args.strategy,
                                          name="dilated_attention" if comm is None else "dilated_attention_sp")
    else:  # the dense causal baseline
        name = args.attn
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, use_cache=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=name)


def make_batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``(inputs, targets)`` ``(batch, seq_len)``, the same on every rank: ``(start + t * stride) % vocab``."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq_len + 1)) % args.vocab
    return seq[:, :-1], seq[:, 1:]


def make_packed_batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """One packed row of ``batch * seq_len`` tokens, the same on every rank: ``(inputs, targets, position_ids)``
    ``(1, batch * seq_len)`` and the int32 document offsets ``[0, ..., batch * seq_len]``.

    Documents of 8 to ``seq_len`` tokens (the last one what is left), each an arithmetic sequence of its
    own with positions from 0; a document's targets are its own next tokens.
    """
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    total, lengths = args.batch * args.seq_len, []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(min(8, args.seq_len), args.seq_len + 1, (1,), generator=g)),
                           total - sum(lengths)))
    inputs, targets = [], []
    for n in lengths:
        start, stride = torch.randint(0, args.vocab, (1,), generator=g), torch.randint(1, 8, (1,), generator=g)
        seq = (start + stride * torch.arange(n + 1)) % args.vocab
        inputs.append(seq[:-1])
        targets.append(seq[1:])
    positions = torch.cat([torch.arange(n) for n in lengths])
    offsets = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return torch.cat(inputs)[None], torch.cat(targets)[None], positions[None], offsets


def train(args: argparse.Namespace, comm: CommBackend | None, device: torch.device,
          log=print, times: list[float] | None = None) -> list[float]:
    """``args.steps`` AdamW steps; returns the global mean loss of each step (the same on every rank).

    ``times`` (if given) receives each step's seconds (the loss's ``.item()`` ends the step).
    """
    model = build_model(args, comm).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    if comm is not None:
        positions = shard_positions(args.seq_len, comm, device=device)[None]
    else:
        positions = torch.arange(args.seq_len, device=device)[None]
    losses = []
    for step in range(args.steps):
        docs = {}
        if args.packed:  # one row; documents found from the offsets (flash-attention's kwargs in transformers)
            inputs, targets, positions, offsets = make_packed_batch(args, step)
            docs = {"cu_seq_lens_q": offsets.to(device), "cu_seq_lens_k": offsets.to(device)}  # global offsets
            positions = (shard_sequence(positions, comm) if comm is not None else positions).to(device)
        else:
            inputs, targets = make_batch(args, step)
        if comm is not None:  # this rank's tokens; the targets were shifted before sharding
            inputs, targets = shard_sequence(inputs, comm), shard_sequence(targets, comm)
        inputs, targets = inputs.to(device), targets.to(device)
        t0 = time.perf_counter()
        with autocast:
            logits = model(input_ids=inputs, position_ids=positions, **docs).logits
        # this rank's share of the mean over all batch * seq_len tokens
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / (args.batch * args.seq_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if comm is not None:
            all_reduce_gradients(model, comm)  # each rank holds only its tokens' part of the gradient
        opt.step()
        total = loss.detach().reshape(1).clone()
        if comm is not None:
            dist.all_reduce(total, group=comm.group)
        losses.append(total.item())
        elapsed = time.perf_counter() - t0
        if times is not None:
            times.append(elapsed)
        log(f"[hf_llama] step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  "
            f"{args.batch * args.seq_len / elapsed:,.0f} tok/s  {1e3 * elapsed:.1f} ms")
    return losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = init_distributed(args.device)  # torchrun's process group (or a world of one), this rank's device
    comm = get_backend("collective") if env.world_size > 1 else None
    say = print if env.is_main else (lambda *a, **k: None)
    say(f"[hf_llama] ranks={env.world_size} device={env.device.type} seq_len={args.seq_len} "
        f"(local {args.seq_len // env.world_size}) segments={args.segments} rates={args.rates} dtype={args.dtype}"
        f"{' packed' if args.packed else ''}",
        flush=True)
    times: list[float] = []
    losses = train(args, comm, env.device, log=lambda msg: say(msg, flush=True), times=times)
    steady = times[2:] or times  # the first steps compile and warm up
    med = statistics.median(steady)
    say(f"[hf_llama] done: attn={args.attn} loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step "
        f"{1e3 * med:.1f} ms, {args.batch * args.seq_len / med:,.0f} tokens/s (global, {len(steady)} steps)",
        flush=True)
    env.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
