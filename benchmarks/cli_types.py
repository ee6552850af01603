"""Argument types the benchmarks share: comma-separated integers and names."""

from __future__ import annotations

import argparse
from typing import Callable


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int_list(text: str) -> list[int]:
    """``int_list``, at least one value, all positive."""
    values = int_list(text)
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def name_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A type for comma-separated names out of ``choices`` (``""``: none)."""
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown name(s) {bad}; choose from {','.join(choices)}")
        return names
    return parse


__all__ = ["int_list", "name_list", "positive_int_list"]

if __name__ == "__main__":  # a module the benchmarks import; run alone it only explains itself
    argparse.ArgumentParser(description=__doc__, epilog="Imported by bench_model.py, bench_ring.py and "
                            "bench_scaling.py; nothing to run on its own.").parse_args()
    print(__doc__)
