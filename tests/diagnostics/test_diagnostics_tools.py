"""The debugging toolkit on CPU: debug mode, repro, fuzz, guard, sanitizer wrapper, contiguity audit, health.

Several tests plant a bug (a kernel that returns a wrong row, a strided view
reaching a send, a dead ring link, a kernel that faults) and check that the
tool finds it and names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dilated_attention.diagnostics import audit, debug, fuzz, repro, sanitize
from dilated_attention.diagnostics import health
from dilated_attention.kernels import guard
from dilated_attention.kernels.chunk_loop import ChunkLoop
from dilated_attention.kernels.protocol import CallSpec
from dilated_attention.kernels.reference import ReferenceKernel
from dilated_attention.patterns import plan_patterns
from dilated_attention.testing.compare import as_layout
from dilated_attention.testing.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


class WrongRow(ReferenceKernel):
    """Planted bug: row 1 of every block is a copy of row 2."""

    name = "wrong-row"

    def forward(self, q, k, v, *, causal, scale):
        out, lse = super().forward(q, k, v, causal=causal, scale=scale)
        if out.shape[2] > 2:
            out[:, :, 1] = out[:, :, 2]
        return out, lse


class MaskBlind(ReferenceKernel):
    """Planted bug: a kernel that says it takes key masks and ignores them (padding, documents, pad keys)."""

    name = "mask-blind"

    def forward(self, q, k, v, *, causal, scale, key_mask=None):
        return super().forward(q, k, v, causal=causal, scale=scale)

    def backward(self, q, k, v, out, lse, dout, *, causal, scale, key_mask=None):
        return super().backward(q, k, v, out, lse, dout, causal=causal, scale=scale)


class Faulting:
    """A PatternKernel whose launches fail with a given message."""

    key_masks = False
    deterministic_backward = True

    def __init__(self, message: str, backward_only: bool = False, error=RuntimeError) -> None:
        self.name, self.message, self.backward_only, self.error = "faulting", message, backward_only, error
        self.inner = ChunkLoop(ReferenceKernel())

    def supports(self, q, k):
        return None

    def forward_pattern(self, *args, **kwargs):
        if not self.backward_only:
            raise self.error(self.message)
        return self.inner.forward_pattern(*args, **kwargs)

    def forward_pattern_into(self, q, k, v, plan, spec, running, **kwargs):
        if not self.backward_only:
            running[0].add_(1.0)  # a launch wrote before the failing one
            raise self.error(self.message)
        return self.inner.forward_pattern_into(q, k, v, plan, spec, running, **kwargs)

    def backward_pattern(self, q, k, v, plan, spec, saved, grads, **kwargs):
        grads[0].add_(1.0)  # one launch succeeded and wrote before the next failed
        raise self.error(self.message)

    def parts(self, direction, plan, q, k, *, causal, masked):
        return False  # in place: the failing launches write into the caller's tensors first

    def backward_pattern_parts(self, *args, **kwargs):
        raise ValueError("Faulting leaves no parts")


def _inputs(seed=0, layout="transposed", dtype=torch.float64, n=32, h=4, hk=2, d=8):
    g = torch.Generator().manual_seed(seed)
    q = as_layout(torch.randn(2, n, h, d, generator=g, dtype=dtype), layout, generator=g)
    k = as_layout(torch.randn(2, n, hk, d, generator=g, dtype=dtype), "head_slice", generator=g)
    v = as_layout(torch.randn(2, n, hk, d, generator=g, dtype=dtype), "storage_offset", generator=g)
    return q, k, v


def _plan(index=1, n=32, h=4, hk=2):
    return plan_patterns([8, 16, 32], [1, 2, 4], seq_len=n, local_len=n, num_heads=h, num_kv_heads=hk)[index]


def _script(name: str):
    """A script of scripts/ as a module, to call its main(argv) in this process (no interpreter start-up)."""
    return load_script(os.path.join(ROOT, "scripts", f"{name}.py"))


def _run(args, timeout=120, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, **kw)


# -- debug mode --------------------------------------------------------------------------------------


def test_debug_off_by_default_and_free():
    kern = ChunkLoop(ReferenceKernel())
    assert os.environ.get(debug.ENV) is None and not debug.enabled()
    assert debug.wrap_kernel(kern, {}) is kern  # off: the very same object, no wrapper
    with debug.debug():
        assert debug.enabled() and isinstance(debug.wrap_kernel(kern, {}), debug.DebugKernel)
    assert not debug.enabled()
    with pytest.raises(ValueError, match="shadow"):
        with debug.debug(shadow=2.0):
            pass


def test_debug_kernel_passes_valid_calls_forward_and_backward():
    q, k, v = _inputs()
    plan = _plan()
    with debug.debug(shadow=1.0):
        kern = debug.wrap_kernel(ChunkLoop(ReferenceKernel()), {"rank": 0})
        out, lse = kern.forward_pattern(q, k, v, plan, CallSpec(True, 0.3))
        full = torch.randn(q.shape, dtype=q.dtype)
        accs = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
        kern.backward_pattern(q, k, v, plan, CallSpec(True, 0.3),
                              (full, torch.randn(q.shape[:3], dtype=q.dtype), torch.randn_like(full)), accs)
    want = ChunkLoop(ReferenceKernel()).forward_pattern(q, k, v, plan, CallSpec(True, 0.3))
    assert torch.equal(out, want[0]) and all(bool(a.abs().sum() > 0) for a in accs)


def test_debug_shadow_checks_the_merge_into_the_running_result():
    q, k, v = _inputs()
    g = torch.Generator().manual_seed(7)
    run = (torch.randn(q.shape, generator=g, dtype=torch.float64), torch.randn(q.shape[:3], generator=g,
                                                                            dtype=torch.float64))
    with debug.debug(shadow=1.0, repro_dir=None):
        good = [t.clone() for t in run]
        debug.wrap_kernel(ChunkLoop(ReferenceKernel()), {}).forward_pattern_into(
            q, k, v, _plan(), CallSpec(True, 0.3), tuple(good))
        assert not torch.equal(good[0], run[0])
        with pytest.raises(debug.ShadowMismatch, match="out differs from the reference kernel"):
            debug.wrap_kernel(ChunkLoop(WrongRow()), {}).forward_pattern_into(
                q, k, v, _plan(), CallSpec(False, 0.3), tuple(t.clone() for t in run))


def test_debug_shadow_check_names_a_kernel_that_returns_a_wrong_row():
    q, k, v = _inputs()
    with debug.debug(shadow=1.0, repro_dir=None):
        kern = debug.wrap_kernel(ChunkLoop(WrongRow()), {"rank": 3, "step": 1, "world_size": 4})
        with pytest.raises(debug.ShadowMismatch) as err:
            kern.forward_pattern(q, k, v, _plan(), CallSpec(False, 0.3))
    msg = str(err.value)
    assert "out differs from the reference kernel" in msg
    for part in ("kernel=wrong-row", "pattern=1", "step=1", "rank=3"):
        assert part in msg, msg


@pytest.mark.parametrize("problem", ["nan", "outside_storage", "overlapping_accumulator", "wrong_kv_heads"])
def test_debug_checks_name_the_bad_tensor(problem):
    q, k, v = _inputs()
    plan = _plan()
    accs = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    if problem == "nan":
        q = q.clone()
        q[1, 5, 2, 3] = float("nan")
    elif problem == "outside_storage":
        k = k.contiguous()
        k.untyped_storage().resize_(100 * 8)  # a view whose buffer shrank under it (a stale ring buffer)
    elif problem == "overlapping_accumulator":
        accs[0] = torch.zeros(1, dtype=torch.float64).expand(q.shape)
    elif problem == "wrong_kv_heads":
        k, v = k[:, :, :1], v[:, :, :1]
    expect = {"nan": "q holds 1 NaN", "outside_storage": r"k \(shape .* reaches element", "overlapping_accumulator": "dq is written to",
              "wrong_kv_heads": "k has 1 heads"}[problem]
    with debug.debug():
        kern = debug.wrap_kernel(ChunkLoop(ReferenceKernel()), {"rank": 0})
        with pytest.raises(debug.DebugCheckError, match=expect):
            if problem == "overlapping_accumulator":
                out = torch.randn(q.shape, dtype=q.dtype)
                kern.backward_pattern(q, k, v, plan, CallSpec(False, 0.3),
                                      (out, torch.randn(q.shape[:3], dtype=q.dtype), out), accs)
            else:
                kern.forward_pattern(q, k, v, plan, CallSpec(False, 0.3))


def test_debug_check_send_rejects_a_strided_view():
    buf = torch.randn(2, 8, 4, 8)
    with debug.debug():
        debug.check_send(buf, {"rank": 0})
        with pytest.raises(debug.DebugCheckError, match="not contiguous"):
            debug.check_send(buf[:, :, 1:3], {"rank": 2, "step": 0})
    debug.check_send(buf[:, :, 1:3])  # off: nothing checked


def test_debug_fault_writes_a_repro_that_replays(tmp_path):
    q, k, v = _inputs(dtype=torch.float32)
    meta = debug.call_meta(q, k, v, [8, 16, 32], [1, 2, 4], causal=True, kernel="faulting")
    with debug.debug(repro_dir=tmp_path, history=2):
        for i in range(3):
            debug.record_call({**meta, "i": i})
        assert [m["i"] for m in debug.last_calls()] == [1, 2]
        kern = debug.wrap_kernel(Faulting("CUDA error: an illegal memory access was encountered"), meta)
        with pytest.warns(UserWarning, match="repro written to"), pytest.raises(debug.KernelFault) as err:
            kern.forward_pattern(q, k, v, _plan(), CallSpec(True, 0.3))
    assert "illegal memory access" in str(err.value) and "pattern=1" in str(err.value)
    path = err.value._dilated_attention_repro
    assert any(path in note for note in err.value.__notes__)
    spec = repro.load(path)
    assert spec["q"]["stride"] == list(q.stride()) and "illegal memory access" in spec["error"]
    rep = repro.run_spec(spec, kernel="reference")
    assert rep.ok, rep.text()


# -- repro -------------------------------------------------------------------------------------------


def test_repro_capture_replays_exact_layouts_and_matches(tmp_path, capsys):
    q, k, v = _inputs(dtype=torch.float32, layout="strided_head_dim")
    path = repro.capture(q, k, v, [8, 16, 32], [1, 2, 4], causal=True, softmax_scale=0.2, path=tmp_path / "c.json")
    spec = repro.load(path)
    rq, rk, rv, _ = repro.build_inputs(spec, 0, "cpu")
    for a, b in ((q, rq), (k, rk), (v, rv)):
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
    rep = repro.run_spec(spec)
    assert rep.ok, rep.text()
    capsys.readouterr()
    assert _script("repro").main(["replay", str(path)]) == 0
    assert "matches the oracle" in capsys.readouterr().out


def test_repro_names_the_faulty_kernel_and_output(tmp_path):
    q, k, v = _inputs(dtype=torch.float32)
    spec = repro.load(repro.capture(q, k, v, [8, 16, 32], [1, 2, 4], path=tmp_path / "c.json"))
    rep = repro.run_spec(spec, kernel=WrongRow())
    text = rep.text()
    assert not rep.ok and "out" in rep.errors and "DIFFERS" in text
    assert "the reference kernel is right: the fault is in kernel 'wrong-row'" in text
    assert "alone, these patterns differ" in text


def test_repro_multi_rank_replays_on_spawned_ranks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 4, 8, generator=g)
    spec = json.loads(json.dumps(debug.call_meta(x, x[:, :, :2], x[:, :, :2], [8, 32], [1, 2], causal=True,
                                                 kernel="reference")))
    spec.update(world_size=2, backend="collective", seed=5)
    reports = repro.replay_spawned(spec)
    assert [r.rank for r in reports] == [0, 1] and all(r.ok for r in reports), [r.text() for r in reports]


def test_repro_records_mask_documents_and_padding_and_finds_a_mask_blind_kernel(tmp_path):
    q, k, v = _inputs(dtype=torch.float32, n=30)  # 30: [8, 16] does not tile it (internal padding)
    pad = torch.zeros(2, 30, dtype=torch.bool)
    pad[0, 3:7] = pad[0, 11] = True
    pad[1, 20:] = True
    path = repro.capture(q, k, v, [8, 16], [1, 2], causal=True, key_padding_mask=pad, pad_to_segments=True,
                         strategy="head", path=tmp_path / "m.json")
    spec = repro.load(path)
    assert spec["version"] == repro.VERSION and spec["cu_seqlens"] is None
    assert spec["kwargs"] == {"pad_to_segments": True, "strategy": "head"}
    assert spec["key_padding_mask"]["exact"][0]["padded"] == [[[3, 7], [11, 12]], [[20, 30]]]
    mask, whole = repro.build_mask(spec, 0, "cpu")
    assert torch.equal(mask, pad) and torch.equal(whole, pad)
    rep = repro.run_spec(spec)
    assert rep.ok, rep.text()
    rep = repro.run_spec(spec, kernel=MaskBlind())
    text = rep.text()
    assert not rep.ok and "DIFFERS" in text and "the fault is in kernel 'mask-blind'" in text, text
    assert "key_padding_mask bool [2, 30]" in text and "keys padded in batch row" in text

    x = torch.randn(1, 37, 4, 8, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 5, 5, 20, 37], dtype=torch.int32)  # a zero-length document, none tiled by [8, 16]
    spec = repro.load(repro.capture(x, x[:, :, :2], x[:, :, :2], [8, 16], [1, 2], cu_seqlens=cu,
                                    path=tmp_path / "d.json"))
    assert spec["cu_seqlens"] == [0, 5, 5, 20, 37] and spec["key_padding_mask"] is None
    assert repro.run_spec(spec).ok
    rep = repro.run_spec(spec, kernel=MaskBlind(), narrow=False)
    assert not rep.ok and "(document 3, its position" in rep.text(), rep.text()
    spec = repro.load(repro.capture(x, x, x, [8], [1], cu_seqlens=cu.long(), path=tmp_path / "bad.json"))
    assert spec["cu_seqlens_dtype"] == "int64"
    assert "cu_seqlens must be a 1-D int32 tensor" in (repro.run_spec(spec).raised or "")


def test_repro_reads_version_1_files_and_refuses_newer_ones(tmp_path):
    q, k, v = _inputs(dtype=torch.float32)
    spec = json.loads(json.dumps(debug.call_meta(q, k, v, [8, 16, 32], [1, 2, 4], causal=True)))
    spec.update(version=1, seed=3)  # as written before masks and documents: neither key
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(spec))
    loaded = repro.load(old)
    assert loaded["key_padding_mask"] is None and loaded["cu_seqlens"] is None
    assert repro.run_spec(loaded).ok
    assert _script("repro").main(["replay", str(old)]) == 0
    newer = tmp_path / "v99.json"
    newer.write_text(json.dumps({**spec, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        repro.load(newer)


def test_repro_judges_a_rank_s_rows_on_the_whole_result_s_scale():
    # 4 ranks of one row each (an untiled length, strategy "head"): rank 0's dq nearly cancels (0.01) while
    # other rows reach 5; bf16 rounding of 0.025 there is fine for the whole tensor, a wrong value is not
    spec = {"floor": {"bfloat16": 2e-2}}
    oracle = [torch.tensor([0.01, 5.0, -4.0, 3.0], dtype=torch.float64).view(1, 4, 1, 1)] * 4
    plain = [o + 1e-3 for o in oracle]
    rounded = [o[:, :1].float() + 0.025 for o in oracle]
    _, _, bad = repro._judge(spec, None, 0, rounded, oracle, plain, torch.bfloat16, 1)
    assert bad == []
    wrong = [o[:, :1].float() + 1.0 for o in oracle]
    _, _, bad = repro._judge(spec, None, 0, wrong, oracle, plain, torch.bfloat16, 1)
    assert bad == list(repro.NAMES)


def test_repro_multi_rank_capture_merges_rank_files_and_replays_masks_and_documents(tmp_path):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2 * 13, 4, 8, generator=g)  # 2 ranks x 13 rows: [8, 16] does not tile 26
    pad = torch.rand(1, 26, generator=g) < 0.3
    cu = torch.tensor([0, 9, 9, 26], dtype=torch.int32)  # global offsets; document 2 spans both ranks
    for r in range(2):
        rows = slice(13 * r, 13 * (r + 1))
        repro.capture(x[:, rows], x[:, rows], x[:, rows], [8, 16], [1, 2], causal=True, strategy="head",
                      key_padding_mask=pad[:, rows], cu_seqlens=cu, seed=9, path=tmp_path / "call.json",
                      comm=SimpleNamespace(world_size=2, rank=r, name="collective"))
    assert sorted(os.listdir(tmp_path)) == ["call.rank0.json", "call.rank1.json"]
    spec = repro.load(tmp_path / "call.rank1.json")
    assert spec["world_size"] == 2 and spec["cu_seqlens"] == [0, 9, 9, 26]
    assert torch.equal(repro.build_mask(spec, 1, "cpu")[1], pad)  # rank 0's rows from its sibling file
    reports = repro.replay_spawned(spec)
    assert all(r.ok for r in reports), [r.text() for r in reports]


# -- fuzz --------------------------------------------------------------------------------------------


def test_fuzz_small_budget_is_clean(tmp_path):
    res = fuzz.fuzz(cases=25, seed=11, out_dir=str(tmp_path))
    assert res.ok, (res.failure, res.lines)
    assert res.cases == 25 and res.valid > 12 and res.invalid > 0


def test_fuzz_finds_a_planted_wrong_row_and_writes_a_replayable_repro(tmp_path):
    res = fuzz.fuzz(cases=50, seed=3, out_dir=str(tmp_path), mix=fuzz.CaseMix(invalid_fraction=0.0),
                    kernel_override=ChunkLoop(WrongRow()))
    assert not res.ok and res.cases < 50, res
    assert "wrong-row" in open(res.repro_path).read()
    assert any("the fault is in kernel 'wrong-row'" in line for line in res.lines), res.lines
    assert not repro.run_spec(repro.load(res.repro_path), kernel=WrongRow(), narrow=False).ok
    assert repro.run_spec(repro.load(res.repro_path), kernel="reference", narrow=False).ok


def test_fuzz_exercises_masks_documents_and_untiled_lengths(tmp_path):
    res = fuzz.fuzz(cases=30, seed=5, out_dir=str(tmp_path), mix=fuzz.CaseMix(invalid_fraction=0.0))
    assert res.ok, (res.failure, res.lines)
    for option in ("key_padding_mask", "cu_seqlens", "zero-length document", "padded document", "untiled length"):
        assert res.options.get(option, 0) > 0, (option, res.options)
    assert res.options["world 1"] == 30 and res.options["key_padding_mask"] < 30  # the plain mix stays


def test_fuzz_finds_a_planted_mask_blind_kernel(tmp_path):
    res = fuzz.fuzz(cases=40, seed=2, out_dir=str(tmp_path), mix=fuzz.CaseMix(invalid_fraction=0.0),
                    kernel_override=ChunkLoop(MaskBlind()))
    assert not res.ok and res.cases < 40, res
    spec = repro.load(res.repro_path)
    assert spec["kernel"] == "mask-blind" and "masked" not in res.failure
    assert spec["key_padding_mask"] is not None or spec["cu_seqlens"] is not None or \
        "untiled length" in fuzz.spec_options(spec), spec
    assert any("the fault is in kernel 'mask-blind'" in line for line in res.lines), res.lines
    assert not repro.run_spec(spec, kernel=MaskBlind(), narrow=False).ok
    assert repro.run_spec(spec, kernel="reference", narrow=False).ok


def test_fuzz_invalid_calls_raise_value_or_type_errors():
    import random

    rng = random.Random(0)
    seen = set()
    for _ in range(150):
        what, call = fuzz.random_invalid(rng)
        seen.add(what.split(" ")[0])
        assert fuzz.check_invalid(what, call) is None, what
    assert len(seen) > 15
    assert "was accepted" in fuzz.check_invalid("planted", lambda: None)
    assert "instead of ValueError" in fuzz.check_invalid("planted", lambda: 1 / 0)


def test_fuzz_spawned_ranks_cover_ring_cases(tmp_path):
    # seed 8: within 16 cases, ring cases and masks, documents and untiled lengths on 2 ranks
    res = fuzz.fuzz_spawned((1, 2), cases=16, seed=8, out_dir=str(tmp_path),
                            mix=fuzz.CaseMix(kernels=("reference", "auto")))
    assert res.ok, (res.failure, res.lines)
    assert res.cases == 16 and res.options.get("strategy ring", 0) > 0
    for option in ("key_padding_mask", "cu_seqlens", "untiled length"):  # on 2 ranks (strategy "head")
        assert res.options.get(f"{option} (world > 1)", 0) > 0, (option, res.options)


# -- kernel-failure guard ----------------------------------------------------------------------------


def test_guard_falls_back_once_on_launch_resource_errors():
    guard.reset()
    q, k, v = _inputs(dtype=torch.float32)
    plan = _plan()
    msg = "out of resource: shared memory, Required: 1049600, Hardware limit: 232448"
    kern = guard.guard_kernel(Faulting(msg), {"rank": 0})
    with pytest.warns(RuntimeWarning, match="could not launch .*shared memory.* using the 'sdpa' path") as rec:
        out, lse = kern.forward_pattern(q, k, v, plan, CallSpec(True, 0.3))
        kern.forward_pattern(q, k, v, plan, CallSpec(True, 0.3))
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    want, _ = ChunkLoop(ReferenceKernel()).forward_pattern(q, k, v, plan, CallSpec(True, 0.3))
    assert (out - want).abs().max() < 1e-5
    guard.reset()


def test_guard_backward_fallback_undoes_partial_writes():
    guard.reset()
    q, k, v = _inputs(dtype=torch.float32)
    plan = _plan()
    out, dout = torch.randn(q.shape), torch.randn(q.shape)
    lse = torch.randn(q.shape[:3])
    got = [torch.zeros(t.shape) for t in (q, k, v)]
    want = [torch.zeros(t.shape) for t in (q, k, v)]
    kern = guard.guard_kernel(Faulting("OutOfResources: out of resource: registers", backward_only=True))
    with pytest.warns(RuntimeWarning):
        kern.backward_pattern(q, k, v, plan, CallSpec(False, 0.3), (out, lse, dout), got)
    guard.guard_kernel(ChunkLoop(ReferenceKernel())).backward_pattern(q, k, v, plan, CallSpec(False, 0.3),
                                                                      (out, lse, dout), want)
    assert all((a - b).abs().max() < 1e-5 * b.abs().max() for a, b in zip(got, want))  # not 1 + the truth
    guard.reset()


def test_guard_explains_a_sticky_cuda_error_and_lets_value_errors_through():
    q, k, v = _inputs(dtype=torch.float32)
    kern = guard.guard_kernel(Faulting("CUDA error: misaligned address"), {"rank": 5, "step": 2})
    with pytest.raises(guard.KernelError) as err:
        kern.forward_pattern(q, k, v, _plan(), CallSpec(True, 0.3))
    msg = str(err.value)
    for part in ("misaligned address", "pattern 1 (segment 16, dilation 2", "step 2", "rank 5",
                 f"q: shape {tuple(q.shape)} stride {tuple(q.stride())}", "Restart the process", "scripts/repro.py",
                 "scripts/sanitize.py"):
        assert part in msg, msg
    assert guard.classify_error(ValueError("out of resource")) is None
    assert guard.classify_error(RuntimeError("CUDA out of memory. Tried to allocate")) == "cuda"
    with pytest.raises(ValueError, match="^kernel declined: shared memory$"):  # not ours to rewrite
        guard.guard_kernel(Faulting("kernel declined: shared memory", error=ValueError)).forward_pattern(
            q, k, v, _plan(), CallSpec(True, 0.3))


# -- sanitizer wrapper -------------------------------------------------------------------------------

MEMCHECK_LOG = f"""\
{sanitize.MARK} _fwd_kernel from dilated_attention/kernels/fused.py:281 (_forward) via dilated_attention/ring/kv_ring.py:80 (ring_forward)
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _fwd_kernel+0x1a30 in /work/dilated_attention/kernels/_fused_triton.py:88
=========     by thread (64,0,0) in block (3,1,0)
=========     Address 0x7f1c0000a000 is out of bounds
========= Invalid __global__ read of size 2 bytes
=========     at _fwd_kernel+0x1a40 in /work/dilated_attention/kernels/_fused_triton.py:88
{sanitize.MARK} _dkdv_kernel from dilated_attention/kernels/fused.py:320 (_backward) via train.py:12 (step)
========= Uninitialized __global__ memory read of size 4 bytes
=========     at _dkdv_kernel+0x220
========= ERROR SUMMARY: 3 errors
"""


def test_sanitize_summarises_per_kernel_and_frame(tmp_path, capsys):
    findings, summary = sanitize.summarise(MEMCHECK_LOG)
    by_kernel = {f.kernel: f for f in findings}
    assert by_kernel["_fwd_kernel"].count == 2 and "kv_ring.py:80" in by_kernel["_fwd_kernel"].frame
    assert by_kernel["_dkdv_kernel"].kind.startswith("Uninitialized") and "train.py:12" in by_kernel["_dkdv_kernel"].frame
    assert summary == ["ERROR SUMMARY: 3 errors"]
    log = tmp_path / "san.log"
    log.write_text(MEMCHECK_LOG)
    capsys.readouterr()
    assert _script("sanitize").main(["--parse", str(log)]) == 1
    assert "2 x Invalid __global__ read of size 2 bytes in _fwd_kernel" in capsys.readouterr().out


def test_sanitize_says_plainly_when_the_tool_or_gpu_is_missing(capsys):
    rc = _script("sanitize").main(["--sanitizer", "/nonexistent/compute-sanitizer"])
    err = capsys.readouterr().err
    if sanitize.find_sanitizer() is None:
        assert rc == 2 and "compute-sanitizer not found" in err
    elif not torch.cuda.is_available():
        assert rc == 2 and "no CUDA GPU" in err


def test_launch_trace_marks_launches_with_the_calling_frame(capsys):
    from dilated_attention.diagnostics import launch_trace

    launch_trace._hook({"name": "_fwd_kernel"})
    line = capsys.readouterr().out.strip()
    assert line.startswith(sanitize.MARK + " _fwd_kernel from ") and "test_diagnostics_tools.py" in line


# -- contiguity audit --------------------------------------------------------------------------------

SEED_PATTERN = """
def ring_step(k, v, idx, h0, h1, dist):
    k_dilated = k[:, :, h0:h1].index_select(1, idx)
    heads = v[:, :, h0:h1]
    v_dilated = heads.index_select(1, idx)
    fine = heads.contiguous().index_select(1, idx)
    dist.isend(k.transpose(1, 2), 1)
    flat = k.transpose(1, 2).view(-1)
    ok = heads.index_select(1, idx)  # audit: ok (copied by the caller)
