"""The tools that install with the package: ``python -m dilated_attention.tools.<name>``, the console scripts
``pyproject.toml`` declares for them, what ``diagnose env`` lists, ``repro show``'s summary, ``fuzz``'s quiet
default."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
import warnings

import pytest
import torch

from dilated_attention import clear_caches
from dilated_attention.diagnostics import checks, fuzz, repro
from dilated_attention.misuse import MisuseWarning
from dilated_attention.tools import diagnose as diagnose_tool
from dilated_attention.tools import repro as repro_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = ("diagnose", "repro", "fuzz", "contiguity_audit")
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def test_console_scripts_name_each_tool_and_its_main():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    targets = {value.split(":")[0].rsplit(".", 1)[1]: value for value in scripts.values()}
    assert set(targets) == set(TOOLS), scripts
    for name, value in scripts.items():
        assert name.startswith("dilated-attention-")
        module, function = value.split(":")
        assert callable(getattr(importlib.import_module(module), function)), value


@pytest.mark.parametrize("name", TOOLS)
def test_each_tool_runs_as_a_module_outside_the_checkout(name, tmp_path):
    """``python -m`` from another directory: the package, not the checkout's scripts/, provides the tool."""
    env_path = os.pathsep.join([ROOT, ENV.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", f"dilated_attention.tools.{name}", "--help"], cwd=tmp_path,
                          env=dict(ENV, PYTHONPATH=env_path), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout.lower()


def test_diagnose_env_lists_the_library_and_every_optional_dependency(capsys):
    assert diagnose_tool.main(["env"]) == 0
    out = capsys.readouterr().out
    import dilated_attention

    assert f"dilated_attention: {dilated_attention.__version__}" in out
    for name, use in checks.OPTIONAL:
        line = next((x for x in out.splitlines() if x.strip().startswith(f"{name}:")), None)
        assert line is not None, f"{name} missing from:\n{out}"
        found = checks.installed_version(name)
        assert (found in line) if found is not None else (f"not installed ({use})" in line), line
    assert f"torch: {torch.__version__}" in out


def test_installed_version_reads_metadata():
    assert checks.installed_version("torch").startswith(torch.__version__.split("+")[0])
    assert checks.installed_version("no-such-distribution-here") is None


def test_repro_show_prints_a_summary_and_json_on_request(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 64, 4, 8, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
    mask = torch.zeros(1, 64, dtype=torch.bool)
    mask[0, 48:] = True
    path = repro.capture(q, q, q, [16, 64], [1, 2], path=tmp_path / "call.json", causal=True,
                         key_padding_mask=mask, error="RuntimeError: boom", strategy="head")
    assert repro_tool.main(["show", path]) == 0
    out = capsys.readouterr().out
    assert "segment_lengths=[16, 64], dilation_rates=[1, 2]" in out and "causal=True" in out
    assert "strategy='head'" in out and "RuntimeError: boom" in out and "25.0% padded" in out
    assert f"stride {tuple(q.stride())}" in out and f"dilated-attention-repro replay {path}" in out
    assert "{" not in out  # no raw JSON
    assert repro_tool.main(["show", path, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    with open(path) as f:
        assert shown == json.load(f)


def _misuse_warnings(quiet: bool, tmp_path) -> tuple[fuzz.FuzzResult, int]:
    clear_caches()  # planned calls are cached: a fresh process's first calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fuzz.fuzz(cases=10, seed=0, quiet=quiet, out_dir=str(tmp_path))
    return res, sum(issubclass(w.category, MisuseWarning) for w in caught)


def test_fuzz_is_quiet_unless_verbose(tmp_path):
    res, loud = _misuse_warnings(False, tmp_path)
    assert res.ok and loud > 0  # these random cases clamp segments: the library warns of it
    res, quiet = _misuse_warnings(True, tmp_path)
    assert res.ok and quiet == 0
