"""A CPU (gloo) job whose last head-strategy call's output is still alive at exit ends cleanly.

After gloo's asynchronous ``all_to_all_single`` such jobs aborted in the interpreter's teardown ("terminate
called without an active exception"; half of the runs of this job on torch 2.13), so on CPU tensors the whole
group's all-to-all stays a batch of point-to-point transfers (``CommBackend.collective_all_to_all``). A user's
script keeps such an output alive easily (a module-level ``out``); the spawned test workers do not (their
values die with ``fn``), so this runs a script under torchrun, several times, with no retry.
"""

from __future__ import annotations

from dilated_attention.testing.spawn import UNINTERPRETED, run_torchrun

_SCRIPT = '''
import torch, torch.distributed as dist
from dilated_attention import dilated_attention
from dilated_attention.comm import get_backend
dist.init_process_group("gloo")
comm = get_backend("collective")
gen = torch.Generator().manual_seed(dist.get_rank())
q, k, v = (torch.randn(1, 256, 4, 8, generator=gen).requires_grad_() for _ in range(3))
for _ in range(2):
    out = dilated_attention(q, k, v, [64, 512], [1, 2], causal=True, comm=comm, strategy="head")
    out.sum().backward()
dist.destroy_process_group()
print("job done", flush=True)
'''


def test_head_strategy_jobs_exit_cleanly_with_an_output_alive(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    for _ in range(4):  # (with collectives on gloo, 4 of 8 runs aborted)
        proc = run_torchrun([str(script)], cwd=str(tmp_path), done="not printed", timeout=120, env=UNINTERPRETED)
        assert proc.returncode == 0 and "job done" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
