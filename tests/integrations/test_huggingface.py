"""Hugging Face Transformers integration (dilated_attention.integrations.huggingface) on CPU.

* single process: a tiny random Llama / Qwen2 with one pattern (w = N, r = 1) equals the
  same model with transformers' sdpa causal attention, logits and every parameter
  gradient, in float64; the registered function equals the fp64 oracle on real patterns;
  what cannot be honoured raises;
* packed documents (position_ids restarting, ``DataCollatorWithFlattening``, its
  ``cu_seq_lens_q/k``) equal each document alone, and sdpa with one full pattern;
  left and right padding equal sdpa on the real tokens;
* one 2-rank gloo spawn: sequence-parallel logits and summed gradients equal the
  single-process ones (packed documents with their global offsets too; without
  them every rank raises), and ``launch/hf_llama_train.py``'s training losses
  equal single-process training step for step (``--packed`` too).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations.huggingface import register_dilated_attention  # noqa: E402
from dilated_attention.testing.compare import FLOOR, rel_err  # noqa: E402
from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks  # noqa: E402
from dilated_attention.testing.oracle import dense_dilated_attention  # noqa: E402
from dilated_attention.testing.scripts import load_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 32
TOL = FLOOR[torch.float64]


def _config(family: str):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4 * N, use_cache=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def _models(family: str, impl: str, seed: int = 0):
    """``(sdpa, impl)``: the same random float64 weights (eager would softmax in fp32); separate configs
    (from_config sets the implementation on the config it is given)."""
    config = _config(family)
    torch.manual_seed(seed)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    other.load_state_dict(eager.state_dict())
    return eager.double(), other.double()


def _logits_and_grads(model, ids, weight=None, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **kwargs).logits
    if weight is None:
        weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5), dtype=logits.dtype)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_full_pattern_equals_sdpa_causal_attention(family):
    name = register_dilated_attention([N], [1], name="test-dilated-full")
    eager, dilated = _models(family, name)
    ids = torch.randint(0, 64, (2, N), generator=torch.Generator().manual_seed(1))
    want, want_grads = _logits_and_grads(eager, ids)
    got, got_grads = _logits_and_grads(dilated, ids)
    assert rel_err(got, want) <= TOL
    for n, g in want_grads.items():
        assert g.abs().max() > 0, n
        assert rel_err(got_grads[n], g) <= TOL, n


def test_bf16_autocast_runs_attention_in_the_autocast_dtype():
    """Under autocast RoPE leaves q, k in fp32 while v is bf16: attention runs in bf16, as SDPA does, and the
    logits agree with sdpa's to bf16 rounding (one full pattern; float32 weights)."""
    name = register_dilated_attention([N], [1], name="test-dilated-autocast")
    eager, dilated = (m.float() for m in _models("llama", name))
    ids = torch.randint(0, 64, (2, N), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager(input_ids=ids).logits.float()
        got = dilated(input_ids=ids).logits.float()
    with torch.no_grad():
        exact = eager.double()(input_ids=ids).logits
    assert rel_err(got, exact) <= 3 * max(rel_err(want, exact), 1e-3), (rel_err(got, exact), rel_err(want, exact))


def test_real_patterns_differ_from_dense_attention():
    """The integration really routes through the registered patterns (a pattern that is not dense changes logits)."""
    name = register_dilated_attention([8, N], [1, 4], name="test-dilated-sparse")
    eager, dilated = _models("llama", name)
    ids = torch.randint(0, 64, (2, N), generator=torch.Generator().manual_seed(1))
    assert rel_err(dilated(input_ids=ids).logits, eager(input_ids=ids).logits) > 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_attention_function_equals_oracle(causal):
    """The registered callable on transformers' (B, H, N, D) layout, GQA and scaling included."""
    from transformers import AttentionInterface

    segs, rates, scale = [8, 16, N], [1, 2, 4], 0.3
    name = register_dilated_attention(segs, rates, name="test-dilated-fn", mode="longnet")
    fn = AttentionInterface()[name]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, N, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, N, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, N, 4, 8, generator=g, dtype=torch.float64)
    module = torch.nn.Module()
    module.is_causal = causal
    out, weights = fn(module, q, k, v, None, scaling=scale)
    assert weights is None and out.shape == (2, N, 4, 8)
    kv = [t.transpose(1, 2).repeat_interleave(2, dim=2) for t in (k, v)]  # the oracle takes equal head counts
    want = dense_dilated_attention(q.transpose(1, 2), *kv, segs, rates, causal=causal, softmax_scale=scale)
    got_grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    assert rel_err(out, want) <= TOL
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) <= TOL


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_equals_sdpa_on_real_tokens(side):
    name = register_dilated_attention([N], [1], name="test-dilated-full")
    eager, dilated = _models("llama", name)
    ids = torch.randint(0, 64, (2, N), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, N, dtype=torch.long)
    if side == "left":
        mask[1, :5] = 0  # later queries would see these keys without the mask
    else:
        mask[1, -7:] = 0
    want = eager(input_ids=ids, attention_mask=mask).logits
    got = dilated(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got[real], want[real]) <= TOL
    if side == "right":  # right padding changes nothing before it: the row alone, real patterns included
        sparse = register_dilated_attention([8, 16], [1, 2], name="test-dilated-sparse")
        dilated.set_attn_implementation(sparse)
        alone = dilated(input_ids=ids[1:, :-7]).logits
        assert rel_err(dilated(input_ids=ids, attention_mask=mask).logits[1, :-7], alone[0]) <= TOL


