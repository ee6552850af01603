"""Multi-node launch, on one machine: two torchrun agents (--nnodes=2, node ranks 0 and 1,
one gloo process each) rendezvous over c10d at 127.0.0.1 through launch/multinode.sh, run
the library's ring on a small problem and check their rows against single-process float64.

This file is also the worker: ``python tests/tools/test_multinode.py --worker OUT_DIR``.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Local (16 <= L = 32) and spanning (64 > L: a ring over both nodes) patterns, GQA.
N, H, HKV, D, SEGMENTS, RATES = 64, 4, 2, 8, [16, 64], [1, 2]


def worker(out_dir: str) -> None:
    sys.path.insert(0, ROOT)
    import torch

    from dilated_attention import dilated_attention
    from dilated_attention.launch_utils import init_distributed
    from dilated_attention.testing.compare import assert_within_rule
    from dilated_attention.testing.oracle import dense_dilated_attention

    env = init_distributed("cpu", seed=0, timeout=60)
    assert env.world_size == 2, env
    local = N // env.world_size
    rows = slice(env.rank * local, (env.rank + 1) * local)
    ring = {"strategy": "ring"} if "strategy" in inspect.signature(dilated_attention).parameters else {}
    errors = {}
    for causal in (False, True):
        g = torch.Generator().manual_seed(11 + causal)  # the same global problem on every rank
        q = torch.randn(1, N, H, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, N, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(1, N, H, D, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = dense_dilated_attention(*full, SEGMENTS, RATES, causal=causal)
        want.backward(dout)
        mine = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
        got = dilated_attention(*mine, SEGMENTS, RATES, causal=causal, comm="collective", **ring)
        got.backward(dout[:, rows])
        for name, a, b in (("out", got, want), *((f"d{n}", m.grad, f.grad) for n, m, f in zip("qkv", mine, full))):
            errors[f"{name} causal={causal}"] = assert_within_rule(name, a, b[:, rows], context=f"rank {env.rank}")
    result = {"rank": env.rank, "world": env.world_size, "node": int(os.environ["GROUP_RANK"]),
              "local_rank": env.local_rank, "errors": errors}
    with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as f:
        json.dump(result, f)
    env.shutdown()


def test_two_nodes_on_localhost(tmp_path):
    from dilated_attention.launch_utils import free_port

    port = free_port()
    env = dict(os.environ, PYTHON=sys.executable, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               NPROC_PER_NODE="1", RDZV_ID=f"pytest-{port}", RDZV_CONF="join_timeout=60", OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", DILATED_ATTENTION_TIMEOUT="30", CUDA_VISIBLE_DEVICES="")
    cmd = ["bash", os.path.join(ROOT, "launch", "multinode.sh")]
    script = [os.path.join(ROOT, "tests", "tools", "test_multinode.py"), "--worker", str(tmp_path)]
    procs = [subprocess.Popen([*cmd, "--node-rank", str(r), *script], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, preexec_fn=os.setsid) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:  # a hung node must not outlive the test: end the process group we started
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert {(x["rank"], x["world"], x["local_rank"]) for x in results} == {(0, 2, 0), (1, 2, 0)}
    assert {x["node"] for x in results} == {0, 1}  # one process on each of two torchrun nodes
    for x in results:
        assert len(x["errors"]) == 8 and max(x["errors"].values()) <= 1e-10, x


def test_plain_python_is_a_world_of_one():
    """init_distributed without torchrun: a one-rank gloo world, threads and seed set."""
    code = ("import os, torch, torch.distributed as dist\n"
            "from dilated_attention.launch_utils import init_distributed\n"
            "env = init_distributed('cpu', seed=5, timeout=30)\n"
            "a = torch.randn(3)\n"
            "torch.manual_seed(5)\n"
            "assert torch.equal(a, torch.randn(3))\n"
            "assert (env.rank, env.world_size, env.local_rank, env.backend) == (0, 1, 0, 'gloo'), env\n"
            "assert env.is_main and env.device.type == 'cpu' and dist.is_initialized()\n"
            "assert os.environ['DS_ACCELERATOR'] == 'cpu'\n"
            "env.shutdown()\n"
            "assert not dist.is_initialized()\n"
            "try:\n"
            "    init_distributed('gpu')\n"
            "except ValueError as exc:\n"
            "    assert 'device must be one of' in str(exc)\n"
            "else:\n"
            "    raise AssertionError('no error')\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "DS_ACCELERATOR")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
