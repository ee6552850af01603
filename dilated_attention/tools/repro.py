"""Replay a captured dilated_attention call against the float64 oracle (forward and backward).

  dilated-attention-repro show bad_call.json [--json]        # what the file records
  dilated-attention-repro replay bad_call.json               # one process (a multi-rank repro: CPU gloo ranks)
  dilated-attention-repro replay bad_call.json --device cuda --kernel fused
  torchrun --nproc_per_node=8 -m dilated_attention.tools.repro replay bad_call.rank0.json --backend deepspeed

Repro files come from debug mode (DILATED_ATTENTION_DEBUG=1 writes one when a call
fails), from the fuzzer (dilated-attention-fuzz) or from user code:
dilated_attention.diagnostics.repro.capture(q, k, v, ..., key_padding_mask=..., cu_seqlens=...).
They record key_padding_mask (exact padded runs, or a seeded density), cu_seqlens (the
offsets), strategy and pad_to_segments; version 1 files (before masks) replay as before.
A multi-rank capture is one file per rank (NAME.rank<r>.json): replaying one merges the
mask rows its siblings recorded.
Exit status 0: output and gradients match the oracle; 1: something differs or the
call raised (the lines say which output, pattern, kernel and rank); 2: bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from ..comm import get_backend
from ..diagnostics import repro
from ..launch_utils import init_distributed, leave_process_group, say


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["show", "replay"])
    p.add_argument("file", help="a repro JSON")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if the repro was on a GPU and one is here)")
    p.add_argument("--kernel", default=None, help="override the recorded kernel (auto, fused, sdpa, reference, ...)")
    p.add_argument("--backend", default=None, choices=["collective", "fairscale", "deepspeed"],
                   help="backend for a multi-rank repro (default: the recorded one)")
    p.add_argument("--json", action="store_true", help="show: the file's JSON as recorded, not the summary")
    a = p.parse_args(argv)
    try:
        spec = repro.load(a.file)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        print(f"cannot read {a.file}: {exc}", file=sys.stderr)
        return 2
    if a.what == "show":
        if a.json:
            print(json.dumps({k: v for k, v in spec.items() if not k.startswith("_")}, indent=1))
        else:
            print("\n".join(repro.summary(spec, a.file)))
        return 0
    world = int(spec.get("world_size") or 1)
    recorded_cuda = str(spec["q"].get("device", "cpu")).startswith("cuda")
    use_cuda = a.device == "cuda" or (a.device is None and recorded_cuda and torch.cuda.is_available())
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but no CUDA device is visible", file=sys.stderr)
        return 2
    if recorded_cuda and not use_cuda:
        print(f"note: recorded on {spec['q'].get('device')}, replaying on CPU (the same layouts; "
              "a GPU-only fault will not show here)")
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _torchrun(spec, a, use_cuda, world)
    if world > 1:
        print(f"the repro is for {world} ranks: spawning {world} gloo ranks on CPU")
        reports = repro.replay_spawned(spec, a.backend)
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        reports = [repro.run_spec(spec, device=device, kernel=a.kernel)]
    for r in reports:
        print(r.text())
    bad = [r.rank for r in reports if not r.ok]
    print("REPRODUCED: " + f"rank(s) {bad} differ or raised" if bad else "no difference: the call matches the oracle")
    return 1 if bad else 0


def _torchrun(spec, a, use_cuda: bool, world: int) -> int:
    device = init_distributed("cuda" if use_cuda else "cpu").device
    if dist.get_world_size() != world:
        if dist.get_rank() == 0:
            print(f"the repro is for {world} ranks, torchrun started {dist.get_world_size()}", file=sys.stderr)
        leave_process_group(barrier=False)
        return 2
    rep = repro.run_spec(spec, comm=get_backend(a.backend or spec.get("backend") or "collective"), device=device,
                         kernel=a.kernel)
    say(rep.text())  # (its lines carry the rank already)
    bad = torch.tensor([int(not rep.ok)], device=device)
    dist.all_reduce(bad)
    if dist.get_rank() == 0:
        print(f"REPRODUCED on {int(bad.item())} rank(s)" if bad.item() else "no difference: the call matches the oracle")
    leave_process_group(barrier=False)
    return 1 if bad.item() else 0


if __name__ == "__main__":
    sys.exit(main())
