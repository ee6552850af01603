"""``hf_training.tile_mlp``: a Llama whose MLPs run in row tiles trains exactly like the untiled one.

* one process, float64: the loss and every parameter's gradient of a tiled model equal those of an untiled
  copy with the same weights, for DeepSpeed's ``TiledMLP`` and the checkpointed-tile fallback, with and
  without per-layer activation checkpointing, the tiles not dividing the rows evenly;
* two gloo ranks, FSDP2 per decoder layer, float32, checkpointed layers: the whole gradients of the tiled model equal the untiled model's -- the MLP's weights are
  gathered for the tiles' recomputation in the backward and their gradients reach FSDP's reduction;
* bad arguments are refused with the argument's name.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dilated_attention.models.hf_training import (  # noqa: E402
    LlamaShape,
    SequenceParallelLoss,
    build_llama,
    deepspeed_tiled_mlp,
    learnable_tokens,
    sequence_parallel_batch,
    shard_model,
    tile_mlp,
)
from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks  # noqa: E402

SHAPE = LlamaShape(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=48, vocab=64)
SEED = 5
IMPLS = ["chunked", pytest.param("deepspeed", marks=pytest.mark.skipif(
    deepspeed_tiled_mlp() is None, reason="deepspeed's TiledMLP does not import"))]


def _loss_and_grads(lm, tokens):
    loss = lm(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in lm.named_parameters()}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_equals_untiled(impl, checkpointing):
    plain = build_llama(SHAPE, "sdpa", 64, SEED, checkpointing=checkpointing).double()
    tiled = copy.deepcopy(plain)
    assert tile_mlp(tiled, rows=13, impl=impl) == impl
    tokens = torch.randint(0, SHAPE.vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    # 80 rows in tiles of 13: 7 tiles, the last of 2 rows (DeepSpeed's chunk: 6 of 14 and one of 10)
    want_loss, want = _loss_and_grads(plain, tokens)
    got_loss, got = _loss_and_grads(tiled, tokens)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        assert want[name].abs().max() > 0, name  # every parameter gets a gradient, the MLP's included
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13, msg=name)


def test_tiling_twice_retiles():
    lm = build_llama(SHAPE, "sdpa", 64, SEED, checkpointing=False).double()
    tile_mlp(lm, rows=5, impl="chunked")
    tile_mlp(lm, rows=7, impl="chunked")
    calls = []
    mlp = lm.model.layers[0].mlp
    mlp.gate_proj.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    with torch.no_grad():
        mlp(torch.randn(1, 20, SHAPE.hidden, dtype=torch.float64))
    assert calls == [7, 7, 6]  # the second tiling's rows, one level of tiles


def test_bad_arguments_are_refused():
    lm = build_llama(SHAPE, "sdpa", 64, SEED, checkpointing=False)
    with pytest.raises(ValueError, match="rows"):
        tile_mlp(lm, rows=0)
    with pytest.raises(ValueError, match="impl"):
        tile_mlp(lm, impl="fast")
    with pytest.raises(TypeError, match="layers"):
        tile_mlp(torch.nn.Linear(2, 2))


def _fsdp_gradients(rank: int, world: int, tiled: str | None) -> dict[str, list]:
    """One step's whole gradients of the FSDP2-sharded, sequence-parallel model (float32, checkpointed layers)."""
    from dilated_attention.comm import get_backend
    from dilated_attention.integrations.huggingface import register_dilated_attention

    comm = get_backend("collective")
    name = register_dilated_attention([16, 64], [1, 2], comm=comm, name="dilated_attention_tiled_mlp")
    lm = build_llama(SHAPE, name, 64, SEED, checkpointing=True)
    if tiled:
        tile_mlp(lm, rows=12, impl=tiled)  # 32 rows a rank: tiles of 12, 12 and 8
    module = shard_model(SequenceParallelLoss(lm, chunk_rows=24), bf16=False)
    batch = sequence_parallel_batch(learnable_tokens(1, 64, SHAPE.vocab, SEED, 0), comm, "cpu")
    module(**batch).backward()
    return {n: p.grad.full_tensor().tolist() for n, p in module.named_parameters()}  # (ranks return JSON)


def _fsdp_runs(rank: int, world: int, impls: list[str]) -> list[dict[str, list]]:
    return [_fsdp_gradients(rank, world, impl) for impl in [None, *impls]]


def test_tiled_mlp_under_fsdp2_and_checkpointing():
    impls = ["chunked"] + (["deepspeed"] if deepspeed_tiled_mlp() is not None else [])
    want, *runs = spawn_ranks(_fsdp_runs, 2, impls, env=UNINTERPRETED)[0]
    assert len(runs) == len(impls)
    for got in runs:
        assert got.keys() == want.keys()
        for name in want:
            a, b = torch.tensor(got[name]), torch.tensor(want[name])
            assert b.abs().max() > 0, name
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7, msg=name)
