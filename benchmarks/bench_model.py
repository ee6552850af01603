"""Model benchmark: a Hugging Face Llama trained sequence parallel, dilated attention against dense peers.

    python benchmarks/bench_model.py --seq-lens 32768,65536                  # one GPU: ours and the dense peers
    python benchmarks/bench_model.py --seq-lens 524288 --variants ours,flash4 --warmup 1 --steps 1 \\
        --find-max ours,flash4                                                  # one GPU: the longest sequence
    torchrun --standalone --nproc_per_node=4 benchmarks/bench_model.py --seq-lens 131072,524288
    torchrun --standalone --nproc_per_node=4 benchmarks/bench_model.py --variants ours --seq-lens 524288 \\
        --find-max ours --time-budget 420
    torchrun --standalone --nproc_per_node=4 benchmarks/bench_model.py --variants ours --seq-lens 1048576 \\
        --find-max ours --find-max-start 2097152 --time-budget 300     # 2M tokens: tiled MLP + offload
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_model.py --tiny --device cpu   # CPU check

Trains ``LlamaForCausalLM`` (transformers, random weights, synthetic learnable tokens) for
``--warmup`` + ``--steps`` optimizer steps per variant and sequence length, and records the median
of the timed steps (each step: forward, backward, gradient clipping, AdamW; timed on the host after a
device sync, slowest rank). Default model: about 0.9B parameters (886M) (hidden 2048, 16 layers, 16 heads
of 128, 8 KV heads, MLP 5632, vocab 32000). The training setup is what a user runs:

- FSDP2 (``fully_shard`` per decoder layer, then the root) over the K ranks: float32 master weights,
  gradients and AdamW state sharded; the layers compute in bfloat16 (``MixedPrecisionPolicy``: gathered
  weights bf16, gradients reduced in fp32). ``--no-fsdp``: float32 weights on every rank under bf16 autocast,
  gradients summed by hand. The output states which (``meta.training``).
- memory savings as needed, per variant and length, the first rung of a ladder whose predicted peak fits in
  ``--memory-limit`` of the GPU (``predicted_bytes``; the same choice on every rank): (a) every layer keeps
  its activations; (b) per-layer activation checkpointing (each decoder layer recomputed in the backward
  from its input); (c) and the MLPs tiled along the sequence (``hf_training.tile_mlp``: the MLP's
  intermediates exist for one tile of ``--mlp-tile`` tokens at a time, recomputed tile by tile); (d) and
  the checkpointed layer inputs offloaded to pinned host memory -- Arctic Long Sequence Training's
  savings. ``--checkpointing layer|none``, ``--tiled-mlp on|off`` and ``--offload-checkpoints`` force
  their part (the ladder keeps the rest). Each record's ``checkpointing`` says what ran
  (``none``, ``layer``, ``layer+tiled-mlp``, ``layer+tiled-mlp+offload``). Eager (no CUDA graphs, no compile).
- sequence parallel: every rank holds a contiguous shard of every sequence (1/K of the tokens), fed at
  its global positions; labels are shifted on the whole sequence before sharding; each rank's loss is its
  share of the mean over the whole batch, computed in row tiles of ``--loss-chunk`` rows (DeepSpeed's
  ``TiledFusedLogitsLoss`` where it imports, else a chunked cross-entropy recomputed in the backward) so
  the logits never exist whole. ``dilated_attention.models.hf_training`` holds these pieces;
  ``tests/models/test_train_parity.py`` checks that two ranks train exactly like one device.

Variants (``--variants``):

- ``ours``: dilated attention through the Hugging Face integration
  (``register_dilated_attention(..., comm=)``), LongNet patterns ``w = [2048, 8192, 32768, ...]`` (x4)
  while shorter than N, then N, with ``r = [1, 2, 4, ...]`` (x2); ``--first-segment``,
  ``--segment-factor``, ``--rate-factor`` change them. Stated in ``meta.patterns`` per length.
- ``sdpa``: transformers' dense causal ``sdpa`` attention (PyTorch picks the kernel), one GPU only.
- ``sdpa_cudnn``: dense causal SDPA forced to cuDNN (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``; the KV heads
  shared through ``enable_gqa`` where cuDNN takes it, else repeated), one GPU only, CUDA only.
- ``flash4``: dense causal flash-attn-4 through transformers' attention interface (``flash_attention_4``), one
  GPU only, where flash-attn-4 is installed.
- ``ulysses``: dense causal attention, DeepSpeed Ulysses (all-to-all from sequence shards to head
  groups around transformers' ``sdpa``): DeepSpeed's ``UlyssesSPAttentionHF`` (Arctic Long Sequence
  Training's Hugging Face path) where it imports, else a plain all-to-all written here
  (``--ulysses-impl``). Needs K to divide the heads.
- ``torch_cp``: dense causal attention, PyTorch context parallel (``context_parallel``, cuDNN SDPA ring,
  its load-balanced order of the tokens), GPUs only.

Every variant runs on the same memory ladder (below). A variant that does not import, does not apply (one GPU,
CPU) or does not fit (out of memory) is recorded in ``skipped`` with the reason, and the run goes on. "vs best
dense" is against the fastest dense record at the same GPU count and length.

Measured per record: step time, global tokens/s, peak memory per GPU (largest rank, model state
included), losses of every step, and model FLOPs utilization: FLOPs of the step / (time x K x
``--peak-tflops``, default 989, an H100's dense bf16). FLOPs of the step: 6 per matrix weight per token
(projections, MLP, LM head) plus 3 x 4 x head_dim per (query, key) pair each attention layer really scores
(forward ``Q K^T`` and ``P V``, backward twice that): dense causal N (N + 1) / 2 pairs per head; for the
dilated patterns, in each segment of w the m = w / r positions of the head's offset score m (m + 1) / 2
pairs, summed over segments, heads and patterns (``attended_pairs``, tested against the masks).
Recomputation (checkpointing, the tiled loss) is not counted.

``--find-max V,...``: for each variant, the sequence length doubles (from ``--find-max-start``, default the
largest ``--seq-lens``) until it runs out of memory, a size is predicted not to fit (no rung of the ladder
fits; or, on the rung the last size ran on, its peak extrapolated linearly from the last one beyond
``--memory-limit`` of the GPU), or the next size would not finish within ``--time-budget`` seconds of the
search: one warm-up and one timed step per size, each on its own rung of the ladder. A record of the same run at
the first length counts as that size (measured, not run again), so ``--seq-lens N --find-max V`` measures N once.

Results: ``<out>/model_<gpu>.{json,md,png}`` (``<gpu>`` as ``gpu_tag.py`` names it; ``cpu`` on CPU),
written by rank 0 after every record; each GPU count's ``runs`` entry states the GPU, the commands, the package
versions and the code (git commit and date, or ``--code-version`` where the tree has no git history), and each
record's ``provenance`` the command, versions, code and date that made it. Runs
with other GPU counts are kept in the same file (a record is replaced when a run measures the same variant, GPU
count and length again, so several commands at one GPU count fill one file); ``--fresh`` starts the file anew.
``--plot-only JSON`` rewrites the ``.md`` and ``.png`` from a results file without running anything.

``--profile``: what limits a step. After each record's timed steps, one more step runs the same way under
``torch.profiler`` (CUDA and CPU activity; CPU only on CPU), and the record's ``profile`` holds rank 0's: device
milliseconds by category -- ``attention`` (the attention kernels and whatever the attention call launches), the
matrix products outside it by the sizes their op read (``record_shapes``): ``mlp`` (one of them the MLP's width),
``logits`` (the vocabulary: the LM head in the tiled loss), ``projections`` (the rest: q, k, v, o), ``matmul``
(sizes unknown), then ``communication`` (NCCL/gloo), ``copies`` (memcpy, memset, copy, cat), ``other``
(elementwise, norms, loss, optimizer) -- classified by name (``CATEGORY_RULES``), the largest kernels,
``gpu_busy_ms`` (the union of kernel intervals), ``step_ms`` (host wall of the step between syncs) and
``host_bound_ms`` = step - busy, the time the GPU idles waiting on the host. The markdown adds a table "What a
step spends". The profiler slows the step it watches: read the shares, not the times. On CPU the categories are
the ops' self CPU time.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scaling import interval_total, interval_union  # noqa: E402
from cli_types import name_list, positive_int_list  # noqa: E402
from gpu_tag import gpu_tag, package_versions  # noqa: E402

VARIANTS = ("ours", "sdpa", "sdpa_cudnn", "flash4", "ulysses", "torch_cp")
DENSE = ("sdpa", "sdpa_cudnn", "flash4", "ulysses", "torch_cp")
ONE_GPU_DENSE = ("sdpa", "sdpa_cudnn", "flash4")
PACKED = ("ours", "flash4")  # the variants that take packed documents (flash-attention's varlen keywords)
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "mlp": 96, "vocab": 160,
        "seq_lens": [256], "first_segment": 32, "warmup": 1, "steps": 2, "loss_chunk": 64, "mlp_tile": 48}
PENDING = "started but never finished: the job hung or crashed here (an out-of-memory on one rank while the " \
          "others wait in a collective ends like this)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=positive_int_list, default=[32768, 131072],
                   help="tokens per sequence (global), comma-separated, e.g. 32768,131072,524288,1048576")
    p.add_argument("--variants", type=name_list(VARIANTS), default=list(VARIANTS), help=f"of {','.join(VARIANTS)}")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    g = p.add_argument_group("model (default about 0.9B parameters)")
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--layers", type=int, default=16)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--mlp", type=int, default=5632)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--tiny", action="store_true", help="a CPU-sized check: hidden 64, 2 layers, 4 heads of 16, "
                   "2 KV heads, MLP 96, vocab 160, 256 tokens, first segment 32, 1 + 2 steps, MLP tiles of 48")
    g = p.add_argument_group("dilated patterns of ours")
    g.add_argument("--first-segment", type=int, default=2048)
    g.add_argument("--segment-factor", type=int, default=4)
    g.add_argument("--rate-factor", type=int, default=2)
    g.add_argument("--kernel", default="auto", help="dilated_attention's kernel= (default auto)")
    g.add_argument("--strategy", choices=["auto", "ring", "head", "hybrid"], default="auto",
                   help="dilated_attention's strategy= across GPUs (default auto)")
    g = p.add_argument_group("training")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    g.add_argument("--steps", type=int, default=3, help="timed steps (their median is the record)")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate warmup")
    g.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    g.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP2 with bf16 compute and fp32 master weights (default); --no-fsdp: fp32 weights "
                        "on every rank under bf16 autocast")
    g.add_argument("--checkpointing", choices=["auto", "layer", "none"], default="auto",
                   help="per-layer activation checkpointing: auto (default) the memory ladder decides (only where "
                        "every layer's activations are predicted not to fit), layer always, none never")
    g.add_argument("--tiled-mlp", choices=["auto", "on", "off"], default="auto",
                   help="each layer's MLP in tiles along the sequence: auto (default) the memory ladder decides "
                        "(where checkpointed layers alone are predicted not to fit), on always, off never")
    g.add_argument("--mlp-tile", type=int, default=8192, help="tokens per tile of a tiled MLP")
    g.add_argument("--mlp-impl", choices=["auto", "deepspeed", "chunked"], default="auto",
                   help="the tiled MLP: DeepSpeed's TiledMLP (auto: where it imports) or checkpointed tiles")
    g.add_argument("--offload-checkpoints", action="store_true",
                   help="always offload the checkpointed layer inputs to pinned host memory (transformers' "
                        "offload=True; default: the memory ladder's last rung)")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute precision (auto: bf16 on GPUs, fp32 on CPU)")
    g.add_argument("--loss-chunk", type=int, default=8192, help="rows per tile of the LM head and loss")
    g.add_argument("--loss-impl", choices=["auto", "deepspeed", "chunked"], default="auto",
                   help="the tiled loss: DeepSpeed's TiledFusedLogitsLoss (auto: where it imports) or chunked")
    g.add_argument("--ulysses-impl", choices=["auto", "deepspeed", "plain"], default="auto",
                   help="ulysses: DeepSpeed's UlyssesSPAttentionHF (auto: where it imports) or the plain all-to-all")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--packed", action="store_true",
                   help=f"train on one packed row of documents (log-uniform lengths from --packed-shortest to the "
                        f"whole row, the same every step) for the variants that take them ({', '.join(PACKED)}); "
                        "results in model_<gpu>-packed.*")
    g.add_argument("--packed-shortest", type=int, default=1024, help="the shortest document of --packed")
    g = p.add_argument_group("longest sequence")
    g.add_argument("--find-max", type=name_list(VARIANTS), default=[], metavar="VARIANTS",
                   help="double the sequence length until out of memory, per variant (e.g. ours,ulysses)")
    g.add_argument("--find-max-start", type=int, default=None, help="first length (default: the largest --seq-lens)")
    g.add_argument("--time-budget", type=float, default=300.0, help="seconds for each variant's search")
    g.add_argument("--memory-limit", type=float, default=0.95,
                   help="a size whose extrapolated peak exceeds this share of the GPU is not launched")
    g = p.add_argument_group("output")
    g.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak bf16 dense TFLOP/s of one GPU for the FLOPs utilization (H100 SXM: 989)")
    g.add_argument("--profile", action="store_true",
                   help="after each record's timed steps, profile one more step (torch.profiler) and record what it "
                        "spends: attention, projections, MLP, logits, communication, copies, other, GPU idle (the "
                        "record's profile)")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    g.add_argument("--out", default="benchmarks/results")
    g.add_argument("--tag", default=None, help="file name model_<tag>.* (default: the GPU name, cpu on CPU)")
    g.add_argument("--fresh", action="store_true", help="start the results file anew (default: merge into it)")
    g.add_argument("--code-version", default=None, metavar="TEXT",
                   help="the code's commit and date for the results (default: git's, where the tree has its history)")
    g.add_argument("--plot-only", default=None, metavar="JSON", help="rewrite the .md and .png of a results file")
    a = p.parse_args(argv)
    if a.plot_only:
        return a
    if a.tiny:
        for key, value in TINY.items():
            setattr(a, key, value)
    for name in ("batch", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab", "steps",
                 "first_segment", "loss_chunk", "mlp_tile"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.heads % a.kv_heads:
        p.error(f"--heads ({a.heads}) must be a multiple of --kv-heads ({a.kv_heads})")
    if a.segment_factor < 2 or a.rate_factor < 1:
        p.error("--segment-factor must be >= 2 and --rate-factor >= 1")
    if a.offload_checkpoints and a.checkpointing == "none":
        p.error("--offload-checkpoints offloads the checkpointed layer inputs: it needs --checkpointing auto or layer")
    if not 0 < a.memory_limit <= 1:
        p.error(f"--memory-limit must be in (0, 1], got {a.memory_limit}")
    if a.packed and (a.batch != 1 or a.packed_shortest <= 0):
        p.error(f"--packed packs one row: it needs --batch 1 (got {a.batch}) and a positive --packed-shortest "
                f"(got {a.packed_shortest})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    bad = [n for n in a.seq_lens if n % world]
    if bad:
        p.error(f"--seq-lens {bad} must be divisible by the number of ranks ({world})")
    return a


class Skip(Exception):
    """A variant that cannot run here (not installed, not applicable): recorded with the reason."""


# -- FLOPs -------------------------------------------------------------------------------------------


def resolved_impl(choice: str, deepspeed_piece: Callable[[], object]) -> str:
    """``--loss-impl``/``--mlp-impl`` as it runs: ``auto`` is DeepSpeed's piece where it imports, else chunked."""
    return choice if choice != "auto" else ("deepspeed" if deepspeed_piece() is not None else "chunked")


