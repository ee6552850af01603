"""Training integration on CPU/gloo: a small LongNet-style causal LM trained with sequence parallelism.

* one 2-rank spawn: plain SP training through each backend (collective on the
  world, fairscale on its model-parallel group from initialize_model_parallel(2),
  deepspeed through deepspeed.comm), per-step loss == single-process training;
* one 4-rank spawn: a DeepSpeed engine with ZeRO-2, SP 2 x DP 2 (DeepSpeed's
  Ulysses mpu protocol), loss == single-process training on the same global batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fairscale")
pytest.importorskip("deepspeed")

from dilated_attention.comm import BACKEND_NAMES  # noqa: E402
from dilated_attention.comm.deepspeed import prebuild_ops  # noqa: E402
from dilated_attention.models.lm import (  # noqa: E402
    DilatedLM,
    LMConfig,
    losses_match,
    spawn_deepspeed_training,
    spawn_sp_training,
)

STEPS = 5
RTOL = 1e-5


@pytest.fixture(scope="module")
def sp_results():
    prebuild_ops()  # compile DeepSpeed's CPU op once here, not in every spawned rank
    by_name: dict[str, list] = {}
    for r in spawn_sp_training(BACKEND_NAMES, STEPS, world_size=2):
        by_name.setdefault(r.name, []).append(r)
    return by_name


@pytest.fixture(scope="module")
def zero_results():
    prebuild_ops()
    return spawn_deepspeed_training(sp_size=2, zero_stage=2, steps=STEPS, world_size=4)


def _check_losses(got, world, name):
    assert sorted(r.rank for r in got) == list(range(world)), f"missing ranks for {name}"
    for r in got:
        assert not r.error, f"rank {r.rank}: {r.error}"
        assert len(r.losses) == STEPS
        # the run must actually train, so agreement after step 0 says the gradients agree
        assert max(r.reference) - min(r.reference) > 1e-2
        assert losses_match(r.losses, r.reference, rtol=RTOL), (
            f"rank {r.rank}: SP losses {r.losses} != single-process {r.reference}")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_sequence_parallel_loss_matches_single_process(sp_results, backend):
    _check_losses(sp_results.get(f"train-{backend}", []), 2, backend)


def test_fairscale_runs_on_its_model_parallel_group(sp_results):
    for r in sp_results["train-fairscale"]:
        assert r.info == {"group_is_mp": True, "world": 2}


def test_fairscale_initialises_model_parallel_once_and_says_so(sp_results):
    got = sp_results.get("fairscale-implicit-init", [])
    assert len(got) == 2
    for r in got:
        assert not r.error, r.error
        assert r.info == {"warnings": 1, "world": 2, "same_group": True, "mp_size": 2}


def test_deepspeed_zero2_sp2_dp2_matches_single_process(zero_results):
    _check_losses(zero_results, 4, "deepspeed zero-2 sp2 x dp2")


def test_lm_rejects_bad_input():
    with pytest.raises(ValueError, match="embed_dim"):
        LMConfig(embed_dim=0)
    model = DilatedLM(LMConfig())
    import torch

    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(64, dtype=torch.long))
    with pytest.raises(ValueError, match="position_offset"):
        model(torch.zeros(1, 32, dtype=torch.long), position_offset=48)


def _torchrun(args: list[str], timeout: int = 240) -> str:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_train_lm_script_under_torchrun():
    """launch/train_lm.py end to end (DeepSpeed ZeRO-2, SP over 2 gloo ranks): a loss per step, then tokens/s."""
    import re

    out = _torchrun(["launch/train_lm.py", "--backend", "deepspeed", "--steps", "3", "--seq-len", "64",
                     "--segments", "16,64", "--rates", "1,2"])
    losses = [float(x) for x in re.findall(r"step\s+\d+/3\s+loss (\S+)", out)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), out
    assert "tokens/s" in out and "sp=2" in out, out
