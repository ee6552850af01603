"""torch.compile(fullgraph=True) and torch.func through dilated_attention (custom_ops.py, execution.Attention).

Compiled models are checked against the same model run eagerly: outputs and every gradient bitwise
equal under ``aot_eager`` (Dynamo + AOTAutograd, the part the library is responsible for: no graph
break, the custom ops, their fake implementations and autograd registration), to 1e-12 under
inductor (which fuses the layers around the attention). Sequence-parallel models run on 2 gloo ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

from dilated_attention import MultiheadDilatedAttention, custom_ops, dilated_attention
from dilated_attention.kernels.chunk_loop import ChunkLoop
from dilated_attention.kernels.reference import ReferenceKernel
from dilated_attention.planning import call_state
from dilated_attention.testing.graphs import op_runs
from dilated_attention.testing.spawn import spawn_ranks

E, HEADS, KV_HEADS = 32, 4, 2
SEGS, RATES = [16, 64], [1, 2]  # with 2 ranks of 32 rows: one local pattern, one ring over both


class Block(nn.Module):
    """Pre-LN transformer block around ``MultiheadDilatedAttention`` (GQA, key padding mask)."""

    def __init__(self, causal: bool, **attn) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.attn = MultiheadDilatedAttention(E, HEADS, SEGS, RATES, num_kv_heads=KV_HEADS, causal=causal, **attn)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln(x), key_padding_mask=mask)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, causal: bool, **attn) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(causal, **attn) for _ in range(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, mask)
        return x


def _model(causal: bool, **attn) -> Model:
    torch.manual_seed(0)  # the same weights on every rank
    return Model(causal, **attn).double()


def _inputs(seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, E, generator=g, dtype=torch.float64), torch.rand(2, n, generator=g) < 0.25


def _run(model, x, mask) -> list[torch.Tensor]:
    """Output, then the gradients of a scalar loss for the input and every parameter."""
    x = x.clone().requires_grad_()
    out = model(x, mask)
    return [out.detach(), *torch.autograd.grad(out.pow(2).sum(), [x, *model.parameters()])]


def _compiled(model, backend: str = "aot_eager"):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_model_equals_eager_bitwise(causal):
    model = _model(causal)
    x, mask = _inputs(1)
    got = _run(_compiled(model), x, mask)
    assert not torch._dynamo.utils.counters["graph_break"]
    want = _run(model, x, mask)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the same compiled graph without a mask is a second graph, also exact
    got = _run(torch.compile(model, fullgraph=True, backend="aot_eager"), x, None)
    assert all(torch.equal(a, b) for a, b in zip(got, _run(model, x, None)))


def test_compiled_model_with_inductor():
    model = _model(True)
    x, mask = _inputs(2)
    with torch._inductor.config.patch(compile_threads=1):  # no compile worker pool for one tiny graph
        got = _run(_compiled(model, "inductor"), x, mask)
    for a, b in zip(got, _run(model, x, mask)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def _traced_ops(fn, *args) -> set[str]:
    """The ``dilated_attention`` ops in the graph Dynamo traces from ``fn(*args)``."""
    names: set[str] = set()

    def backend(gm, example_inputs):
        names.update(str(node.target) for node in gm.graph.nodes
                     if node.op == "call_function" and "dilated_attention" in str(node.target))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return names


def test_reduce_overhead_captures_the_ops_a_graph_can_hold():
    """``attend`` and its backward may be captured by a cudagraph tree (what they keep past a call lives in the
    library's own memory pool); packed documents read ``cu_seqlens`` on the host, so they trace to
    ``attend_ungraphed``, tagged cudagraph-unsafe, which inductor runs between its graphs. The GPU harness and
    ``tests/kernels/test_cuda_graphs.py`` check the replays; here, the mode on CPU (no graphs) gives the eager
    result."""
    for name, unsafe in ((custom_ops.GRAPHED, False), (custom_ops.UNGRAPHED, True)):
        for op in (getattr(torch.ops.dilated_attention, name), getattr(torch.ops.dilated_attention, f"{name}_backward")):
            assert (torch.Tag.cudagraph_unsafe in op.default.tags) == unsafe, op
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    docs = torch.tensor([0, 12, 32], dtype=torch.int32)
    assert _traced_ops(lambda a, b, c: dilated_attention(a, b, c, [8, 16], [1, 2]), q, k, v) \
        == {"dilated_attention.attend"}
    assert _traced_ops(lambda a, b, c: dilated_attention(a, b, c, [8, 16], [1, 2], cu_seqlens=docs), q, k, v) \
        == {"dilated_attention.attend_ungraphed"}
    always, checked = SimpleNamespace(check_calls="always"), SimpleNamespace(check_calls=True)
    assert custom_ops.op_name(q, None, always) == custom_ops.UNGRAPHED
    assert custom_ops.op_name(q, None, checked) == custom_ops.op_name(q, None, "collective") == custom_ops.GRAPHED
    model = _model(True)
    x, mask = _inputs(5)
    with torch._inductor.config.patch(compile_threads=1), op_runs() as runs:
        got = _run(torch.compile(model, mode="reduce-overhead", fullgraph=True), x, mask)
    assert runs == {"forward": 2, "backward": 2}  # two blocks; op_runs counts what the GPU tests count
    for a, b in zip(got, _run(model, x, mask)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_the_constant_mark_is_the_one_torch_sets():
    """custom_ops marks its trace-time key functions as torch.compiler.assume_constant_result would, without
    importing Dynamo: the same attributes, so a torch that marks otherwise fails here (and compiled calls would
    then recompile or break)."""
    def ours():
        return 0

    def torchs():
        return 0

    assert custom_ops._assume_constant_result(ours) is ours
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) and vars(ours)
    assert all(vars(fn) == vars(ours) for fn in (custom_ops._object_key, custom_ops._backend_key,
                                                  custom_ops._pools_nest))


def test_compiled_call_options():
    """Grouped mode, internal padding, a scale, a kernel object (passed by registry key), packed documents."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 60, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kernel = ChunkLoop(ReferenceKernel())

    def call(q, k, v, cu_seqlens=None):
        return dilated_attention(q, k[:, :, :2], v[:, :, :2], [16, 32], [1, 2], mode="grouped", causal=True,
                                 softmax_scale=0.3, cu_seqlens=cu_seqlens, kernel=kernel)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend=counter)
    for cu in (None, [0, 10, 10, 45, 60], [0, 5, 32, 33, 60]):  # cu_seqlens values are read inside the op
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        got = compiled(*args, cu)
        got_grads = torch.autograd.grad(got.pow(2).sum(), args)
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        want = call(*args, cu)
        want_grads = torch.autograd.grad(want.pow(2).sum(), args)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert counter.frame_count == 2  # without and with documents; new document splits reuse the graph