def patterns(args, n: int) -> tuple[list[int], list[int]]:
    from dilated_attention.models.hf_training import longnet_schedule

    return longnet_schedule(n, args.first_segment, args.segment_factor, args.rate_factor)


def documents(args, n: int) -> list[int]:
    """The document offsets of a ``--packed`` row of ``n`` tokens, or ``[0, n]`` (one sequence)."""
    from dilated_attention.models.hf_training import packed_offsets

    return packed_offsets(n, args.packed_shortest, args.seed) if args.packed else [0, n]


def step_flops(args, shape, variant: str, n: int) -> float:
    """FLOPs of one training step at ``n`` tokens per sequence (``hf_training.model_flops``); packed documents
    score pairs inside each document only (ours: each document's own patterns, its segments clamped to it)."""
    from dilated_attention.models.hf_training import attended_pairs, dense_causal_pairs, model_flops

    segs, rates = patterns(args, n)
    pairs, docs = 0, documents(args, n)
    for a, b in zip(docs, docs[1:]):
        if variant == "ours":
            pairs += attended_pairs(b - a, shape.heads, segs, rates, causal=True)
        else:
            pairs += dense_causal_pairs(b - a, shape.heads)
    return model_flops(shape, args.batch * n, args.batch * pairs)


# -- the attention of each variant -------------------------------------------------------------------