# -- packed documents (padding-free batches) --------------------------------------------------------

DOCS = (13, 24, 11)  # none a multiple of the segments: each document is padded internally on its own


def _documents(seed: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (1, n), generator=g) for n in DOCS]


def _packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids)`` of the documents packed into one row (positions restart at 0)."""
    return torch.cat(docs, 1), torch.cat([torch.arange(d.shape[1]) for d in docs])[None]


def test_packed_documents_equal_each_document_alone():
    """Documents found from position_ids: logits and parameter gradients equal separate runs (real patterns)."""
    name = register_dilated_attention([8, 16], [1, 2], name="test-dilated-sparse")
    _, dilated = _models("llama", name)
    docs = _documents()
    ids, positions = _packed(docs)
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(1, d.shape[1], 64, generator=g, dtype=torch.float64) for d in docs]
    dilated.zero_grad(set_to_none=True)
    want = []
    for d, w in zip(docs, weights):
        logits = dilated(input_ids=d).logits
        (logits * w).sum().backward()
        want.append(logits.detach())
    want_grads = {n: p.grad.clone() for n, p in dilated.named_parameters()}
    got, got_grads = _logits_and_grads(dilated, ids, weight=torch.cat(weights, 1), position_ids=positions)
    assert rel_err(got, torch.cat(want, 1)) <= TOL
    for n, grad in want_grads.items():
        assert rel_err(got_grads[n], grad) <= TOL, n


def test_packed_documents_full_pattern_equals_sdpa():
    """One full pattern: the packed row equals sdpa on each document alone, and sdpa on the packed row."""
    name = register_dilated_attention([sum(DOCS)], [1], name="test-dilated-packed-full")
    eager, dilated = _models("qwen2", name)
    docs = _documents()
    ids, positions = _packed(docs)
    got = dilated(input_ids=ids, position_ids=positions).logits
    assert rel_err(got, torch.cat([eager(input_ids=d).logits for d in docs], 1)) <= TOL
    assert rel_err(got, eager(input_ids=ids, position_ids=positions).logits) <= TOL
    # rows of a larger batch are documents too (transformers' masks find documents in every row)
    two = torch.cat([ids[:, :24], ids[:, 24:]]), torch.cat([positions[:, :24], positions[:, 24:]])
    two_rows = dilated(input_ids=two[0], position_ids=two[1]).logits
    assert rel_err(two_rows, eager(input_ids=two[0], position_ids=two[1]).logits) <= TOL


@pytest.mark.skipif(not hasattr(transformers, "DataCollatorWithFlattening"), reason="no DataCollatorWithFlattening")
@pytest.mark.parametrize("flash_kwargs", [True, False])
def test_data_collator_with_flattening(flash_kwargs):
    """The padding-free collator's batch as it comes (positions, and cu_seq_lens_q/k when asked): loss and logits
    equal each document alone."""
    name = register_dilated_attention([8, 16], [1, 2], name="test-dilated-sparse")
    _, dilated = _models("llama", name)
    docs = _documents()
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": d[0].tolist()} for d in docs])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    out = dilated(**batch)
    alone = [dilated(input_ids=d, labels=d) for d in docs]
    assert rel_err(out.logits, torch.cat([a.logits for a in alone], 1)) <= TOL
    tokens = [d.shape[1] - 1 for d in docs]  # predicted tokens per document (the collator masks each first label)
    want_loss = sum(a.loss * t for a, t in zip(alone, tokens)) / sum(tokens)
    assert abs(out.loss.item() - want_loss.item()) <= 1e-12


def test_attention_function_takes_collator_offsets():
    """cu_seq_lens_q/k (flash-attention's kwargs) are used as given, whatever position_ids say; rows flatten."""
    from transformers import AttentionInterface

    segs, rates = [8, 16], [1, 2]
    name = register_dilated_attention(segs, rates, name="test-dilated-fn")
    fn = AttentionInterface()[name]
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 10, 30, 48], dtype=torch.int32)  # offsets into the flattened 2 x 24 tokens
    out, _ = fn(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(),
                position_ids=torch.arange(24)[None])
    flat = [t.transpose(1, 2).reshape(1, 48, t.shape[1], 8) for t in (q, k, v)]
    want = torch.cat([fn(module, *(t[:, a:b].transpose(1, 2) for t in flat), None)[0]
                      for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert rel_err(out.reshape(1, 48, 4, 8), want) <= TOL
    with pytest.raises(ValueError, match="cu_seq_lens_q must equal cu_seq_lens_k"):
        fn(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 48], dtype=torch.int32))


