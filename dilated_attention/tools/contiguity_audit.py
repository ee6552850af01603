"""Find strided views that reach code assuming contiguous memory (GPU 'illegal memory access' crashes).

  dilated-attention-audit                          # scan this library (static)
  dilated-attention-audit path/to/your/code         # scan yours (files or trees; same as static PATH)
  dilated-attention-audit static path/to/your/code
  dilated-attention-audit run                      # a built-in call of every layout, audited
  dilated-attention-audit run --torch-p2p -- train.py --steps 2   # your script, audited
  torchrun --nproc_per_node=4 -m dilated_attention.tools.contiguity_audit run --torch-p2p -- train.py

static: index_select/gather/sends/collectives/Triton launches on sliced or transposed
views, and .view() after transpose; prints file:line and why (silence one line with
a "# audit: ok" comment). run: wraps the library's kernels and CommBackend.send_recv
(and torch.distributed send/isend/P2POp with --torch-p2p) and lists every tensor that
reaches them non-contiguous (sends) or misaligned, with shape, strides and caller.
Exit 0: nothing found; 1: findings; 2: bad usage.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

import torch

from ..diagnostics import audit
from ..functional import dilated_attention
from ..launch_utils import say
from ..testing.compare import LAYOUTS, as_layout


def _demo() -> None:
    """Every layout of compare.LAYOUTS through the public API, forward and backward."""
    g = torch.Generator().manual_seed(0)
    for layout in LAYOUTS:
        q, k, v = (as_layout(torch.randn(2, 32, h, 16, generator=g), layout, generator=g).requires_grad_()
                   for h in (4, 2, 2))
        out = dilated_attention(q, k, v, [8, 32], [1, 4], causal=True)
        out.sum().backward()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["static", "run"], help="static (the default when omitted) or run")
    p.add_argument("paths", nargs="*", help="static: files or trees to scan (default: the library)")
    p.add_argument("--torch-p2p", action="store_true", help="run: also audit torch.distributed send/isend/P2POp")
    p.add_argument("--notes", action="store_true", help="run: also list legal-but-notable tensors (strided head dim)")
    argv = list(sys.argv[1:] if argv is None else argv)
    script = argv[argv.index("--") + 1:] if "--" in argv else []  # run: -- script.py args (default: built-in demo)
    own = argv[:argv.index("--")] if "--" in argv else argv
    if not own or own[0] not in ("static", "run", "-h", "--help"):
        own = ["static", *own]  # a bare path (or nothing) is a static scan
    a = p.parse_args(own)
    rest = script
    if a.what == "static":
        paths = a.paths or [audit.default_root()]
        try:
            findings, files = audit.scan_paths(paths)
        except FileNotFoundError as exc:
            print(exc, file=sys.stderr)
            return 2
        for f in findings:
            print(f.text())
        print(f"{files} files scanned, {len(findings)} finding(s)"
              + ("" if findings else ": no strided view reaches a gather, a send or a kernel launch unguarded"))
        return 1 if findings else 0
    rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    with audit.runtime_audit(torch_p2p=a.torch_p2p) as rec:
        if rest:
            sys.argv = rest
            sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
            try:
                runpy.run_path(rest[0], run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (0, None):
                    say(f"the script exited with {exc.code}", rank)
        else:
            _demo()
    found = rec.dedup()
    errors = [f for f in found if f.severity == "error"]
    notes = len(found) - len(errors)
    say("\n".join([f.text() for f in found if f.severity == "error" or a.notes]
                  + [f"{rec.checked} tensors checked at kernel and communication entry points: {len(errors)} problem(s)"
                     + (f", {notes} note(s) (--notes lists them)" if notes and not a.notes else "")]), rank)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