def test_compiled_call_raises_at_trace_time():
    f = torch.compile(lambda q: dilated_attention(q, q, q, [24], [1], pad_to_segments=False), fullgraph=True,
                      backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="must be divisible by segment_lengths"):
        f(torch.randn(1, 64, 2, 8))


def _spawned(rank: int, world: int) -> dict:
    from dilated_attention.comm import get_backend, resolve_comm

    res = {"backend_key_args": []}
    comm = get_backend("collective")
    found = custom_ops._backend_key  # torch < 2.13 hands an assumed-constant function constants only: a backend's id

    def recording(ident):
        res["backend_key_args"].append(ident)
        return found(ident)

    custom_ops._backend_key = torch.compiler.assume_constant_result(recording)
    for strategy, causal, name, layout in (("ring", True, "collective", "contiguous"), ("head", False, None, "contiguous"),
                                           ("ring", True, None, "zigzag")):
        # a backend name, and a backend object (the op gets it by registry key)
        model = _model(causal, comm=name or comm, strategy=strategy, layout=layout)
        counted = call_state(resolve_comm(name or comm))  # the calls of the backend they go through
        x, mask = _inputs(10 + rank, 32)  # this rank's rows
        before = counted.calls
        got = _run(_compiled(model), x, mask)
        compiled_calls = counted.calls - before
        want = _run(model, x, mask)
        res[f"{strategy}/{layout}"] = {"equal": all(torch.equal(a, b) for a, b in zip(got, want)),
                         "breaks": len(torch._dynamo.utils.counters["graph_break"]),
                         "calls": [compiled_calls, counted.calls - before - compiled_calls]}
    # the cross-rank check runs inside the op, with what requires_grad was when the graph was traced
    q = torch.randn(1, 32, 4, 8, dtype=torch.float64)
    v = q.clone().requires_grad_(rank == 0)
    f = torch.compile(lambda q, v: dilated_attention(q, q, v, SEGS, RATES, comm=comm), fullgraph=True,
                      backend="aot_eager")
    try:
        f(q, v)
        res["mismatch"] = None
    except ValueError as exc:
        res["mismatch"] = str(exc)
    return res