"""


def test_static_audit_finds_the_seed_pattern(tmp_path, capsys):
    src = tmp_path / "user_ring.py"
    src.write_text(SEED_PATTERN)
    findings, files = audit.scan_paths([str(tmp_path)])
    assert files == 1
    assert [f.line for f in findings] == [3, 5, 7, 8], [f.text() for f in findings]
    assert "index_select on a view made by a slice" in findings[0].text()
    assert "isend gets a view made by .transpose()" in findings[2].why and ".view() after" in findings[3].why
    assert _script("contiguity_audit").main(["static", str(src)]) == 1
    assert f"{src}:3:" in capsys.readouterr().out
    assert _script("contiguity_audit").main([str(src)]) == 1  # a bare path is a static scan
    assert f"{src}:3:" in capsys.readouterr().out


def test_static_audit_of_the_library_is_clean():
    findings, files = audit.scan_paths([audit.default_root()])
    assert files > 20 and not findings, [f.text() for f in findings]


def test_runtime_audit_names_a_strided_view_reaching_a_send():
    import torch.distributed as dist

    from dilated_attention.comm import get_backend
    from dilated_attention.launch_utils import free_port
    from dilated_attention.testing.spawn import init_local_rank

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    init_local_rank(0, 1, free_port())
    try:
        comm = get_backend("collective")
        k = torch.randn(2, 16, 4, 8)
        with audit.runtime_audit(torch_p2p=True) as rec:
            with pytest.raises(ValueError, match="contiguous"):
                comm.send_recv(k[:, :, 1:3], 0, torch.empty(2, 16, 2, 8), 0)  # planted: head-sliced send
            with pytest.raises(ValueError, match="contiguous"):  # the ring's call: what and stamp passed on
                comm.send_recv(k[:, :, 1:3], 0, torch.empty(2, 16, 2, 8), 0, "ring step", stamp=None)
            q = as_layout(torch.randn(1, 16, 2, 8), "head_slice").requires_grad_()
            from dilated_attention import dilated_attention

            dilated_attention(q, q, q, [8, 16], [1, 2], causal=True).sum().backward()
    finally:
        dist.destroy_process_group()
    errors = [f for f in rec.dedup() if f.severity == "error"]
    assert len(errors) == 2, [f.text() for f in rec.dedup()]  # the two planted sends, nothing from the call
    text = errors[0].text()
    assert "exchange (to rank 0)" in text and "stride (512, 32, 8, 1)" in text and "not contiguous" in text
    assert "test_diagnostics_tools.py" in errors[0].caller
    assert rec.checked > 6  # the kernel entry points were audited too


# -- distributed health ------------------------------------------------------------------------------

TOPO = """\
\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tSYS\t0-63\t0
GPU1\tNV18\t X \tPIX\t0-63\t0
GPU2\tSYS\tPIX\t X \t64-127\t1

