"""Run a workload under NVIDIA compute-sanitizer and summarise what it finds, per kernel and Python frame.

What runs: our fused-kernel suite (``scripts/fused_sanitizer_cases.py``, default),
a repro file (``scripts/repro.py replay FILE``) or any command. It runs with
``CUDA_LAUNCH_BLOCKING=1`` and ``TORCH_USE_CUDA_DSA=1`` (errors surface at the
launch that caused them), under ``python -m dilated_attention.diagnostics.launch_trace``,
which prints a marker line naming every Triton kernel launch and the Python frame
that made it. The summariser attributes each sanitizer report to the kernel named
in the report and to the last launch marker before it, so a finding reads
"memcheck: 12 x Invalid __global__ read of size 2 bytes in _fwd_kernel, launched
from dilated_attention/ring/kv_ring.py:80 (ring_forward)".

``summarise(text)`` also works on a log captured elsewhere (``--parse LOG``), e.g.
from a cluster job.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
MARK = "[dilated_attention.launch]"

# A report starts at "========= " + text (one space); its details are indented further.
_HEADER = re.compile(
    r"^=+ (?P<what>(Invalid|Uninitialized|Misaligned|Out-of-range|Race|Barrier|Program hit|Error:|"
    r"Memory leak|Potential|Warning: |Detected|Illegal|cudaError|CUDA_ERROR|Unspecified)[^\n]*)", re.I)
_KERNEL = re.compile(r"^=+\s+(?:at\s+(?:0x[0-9a-f]+\s+in\s+)?(?P<at>[^\s(]+)|.*\bin kernel\s+(?P<inkernel>[^\s(]+)|"
                     r".*\bkernel\s+(?P<kernel>[A-Za-z_][\w:<>]*))", re.I)
_SUMMARY = re.compile(r"(ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY)[^\n]*", re.I)


@dataclass
class Finding:
    tool: str
    kind: str
    kernel: str
    frame: str
    count: int = 1

    def text(self) -> str:
        return (f"{self.tool}: {self.count} x {self.kind} in {self.kernel}"
                + (f", launched from {self.frame}" if self.frame else ""))


@dataclass
class SanitizeReport:
    tool: str
    returncode: int
    findings: list[Finding] = field(default_factory=list)
    summary_lines: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.findings


def find_sanitizer(explicit: str | None = None) -> str | None:
    """Path of compute-sanitizer: ``explicit``, PATH, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``."""
    candidates = [explicit] if explicit else []
    candidates += [shutil.which("compute-sanitizer")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "compute-sanitizer"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def gpu_problem() -> str | None:
    """Why no GPU workload can run here, or ``None``."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible to torch (torch.cuda.is_available() is False): compute-sanitizer "
                "checks GPU kernels, run this on a machine with an NVIDIA GPU")
    return None


def _normalise_kernel(name: str) -> str:
    name = name.split("+0x")[0].strip()
    return name or "?"


def summarise(text: str, tool: str = "memcheck") -> tuple[list[Finding], list[str]]:
    """``(findings grouped by (kind, kernel, frame), the sanitizer's own summary lines)`` of a log."""
    groups: dict[tuple[str, str, str], Finding] = {}
    frame = ""
    pending: tuple[str, str] | None = None  # (kind, frame) of a header still looking for its kernel

    def flush(kernel: str = "?") -> None:
        nonlocal pending
        if pending is None:
            return
        kind, fr = pending
        key = (kind, kernel, fr)
        if key in groups:
            groups[key].count += 1
        else:
            groups[key] = Finding(tool, kind, kernel, fr)
        pending = None

    for line in text.splitlines():
        if line.startswith(MARK):
            flush(_marker_kernel(frame))
            frame = line[len(MARK):].strip()
            continue
        if _SUMMARY.search(line):
            continue
        m = _HEADER.match(line)
        if m:
            flush(_marker_kernel(frame))
            kind = re.sub(r"\s+at\s+0x[0-9a-f]+.*$", "", m.group("what").strip())
            kind = re.sub(r"\s*\(.*\)$", "", kind).rstrip(":. ")
            pending = (kind[:120], _marker_frame(frame))
            inline = re.search(r"\bin kernel\s+([^\s(]+)|\bin\s+([A-Za-z_]\w*)\s*$", line)
            if inline:
                flush(_normalise_kernel(inline.group(1) or inline.group(2)))
            continue
        if pending is not None:
            k = _KERNEL.match(line)
            if k and (k.group("at") or k.group("inkernel") or k.group("kernel")):
                flush(_normalise_kernel(k.group("at") or k.group("inkernel") or k.group("kernel")))
    flush(_marker_kernel(frame))
    summary = [m.group(0).strip() for m in _SUMMARY.finditer(text)]
    return list(groups.values()), summary


def _marker_kernel(marker: str) -> str:
    """Kernel name from a launch marker ``<kernel> from <file:line> (<function>)``."""
    return marker.split(" from ")[0].strip() or "?" if marker else "?"


def _marker_frame(marker: str) -> str:
    return marker.split(" from ", 1)[1].strip() if " from " in marker else ""


def sanitizer_env(triton_debug: bool = False) -> dict[str, str]:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", TORCH_USE_CUDA_DSA="1", PYTHONUNBUFFERED="1")
    # Triton's own caching allocator / async compile hide nothing here, but its debug mode turns
    # tl.device_assert and bounds checks on (slower; off by default)
    if triton_debug:
        env["TRITON_DEBUG"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def default_command() -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [os.path.join(root, "scripts", "fused_sanitizer_cases.py")]


def repro_command(path: str) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [os.path.join(root, "scripts", "repro.py"), "replay", path, "--device", "cuda"]


def run(tool: str, command: list[str], *, sanitizer: str | None = None, timeout: float = 600,
        triton_debug: bool = False, print_limit: int = 100) -> SanitizeReport:
    """Run ``python <command...>`` under ``compute-sanitizer --tool tool`` and summarise it.

    ``command`` is a Python script and its arguments (it is run through the launch
    tracer). Raises ``FileNotFoundError``/``RuntimeError`` with a plain message when
    the sanitizer or a GPU is missing.
    """
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {TOOLS}, got {tool!r}")
    exe = find_sanitizer(sanitizer)
    if exe is None:
        raise FileNotFoundError(
            "compute-sanitizer not found (looked at --sanitizer, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): it ships "
            "with the CUDA toolkit; install the toolkit or pass --sanitizer /path/to/compute-sanitizer")
    problem = gpu_problem()
    if problem:
        raise RuntimeError(problem)
    args = [exe, "--tool", tool, "--error-exitcode", "9", "--print-limit", str(print_limit)]
    if tool == "memcheck":
        args += ["--leak-check", "no"]
    args += [sys.executable, "-m", "dilated_attention.diagnostics.launch_trace", *command]
    try:
        proc = subprocess.run(args, env=sanitizer_env(triton_debug), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc = 124
    findings, summary = summarise(out, tool)
    rep = SanitizeReport(tool, rc, findings, summary)
    if rc == 124:
        rep.note = f"timed out after {timeout:.0f} s (findings so far are listed)"
    elif rc not in (0, 9) and not findings:
        tail = "\n".join(out.strip().splitlines()[-15:])
        rep.note = f"the workload itself failed (exit {rc}); its last lines:\n{tail}"
    rep.log = out  # type: ignore[attr-defined]
    return rep