# -- memory: the ladder of savings -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a step does to fit: per-layer activation checkpointing, the MLPs tiled along the sequence, the
    checkpointed layer inputs offloaded to host memory."""

    checkpointing: bool = False
    tiled_mlp: bool = False
    offload: bool = False

    @property
    def label(self) -> str:
        """``none``, ``layer``, ``layer+tiled-mlp``, ``layer+tiled-mlp+offload`` (each record's ``checkpointing``)."""
        parts = [name for name, on in (("layer", self.checkpointing), ("tiled-mlp", self.tiled_mlp),
                                       ("offload", self.offload)) if on]
        return "+".join(parts) or "none"


# Arctic Long Sequence Training's savings, cheapest first: each rung recomputes or moves more than the one before.
LADDER = (MemoryPlan(), MemoryPlan(checkpointing=True), MemoryPlan(checkpointing=True, tiled_mlp=True),
          MemoryPlan(checkpointing=True, tiled_mlp=True, offload=True))


# Bytes an eager Hugging Face Llama decoder layer keeps for its backward, per token, bf16 compute: two RMSNorms
# (float32 input and normalized rows, bf16 output: 10 x hidden each), q/k/v projections and their rotated q/k,
# the attention output and its transposed copy, and the MLP's gate, up, SiLU and product (2 bytes each).
def activation_bytes(shape) -> int:
    kv = shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    return 2 * 10 * shape.hidden + 2 * (2 * q + 2 * kv) + 2 * (2 * q) + mlp_activation_bytes(shape)


def mlp_activation_bytes(shape) -> int:
    """Of ``activation_bytes``, the MLP's gate, up, SiLU and product (bf16): what a tiled MLP keeps for one tile only."""
    return 2 * 4 * shape.mlp


def attention_transient_bytes(shape) -> int:
    """Bytes per token the attention's backward holds besides the layer's activations: two query-sized float32
    tensors (16 KiB a token at the default shape). Measured on 4 x H200 at the default shape, 262,144 tokens a
    rank, checkpointed: 47.8 GiB peak, of which one recomputed layer and the attention ~114 KiB a token."""
    return 2 * 4 * shape.heads * shape.head_dim


def checkpoint_bytes(shape) -> int:
    """Bytes per token and layer that per-layer checkpointing keeps: the layer's bf16 input."""
    return 2 * shape.hidden


def predicted_bytes(shape, tokens_per_rank: int, ranks: int, plan: MemoryPlan = LADDER[0]) -> float:
    """Peak bytes of a step on one rank under ``plan``, T = ``tokens_per_rank``, L layers:

    - model state: fp32 weights, gradients and two AdamW moments sharded over ``ranks`` (16 bytes a parameter),
      plus one layer's bf16 weights gathered;
    - checkpoints (``plan.checkpointing`` without ``plan.offload``): ``L x T x checkpoint_bytes``;
    - activations alive at once: every layer's without checkpointing, one layer's (the one being recomputed)
      with it; ``activation_bytes`` per token and layer, less ``mlp_activation_bytes`` with a tiled MLP (one
      tile's, 8192 tokens by default, is within the margin); plus the attention's transients
      (``attention_transient_bytes``); all 1.1x for the allocator and the loss's and the other temporaries.

    Default shape, 4 ranks (bytes a token: activations 104 KiB, of which the MLP's 44 KiB; attention 16 KiB;
    checkpoints 4 KiB a layer): 32,768 tokens a rank keep every layer in 61 GiB (measured on H200: 50.6);
    262,144 checkpointed in 53 GiB (measured: 47.8); 524,288 need the tiled MLP and, on an 80 GB GPU, the
    offload: 45 GiB (layer 100 GiB, layer+tiled-mlp 77 GiB).
    """
    state = 16 * shape.params() / ranks + 2 * shape.params() / shape.layers
    kept_layers = 1 if plan.checkpointing else shape.layers
    per_layer = activation_bytes(shape) - (mlp_activation_bytes(shape) if plan.tiled_mlp else 0)
    activations = 1.1 * tokens_per_rank * (kept_layers * per_layer + attention_transient_bytes(shape))
    checkpoints = shape.layers * tokens_per_rank * checkpoint_bytes(shape) \
        if plan.checkpointing and not plan.offload else 0
    return activations + checkpoints + state


def allowed_rungs(args) -> list[MemoryPlan]:
    """The ladder's rungs the flags allow (``--checkpointing``, ``--tiled-mlp``, ``--offload-checkpoints`` force
    their part); where the flags name a plan off the ladder (e.g. no checkpointing with a tiled MLP), that alone."""

    def allowed(plan: MemoryPlan) -> bool:
        return (args.checkpointing == "auto" or plan.checkpointing == (args.checkpointing == "layer")) and \
            (args.tiled_mlp == "auto" or plan.tiled_mlp == (args.tiled_mlp == "on")) and \
            (plan.offload or not args.offload_checkpoints)

    rungs = [plan for plan in LADDER if allowed(plan)]
    return rungs or [MemoryPlan(checkpointing=args.checkpointing == "layer" or args.offload_checkpoints,
                                tiled_mlp=args.tiled_mlp == "on", offload=args.offload_checkpoints)]


def choose_plan(shape, tokens_per_rank: int, ranks: int, rungs: list[MemoryPlan], limit: float | None) -> MemoryPlan:
    """The first of ``rungs`` whose ``predicted_bytes`` fits ``limit`` bytes, else the last (the least memory; it
    may still run out). ``limit=None`` (no GPU to fit): the first."""
    if limit is None:
        return rungs[0]
    return next((plan for plan in rungs if predicted_bytes(shape, tokens_per_rank, ranks, plan) <= limit), rungs[-1])


def _no_mask(*args, **kwargs):
    """Mask interface of the dense peers: causal attention with no mask tensor (SDPA's is_causal)."""
    return None


def _repeat_kv(x, groups: int):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def plain_ulysses(group) -> Callable:
    """Ulysses written out: all-to-all from sequence shards to head groups, SDPA causal on the whole sequence,
    all-to-all back. An attention function of transformers' interface (q ``(B, H, L, D)`` -> ``(B, L, H, D)``)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.nn.functional import all_to_all_single

    k = dist.get_world_size(group)

    def to_heads(x):  # (B, h, L, D) -> (B, h/K, K L, D): head group j goes to rank j, sequence chunks come back
        b, h, n, d = x.shape
        x = x.reshape(b, k, h // k, n, d).transpose(0, 1).contiguous()
        y = all_to_all_single(torch.empty_like(x), x, group=group)
        return y.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * n, d)

    def to_sequence(x):  # (B, h/K, K L, D) -> (B, h, L, D)
        b, hk, n, d = x.shape
        x = x.reshape(b, hk, k, n // k, d).permute(2, 0, 1, 3, 4).contiguous()
        y = all_to_all_single(torch.empty_like(x), x, group=group)
        return y.transpose(0, 1).reshape(b, k * hk, n // k, d)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        if key.shape[1] % k:  # fewer KV heads than ranks: every rank gets its query heads' own copies
            key, value, groups = _repeat_kv(key, groups), _repeat_kv(value, groups), 1
        q, kk, v = (to_heads(t) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
        return to_sequence(out).transpose(1, 2).contiguous(), None

    return attention


def deepspeed_ulysses(shape, batch: int, group) -> Callable:
    """DeepSpeed's ``UlyssesSPAttentionHF`` around transformers' ``sdpa`` (what its
    ``register_with_transformers`` builds, registered under its own name instead of replacing ``sdpa``)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dilated_attention.comm.deepspeed import ensure_initialized

    ensure_initialized()  # DeepSpeed's comm layer over torch's default group
    uattn = UlyssesSPAttentionHF(
        attn=sdpa_attention_forward, batch_size=batch, attn_head_count=shape.heads, attn_head_size=shape.head_dim,
        kv_head_count=shape.kv_heads, num_hidden_layers=shape.layers, process_group=group,
        seq_length_is_variable=True)
    uattn.core_attn_implementation = "sdpa"

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        return uattn(module, query, key, value, None, *args, **kwargs)  # the mask is causal: none after the exchange

    return attention


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """torch_cp's attention: causal SDPA on this rank's tokens (``context_parallel`` turns it into its ring);
    KV heads repeated (the ring's SDPA ops take no enable_gqa)."""
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, _repeat_kv(key, groups), _repeat_kv(value, groups), is_causal=True,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def takes_gqa(backend, query, key, value) -> bool:
    """Whether SDPA's ``backend`` takes these causal inputs with fewer KV heads (``enable_gqa``) as they are."""
    import torch.backends.cuda as tbc
    from torch.nn.attention import SDPBackend

    check = {SDPBackend.CUDNN_ATTENTION: tbc.can_use_cudnn_attention, SDPBackend.FLASH_ATTENTION:
             tbc.can_use_flash_attention, SDPBackend.EFFICIENT_ATTENTION: tbc.can_use_efficient_attention}.get(backend)
    return check is None or check(tbc.SDPAParams(query, key, value, None, 0.0, True, True), False)


def forced_sdpa(backend) -> Callable:
    """Causal SDPA on ``backend`` alone (``sdpa_kernel``): an attention function of transformers' interface (q
    ``(B, H, L, D)`` -> ``(B, L, H, D)``), as transformers' ``sdpa`` with the kernel chosen. Fewer KV heads go
    in as they are (``enable_gqa``) where the backend takes them, else repeated. A backend that cannot run the
    inputs raises (SDPA's "no available kernel"): the record says so."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        gqa = groups > 1 and takes_gqa(backend, query, key, value)
        if groups > 1 and not gqa:
            key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None

    return attention


def flash4_interface() -> str:
    """transformers' name of flash-attn-4 (``flash_attention_4``); ``Skip`` where it is not installed or this
    transformers has no such attention."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.utils import is_flash_attn_4_available

    name = "flash_attention_4"
    if name not in AttentionInterface() or name not in AttentionMaskInterface():
        raise Skip(f"transformers {package_versions('transformers')['transformers']} has no {name} attention")
    if not is_flash_attn_4_available():
        raise Skip("flash-attn-4 is not installed (pip install flash-attn-4)")
    return name


def attention_for(variant: str, args, shape, n: int, env, comm, state: dict) -> tuple[str, str]:
    """Register ``variant``'s attention with transformers: ``(attn_implementation name, what runs)``."""
    import torch.distributed as dist
    from transformers import AttentionInterface, AttentionMaskInterface

    k = env.world_size
    if variant == "ours":
        from dilated_attention.integrations.huggingface import register_dilated_attention

        segs, rates = patterns(args, n)
        name = register_dilated_attention(segs, rates, comm=comm, kernel=args.kernel, strategy=args.strategy,
                                          name=f"dilated_{n}")
        return name, (f"dilated attention w={segs} r={rates}, kernel={args.kernel}"
                      + (f", strategy={args.strategy} over K" if comm else ""))
    if variant in ONE_GPU_DENSE:
        if k > 1:
            raise Skip("dense attention on one process only: its sequence-parallel forms are ulysses and torch_cp")
        if variant == "sdpa":
            return "sdpa", "transformers' sdpa, causal (PyTorch picks the kernel)"
        if env.device.type != "cuda":
            raise Skip(f"{variant} needs CUDA")
        if variant == "flash4":
            return flash4_interface(), "flash-attn-4 through transformers' flash_attention_4, causal"
        from torch.nn.attention import SDPBackend

        AttentionInterface.register("sdpa_cudnn_bench", forced_sdpa(SDPBackend.CUDNN_ATTENTION))
        AttentionMaskInterface.register("sdpa_cudnn_bench", _no_mask)
        return "sdpa_cudnn_bench", ("SDPA forced to cuDNN (sdpa_kernel CUDNN_ATTENTION), causal; KV heads shared "
                                    "(enable_gqa) where cuDNN takes them, else repeated")
    if k == 1:
        raise Skip(f"one GPU: nothing to exchange (the one-GPU dense peers are {', '.join(ONE_GPU_DENSE)})")
    if variant == "ulysses":
        if shape.heads % k:
            raise Skip(f"Ulysses needs the ranks ({k}) to divide the heads ({shape.heads})")
        impl = args.ulysses_impl
        fn = None
        if impl in ("auto", "deepspeed"):
            try:
                fn = deepspeed_ulysses(shape, args.batch, dist.group.WORLD)
                how = "DeepSpeed UlyssesSPAttentionHF around transformers' sdpa"
            except Exception as exc:  # not installed, or an API it no longer has
                if impl == "deepspeed":
                    raise Skip(f"DeepSpeed's UlyssesSPAttentionHF: {type(exc).__name__}: {exc}") from None
                state.setdefault("notes", []).append(f"ulysses: DeepSpeed's UlyssesSPAttentionHF unavailable "
                                                     f"({type(exc).__name__}: {exc}); the plain all-to-all ran")
        if fn is None:
            fn, how = plain_ulysses(dist.group.WORLD), "plain all-to-all around SDPA (this benchmark's)"
        AttentionInterface.register("ulysses_bench", fn)
        AttentionMaskInterface.register("ulysses_bench", _no_mask)
        return "ulysses_bench", how
    if variant == "torch_cp":
        if env.device.type != "cuda":
            raise Skip("torch_cp needs CUDA (its ring runs cuDNN/flash SDPA)")
        try:
            from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        except ImportError as exc:
            raise Skip(f"torch context parallel does not import: {exc}") from None
        AttentionInterface.register("torch_cp_bench", cp_attention)
        AttentionMaskInterface.register("torch_cp_bench", _no_mask)
        return "torch_cp_bench", "torch context_parallel, cuDNN SDPA ring, load-balanced token order"
    raise ValueError(f"unknown variant {variant!r}")


# -- what a step spends: one profiled step -----------------------------------------------------------

PROFILE_CATEGORIES = ("attention", "projections", "mlp", "logits", "matmul", "communication", "copies", "other")

# What a GPU kernel or CPU op is, from its name: the first row holding a substring of the name (any case) wins,
# else ``other`` (elementwise, norms, rotary, the optimizer, ...). Communication comes first (the ring's exchanges
# run inside the attention call), then the loss's log-softmax (not attention), then attention before matmul
# (cuDNN's, flash's and memory-efficient attention kernels are CUTLASS/sm90 kernels too). No bare "broadcast"
# or "cat": GEMM epilogues, aten::broadcast_tensors and scatter kernels hold them.
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "c10d::", "gloo", "record_param_comms", "all_gather", "allgather", "reduce_scatter",
                       "reducescatter", "all_to_all", "alltoall", "all_reduce", "allreduce", "post_backward_reduce")),
    ("other", ("log_softmax", "logsoftmax", "cross_entropy", "nll_loss")),
    ("attention", ("attention", "attn", "flash", "fmha", "cudnn", "sdpa", "scaled_dot_product", "softmax_backward",
                   # this library's Triton kernels: fused forward, backward, live key tiles, merges of partials
                   "fwd_kernel", "dq_kernel", "dkdv_kernel", "delta_kernel", "tiles_kernel", "merge_kernel",
                   "combine")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "sm90_", "sm80_", "ampere_", "splitkreduce", "matmul",
                "addmm", "bmm", "aten::mm", "aten::linear")),
    ("copies", ("memcpy", "memset", "copy", "aten::cat", "catarray", "chunk_cat", "contiguous")),
)


