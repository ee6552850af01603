#!/usr/bin/env python
"""Run our kernels (or your command, or a repro file) under NVIDIA compute-sanitizer.

  python scripts/sanitize.py                               # fused-kernel suite, memcheck
  python scripts/sanitize.py --tool memcheck --tool racecheck --tool initcheck --tool synccheck
  python scripts/sanitize.py --repro dilated_attention_repro/repro-...json
  python scripts/sanitize.py -- my_train_step.py --steps 1  # any Python script and its arguments
  python scripts/sanitize.py --parse sanitizer.log          # summarise a log captured elsewhere

Runs with CUDA_LAUNCH_BLOCKING=1 and TORCH_USE_CUDA_DSA=1 (add --triton-debug for
Triton's device asserts) and prints, per tool, each finding grouped by kernel and
the Python frame that launched it. Exit 0: clean; 1: findings or the workload
failed; 2: compute-sanitizer or a GPU is missing (the message says which).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _print(rep, verbose: bool) -> None:
    head = "clean" if rep.ok else (f"{sum(f.count for f in rep.findings)} finding(s)" if rep.findings
                                   else f"workload exit {rep.returncode}")
    print(f"== {rep.tool}: {head}")
    for f in rep.findings:
        print("   " + f.text())
    for line in rep.summary_lines:
        print("   " + line)
    if rep.note:
        print("   " + rep.note.replace("\n", "\n   "))
    if verbose and getattr(rep, "log", ""):
        print(rep.log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tool", action="append", choices=["memcheck", "racecheck", "initcheck", "synccheck"],
                   help="repeat for several (default memcheck)")
    p.add_argument("--repro", help="a repro JSON to replay under the sanitizer")
    p.add_argument("--parse", metavar="LOG", help="only summarise an existing compute-sanitizer log")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, $CUDA_HOME, /usr/local/cuda)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per tool")
    p.add_argument("--triton-debug", action="store_true", help="TRITON_DEBUG=1 (device asserts; slower)")
    p.add_argument("--verbose", action="store_true", help="print the full sanitizer output too")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py args... (default: the fused-kernel suite)")
    a = p.parse_args(argv)
    from dilated_attention.diagnostics import sanitize

    tools = a.tool or ["memcheck"]
    if a.parse:
        with open(a.parse) as f:
            text = f.read()
        findings, summary = sanitize.summarise(text, tools[0])
        rep = sanitize.SanitizeReport(tools[0], 0, findings, summary)
        _print(rep, False)
        return 0 if rep.ok else 1
    command = [c for c in a.command if c != "--"] if a.command else []
    if a.repro:
        command = sanitize.repro_command(a.repro)
    elif not command:
        command = sanitize.default_command()
    bad = False
    for tool in tools:
        try:
            rep = sanitize.run(tool, command, sanitizer=a.sanitizer, timeout=a.timeout, triton_debug=a.triton_debug)
        except (FileNotFoundError, RuntimeError) as exc:
            print(f"cannot sanitize: {exc}", file=sys.stderr)
            return 2
        _print(rep, a.verbose)
        bad |= not rep.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
