"""benchmarks/bench_kernel.py --smoke end to end (CPU, Triton's interpreter, tiny shapes): the auto table it
measures (LongNet segments and full attention, keyed by rows), the summary and the report files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke is the CPU path; a GPU runs the real benchmark")
def test_bench_kernel_smoke(tmp_path):
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "benchmarks/bench_kernel.py", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed" not in proc.stdout, proc.stdout[-3000:]
    result = json.loads((tmp_path / "kernel_smoke.json").read_text())
    assert result["complete"]
    assert not [row for row in result["table"] if "error" in row]
    (entry,) = result["auto_table"].values()
    choices = entry["choices"]
    # smoke: N=64, LongNet segments 16/32/64 at rates 1/2/4 (16 rows each) and full attention (64 rows)
    for causal in ("full", "causal"):
        for direction in ("fwd", "bwd", "bwd-any"):
            assert f"{direction}/dense/{causal}/D16/float32/M16" in choices
            assert f"{direction}/dilated/{causal}/D16/float32/M16" in choices
            assert f"{direction}/dense/{causal}/D16/float32/M64" in choices
    assert set(choices.values()) <= {"fused", "reference"}
    summary = result["summary"]
    for causal in ("False", "True"):
        assert summary[causal]["library_fwd_bwd_vs_dense_cudnn"] > 0
    assert (tmp_path / "kernel_smoke.png").exists()