@functools.lru_cache(maxsize=None)
def category(name: str) -> str:
    """The category of a kernel or op named ``name`` (``CATEGORY_RULES``)."""
    low = name.lower()
    return next((cat for cat, parts in CATEGORY_RULES if any(part in low for part in parts)), "other")


def classify(name: str, op=None, inside: dict | None = None, widths: dict[str, int] | None = None) -> str:
    """The category of a kernel or op named ``name``; ``op``: the profiler's CPU op that ran it (a CPU op itself, or
    the op that launched a kernel; None if unknown). Work inside an attention call (an op named like attention,
    e.g. the library's autograd function ``Attention`` and its backward, or ``aten::scaled_dot_product_attention``)
    is attention whatever its name -- the call's copies and matrix products on CPU -- except communication.
    ``inside``: a memo of op -> inside attention, shared across calls. ``widths``: a matrix product outside
    attention is the first category whose width its op read (``gemm_category``), where given."""
    own = category(name)
    if own in ("communication", "attention") or op is None:
        return own
    inside = {} if inside is None else inside
    origin, chain = op, []
    found = False
    while op is not None and id(op) not in inside:
        chain.append(op)
        if category(op.name) == "attention":
            found = True
            break
        op = op.cpu_parent
    found = found or (op is not None and inside[id(op)])
    for seen in chain:  # everything under an attention op is inside; a chain that met none is outside
        inside[id(seen)] = found
    if found:
        return "attention"
    return gemm_category(origin, widths) if own == "matmul" and widths is not None else own