def test_collator_offsets_are_remembered_per_tensor_object_not_per_id():
    """The per-forward memo of cu_seq_lens_q/k matches both tensors by identity and version: a new cu_seq_lens_k
    (which may take a freed one's id) is read and checked again, never answered from the last call's."""
    from dilated_attention.integrations.huggingface import _PerTensor

    memo, cu_q, calls = _PerTensor(), torch.tensor([0, 3]), []

    def compute():
        calls.append(None)
        return len(calls)

    cu_k = torch.tensor([0, 3])
    assert memo.get(cu_q, ("offsets",), compute, also=cu_k) == 1
    assert memo.get(cu_q, ("offsets",), compute, also=cu_k) == 1  # the same two tensors: remembered
    cu_k.add_(0)  # written in place: read again
    assert memo.get(cu_q, ("offsets",), compute, also=cu_k) == 2
    assert memo.get(cu_q, ("offsets",), compute, also=torch.tensor([0, 3])) == 3  # another tensor, equal values
    assert memo.get(cu_q, ("offsets",), compute) == 4
    assert memo.get(cu_q, ("offsets",), compute) == 4


def test_packed_mask_composition_without_remapping_is_read():
    """Releases before 5.23 put the packed-document mask beside the base mask (no position remapping)."""
    from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                            packed_sequence_mask_function)

    from dilated_attention.integrations.huggingface import check_mask_function

    docs = torch.zeros(1, 8, dtype=torch.long)
    for base in (causal_mask_function, bidirectional_mask_function):
        check_mask_function(and_masks(base, packed_sequence_mask_function(docs)))
    with pytest.raises(ValueError, match="does not recognise"):
        check_mask_function(and_masks(lambda b, h, i, j: i == j, packed_sequence_mask_function(docs)))


def test_packed_mask_compositions_with_remapping_are_read():
    """5.23 wraps the packed-document mask around the remapped base; 5.24 on the other way round."""
    import transformers.masking_utils as mu

    if not hasattr(mu, "remap_positions_for_packed_sequence"):
        pytest.skip(f"transformers {transformers.__version__} does not remap packed positions (new in 5.23)")
    from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                            packed_sequence_mask_function, remap_positions_for_packed_sequence)

    from dilated_attention.integrations.huggingface import check_mask_function

    pos, docs = torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long)
    for base in (causal_mask_function, bidirectional_mask_function):
        remapped = remap_positions_for_packed_sequence(base, pos)
        check_mask_function(and_masks(packed_sequence_mask_function(docs), remapped))  # 5.23
        check_mask_function(and_masks(remapped, packed_sequence_mask_function(docs)))  # 5.24
    unknown = remap_positions_for_packed_sequence(lambda b, h, i, j: i == j, pos)
    with pytest.raises(ValueError, match="does not recognise"):
        check_mask_function(and_masks(unknown, packed_sequence_mask_function(docs)))


def test_unsupported_transformers_releases_are_named(monkeypatch, recwarn):
    import dilated_attention.integrations.huggingface as hf

    monkeypatch.setattr(hf, "_transformers_version", lambda: "4.57.6")
    with pytest.raises(RuntimeError, match=r"transformers 4\.57\.6 .*supports 5\.0 to 5\.25.*'transformers>=5\.0,<5\.26'"):
        register_dilated_attention([N], [1], name="test-old-release")
    for supported in ("5.0.0", "5.17.0", "5.25.0"):  # the bounds, and one between
        monkeypatch.setattr(hf, "_transformers_version", lambda: supported)
        assert register_dilated_attention([N], [1], name="test-supported-release") == "test-supported-release"
    assert not [w for w in recwarn if "transformers" in str(w.message)]
    monkeypatch.setattr(hf, "_transformers_version", lambda: "5.31.0")
    with pytest.warns(UserWarning, match=r"untested transformers 5\.31\.0"):
        register_dilated_attention([N], [1], name="test-new-release")