Legend:
  X    = Self
"""


def test_topology_parse_and_slow_link_verdict():
    topo = health.parse_topology(TOPO)
    assert topo[(0, 1)] == "NV18" and topo[(1, 2)] == "PIX" and topo[(2, 0)] == "SYS"
    assert health.expected_gbps("NV18") == 18 * health.PER_NVLINK_GBPS
    bw = [[health.Check("collective", "bandwidth 16 MiB -> rank 1", True, "", g)] for g in (30.0, 19.0, 5.0)]
    lines = health.link_table(bw, ["a", "a", "a"], [0, 1, 2], topo)
    assert "SLOW" in lines[0] and "NV18" in lines[0]  # 30 GB/s on 18 NVLinks
    assert "SLOW" not in lines[1] and "SLOW" not in lines[2]


def _torchrun(nproc, *args):
    from dilated_attention.testing.spawn import run_torchrun

    return run_torchrun(["scripts/diagnose.py", "ring", "--distributed", "--backend", "collective", "--sizes-mb",
                         "0.0625", "--iters", "2", *args], cwd=ROOT, done="healthy: every check passed", nproc=nproc,
                        env={"PYTHONPATH": ROOT}, timeout=150)


def test_ring_health_check_passes_on_healthy_gloo_ranks():
    proc = _torchrun(2, "--timeout", "20")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ping rank 0 -> rank 1 (ring of 2)" in proc.stdout and "GB/s" in proc.stdout
    assert "healthy: every check passed" in proc.stdout


def test_ring_health_check_names_a_dead_link_within_the_timeout():
    proc = _torchrun(3, "--timeout", "2", "--simulate-dead-link", "1,2")
    assert proc.returncode != 0
    # on stderr, as a whole line (the terminal sees it whatever stdout is doing)
    assert "\n[rank 2] FAIL: rank 1 -> rank 2 did not complete within 2 s\n" in "\n" + proc.stderr, proc.stderr[-3000:]