def gemm_category(op, widths: dict[str, int]) -> str:
    """Which matrix product ``op`` (or the nearest matrix-product op above it) is: the first category of ``widths``
    (e.g. ``{"logits": vocab, "mlp": intermediate}``) whose width is among the sizes it read, else
    ``projections``; ``matmul`` where no op above records its input shapes (a profile without ``record_shapes``).
    ``widths`` must be distinct (``step_profile`` drops a width two categories share)."""
    while op is not None:
        shapes = getattr(op, "input_shapes", None)
        if shapes and category(op.name) == "matmul":
            sizes = {x for shape in shapes if isinstance(shape, (list, tuple)) for x in shape}
            return next((cat for cat, w in widths.items() if w in sizes), "projections")
        op = op.cpu_parent
    return "matmul"


def _gpu_work(evt, device_type) -> bool:
    """A kernel, copy or fill on the GPU (not the GPU mirror of a host range, a sync or the profiler's overhead)."""
    kind = str(getattr(evt, "activity_type", "") or "").lower()
    return evt.device_type == device_type and not getattr(evt, "is_user_annotation", False) and \
        not any(word in kind for word in ("annotation", "sync", "overhead"))


def launched_by(cpu_ops, kernels) -> list[tuple[str, object, float]]:
    """``(name, launching op or None, device ms)`` of each of ``kernels``: the profiler lists under each host op the
    kernels it launched (``FunctionEvent.kernels``, by correlation id: what every torch release keeps, where the
    kernel events' own link to their op is not), each taken once; a kernel no op claims (launched outside every
    profiled op) has no launcher and is told by its name."""
    left = collections.Counter(k.name for k in kernels)
    units = []
    for op in cpu_ops:
        for launched in getattr(op, "kernels", ()):
            if left[launched.name] > 0:
                left[launched.name] -= 1
                units.append((launched.name, op, launched.duration / 1e3))
    for k in kernels:
        if left[k.name] > 0:
            left[k.name] -= 1
            units.append((k.name, None, k.time_range.elapsed_us() / 1e3))
    return units


def step_profile(events, step_ms: float, cuda: bool, top: int = 10, widths: dict[str, int] | None = None) -> dict:
    """What one profiled step spent, from ``torch.profiler``'s ``prof.events()``; ``step_ms``: its host wall time.

    GPU (``cuda``): each kernel, copy and fill's device time in its category (``classify``, with the host op that
    launched it); ``gpu_busy_ms``: the union of their intervals (kernels on several streams overlap, so the
    categories may add past it). CPU: each op's self CPU time in its category; busy: their sum (the host is the
    device). ``host_bound_ms = max(0, step_ms - gpu_busy_ms)``: the time the device idled (waiting on the host,
    or the host outside ops on CPU). ``top``: the largest names with their category and milliseconds. ``widths``:
    the model's widths that tell its matrix products apart (``gemm_category``)."""
    from torch.autograd import DeviceType

    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if cuda:
        kernels = [e for e in events if _gpu_work(e, DeviceType.CUDA)]
        units = launched_by(cpu_ops, kernels)
        busy = interval_total(interval_union((k.time_range.start, k.time_range.end) for k in kernels)) / 1e3
    else:
        units = [(e.name, e, e.self_cpu_time_total / 1e3) for e in cpu_ops]
        busy = sum(ms for _, _, ms in units)
    if widths is not None:  # a width two categories share names neither
        widths = {cat: w for cat, w in widths.items() if list(widths.values()).count(w) == 1}
    spent = dict.fromkeys(PROFILE_CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    inside: dict = {}
    for name, op, ms in units:
        cat = classify(name, op, inside, widths)
        spent[cat] += ms
        by_name[name, cat] = by_name.get((name, cat), 0.0) + ms
    largest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"source": "CUDA kernels (device time)" if cuda else "CPU ops (self CPU time)", "step_ms": step_ms,
            "ms": spent, "gpu_busy_ms": busy, "host_bound_ms": max(0.0, step_ms - busy), "events": len(units),
            "top": [{"name": name[:160], "category": cat, "ms": ms} for (name, cat), ms in largest]}


def profile_spent(p: dict) -> list[tuple[str, float, float]]:
    """``(name, ms, % of the step)`` of each category, then of the GPU's idle time."""
    spent = [*((cat, p["ms"].get(cat, 0.0)) for cat in PROFILE_CATEGORIES), ("idle", p["host_bound_ms"])]
    return [(name, ms, 100 * ms / p["step_ms"]) for name, ms in spent]


def profile_line(p: dict) -> str:
    """A profile in one line: each category's and the idle time's share of the step."""
    shares = ", ".join(f"{name} {pct:.0f}%" for name, _, pct in profile_spent(p))
    return f"profiled step {p['step_ms']:,.1f} ms: {shares}"


# -- one measurement ---------------------------------------------------------------------------------


