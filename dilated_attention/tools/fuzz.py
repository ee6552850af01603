"""Fuzz dilated_attention against the float64 oracle; stop at the first mismatch and write its repro.

  dilated-attention-fuzz --cases 500                          # single process, CPU kernels
  dilated-attention-fuzz --seconds 600 --world-sizes 1,2,4    # + multi-rank cases on spawned gloo ranks
  dilated-attention-fuzz --device cuda --kernels fused,auto --dtypes bfloat16,float16,float32 --seconds 60

Valid cases: random shapes, GQA, 1-3 patterns (local, spanning ranks, clamped), both
modes, causal, scales, dtypes, kernels, strategies (several ranks) and, for each of
q/k/v, a random memory layout (transposed, head-sliced, storage offset, zero stride,
strided head dim...); about 30% each (--option-rate) with a key_padding_mask, packed
documents (cu_seqlens, zero-length and untiled documents) and a sequence length the
segments do not tile (internal padding); judged forward and backward by the
project's tolerance rule. Invalid cases break
one rule and must raise ValueError/TypeError. Exit 0: no finding; 1: a finding
(printed, with the repro file to replay: dilated-attention-repro replay FILE).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..diagnostics import fuzz
from ..launch_utils import fraction, positive_float, positive_int, positive_list


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=positive_int, default=None, help="number of cases (default 200 unless --seconds)")
    p.add_argument("--seconds", type=positive_float, default=None, help="time budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kernels", type=_csv, default=None, help="comma list (default: auto,reference,sdpa)")
    p.add_argument("--dtypes", type=_csv, default=None, help="comma list (default: float64,float32,bfloat16)")
    p.add_argument("--world-sizes", type=positive_list(int), default=[1],
                   help="comma list; above 1 spawns gloo ranks on CPU")
    p.add_argument("--backend", default="collective", choices=["collective", "fairscale", "deepspeed"])
    p.add_argument("--invalid-fraction", type=fraction, default=0.2)
    p.add_argument("--option-rate", type=fraction, default=None,
                   help="how often each of key_padding_mask, cu_seqlens, an untiled length is used (default 0.3)")
    p.add_argument("--out", default="fuzz_repro", help="where the repro of a finding goes")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true",
                   help="also show the library's warnings about the random calls (clamped segments, ...)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    if a.device == "cuda" and max(a.world_sizes) > 1:
        print("multi-rank fuzzing runs on CPU gloo ranks; use --device cpu with --world-sizes", file=sys.stderr)
        return 2
    kernels = a.kernels or (["auto", "fused", "sdpa"] if a.device == "cuda" else list(fuzz.CPU_KERNELS))
    dtypes = a.dtypes or (["bfloat16", "float16", "float32"] if a.device == "cuda" else list(fuzz.CPU_DTYPES))
    if "fused" in kernels and a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the fused kernel on CPU runs in Triton's interpreter (slow)
    cases = a.cases if a.cases is not None or a.seconds is not None else 200
    mix = fuzz.CaseMix(tuple(kernels), tuple(dtypes), a.device, a.invalid_fraction,
                       fuzz.OPTION_RATE if a.option_rate is None else a.option_rate)
    common = dict(cases=cases, seconds=a.seconds, seed=a.seed, mix=mix, out_dir=a.out, progress=not a.no_progress,
                  quiet=not a.verbose)
    if max(a.world_sizes) > 1:
        res = fuzz.fuzz_spawned(a.world_sizes, backend=a.backend, **common)
    else:
        res = fuzz.fuzz(**common)
    declined = f", {res.skipped} declined by the named kernel" if res.skipped else ""
    print(f"{res.cases} cases ({res.valid} valid{declined}, {res.invalid} invalid) in {res.seconds:.0f} s, "
          f"kernels {','.join(kernels)}, dtypes {','.join(dtypes)}, world sizes {a.world_sizes}, seed {a.seed}")
    if res.options:
        print("valid cases by option: " + ", ".join(f"{name} {count}" for name, count in sorted(res.options.items())))
    if res.ok:
        print("no finding: every valid case matched the oracle, every invalid one raised ValueError/TypeError")
        return 0
    print(f"FINDING after {res.cases} cases: {res.failure}")
    for line in res.lines:
        print("  " + line)
    if res.repro_path:
        print(f"repro: {res.repro_path}" + ("" if res.repro_path.endswith(".txt")
                                           else f"  (replay: dilated-attention-repro replay {res.repro_path})"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
