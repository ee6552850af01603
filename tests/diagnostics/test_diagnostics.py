import subprocess
import sys

import torch

from dilated_attention.diagnostics import check_kernels, check_views, env_report
from dilated_attention.testing.compare import LAYOUTS


def test_env_report_names_versions():
    info = env_report()
    assert info["torch"] == torch.__version__ and "triton" in info


def test_views_check_passes_on_cpu_layouts():
    rows = check_views("cpu", torch.float32)
    assert [r[0] for r in rows] == list(LAYOUTS)  # incl. strided head dim and permuted buffers
    assert all(ok for _, ok, _ in rows), rows


def test_kernel_check_reports_each_kernel():
    rows = {r["kernel"]: r for r in check_kernels("cpu", torch.float32, kernels=("reference", "sdpa", "sdpa-cudnn"),
                                                  seq_len=64, head_dim=16)}
    assert rows["reference"]["ok"] is True and rows["sdpa"]["ok"] is True
    assert rows["sdpa-cudnn"]["ok"] is None and "CUDA" in rows["sdpa-cudnn"]["note"]


def test_kernel_check_flags_a_wrong_kernel():
    from dilated_attention.kernels.reference import ReferenceKernel

    class Broken(ReferenceKernel):
        name = "broken"

        def forward(self, q, k, v, *, causal, scale):
            out, lse = super().forward(q, k, v, causal=causal, scale=scale * 1.01)
            return out, lse

    from dilated_attention.diagnostics import checks

    rows = checks.check_kernels("cpu", torch.float32, kernels=(Broken(),), seq_len=64, head_dim=16)
    assert rows[0]["ok"] is False


def test_cli_env_runs():
    out = subprocess.run([sys.executable, "scripts/diagnose.py", "env"], capture_output=True, text=True, check=True)
    assert "torch" in out.stdout
