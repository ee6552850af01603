"""Every script in benchmarks/, scripts/ and launch/ answers ``--help`` on a machine without a GPU: exit 0 and a usage
text, before anything GPU-only is imported. Scripts are found by glob, so a new one is covered at once; they run
in parallel subprocesses (most answer before torch loads)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# launch/: every launcher, not the files that are sourced or imported (setup_env.sh, torchrun_env.sh,
# rank_zero.py) or that set up .venv before they parse (demo.sh, test.sh: their --help is the demo's and pytest's)
SOURCED = {"launch/setup_env.sh", "launch/torchrun_env.sh", "launch/demo.sh", "launch/test.sh",
           "launch/rank_zero.py"}  # rank_zero.py: a module the launchers import
SCRIPTS = sorted(rel for folder in ("benchmarks", "scripts", "launch") for ext in ("py", "sh", "sbatch")
                 for rel in (os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, folder, f"*.{ext}")))
                 if rel not in SOURCED)
TIMEOUT = 120


def _help(script: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, script, "--help"] if script.endswith(".py") else ["bash", script, "--help"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(cmd, -1, exc.stdout or "", f"timed out after {TIMEOUT} s")


@pytest.fixture(scope="module")
def answers() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        return dict(zip(SCRIPTS, pool.map(_help, SCRIPTS)))


def test_scripts_are_found():
    assert "benchmarks/bench_kernel.py" in SCRIPTS and "scripts/contiguity_audit.py" in SCRIPTS
    assert any(s.endswith(".sh") for s in SCRIPTS) and "launch/train_lm.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_without_a_gpu(script, answers):
    proc = answers[script]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --help exited {proc.returncode}:\n{out[-3000:]}"
    assert "usage" in out.lower() or os.path.basename(script) in out, out[-3000:]