def test_a_backend_not_alive_is_refused_by_name():
    from dilated_attention import custom_ops

    with pytest.raises(TypeError, match="no live CommBackend has id 0x0"):
        custom_ops._backend_key(0)


def test_compiled_sequence_parallel_model_equals_eager():
    for rank, res in enumerate(spawn_ranks(_spawned, 2)):
        for strategy in ("ring/contiguous", "head/contiguous", "ring/zigzag"):
            got = res[strategy]
            assert got["equal"] and got["breaks"] == 0, (rank, strategy, got)
            assert got["calls"] == [2, 2], (rank, strategy, got)  # one per layer: no forward recomputed
        assert "requires_grad.v: rank 0=True, rank 1=False" in (res["mismatch"] or ""), res["mismatch"]
        keys = res["backend_key_args"]
        assert keys and all(type(k) is int for k in keys), keys  # the backend object never crosses as an argument


def _qkv(seed: int, *lead: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*lead, 64, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]


KW = dict(segment_lengths=[16, 64], dilation_rates=[1, 2], causal=True)


def _loss(q, k, v, mask=None):
    return dilated_attention(q, k, v, key_padding_mask=mask, **KW).pow(2).sum()


def test_func_grad_equals_autograd():
    q, k, v = _qkv(4, 2)
    mask = torch.rand(2, 64, generator=torch.Generator().manual_seed(5)) < 0.25
    got = torch.func.grad(_loss, argnums=(0, 1, 2))(q, k, v, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_loss(*leaves, mask), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_func_vmap_folds_into_the_batch():
    q, k, v = _qkv(6, 3, 2)
    mask = torch.rand(3, 2, 64, generator=torch.Generator().manual_seed(7)) < 0.25
    got = torch.func.vmap(lambda q, k, v, m: dilated_attention(q, k, v, key_padding_mask=m, **KW))(q, k, v, mask)
    loop = torch.stack([dilated_attention(q[i], k[i], v[i], key_padding_mask=mask[i], **KW) for i in range(3)])
    torch.testing.assert_close(got, loop, rtol=0, atol=1e-12)  # a batch of 6 rows vs 3 of 2: same math
    folded = dilated_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), key_padding_mask=mask.flatten(0, 1),
                               **KW)
    assert torch.equal(got, folded.unflatten(0, (3, 2)))
    # an unbatched k/v and a vmapped dim that is not the first
    got = torch.func.vmap(lambda q: dilated_attention(q, k[0], v[0], **KW), in_dims=1)(q.transpose(0, 1))
    loop = torch.stack([dilated_attention(q[i], k[0], v[0], **KW) for i in range(3)])
    torch.testing.assert_close(got, loop, rtol=0, atol=1e-12)
    # per-sample gradients: vmap of grad
    got = torch.func.vmap(torch.func.grad(_loss, argnums=(0, 1, 2)))(q, k, v)
    loop = [torch.func.grad(_loss, argnums=(0, 1, 2))(q[i], k[i], v[i]) for i in range(3)]
    for i, grads in enumerate(zip(*got)):
        for a, b in zip(grads, loop[i]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_func_jvp_and_double_grad_raise_clearly():
    q, k, v = _qkv(8, 1)
    with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
        torch.func.jvp(lambda q: dilated_attention(q, k, v, **KW), (q,), (torch.ones_like(q),))
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.func.grad(lambda q: torch.func.grad(_loss)(q, k, v).sum())(q)


def test_opcheck_custom_ops():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 60, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    mask = torch.rand(1, 60, generator=g) < 0.25
    cu = torch.tensor([0, 10, 45, 60], dtype=torch.int32)
    common = ([16, 64], [1, 2], "longnet", True, None, True, "spread", "", "auto", "auto", "contiguous",
              [True, True, True])
    for name, extra in ((custom_ops.GRAPHED, (mask, None)), (custom_ops.UNGRAPHED, (None, cu))):
        forward = getattr(torch.ops.dilated_attention, name)
        backward = getattr(torch.ops.dilated_attention, f"{name}_backward")
        args = (q, k, v, *extra, *common)
        torch.library.opcheck(forward.default, args)
        out, saved = forward(*args)
        torch.library.opcheck(backward.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), *extra,
                                                 out.detach(), [t.detach() for t in saved], *common))