class Runner:
    def __init__(self, args, env, comm, shape) -> None:
        import torch

        self.torch, self.args, self.env, self.comm, self.shape = torch, args, env, comm, shape
        self.cuda = env.device.type == "cuda"
        self.bf16 = args.precision == "bf16" or (args.precision == "auto" and self.cuda)
        self.mesh = None
        self.state: dict = {}
        self.rungs = allowed_rungs(args)  # the memory ladder's rungs the flags allow

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def max_over_ranks(self, value: float) -> float:
        import torch.distributed as dist

        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.env.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def agree(self, error: str | None) -> str | None:
        import torch.distributed as dist

        everyone: list = [None] * self.env.world_size
        dist.all_gather_object(everyone, error)
        return next((e for e in everyone if e is not None), None)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def training(self) -> str:
        a = self.args
        prec = "bf16 compute" if self.bf16 else "fp32 compute"
        how = (f"FSDP2 over {self.env.world_size} rank(s): fp32 master weights, gradients and AdamW state sharded, "
               f"{prec}" + (" (MixedPrecisionPolicy param bf16, reduce fp32)" if self.bf16 else "")) if a.fsdp else \
            (f"fp32 weights on every rank, {'bf16 autocast' if self.bf16 else 'fp32'}, gradients all-reduced")
        return f"{how}; {self.savings()}; eager; AdamW lr {a.lr} (warmup {a.lr_warmup}), clip {a.clip}"

    def savings(self) -> str:
        """The memory savings the flags allow, in words (what ran is each record's ``checkpointing``)."""
        a = self.args
        rungs = self.rungs
        tiles = f"MLP in tiles of {a.mlp_tile} tokens ({self.mlp_impl()})"
        if len(rungs) == 1:
            plan = rungs[0]
            parts = ["per-layer activation checkpointing" if plan.checkpointing else "no activation checkpointing"]
            parts += [tiles] if plan.tiled_mlp else []
            parts += ["checkpoints offloaded to host"] if plan.offload else []
            return ", ".join(parts)
        return (f"memory savings per length: the first of {', '.join(p.label for p in rungs)} predicted to fit in "
                f"{a.memory_limit:.0%} of the GPU (layer: per-layer activation checkpointing; tiled-mlp: {tiles}; "
                f"offload: checkpointed layer inputs in host memory; each record's `checkpointing` says which ran)")

    def mlp_impl(self) -> str:
        from dilated_attention.models.hf_training import deepspeed_tiled_mlp

        return resolved_impl(self.args.mlp_impl, deepspeed_tiled_mlp)

    def run(self, variant: str, n: int, warmup: int, steps: int, profile: bool = False) -> dict:
        """Build the model with ``variant``'s attention, train ``warmup + steps`` steps at ``n`` tokens; ``profile``:
        then one more step under ``torch.profiler``, summarized in the record's ``profile`` (``step_profile``)."""
        import torch.distributed as dist

        from dilated_attention.models.hf_training import (
            SequenceParallelLoss,
            build_llama,
            learnable_tokens,
            make_optimizer,
            packed_batch,
            sequence_parallel_batch,
            shard_model,
            tile_mlp,
            train_step,
        )

        torch, a, env, k = self.torch, self.args, self.env, self.env.world_size
        if a.packed and variant not in PACKED:
            raise Skip(f"{variant} does not take packed documents here (only a full mask of the row, which does not "
                       f"fit at this length); --packed runs {', '.join(PACKED)}")
        name, how = attention_for(variant, a, self.shape, n, env, self.comm, self.state)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        group = dist.group.WORLD if k > 1 else None
        grad_comm = self.comm if (k > 1 and not a.fsdp) else None
        autocast = self.bf16 and not a.fsdp
        cp = variant == "torch_cp"
        times, losses = [], []
        module = opt = sched = spent = None
        try:
            plan = self.memory_plan(n)
            lm = build_llama(self.shape, name, n, a.seed, device=env.device, checkpointing=plan.checkpointing,
                             offload=plan.offload)
            if plan.tiled_mlp:
                tile_mlp(lm, rows=a.mlp_tile, impl=a.mlp_impl)
            module = SequenceParallelLoss(lm, chunk_rows=a.loss_chunk, loss_impl=a.loss_impl)
            del lm
            if a.fsdp:
                shard_model(module, bf16=self.bf16)
            opt, sched = make_optimizer(module.parameters(), lr=a.lr, warmup_steps=a.lr_warmup,
                                        total_steps=max(1000, warmup + steps))

            def step(i: int, watch=None) -> tuple[float, float]:
                """Training step ``i`` after a barrier: (host seconds between device syncs, loss); ``watch``: a
                context (the profiler) entered after the barrier, around the timed part."""
                if a.packed:
                    batch = packed_batch(documents(a, n), self.shape.vocab, a.seed, i, self.comm, env.device)
                else:
                    tokens = learnable_tokens(a.batch, n, self.shape.vocab, a.seed, i)
                    batch = sequence_parallel_batch(tokens, None if cp else self.comm, env.device)
                self.sync()
                dist.barrier()
                with watch if watch is not None else _nullcontext():
                    t0 = time.perf_counter()
                    with self.cp_context(batch) if cp else _nullcontext():
                        loss = train_step(module, opt, sched, batch, loss_group=group, grad_comm=grad_comm,
                                          autocast_bf16=autocast, clip=a.clip)
                    self.sync()
                    seconds = time.perf_counter() - t0
                return seconds, loss

            for i in range(warmup + steps):
                seconds, loss = step(i)
                times.append(self.max_over_ranks(seconds))
                losses.append(loss)
            # (the largest rank's: find_max's stop decisions read these and must agree on every rank)
            state_gib = self.max_over_ranks(torch.cuda.memory_allocated() / 2**30) if self.cuda else None
            peak = self.max_over_ranks(torch.cuda.max_memory_allocated() / 2**30) if self.cuda else None
            if profile:  # one more step, the same, under the profiler (this rank's; rank 0's is saved)
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as profiler

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
                prof = profiler(activities=activities, record_shapes=True)  # (shapes: which matrix product)
                seconds, _ = step(warmup + steps, watch=prof)
                widths = {"logits": self.shape.vocab, "mlp": self.shape.mlp}
                if {a.batch, n // k} & set(widths.values()):  # a product's sizes hold the tokens too: ambiguous
                    widths = None
                spent = step_profile(prof.events(), 1e3 * seconds, self.cuda, widths=widths)
        finally:
            del module, opt, sched
            self.free()
        timed = times[warmup:]
        step_s = statistics.median(timed)
        flops = step_flops(a, self.shape, variant, n)
        return {"variant": variant, "gpus": k, "seq_len": n, "tokens_per_gpu": n // k, "batch": a.batch,
                "step_s": step_s, "step_times_s": times, "tokens_per_s": a.batch * n / step_s,
                "peak_gib": peak, "state_gib": state_gib, "losses": losses, "step_tflop": flops / 1e12,
                "mfu": flops / (step_s * k * a.peak_tflops * 1e12), "attention": how,
                "checkpointing": plan.label, "predicted_gib": self.predicted(plan, n) / 2**30,
                **({"profile": spent} if profile else {})}

    def predicted(self, plan: MemoryPlan, n: int) -> float:
        """``predicted_bytes`` of ``plan`` at ``n`` tokens per sequence on this run's ranks."""
        k = self.env.world_size
        return predicted_bytes(self.shape, self.args.batch * n // k, k, plan)

    def capacity(self) -> float | None:
        """``--memory-limit`` of the GPU in bytes (None on CPU)."""
        if not self.cuda:
            return None
        return self.args.memory_limit * self.torch.cuda.get_device_properties(self.env.device).total_memory

    def memory_plan(self, n: int) -> MemoryPlan:
        """The first allowed rung whose predicted peak at ``n`` tokens fits ``--memory-limit`` of the GPU, else the
        last (the cheapest in memory; it may still run out). On CPU the first. The same answer on every rank
        (the same formula of the same numbers: no collective)."""
        k = self.env.world_size
        return choose_plan(self.shape, self.args.batch * n // k, k, self.rungs, self.capacity())

    def cp_context(self, batch: dict):
        """torch's context parallel over the world: shards the whole-sequence inputs in place (load-balanced
        head-tail order, the same for tokens, positions and labels), SDPA inside runs its ring."""
        import contextlib

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if self.mesh is None:
            self.mesh = init_device_mesh("cuda", (self.env.world_size,))
        bufs = [batch["input_ids"], batch["position_ids"], batch["labels"]]
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]))
        stack.enter_context(context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1],
                                             no_restore_buffers=set(bufs)))
        return stack


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def failure(exc: BaseException, limit: int = 300) -> str:
    name = type(exc).__name__
    if "OutOfMemory" in name or "out of memory" in str(exc).lower():
        return f"OOM: {str(exc).splitlines()[0][:limit]}"
    return f"{name}: {str(exc)[:limit]}"


def guarded(runner: Runner, fn: Callable[[], dict]) -> tuple[dict | None, str | None]:
    """``fn()`` on every rank; any rank's failure is every rank's ``(None, reason)``."""
    result, error = None, None
    try:
        result = fn()
    except Skip as exc:
        error = str(exc)
    except Exception as exc:  # out of memory, a peer's API: data, not the end of the run
        error = failure(exc)
    runner.free()
    error = runner.agree(error)
    return (None, error) if error else (result, None)


