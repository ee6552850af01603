"""Calls with ``comm`` reuse their schedule and signature text (gloo ranks).

Planning a call with ``comm`` costs host time a LongNet forward cannot hide, so a repeated call
reuses it (``planning.prepare``). What the signature reads besides the schedule (grad mode,
which inputs require grad) is part of the key: a call that differs there is planned and signed
anew, so the cross-rank agreement still sees it. Each backend keeps its own table, so nothing
of the library's holds a backend (and its process group) after the caller drops it.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from dilated_attention import dilated_attention, planning
from dilated_attention.comm import get_backend
from dilated_attention.testing.spawn import spawn_ranks

WORLD = 2
L = 16
SEGS, RATES = (8, L * WORLD), (1, 2)


def _scenarios(rank: int, world_size: int) -> dict:
    g = torch.Generator().manual_seed(700 + rank)
    q, k, v, dout = (torch.randn(1, L, 4, 8, generator=g, dtype=torch.float64) for _ in range(4))
    planned, texts = [], []
    schedule, agree = planning.schedule, planning.agree
    planning.schedule = lambda *a, **kw: planned.append(1) or schedule(*a, **kw)
    planning.agree = lambda comm, state, text, *a: texts.append(text) or agree(comm, state, text, *a)
    out = {}
    try:
        for strategy in ("ring", "head"):
            comm = get_backend("collective", dist.new_group(list(range(WORLD))))
            runs = []
            for _ in range(2):
                x = [t.clone().requires_grad_() for t in (q, k, v)]
                o = dilated_attention(*x, SEGS, RATES, comm=comm, strategy=strategy, causal=True)
                o.backward(dout)
                runs.append([o.detach(), *(t.grad for t in x)])
            out[f"{strategy}-planned"] = len(planned)
            out[f"{strategy}-same"] = all(torch.equal(a, b) for a, b in zip(*runs))
            with torch.no_grad():
                o = dilated_attention(q, k, v, SEGS, RATES, comm=comm, strategy=strategy, causal=True)
            out[f"{strategy}-no-grad"] = {"planned": len(planned), "same": torch.equal(o, runs[0][0]),
                                          "new text": texts[-1] != texts[-2]}
            planned.clear()
            texts.clear()
            gone = weakref.ref(comm)
            del comm, o, x, runs
            # nothing of the library's keeps a backend (its process group) once the caller drops it, and no
            # reference cycle does either: gloo aborts if a group dies in the interpreter's last collection
            out[f"{strategy}-released"] = gone() is None
            gc.collect()
    finally:
        planning.schedule, planning.agree = schedule, agree
    return out


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_scenarios, WORLD)


@pytest.mark.parametrize("strategy", ["ring", "head"])
def test_a_repeated_call_is_planned_once_and_computes_the_same(outcomes, strategy):
    for rank_out in outcomes:
        assert rank_out[f"{strategy}-planned"] == 1
        assert rank_out[f"{strategy}-same"]


@pytest.mark.parametrize("strategy", ["ring", "head"])
def test_a_call_without_gradients_is_planned_and_signed_anew(outcomes, strategy):
    for rank_out in outcomes:
        assert rank_out[f"{strategy}-no-grad"] == {"planned": 2, "same": True, "new text": True}


@pytest.mark.parametrize("strategy", ["ring", "head"])
def test_the_schedules_go_with_their_backend(outcomes, strategy):
    for rank_out in outcomes:
        assert rank_out[f"{strategy}-released"]


_NAMED = '''
import gc, os, weakref
import torch, torch.distributed as dist
from dilated_attention import comm, dilated_attention
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)
q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
dilated_attention(q, k, v, [8, 16], [1, 2], comm="collective").sum().backward()
group = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
print("held after destroy:", group() is not None)
comm._release_named_backends()  # what runs at exit
gc.collect()
print("held at exit:", group() is not None)
'''


def test_a_named_backend_lets_its_destroyed_group_go_at_exit():
    """``comm="collective"`` keeps one backend per process group; at exit it lets a destroyed group go while the
    interpreter is whole (gloo can abort when a group dies in the interpreter's teardown)."""
    import os
    import subprocess
    import sys

    from dilated_attention.launch_utils import free_port

    proc = subprocess.run([sys.executable, "-c", _NAMED], env=dict(os.environ, PORT=str(free_port())),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held after destroy: True" in proc.stdout and "held at exit: False" in proc.stdout, proc.stdout
