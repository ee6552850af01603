"""Ranks out of step between configurations whose exchanges differ in size or number, on gloo: every rank raises
``ValueError`` naming the difference (gloo would abort a process that receives a message of another size).

After agreeing on both configurations, rank 0 runs the other one: a non-causal ring where its peers run a causal
one (whose heads then swap, other exchanges), or grouped mode where they run LongNet (other ring buffers). Stamps
are swapped before any data moves (``comm/stamps.handshake``), so no rank receives a block of another size.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from dilated_attention import dilated_attention
from dilated_attention.comm import BACKEND_NAMES, get_backend
from dilated_attention.testing.spawn import spawn_ranks

INSTALLED = [n for n in BACKEND_NAMES if n == "collective" or importlib.util.find_spec(n) is not None]
TIMEOUT = 1.5  # seconds the library waits on a peer here
SWITCHES = {"causal": ({"causal": True}, {"causal": False}), "mode": ({"mode": "longnet"}, {"mode": "grouped"})}


def _drift(rank: int, world: int, backends: list[str]) -> dict:
    out = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    for name in backends:
        for field, (a, b) in SWITCHES.items():
            # a group of its own per case: transfers the drift left unmatched stay there
            comm = get_backend(name, dist.new_group(list(range(world))), timeout=TIMEOUT)

            def call(cfg: dict) -> torch.Tensor:
                return dilated_attention(x, x, x, (8, 16 * world), (1, 2), comm=comm, strategy="ring", **cfg)

            for cfg in (a, b):  # both agreed on every rank; their ring buffers differ
                call(cfg).sum().backward()
            try:
                call(b if rank == 0 else a).sum().backward()
                got = "no error"
            except ValueError as exc:
                got = f"ValueError: {exc}"
            except Exception as exc:  # noqa: BLE001 (reported to the test)
                got = f"{type(exc).__name__}: {exc}"
            out[f"{name}/{field}"] = got
    return out


def test_every_rank_raises_when_the_drifting_configuration_exchanges_other_sizes():
    if "deepspeed" in INSTALLED:
        from dilated_attention.comm.deepspeed import prebuild_ops

        prebuild_ops()  # compiled here, not in a rank while the others wait
    results = spawn_ranks(_drift, 2, INSTALLED)
    for rank, got in enumerate(results):
        for key, message in got.items():
            field = key.split("/")[1]
            assert message.startswith("ValueError: dilated_attention: ranks out of step: in call 3 (forward)"), \
                (rank, key, message[:300])
            assert f"{field}: rank 0=" in message, (rank, key, message[:300])