# -- results -----------------------------------------------------------------------------------------


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def merge(old: dict | None, meta: dict, k: int, cases: list[tuple[int, str]], searched: list[str]) -> dict:
    """The results file with this run's meta under its GPU count. Of the old records, those this run measures
    again (same GPU count, length and variant; same GPU count and variant for ``--find-max``) are dropped, the
    rest kept: several commands at one GPU count fill one file. ``meta["commands"]`` lists those behind the kept
    records (all, where an older record does not say which made it) and this run's."""
    data = {"runs": {}, "records": [], "skipped": [], "find_max": []}
    again = {(k, n, v) for n, v in cases}
    if old:
        data["runs"] = dict(old.get("runs", {}))
        for key in ("records", "skipped"):
            data[key] = [r for r in old.get(key, []) if (r.get("gpus"), r.get("seq_len"), r.get("variant")) not in again]
        data["find_max"] = [f for f in old.get("find_max", []) if not (f.get("gpus") == k and f["variant"] in searched)]
    before = data["runs"].get(str(k), {})
    # the commands that remake what the file keeps: a command whose records were all measured again is dropped
    kept = [r for r in data["records"] if r.get("gpus") == k]
    made = {r.get("provenance", {}).get("command") for r in kept}
    commands = [c for c in before.get("commands", []) if c in made or None in made] + [meta["command"]]
    data["runs"][str(k)] = {**meta, "commands": list(dict.fromkeys(commands)),
                            "patterns": {**before.get("patterns", {}), **meta["patterns"]}}
    return data


def best_dense(records: list[dict], k: int, n: int) -> dict | None:
    dense = [r for r in records if r["gpus"] == k and r["seq_len"] == n and r["variant"] in DENSE]
    return max(dense, key=lambda r: r["tokens_per_s"]) if dense else None


