"""Hugging Face Transformers integration (dilated_attention.integrations.huggingface) on CPU.

* single process: a tiny random Llama / Qwen2 with one pattern (w = N, r = 1) equals the
  same model with transformers' sdpa causal attention, logits and every parameter
  gradient, in float64; the registered function equals the fp64 oracle on real patterns;
  what cannot be honoured raises;
* one 2-rank gloo spawn: sequence-parallel logits and summed gradients equal the
  single-process ones, and ``examples/hf_llama_train.py``'s training losses equal
  single-process training step for step.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.integrations.huggingface import register_dilated_attention  # noqa: E402
from dilated_attention.testing.compare import FLOOR, rel_err  # noqa: E402
from dilated_attention.testing.spawn import spawn_ranks  # noqa: E402
from dilated_attention.testing.oracle import dense_dilated_attention  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def _logits_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **kwargs).logits
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


@pytest.mark.skipif("key_padding_mask" not in inspect.signature(dilated_attention).parameters,
                    reason="dilated_attention has no key_padding_mask yet")
def test_padding_mask_equals_sdpa_on_real_tokens():
    name = register_dilated_attention([N], [1], name="test-dilated-full")
    eager, dilated = _models("llama", name)
    ids = torch.randint(0, 64, (2, N), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, :5] = 0  # left padding: later queries would see these keys without the mask
    want = eager(input_ids=ids, attention_mask=mask).logits
    got = dilated(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got[real], want[real]) <= TOL


def test_unsupported_features_raise():
    from transformers import AttentionInterface

    name = register_dilated_attention([N], [1], name="test-dilated-full")
    _, dilated = _models("llama", name)
    ids = torch.randint(0, 64, (1, N), generator=torch.Generator().manual_seed(4))
    packed = torch.cat([torch.arange(N // 2), torch.arange(N // 2)])[None]
    with pytest.raises(ValueError, match="packed sequences"):
        dilated(input_ids=ids, position_ids=packed)
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
    with pytest.raises(TypeError, match=r"unsupported keyword\(s\) \['causal'\]"):
        register_dilated_attention([N], [1], name="test-bad", causal=True)
    with pytest.raises(ValueError, match="name must be a new attention implementation name"):
        register_dilated_attention([N], [1], name="sdpa")


# -- sequence parallel, 2 gloo ranks ---------------------------------------------------------------


def _load_example():
    spec = importlib.util.spec_from_file_location("hf_llama_train", os.path.join(ROOT, "examples", "hf_llama_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

    # the example's training loop: sequence parallel == single process, step for step
    res["reference"] = example.train(args, None, cpu, log=quiet)
    res["losses"] = example.train(args, comm, cpu, log=quiet)
    return res


@pytest.fixture(scope="module")
def sp_results() -> list[dict]:
    return spawn_ranks(_sp_worker, 2)


def test_sequence_parallel_logits_and_gradients_equal_single_process(sp_results):
    for res in sp_results:
        assert res["logits_err"] <= TOL
        assert res["grad_err"] <= 1e-9  # float64, summed in a different order over ranks


def test_sequence_parallel_rejects_local_positions_on_every_rank(sp_results):
    for res in sp_results:
        assert "rank(s) [1] got position_ids starting at 0" in res["local_positions"]


def test_example_trains_sequence_parallel_like_single_process(sp_results):
    for res in sp_results:
        ref, got = res["reference"], res["losses"]
        assert len(got) == 3 and ref[-1] < ref[0], ref  # it trains
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), (got, ref)
