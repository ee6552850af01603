"""``leave_process_group``: compiled CUDA graphs released before the group is destroyed.

A CUDA graph alive with NCCL kernels in it keeps NCCL's finalize waiting, so ``destroy_process_group`` hangs
after ``torch.compile(mode="reduce-overhead")`` of a ring call; only a GPU shows the hang (the 2-GPU harness
compiles one and exits through this function). Here: the order of the steps, and that Dynamo is neither
imported nor reset when nothing was compiled."""

import sys

import pytest
import torch

from dilated_attention import launch_utils


@pytest.fixture
def steps(monkeypatch):
    done = []
    monkeypatch.setattr(launch_utils.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch_utils.dist, "barrier", lambda: done.append("barrier"))
    monkeypatch.setattr(launch_utils.dist, "destroy_process_group", lambda: done.append("destroy"))
    monkeypatch.setattr(torch.compiler, "reset", lambda: done.append("release compiled"))
    return done


def test_compiled_graphs_go_before_the_group(steps):
    import torch._dynamo  # noqa: F401  (something was compiled)

    launch_utils.leave_process_group()
    assert steps == ["release compiled", "barrier", "destroy"]
    steps.clear()
    launch_utils.leave_process_group(barrier=False)
    assert steps == ["release compiled", "destroy"]


def test_nothing_compiled_leaves_dynamo_alone(steps, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    launch_utils.DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo").shutdown()
    assert steps == ["barrier", "destroy"]
    assert "torch._dynamo" not in sys.modules


def test_outside_a_process_group_it_does_nothing(steps, monkeypatch):
    monkeypatch.setattr(launch_utils.dist, "is_initialized", lambda: False)
    launch_utils.leave_process_group()
    assert steps == []
