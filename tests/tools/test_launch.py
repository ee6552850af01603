"""launch/ scripts and the HF example as a user meets them: one message per job, clean argument errors.

* a bad argument is one line on stderr from rank 0 (other ranks silent), exit status 2,
  before any process group exists;
* the demo under torchrun (2 gloo ranks, every backend): step labels count to the
  number of steps, fairscale's warning appears once, no FutureWarning, and it passes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dilated_attention.testing.spawn import UNINTERPRETED, environ_with, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args: list[str], env: dict[str, str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    full_env = environ_with({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("script, args, message", [
    ("launch/demo.py", ["--check-args", "--seq-len", "1000"],
     "demo.py: error: --seq-len (1000) must be divisible by 2^(patterns - 1) = 16"),
    ("launch/demo.py", ["--check-args", "--seq-len", "1026", "--patterns", "1"],
     "demo.py: error: --seq-len (1026) must be divisible by the number of ranks (4)"),
    ("launch/train_lm.py", ["--seq-len", "100"],
     "train_lm.py: error: --segments/--rates: sequence length 100 must be divisible by segment_lengths[0]=32"),
    ("launch/train_lm.py", ["--sp-size", "3"], "train_lm.py: error: --sp-size (3) must divide the number of ranks (4)"),
    ("launch/hf_llama_train.py", ["--seq-len", "130"],
     "hf_llama_train.py: error: --seq-len (130) must be divisible by the number of ranks (4)"),
])
def test_bad_argument_is_one_line_from_rank_zero(script, args, message):
    rank0 = _run([script, *args], env={"RANK": "0", "WORLD_SIZE": "4"})
    assert rank0.returncode == 2, rank0.stderr
    assert rank0.stdout == ""
    lines = rank0.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), rank0.stderr
    other = _run([script, *args], env={"RANK": "1", "WORLD_SIZE": "4"})
    assert (other.returncode, other.stdout, other.stderr) == (2, "", "")


def test_demo_names_the_extra_of_a_missing_backend_in_one_line(tmp_path):
    """fairscale made unimportable (as in an environment without it): one line from rank 0, the extra to install."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['fairscale'] = None\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]), "WORLD_SIZE": "2"}
    rank0 = _run(["launch/demo.py", "--backends", "fairscale"], env={**env, "RANK": "0"})
    assert rank0.returncode == 2 and rank0.stdout == "", rank0.stderr
    assert rank0.stderr.strip().splitlines() == [
        'demo.py: error: --backends fairscale: not installed; install the extra: '
        'pip install -c launch/constraints.txt ".[fairscale]" (--help lists the options)'], rank0.stderr
    other = _run(["launch/demo.py", "--backends", "fairscale"], env={**env, "RANK": "1"})
    assert (other.returncode, other.stdout, other.stderr) == (2, "", "")


def test_demo_under_torchrun_speaks_once():
    pytest.importorskip("fairscale")
    pytest.importorskip("deepspeed")
    from dilated_attention.comm.deepspeed import prebuild_ops

    prebuild_ops()  # DeepSpeed compiles a CPU op on first use: not inside the timed ranks
    proc = run_torchrun(["launch/demo.py", "--seq-len", "256", "--patterns", "2", "--heads", "2", "--head-dim", "8",
                         "--iters", "1"], cwd=ROOT, done="all backends match the single-device result",
                        env=UNINTERPRETED)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for i, label in enumerate(["single-device result", "backend collective", "backend fairscale",
                               "backend deepspeed"], start=1):
        assert f"[{i}/4] {label}" in out, out
    assert out.count("fairscale model parallel was not initialised") == 1, out
    assert "FutureWarning" not in out, out
    assert "all backends match the single-device result" in out, out


_ONE_RANK_FAILS = '''
import sys
sys.path.insert(0, "launch")
import torch, torch.distributed as dist
from rank_zero import run_job
from dilated_attention.launch_utils import init_distributed

env = init_distributed("cpu", timeout=300)
def body():
    if env.rank == 1:
        raise RuntimeError("rank 1 ran out of data")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for an exchange rank 1 never joins
sys.exit(run_job("job", env, body))
'''


def test_a_crash_on_one_rank_ends_the_job_at_once(tmp_path):
    """An exception on one rank ends the torchrun job with it, not after the process group's timeout (300 s here):
    the failing rank leaves without waiting in a barrier the others cannot reach."""
    script = tmp_path / "one_rank_fails.py"
    script.write_text(_ONE_RANK_FAILS)
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)], timeout=120)
    assert proc.returncode != 0
    assert "rank 1 ran out of data" in proc.stdout + proc.stderr
