"""The GPU model in result file names: 'NVIDIA H200' -> h200, 'NVIDIA H100 80GB HBM3' -> h100.

The benchmarks name their results ``<benchmark>_<tag>[_x<GPUs>].<ext>`` with this tag, so one
model's reruns replace its files (memory size and packaging variants share a tag). Their metadata
records the installed packages the same way too (``package_versions``).

    python benchmarks/gpu_tag.py                          # the tag of this machine's GPU 0
    python benchmarks/gpu_tag.py "NVIDIA H100 80GB HBM3"  # h100
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys

VENDOR_WORDS = ("nvidia", "tesla", "geforce", "amd", "instinct", "radeon")


def gpu_tag(name: str) -> str:
    """The words of ``name`` up to the first one with a digit, without vendor and brand words.

    'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' ->
    'rtx_4090', 'cpu' -> 'cpu'."""
    words = [w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in VENDOR_WORDS]
    for i, word in enumerate(words):
        if any(c.isdigit() for c in word):
            return "_".join(words[:i + 1])
    return "_".join(words) or "gpu"


def package_versions(*dists: str) -> dict[str, str | None]:
    """``{distribution: installed version}`` for the named distributions, ``None`` for one not installed."""
    found: dict[str, str | None] = {}
    for dist in dists:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="a device name (default: torch's name of GPU 0)")
    args = ap.parse_args(argv)
    name = args.name
    if name is None:
        import torch

        if not torch.cuda.is_available():
            print("gpu_tag.py: no GPU visible; pass a device name", file=sys.stderr)
            return 2
        name = torch.cuda.get_device_name(0)
    print(gpu_tag(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
