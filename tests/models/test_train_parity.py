"""Training a Hugging Face Llama sequence parallel gives the loss curve of one device.

* the attention FLOP count (``attended_pairs``) equals the attended (query, key) pairs of the
  oracle's masks, dense causal attention included;
* the tiled loss (DeepSpeed's ``TiledFusedLogitsLoss`` and the chunked one) equals the plain
  cross-entropy of the whole logits, value and gradients, in float64;
* two gloo ranks, each holding half of every sequence, train a tiny ``LlamaForCausalLM`` with
  dilated attention through the Hugging Face integration (``comm=``), FSDP2, per-layer activation
  checkpointing and the tiled loss -- ``benchmarks/bench_model.py``'s step -- for 20 AdamW steps
  (lr 3e-4 after a warmup, gradients clipped to 1.0); one process trains the same model the plain way
  (``model(input_ids, labels=input_ids).loss``, transformers' own loss). Float32: every step's loss
  agrees within ``LOSS_RTOL`` (a few hundred float32 roundings of the summation order, which differs
  between the ranks' partial sums, the tiles and FSDP's reduction, carried through 20 Adam steps),
  and the loss falls.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dilated_attention.models.hf_training import (  # noqa: E402
    IGNORE_INDEX,
    LlamaShape,
    SequenceParallelLoss,
    attended_pairs,
    build_llama,
    deepspeed_tiled_loss,
    dense_causal_pairs,
    learnable_tokens,
    longnet_schedule,
    make_optimizer,
    sequence_parallel_batch,
    shard_model,
    shift_labels,
    tiled_lm_loss,
    train_step,
)
from dilated_attention.testing.oracle import pattern_masks  # noqa: E402
from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks  # noqa: E402

SHAPE = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=128)
SEQ, BATCH, STEPS, SEED = 128, 2, 20, 7
SEGMENTS, RATES = longnet_schedule(SEQ, first=16)  # [16, 64, 128], [1, 2, 4]: one pattern spans both shards
LR, WARMUP = 3e-4, 4
LOSS_RTOL = 2e-5


@pytest.mark.parametrize("n,heads,segments,rates", [
    (48, 3, [8, 24, 48], [1, 2, 4]),  # a rate that does not divide the heads: offsets spread unevenly
    (64, 4, [16, 64], [1, 2]),
    (32, 2, [32], [1]),  # one full pattern: dense attention
])
@pytest.mark.parametrize("causal", [True, False])
def test_attended_pairs_count_the_masks(n, heads, segments, rates, causal):
    masks = pattern_masks(n, heads, segments, rates, "longnet", causal)
    assert attended_pairs(n, heads, segments, rates, causal) == sum(int(m.sum()) for m in masks)
    if segments == [n] and causal:
        assert attended_pairs(n, heads, segments, rates) == dense_causal_pairs(n, heads)


def test_longnet_schedule():
    assert longnet_schedule(131072) == ([2048, 8192, 32768, 131072], [1, 2, 4, 8])
    assert longnet_schedule(65536) == ([2048, 8192, 32768, 65536], [1, 2, 4, 8])
    assert longnet_schedule(2048) == ([2048], [1])


def test_shift_labels_crosses_shards():
    tokens = torch.arange(12).reshape(2, 6)
    labels = shift_labels(tokens)
    assert labels[:, :-1].tolist() == tokens[:, 1:].tolist() and (labels[:, -1] == IGNORE_INDEX).all()
    # the last row of the first half predicts the first token of the second half
    assert labels[0, 2] == tokens[0, 3]


@pytest.mark.parametrize("impl", ["chunked", "deepspeed"])
def test_tiled_loss_equals_whole_logits(impl):
    if impl == "deepspeed" and deepspeed_tiled_loss() is None:
        pytest.skip("deepspeed's TiledFusedLogitsLoss does not import")
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(16, 40, bias=False).double()
    hidden = torch.randn(2, 30, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 30), generator=g)
    labels[0, 5] = labels[1, -1] = IGNORE_INDEX
    normalizer = int((labels != IGNORE_INDEX).sum())
    want = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="sum") / normalizer
    want.backward()  # (DeepSpeed's tiles run their backward inside the forward: read .grad, not autograd.grad)
    want_grads = [hidden.grad, head.weight.grad]
    hidden.grad = head.weight.grad = None
    got = tiled_lm_loss(hidden, head, labels, normalizer, chunk_rows=7, impl=impl)  # 9 tiles, the last short
    got.backward()
    got_grads = [hidden.grad, head.weight.grad]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def _register(comm):
    from dilated_attention.integrations.huggingface import register_dilated_attention

    return register_dilated_attention(SEGMENTS, RATES, comm=comm, name="dilated_attention_sp" if comm else
                                      "dilated_attention")


def _sequence_parallel_losses(rank: int, world: int) -> list[float]:
    """The benchmark's step on this rank: FSDP2 (float32), checkpointed layers, tiled loss, SP over the world."""
    import torch.distributed as dist

    from dilated_attention.comm import get_backend

    comm = get_backend("collective")
    lm = build_llama(SHAPE, _register(comm), SEQ, SEED, checkpointing=True)
    module = shard_model(SequenceParallelLoss(lm, chunk_rows=40), bf16=False)
    opt, sched = make_optimizer(module.parameters(), lr=LR, warmup_steps=WARMUP, total_steps=STEPS)
    losses = []
    for step in range(STEPS):
        batch = sequence_parallel_batch(learnable_tokens(BATCH, SEQ, SHAPE.vocab, SEED, step), comm, "cpu")
        losses.append(train_step(module, opt, sched, batch, loss_group=dist.group.WORLD))
    return losses


def _one_device_losses() -> list[float]:
    """Plain single-process training: the whole sequences, transformers' own loss, no sharding or tiling."""
    lm = build_llama(SHAPE, _register(None), SEQ, SEED, checkpointing=False)
    opt, sched = make_optimizer(lm.parameters(), lr=LR, warmup_steps=WARMUP, total_steps=STEPS)
    losses = []
    for step in range(STEPS):
        tokens = learnable_tokens(BATCH, SEQ, SHAPE.vocab, SEED, step)
        loss = lm(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_two_ranks_train_like_one_device():
    ranks = spawn_ranks(_sequence_parallel_losses, 2, env=UNINTERPRETED)
    assert ranks[0] == ranks[1]  # every rank reports the whole batch's loss
    torch.set_num_threads(1)
    want = _one_device_losses()
    got = ranks[0]
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: K=2 loss {a} vs one device {b}\n{got}\n{want}"
    assert sum(want[-4:]) / 4 < sum(want[:4]) / 4 - 0.05, f"the loss does not fall: {want}"