# -- shapes that change between calls (torch's automatic dynamic shapes) ------------------------------


def _longest_segment_is_the_length(q, k, v):
    """LongNet's usual setting: the largest segment is the sequence, whatever its length."""
    return dilated_attention(q, k, v, [16, q.shape[1]], [1, 2], causal=True)


def _grads(fn, leaves: list[torch.Tensor], *args) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(*leaves, *args)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), leaves)]


def test_changing_lengths_recompile_where_a_segment_follows_the_length():
    """Plain ``torch.compile`` (dynamic shapes after the first change): a segment taken from ``q.shape`` reaches
    the op as a symbol; it is specialised (a guard on its value), so each length gets a graph, bitwise eager."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(_longest_segment_is_the_length, backend=counter)
    for n in (32, 48, 32, 64):
        g = torch.Generator().manual_seed(n)
        qkv = [torch.randn(2, n, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
        got, want = _grads(compiled, qkv), _grads(_longest_segment_is_the_length, qkv)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
    assert counter.frame_count == 3  # 32, 48, 64 (32 again: its graph is reused)


def test_changing_lengths_equal_the_oracle_under_inductor():
    from dilated_attention.testing.oracle import dense_dilated_attention

    torch._dynamo.reset()
    compiled = torch.compile(_longest_segment_is_the_length)
    with torch._inductor.config.patch(compile_threads=1):
        for n in (32, 48):
            g = torch.Generator().manual_seed(n)
            qkv = [torch.randn(1, n, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
            got = _grads(compiled, qkv)
            want = _grads(lambda q, k, v: dense_dilated_attention(q, k, v, [16, n], [1, 2], causal=True), qkv)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_compiled_model_at_changing_lengths_equals_eager():
    """The module path: fixed segments, lengths that change (96 is padded internally), a key padding mask."""
    model = _model(True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter)
    for n in (64, 96):
        x, mask = _inputs(n, n)
        got, want = _run(compiled, x, mask), _run(model, x, mask)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compiled_hugging_face_attention_at_changing_lengths_equals_eager():
    """The Hugging Face path: the callable ``register_dilated_attention`` registers, called as a transformers layer
    calls it (``(B, H, N, D)``, a padding mask, the layer's scale), compiled, at lengths that change: output and
    q/k/v gradients bitwise those of the eager call. (tests/integrations checks the whole models against sdpa.)"""
    pytest.importorskip("transformers")
    from dilated_attention.integrations.huggingface import DilatedAttentionForTransformers

    attention = DilatedAttentionForTransformers([8, 4096], [1, 2], None, {})  # 4096: clamped to each length
    layer = nn.Module()
    layer.is_causal = True

    def call(q, k, v, mask):
        return attention(layer, q, k, v, mask, scaling=0.25)[0]

    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager")
    for n in (32, 48, 64):
        g = torch.Generator().manual_seed(n)
        qkv = [torch.randn(2, h, n, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
        mask = (torch.rand(2, n, generator=g) > 0.2).long()  # transformers: 1 = attend
        got, want = _grads(compiled, qkv, mask), _grads(call, qkv, mask)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