def test_unsupported_features_raise():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function, or_masks
    from transformers.masking_utils import sliding_window_causal_mask_function

    name = register_dilated_attention([N], [1], name="test-dilated-full")
    fn = AttentionInterface()[name]
    module = torch.nn.Module()
    q = torch.randn(1, 4, N, 8)
    with pytest.raises(ValueError, match="dropout=0.1"):
        fn(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="use_cache=False"):
        fn(module, q[:, :, :1], q, q, None)
    with pytest.raises(ValueError, match=r"2D padding attention_mask .* got shape \(1, 1, 32, 32\)"):
        fn(module, q, q, q, torch.zeros(1, 1, N, N))
    with pytest.raises(ValueError, match="sliding-window"):
        fn(module, q, q, q, None, sliding_window=8)
    mask_fn = AttentionMaskInterface()[name]
    assert mask_fn(1, N, N, mask_function=causal_mask_function) is None
    for other, what in ((sliding_window_causal_mask_function(8), "sliding-window attention"),
                        (chunked_causal_mask_function(8, torch.zeros(1)), "chunked attention"),
                        (or_masks(causal_mask_function, lambda b, h, i, j: i == j), "a custom mask overlay")):
        with pytest.raises(ValueError, match=f"causal or full attention, .* asks for {what}"):
            mask_fn(1, N, N, mask_function=other)
    with pytest.raises(ValueError, match=r"cannot tell what .* transformers 5\.\d+.* supports 5\.0 to 5\.25"):
        mask_fn(1, N, N, mask_function=lambda b, h, i, j: i >= j)  # a composition it does not know
    with pytest.raises(TypeError, match=r"unsupported keyword\(s\) \['causal'\]"):
        register_dilated_attention([N], [1], name="test-bad", causal=True)
    with pytest.raises(ValueError, match="name must be a new attention implementation name"):
        register_dilated_attention([N], [1], name="sdpa")


# -- sequence parallel, 2 gloo ranks ---------------------------------------------------------------


def _load_example():
    return load_script(os.path.join(ROOT, "launch", "hf_llama_train.py"))


