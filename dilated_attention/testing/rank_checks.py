"""The harness's checks beyond the cases: ranks that disagree or hold an invalid input all raise, unchecked
calls give the same bits, and (GPUs) CUDA graphs and ``torch.compile(mode="reduce-overhead")`` replay
what the eager call gives."""

from __future__ import annotations

import torch

from ..comm import get_backend
from ..functional import dilated_attention
from .cases import Result
from .graphs import capture, eager_and_compiled, replay_problem


def check_disagreement(backend_name: str, group, device: torch.device) -> Result:
    """Ranks that disagree on the call must all raise ValueError, none may hang."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    n_local = 16
    q = torch.randn(1, n_local, 2, 8, dtype=torch.float64, device=device)
    segs = (8, n_local * comm.world_size) if rank == 0 else (16, n_local * comm.world_size)
    try:
        dilated_attention(q, q, q, segs, (1, 2), comm=comm)
    except ValueError as exc:
        # the message shows the differing values themselves, not hashes
        ok = "disagree" in str(exc) and f"segment_lengths: rank 0=[8, {n_local * comm.world_size}]" in str(exc)
        return Result("disagreeing-ranks", backend_name, rank, comm.world_size, ok, message=str(exc)[:200])
    return Result("disagreeing-ranks", backend_name, rank, comm.world_size, False, message="no error raised")


def check_one_rank_invalid(backend_name: str, group, device: torch.device) -> Result:
    """A rank whose own input is invalid raises its error; the others raise too, instead of waiting."""
    comm = get_backend(backend_name, group)
    rank = comm.rank
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, device=device)
    rates = (1, 5) if rank == comm.world_size - 1 else (1, 2)  # 5 divides no segment of 16 K rows
    try:
        dilated_attention(q, q, q, (8, 16 * comm.world_size), rates, comm=comm)
    except ValueError as exc:
        ok = ("dilation_rates" in str(exc)) if rank == comm.world_size - 1 else ("rejected" in str(exc))
        return Result("one-rank-invalid", backend_name, rank, comm.world_size, ok, message=str(exc)[:200])
    return Result("one-rank-invalid", backend_name, rank, comm.world_size, False, message="no error raised")


def check_unchecked_calls(backend_name: str, group, device: torch.device) -> Result:
    """``check_calls=False`` skips only the signature gather: results are bitwise the same."""
    checked, unchecked = get_backend(backend_name, group), get_backend(backend_name, group, check_calls=False)
    rank, size = checked.rank, checked.world_size
    g = torch.Generator().manual_seed(7)
    full = torch.randn(1, 16 * size, 4, 8, generator=g, dtype=torch.float64)
    mine = full[:, rank * 16 : (rank + 1) * 16].to(device)  # on the harness's device: NCCL moves CUDA tensors only
    a = dilated_attention(mine, mine, mine, (8, 16 * size), (1, 4), causal=True, comm=checked)
    b = dilated_attention(mine, mine, mine, (8, 16 * size), (1, 4), causal=True, comm=unchecked)
    same = torch.equal(a, b)
    return Result("unchecked-calls", backend_name, rank, size, same, message="" if same else "results differ")


def check_cuda_graph(backend_name: str, group, device: torch.device) -> list[Result]:
    """GPUs: a ring and a head call's forward+backward captured into one CUDA graph (after an eager warm-up,
    with the default call checks) replay bit for bit what the eager call gives, on new input values."""
    comm = get_backend(backend_name, group)
    rank, size = comm.rank, comm.world_size
    results = []
    for strategy in ("ring", "head"):
        shape = (1, 16, 4 * size, 16)
        leaves = [torch.zeros(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        dout = torch.zeros(shape, device=device, dtype=torch.bfloat16)

        def fill(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for x in (*leaves, dout):
                    full = torch.randn((1, 16 * size, *shape[2:]), generator=g)
                    x.copy_(full[:, rank * 16:(rank + 1) * 16])

        def step() -> torch.Tensor:
            for x in leaves:
                x.grad = None
            out = dilated_attention(*leaves, (8, 16 * size), (1, 2), causal=True, comm=comm, strategy=strategy)
            out.backward(dout)
            return out

        try:
            fill(1)
            graph, out = capture(step, warmup=2)
            grads = [x.grad for x in leaves]
            fill(2)
            graph.replay()
            got = [t.clone() for t in (out, *grads)]
            eager = step()
            same = all(torch.equal(a, b) for a, b in zip(got, (eager, *(x.grad for x in leaves))))
            msg = "" if same else "replay differs from the eager call"
        except Exception as exc:
            same, msg = False, f"{type(exc).__name__}: {exc}"[:200]
        results.append(Result(f"cuda-graph-{strategy}", backend_name, rank, size, same, message=msg))
    return results


def check_compiled_graphs(backend_name: str, group, device: torch.device) -> Result:
    """GPUs: a ring call inside ``torch.compile(mode="reduce-overhead")`` gives, step after step, what the eager
    call gives, bit for bit, and from the third step on the cudagraph tree replays it (the op's body runs in
    the warm-up and the recording only)."""
    comm = get_backend(backend_name, group)
    rank, size = comm.rank, comm.world_size

    def layer(q, k, v):
        return dilated_attention(q * 2, k, v, (8, 16 * size), (1, 2), causal=True, comm=comm) * 3

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    same, msg = True, ""
    try:
        for seed in range(4):  # warm-up, recording, then replays
            g = torch.Generator().manual_seed(100 + seed)
            full = [torch.randn((1, 16 * size, 4 * size, 16), generator=g) for _ in range(4)]
            q, k, v, dout = (x[:, rank * 16:(rank + 1) * 16].to(device, torch.bfloat16) for x in full)
            eager, got, runs = eager_and_compiled(layer, compiled, q, k, v, dout)
            if not all(torch.equal(a, b) for a, b in zip(eager, got)):
                same, msg = False, f"step {seed}: the compiled call differs from the eager one"
                break
            problem = replay_problem(seed, runs)
            if problem is not None:
                same, msg = False, problem
                break
    except Exception as exc:
        same, msg = False, f"{type(exc).__name__}: {exc}"[:200]
    return Result("compiled-reduce-overhead", backend_name, rank, size, same, message=msg)
