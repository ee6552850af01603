#!/usr/bin/env python
"""Train a small LongNet-style causal LM with sequence parallelism (dilated attention ring).

    torchrun --nproc_per_node=2 launch/train_lm.py --backend deepspeed --steps 20          # CPU, gloo
    torchrun --nproc_per_node=2 launch/train_lm.py --backend collective --dtype bf16 \\
        --seq-len 65536 --embed-dim 1024 --heads 16 --segments 2048,8192,65536 --rates 1,2,4  # GPUs, NCCL

Ranks form ``world / sp_size`` data-parallel replicas of ``sp_size`` consecutive
ranks each; a replica's ranks hold contiguous shards of its sequences (global
positions). The loss is the mean over the global batch's tokens. Gradients:
summed over the sequence-parallel group, averaged over data parallel -- by us
(collective, fairscale) or by the DeepSpeed engine (ZeRO 0/1/2 with DeepSpeed's
sequence-parallel ``mpu``). Rank 0 prints the loss of every step and tokens/s.
Without torchrun it runs as one process (no sequence parallelism).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, _ROOT)


from rank_zero import RankZeroParser, quiet_other_ranks, run_job  # noqa: E402

from dilated_attention.launch_utils import int_list  # noqa: E402

quiet_other_ranks()  # rank 0 speaks for the job



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Arguments, checked before any process group exists (``WORLD_SIZE`` comes from torchrun)."""
    p = RankZeroParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["collective", "fairscale", "deepspeed"], default="collective")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=2, help="DeepSpeed ZeRO stage (deepspeed only)")
    p.add_argument("--sp-size", type=int, default=0, help="sequence-parallel group size (default: the world)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=0, help="global batch in sequences (default: one per replica)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--segments", type=int_list, default=(32, 256), help="segment lengths, e.g. 32,256")
    p.add_argument("--rates", type=int_list, default=(1, 4), help="dilation rates, e.g. 1,4")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast (DeepSpeed: its bf16 mode)")
    p.add_argument("--kernel", default="auto", help="auto | fused | sdpa | reference")
    p.add_argument("--data", choices=["arith", "random"], default="arith", help="arith is learnable: the loss falls")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "vocab", "embed_dim", "heads", "layers", "log_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.sp_size < 0 or args.batch < 0:
        p.error("--sp-size and --batch must be >= 0")
    if args.embed_dim % args.heads:
        p.error(f"--embed-dim ({args.embed_dim}) must be divisible by --heads ({args.heads})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.sp = args.sp_size or world
    if world % args.sp:
        p.error(f"--sp-size ({args.sp}) must divide the number of ranks ({world})")
    args.dp = world // args.sp
    args.batch = args.batch or args.dp
    if args.batch % args.dp:
        p.error(f"--batch ({args.batch}) must be divisible by the data-parallel size ({args.dp})")
    if args.seq_len % args.sp:
        p.error(f"--seq-len ({args.seq_len}) must be divisible by --sp-size ({args.sp})")
    from dilated_attention.patterns import validate_patterns

    try:  # the patterns' own rules; rules that depend on the strategy are checked by the first call
        validate_patterns(args.segments, args.rates, args.seq_len)
    except (TypeError, ValueError) as exc:
        p.error(f"--segments/--rates: {exc}")
    args.prog = p.prog
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dilated_attention.launch_utils import init_distributed

    env = init_distributed(args.device)
    return run_job(args.prog, env, lambda: train(args, env))


def train(args: argparse.Namespace, env) -> None:
    import torch
    import torch.distributed as dist

    from dilated_attention.comm import get_backend
    from dilated_attention.distributed import all_reduce_gradients, shard_sequence
    from dilated_attention.models import lm

    device, world, rank = env.device, env.world_size, env.rank
    use_cuda = device.type == "cuda"
    sp, dp, batch = args.sp, args.dp, args.batch
    micro, local_len = batch // dp, args.seq_len // sp
    sp_rank, dp_rank = rank % sp, rank // sp  # SP groups are consecutive ranks (as DeepSpeed and fairscale build them)
    cfg = lm.LMConfig(vocab_size=args.vocab, seq_len=args.seq_len, embed_dim=args.embed_dim, num_heads=args.heads,
                      num_layers=args.layers, segment_lengths=args.segments, dilation_rates=args.rates)
    bf16 = args.dtype == "bf16"

    engine = model = opt = None
    if args.backend == "deepspeed":
        engine, comm, _, _ = lm.deepspeed_setup(cfg, sp, args.zero_stage, micro, args.seed, args.optimizer,
                                                args.lr, args.kernel, bf16=bf16)
        step_model = engine
    else:
        comm = None
        if sp > 1:
            if args.backend == "fairscale":
                from fairscale.nn.model_parallel import initialize as mp

                mp.initialize_model_parallel(sp)  # its model-parallel group is our SP group
                comm = get_backend("fairscale")
            else:
                groups = [dist.new_group(list(range(i * sp, (i + 1) * sp))) for i in range(dp)]
                comm = get_backend("collective", groups[dp_rank])
        world_comm = get_backend("collective")  # gradient sums over the world (SP x DP)
        model = lm.build_model(cfg, comm, args.seed, args.kernel).to(device)
        opt = lm.make_optimizer(model.parameters(), args.optimizer, args.lr)
        step_model = model
    if rank == 0:
        params = sum(p.numel() for p in (engine.module if engine else model).parameters())
        print(f"[train_lm] backend={args.backend} world={world} sp={sp} dp={dp} global_batch={batch} "
              f"seq_len={args.seq_len} params={params / 1e6:.2f}M dtype={args.dtype} device={device.type}"
              + (f" zero_stage={args.zero_stage}" if engine else ""), flush=True)

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and engine is None)
    step_times, tokens = [], batch * args.seq_len
    for step in range(args.steps):
        inputs, targets = lm.make_batch(cfg, batch, args.seed, step, args.data)
        rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
        inputs, targets = inputs[rows], targets[rows]
        if comm is not None:
            inputs, targets = shard_sequence(inputs, comm), shard_sequence(targets, comm)
        inputs, targets = inputs.to(device), targets.to(device)
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            loss = lm.local_loss(step_model, inputs, targets, sp_rank * local_len, micro * args.seq_len)
        if engine is not None:
            engine.backward(loss)  # DeepSpeed: sum over SP, mean over DP (its mpu protocol)
            engine.step()
        else:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            all_reduce_gradients(model, world_comm)  # world sum = SP sum of DP sums ...
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(dp)  # ... / dp = mean over data-parallel replicas
            opt.step()
        total = loss.detach().float().reshape(1).clone()
        dist.all_reduce(total)  # also the end of this step for every rank
        if use_cuda:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[train_lm] step {step + 1:4d}/{args.steps}  loss {total.item() / dp:.4f}  "
                  f"{tokens / step_times[-1]:,.0f} tok/s  {1e3 * step_times[-1]:.1f} ms", flush=True)
    if rank == 0:
        steady = step_times[2:] or step_times
        med = statistics.median(steady)
        print(f"[train_lm] done: median step {1e3 * med:.1f} ms, {tokens / med:,.0f} tokens/s "
              f"(global, {len(steady)} steps after warm-up)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