def _sp_worker(rank: int, world_size: int) -> dict:
    from dilated_attention.comm import get_backend
    from dilated_attention.distributed import all_reduce_gradients, gather_sequence, shard_positions, shard_sequence

    res: dict = {}
    comm = get_backend("collective")
    example = _load_example()
    args = example.parse_args(["--steps", "3", "--seq-len", "64", "--segments", "16,64", "--rates", "1,2"])
    cpu = torch.device("cpu")
    quiet = lambda msg: None  # noqa: E731

    # one forward/backward: logits rows and summed gradients vs the single process
    ids, _ = example.make_batch(args, 0)
    ref = example.build_model(args, None).double()
    want, want_grads = _logits_and_grads(ref, ids)
    sp = example.build_model(args, comm).double()
    # this rank's rows of the weights _logits_and_grads puts on the full logits
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=want.dtype)
    logits = sp(input_ids=shard_sequence(ids, comm), position_ids=shard_positions(args.seq_len, comm)[None]).logits
    (logits * shard_sequence(weight, comm)).sum().backward()
    all_reduce_gradients(sp, comm)
    res["logits_err"] = rel_err(gather_sequence(logits, comm), want)
    res["grad_err"] = max(rel_err(p.grad, want_grads[n]) for n, p in sp.named_parameters())

    # local positions on a shard are caught on every rank (a fresh registration checks its first call)
    fresh = example.build_model(args, comm)
    try:
        fresh(input_ids=shard_sequence(ids, comm))
        res["local_positions"] = "no error"
    except ValueError as exc:
        res["local_positions"] = str(exc)

    # left padding in rank 0's shard only: every rank still passes a mask (the ranks must agree on masking)
    mask = torch.ones(ids.shape, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = gather_sequence(sp(input_ids=shard_sequence(ids, comm), attention_mask=shard_sequence(mask, comm),
                                 position_ids=shard_positions(args.seq_len, comm)[None]).logits, comm)
    res["padded_err"] = rel_err(got[mask.bool()], want[mask.bool()])

    # packed documents (one row, global offsets, a document across the shard boundary): logits and gradients
    pids, _, ppos, offsets = example.make_packed_batch(args, 1)  # 2 x 64 tokens
    assert offsets.numel() > 3 and not (offsets == pids.shape[1] // 2).any()
    pweight = torch.randn((*pids.shape, args.vocab), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    want, want_grads = _logits_and_grads(ref, pids, weight=pweight, position_ids=ppos)
    sp.zero_grad(set_to_none=True)
    logits = sp(input_ids=shard_sequence(pids, comm), position_ids=shard_sequence(ppos, comm),
                cu_seq_lens_q=offsets, cu_seq_lens_k=offsets).logits
    (logits * shard_sequence(pweight, comm)).sum().backward()
    all_reduce_gradients(sp, comm)
    res["packed_logits_err"] = rel_err(gather_sequence(logits, comm), want)
    res["packed_grad_err"] = max(rel_err(p.grad, want_grads[n]) for n, p in sp.named_parameters())

    # packed without the global offsets, on the ring: the ranks find the documents from the gathered positions
    ring = example.parse_args(["--seq-len", "64", "--segments", "16,64", "--rates", "1,2", "--strategy", "ring"])
    sp_ring = example.build_model(ring, comm).double()
    logits = sp_ring(input_ids=shard_sequence(pids, comm), position_ids=shard_sequence(ppos, comm)).logits
    (logits * shard_sequence(pweight, comm)).sum().backward()
    all_reduce_gradients(sp_ring, comm)
    res["packed_ring_logits_err"] = rel_err(gather_sequence(logits, comm), want)
    res["packed_ring_grad_err"] = max(rel_err(p.grad, want_grads[n]) for n, p in sp_ring.named_parameters())
    # a document starting at a shard and no restart inside any: taken for local positions, every rank raises
    try:
        sp(input_ids=shard_sequence(pids, comm), position_ids=shard_sequence(torch.arange(64).repeat(2)[None], comm))
        res["packed_boundary"] = "no error"
    except ValueError as exc:
        res["packed_boundary"] = str(exc)

    # the example's training loop: sequence parallel == single process, step for step (packed too)
    res["reference"] = example.train(args, None, cpu, log=quiet)
    res["losses"] = example.train(args, comm, cpu, log=quiet)
    packed = example.parse_args(["--steps", "3", "--seq-len", "64", "--segments", "16,64", "--rates", "1,2",
                                 "--packed", "--strategy", "ring"])
    res["packed_reference"] = example.train(packed, None, cpu, log=quiet)
    res["packed_losses"] = example.train(packed, comm, cpu, log=quiet)
    return res


@pytest.fixture(scope="module")
def sp_results() -> list[dict]:
    return spawn_ranks(_sp_worker, 2, env=UNINTERPRETED)


def test_sequence_parallel_logits_and_gradients_equal_single_process(sp_results):
    for res in sp_results:
        assert res["logits_err"] <= TOL
        assert res["grad_err"] <= 1e-9  # float64, summed in a different order over ranks


def test_sequence_parallel_rejects_local_positions_on_every_rank(sp_results):
    for res in sp_results:
        assert "rank(s) [1] got position_ids starting at 0" in res["local_positions"]


def test_sequence_parallel_padding_equals_single_process(sp_results):
    for res in sp_results:
        assert res["padded_err"] <= TOL


def test_sequence_parallel_packed_documents_equal_single_process(sp_results):
    for res in sp_results:
        assert res["packed_logits_err"] <= TOL
        assert res["packed_grad_err"] <= 1e-9


def test_sequence_parallel_packed_positions_alone_run_on_the_ring(sp_results):
    for res in sp_results:
        assert res["packed_ring_logits_err"] <= TOL
        assert res["packed_ring_grad_err"] <= 1e-9


def test_sequence_parallel_local_positions_without_restarts_raise_on_every_rank(sp_results):
    for res in sp_results:
        assert "rank(s) [1] got position_ids starting at 0" in res["packed_boundary"]
        assert "If packed documents start there" in res["packed_boundary"]


@pytest.mark.parametrize("mode", ["", "packed_"])
def test_example_trains_sequence_parallel_like_single_process(sp_results, mode):
    for res in sp_results:
        ref, got = res[f"{mode}reference"], res[f"{mode}losses"]
        assert len(got) == 3 and ref[-1] < ref[0], ref  # it trains
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), (got, ref)