def render_md(data: dict) -> str:
    lines = ["# Model benchmark: Llama trained sequence parallel, dilated attention vs dense peers", ""]
    for k, meta in sorted(data["runs"].items(), key=lambda kv: int(kv[0])):
        versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items() if version)
        commands = "; ".join(f"`{c}`" for c in meta.get("commands", [meta["command"]]))
        data_line = f"; data: {meta['data']}" if meta.get("data") else ""
        lines += [f"- {k} x {meta['gpu']}: {meta['model']}{data_line}; {meta['training']}; timing: {meta['timing']}; "
                  f"MFU against {meta['peak_tflops']} TFLOP/s per GPU ({meta['flops']}); {versions}. Patterns of "
                  f"ours: {meta['pattern_rule']}. Code: {meta.get('code', 'not recorded')}; measured "
                  f"{meta['date']}. Commands: {commands}."]
    lines += ["", "| GPUs | tokens/seq | variant | step s | tokens/s | vs best dense | MFU | peak GiB/GPU | checkpointing "
              "| loss first -> last |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    ordered = sorted(data["records"], key=lambda r: (r["gpus"], r["seq_len"], VARIANTS.index(r["variant"])))
    for r in ordered:
        ref = best_dense(data["records"], r["gpus"], r["seq_len"])
        vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x {ref['variant']}" \
            if ref and r["variant"] == "ours" else ""
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        lines.append(f"| {r['gpus']} | {r['seq_len']:,} | {r['variant']} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {vs} | {100 * r['mfu']:.1f}% | {peak} | {r.get('checkpointing', 'layer')} | "
                     f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    profiled = [r for r in ordered if r.get("profile")]
    if profiled:
        lines += ["", "What a step spends: one more step of each record under torch.profiler (rank 0's), in ms and "
                  "share of that step. GPU time by kernel category; GPU idle = step - time any kernel runs (the GPU "
                  "waits on the host). The profiler slows the step: read the shares, not the times. Kernels on "
                  "several streams overlap, so the shares may add past 100%. On CPU: ops' self CPU time, and idle "
                  "is the host outside ops.", "",
                  "| GPUs | tokens/seq | variant | step ms | " + " | ".join(PROFILE_CATEGORIES) + " | GPU idle |",
                  "| ---: | ---: | --- | ---: |" + " ---: |" * (len(PROFILE_CATEGORIES) + 1)]
        for r in profiled:
            p = r["profile"]
            cells = [f"{ms:,.1f} ({pct:.0f}%)" for _, ms, pct in profile_spent(p)]
            lines.append(f"| {r['gpus']} | {r['seq_len']:,} | {r['variant']} | {p['step_ms']:,.1f} | "
                         + " | ".join(cells) + " |")
    if data["find_max"]:
        lines += ["", "Longest trainable sequence (doubling until out of memory):", "",
                  "| GPUs | variant | longest tokens/seq | its step s | its checkpointing | stopped at | why |",
                  "| ---: | --- | ---: | ---: | --- | ---: | --- |"]
        for f in data["find_max"]:
            step = f"{f['step_s']:.2f}" if f.get("step_s") else "-"
            longest = f"{f['max_seq_len']:,}" if f.get("max_seq_len") else "-"
            stop = f"{f['stopped_at']:,}" if f.get("stopped_at") else "-"
            lines.append(f"| {f['gpus']} | {f['variant']} | {longest} | {step} | {f.get('checkpointing', '-')} | {stop} "
                         f"| {f['why']} |")
    if data["skipped"]:
        lines += ["", "Not measured:", ""]
        lines += [f"- {s['gpus']} GPU(s), {s['seq_len']:,} tokens, {s['variant']}: {s['reason']}" for s in data["skipped"]]
    return "\n".join(lines) + "\n"


def render_png(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"ours": "o-", "sdpa": "s--", "sdpa_cudnn": "D--", "flash4": "x--", "ulysses": "^--", "torch_cp": "v--"}
    for k in sorted({r["gpus"] for r in data["records"]}):
        for v in VARIANTS:
            rows = sorted((r for r in data["records"] if r["gpus"] == k and r["variant"] == v),
                          key=lambda r: r["seq_len"])
            if rows:
                ax.plot([r["seq_len"] for r in rows], [r["tokens_per_s"] for r in rows], styles[v],
                        label=f"{v} x{k}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("training tokens/s (all GPUs)")
    gpus = ", ".join(sorted({m["gpu"] for m in data["runs"].values()}))
    ax.set_title(f"Llama training throughput, {gpus}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(data: dict, json_path: str) -> None:
    """The JSON, then its table and plot (a failure there is reported, never the end of a run: --plot-only)."""
    base = os.path.splitext(json_path)[0]
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    try:
        with open(base + ".md", "w") as f:
            f.write(render_md(data))
        if data["records"]:
            render_png(data, base + ".png")
    except Exception as exc:  # matplotlib missing (the bench extra), or a table bug: the JSON is written
        print(f"bench_model: no table/plot ({type(exc).__name__}: {exc}); rerun with --plot-only {json_path}",
              file=sys.stderr)


# -- main --------------------------------------------------------------------------------------------


def find_max(runner: Runner, variant: str, start: int, save: Callable[[], None], data: dict, progress,
             measured: list[dict] = ()) -> None:
    """Double the length from ``start`` until out of memory, a predicted out of memory, or the time budget. Each
    size runs on its own rung of the memory ladder (``Runner.memory_plan``). Predicted out of memory: on the rung
    the last size ran on, its measured peak extrapolated linearly; on another rung, ``predicted_bytes``.
    ``measured``: this run's records; one of ``variant`` at ``start`` is that size, not run again."""
    a, k = runner.args, runner.env.world_size
    limit = runner.capacity()
    entry = {"variant": variant, "gpus": k, "max_seq_len": None, "step_s": None, "peak_gib": None,
             "stopped_at": None, "why": PENDING, "sizes": []}
    data["find_max"].append(entry)

    def found(res: dict, **how) -> None:
        entry["sizes"].append({"seq_len": res["seq_len"], "step_s": res["step_s"], "peak_gib": res["peak_gib"],
                               "tokens_per_s": res["tokens_per_s"], "mfu": res["mfu"],
                               "checkpointing": res["checkpointing"], **how})
        entry.update(max_seq_len=res["seq_len"], step_s=res["step_s"], peak_gib=res["peak_gib"], mfu=res["mfu"],
                     checkpointing=res["checkpointing"])

    t_start, n, last = time.perf_counter(), start, None
    record = next((r for r in measured if r["variant"] == variant and r["gpus"] == k and r["seq_len"] == start), None)
    if record is not None:
        found(record, measured_as="this run's record")
        n, last = 2 * start, record
    while True:
        plan = runner.memory_plan(n)
        fits = ""
        if limit is not None:
            if last is not None and last["peak_gib"] is not None and last["checkpointing"] == plan.label:
                predicted = last["state_gib"] + (last["peak_gib"] - last["state_gib"]) * n / last["seq_len"]
                how = f"{plan.label}, extrapolated from {last['seq_len']:,}"
            else:
                predicted, how = runner.predicted(plan, n) / 2**30, f"{plan.label}, predicted_bytes"
            if predicted > limit / 2**30:
                entry.update(stopped_at=n, why=f"predicted OOM: {predicted:.0f} GiB ({how}) > {a.memory_limit:.0%} "
                                               f"of the GPU's {limit / a.memory_limit / 2**30:.0f} GiB")
                break
            fits = f"; its peak, {predicted:.0f} GiB ({how}), would fit"
        if last is not None:
            ratio = step_flops(a, runner.shape, variant, n) / step_flops(a, runner.shape, variant, last["seq_len"])
            # the slowest rank's clock decides: every rank stops at the same size (a rank that stopped alone
            # would leave its peers waiting in the next size's collectives)
            elapsed = runner.max_over_ranks(time.perf_counter() - t_start)
            if elapsed + 2.5 * last["step_s"] * ratio > a.time_budget:
                entry.update(stopped_at=n, why=f"time budget ({a.time_budget:.0f} s): a step of {n:,} tokens would "
                                               f"take about {last['step_s'] * ratio:.0f} s{fits}")
                break
        if n % k:
            entry.update(stopped_at=n, why=f"{n} tokens do not divide over {k} ranks")
            break
        progress.set_postfix_str(f"find-max {variant} {n} ({plan.label})")
        save()
        res, err = guarded(runner, lambda: runner.run(variant, n, warmup=1, steps=1))
        progress.update()
        if err:
            entry.update(stopped_at=n, why=err)
            break
        found(res)
        last = res
        n *= 2
    entry["seconds"] = time.perf_counter() - t_start
    save()


def code_version(given: str | None) -> str:
    """The code that ran: ``given`` (``--code-version``), else git's commit and its date (with local changes
    said), else unknown (a copied tree without git history)."""
    if given:
        return given
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", root, *words], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        head = git("log", "-1", "--format=%h %cI")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git history here: pass --code-version)"
    return head + (" with local changes" if changed else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        data = load(args.plot_only)
        write_outputs(data, args.plot_only)
        print(f"wrote {os.path.splitext(args.plot_only)[0]}.md and .png")
        return 0
    # long sequences: less fragmentation (set before CUDA starts)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from dilated_attention.launch_utils import init_distributed

    env = init_distributed(args.device, seed=args.seed, timeout=900)
    import torch
    from tqdm import tqdm

    from dilated_attention.comm import get_backend
    from dilated_attention.models.hf_training import LlamaShape, deepspeed_tiled_loss

    k = env.world_size
    comm = get_backend("collective") if k > 1 else None
    shape = LlamaShape(args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.mlp, args.vocab)
    runner = Runner(args, env, comm, shape)
    cuda = runner.cuda
    device_name = torch.cuda.get_device_name(env.device) if cuda else "cpu"
    tag = (args.tag or (gpu_tag(device_name) if cuda else "cpu")) + ("-packed" if args.packed else "")
    path = os.path.join(args.out, f"model_{tag}.json")
    loss_impl = resolved_impl(args.loss_impl, deepspeed_tiled_loss)
    meta = {
        "gpu": device_name, "gpus": k, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "code": code_version(args.code_version),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda if cuda else None,
                     "cudnn": torch.backends.cudnn.version() if cuda else None,
                     **package_versions("transformers", "deepspeed", "flash-attn-4", "triton")},
        "model": f"LlamaForCausalLM hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads of "
                 f"{shape.head_dim}, {shape.kv_heads} KV heads, MLP {shape.mlp}, vocab {shape.vocab}: "
                 f"{shape.params() / 1e6:,.1f}M parameters; batch {args.batch}",
        "shape": dataclasses.asdict(shape),
        "training": runner.training() + f"; loss in tiles of {args.loss_chunk} rows ({loss_impl})",
        "timing": f"median of {args.steps} steps after {args.warmup} warm-up steps; a step is forward, backward, "
                  "clip, AdamW, timed on the host between device syncs, slowest rank",
        "pattern_rule": f"w = [{args.first_segment}, x{args.segment_factor}, ...] while shorter than N, then N; "
                        f"r = [1, x{args.rate_factor}, ...]",
        "patterns": {str(n): dict(zip(("segments", "rates"), patterns(args, n))) for n in args.seq_lens},
        **({"data": f"one packed row of documents, lengths log-uniform from {args.packed_shortest} tokens to the "
                    f"whole row (seed {args.seed}: " + "; ".join(f"N={n}: {len(documents(args, n)) - 1} documents"
                                                                 for n in args.seq_lens) + ")"}
           if args.packed else {}),
        "peak_tflops": args.peak_tflops,
        "flops": "6 x matrix weights x tokens + 12 x head_dim x scored (query, key) pairs per layer; recompute "
                 "not counted",
        "notes": runner.state.setdefault("notes", []),
    }
    cases = [(n, v) for n in args.seq_lens for v in args.variants]
    data = {"runs": {}, "records": [], "skipped": [], "find_max": []}
    if env.rank == 0:
        old = load(path) if os.path.exists(path) and not args.fresh else None
        data = merge(old, meta, k, cases, args.find_max)
        meta = data["runs"][str(k)]

    def save() -> None:
        if env.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            write_outputs(data, path)

    progress = tqdm(total=len(cases), disable=env.rank != 0, desc=f"model x{k}", dynamic_ncols=True)
    measured = []  # this run's records (find_max starts from them)
    for n, variant in cases:
        progress.set_postfix_str(f"{variant} {n}")
        pending = {"variant": variant, "gpus": k, "seq_len": n, "reason": PENDING}
        data["skipped"].append(pending)
        save()
        res, err = guarded(runner, lambda: runner.run(variant, n, args.warmup, args.steps, profile=args.profile))
        data["skipped"].remove(pending)
        if err:
            data["skipped"].append({"variant": variant, "gpus": k, "seq_len": n, "reason": err})
            if env.rank == 0:
                progress.write(f"  {variant:8s} N={n:>9,d} x{k}: skipped: {err}")
        else:
            # what made it, kept with it: one GPU count's records may come from several commands and installs
            res["provenance"] = {key: meta[key] for key in ("command", "code", "date", "versions")}
            data["records"].append(res)
            measured.append(res)
            if env.rank == 0:
                peak = f"{res['peak_gib']:.1f} GiB" if res["peak_gib"] is not None else "-"
                progress.write(f"  {variant:8s} N={n:>9,d} x{k}: {res['step_s']:.3f} s/step, "
                               f"{res['tokens_per_s']:,.0f} tokens/s, MFU {100 * res['mfu']:.1f}%, peak {peak} "
                               f"({res['checkpointing']}), "
                               f"loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}")
                if res.get("profile"):
                    progress.write(f"  {'':8s} {profile_line(res['profile'])}")
        save()
        progress.update()
    progress.close()
    for variant in args.find_max:
        start = args.find_max_start or max(args.seq_lens)
        bar = tqdm(disable=env.rank != 0, desc=f"find-max {variant} x{k}", dynamic_ncols=True)
        find_max(runner, variant, start, save, data, bar, measured)
        bar.close()
    save()
    if env.rank == 0:
        print(f"wrote {path} (+ .md, .png): {len(data['records'])} records, {len(data['skipped'])} skipped")
        for f in data["find_max"]:
            if f["gpus"] == k:
                print(f"  longest {f['variant']} x{k}: {f['max_seq_len']} tokens "
                      f"({f['step_s'] or 0:.2f} s/step, {f.get('checkpointing', '-')}); stopped at {f['stopped_at']}: "
                      f"{f['why']}")
    env.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
