"""``kernel="auto"``: per pattern and direction, the implementation the measured table names.

The table logic is checked with recording stand-ins; then the library end to end
(``dilated_attention`` forward and backward) with an ``AutoKernel`` mixing the
fused kernel and the cuDNN pattern kernel (real on a GPU, the float64 stand-in
``MathOps`` on CPU) against the fp64 oracle.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

# first: kernel_checks sets TRITON_INTERPRET on CPU, which must precede triton's import
from kernel_checks import CUDA, DEVICE, seeded  # noqa: F401, I001

from dilated_attention import dilated_attention
from dilated_attention.kernels import auto_table, dispatch
from dilated_attention.kernels.auto import (
    LONG_ROWS,
    SHORT_ROWS,
    AutoKernel,
    available_choices,
    length_class,
    normalize_choices,
    ranked,
    table_key,
)
from dilated_attention.kernels.cudnn import CudnnDkdvKernel, CudnnKernel
from dilated_attention.kernels.fused import FusedKernel
from dilated_attention.kernels.protocol import CallSpec
from dilated_attention.patterns import plan_patterns
from dilated_attention.testing.compare import assert_within_rule
from dilated_attention.testing.oracle import dense_dilated_attention

from test_cudnn import MathOps


class Recorder:
    """A PatternKernel stand-in that records which patterns and directions reached it."""

    key_masks = False

    def __init__(self, name: str, refuse: str | None = None, deterministic: bool = True) -> None:
        self.name, self.refuse, self.seen = name, refuse, []
        self.deterministic_backward = deterministic

    def supports(self, q, k):
        return self.refuse

    def forward_pattern(self, q, k, v, plan, spec):
        self.seen.append(("fwd", plan.dilation, spec.causal))
        return None

    def backward_pattern(self, q, k, v, plan, spec, saved, grads, *, fresh=False):
        self.seen.append(("bwd", plan.dilation, spec.causal))

    def parts(self, direction, plan, q, k, *, causal, masked):
        return False  # never asked for parts: nothing here runs a strategy

    def backward_pattern_parts(self, q, k, v, plan, spec, saved):
        raise ValueError("Recorder leaves no parts")


PLANS = plan_patterns([8, 16], [1, 2], seq_len=16, local_len=16, num_heads=4, num_kv_heads=4)
Q = torch.randn(1, 16, 4, 32, dtype=torch.bfloat16)


def _run(kern: AutoKernel, causal: bool) -> None:
    for p in PLANS:
        kern.forward_pattern(Q, Q, Q, p, CallSpec(causal, 0.1))
        kern.backward_pattern(Q, Q, Q, p, CallSpec(causal, 0.1), (Q, Q[..., 0], Q), (Q, Q, Q))


def test_table_key():
    assert table_key("fwd", 1, False, 128, torch.bfloat16) == "fwd/dense/full/D128/bfloat16"
    assert table_key("bwd-any", 4, True, 40, torch.float16) == "bwd-any/dilated/causal/D40/float16"
    assert table_key("fwd", 1, True, 128, torch.float16, 2048) == "fwd/dense/causal/D128/float16/short"
    assert table_key("bwd", 1, True, 128, torch.float16, SHORT_ROWS) == "bwd/dense/causal/D128/float16/short"
    assert table_key("bwd", 1, True, 128, torch.float16, SHORT_ROWS + 1) == "bwd/dense/causal/D128/float16/mid"
    assert table_key("bwd", 1, True, 128, torch.float16, LONG_ROWS) == "bwd/dense/causal/D128/float16/mid"
    assert table_key("bwd", 1, True, 128, torch.float16, LONG_ROWS + 1) == "bwd/dense/causal/D128/float16/long"
    with pytest.raises(ValueError, match="direction"):
        table_key("sideways", 1, False, 64, torch.float16)


def _plan(rows: int, r: int = 1):
    return plan_patterns([rows * r], [r], seq_len=rows * r, local_len=rows * r, num_heads=4, num_kv_heads=4)[0]


def test_length_class_picks_the_entry_of_the_segment_class():
    """``/short`` answers segments of at most ``SHORT_ROWS`` rows, ``/mid`` up to ``LONG_ROWS``, ``/long`` longer
    ones (long dense segments, full attention); a table without ``/mid`` entries (measured before the class)
    answers mid rows with its ``/short`` entry; a key without a class answers a class without an entry."""
    fused, other, third = Recorder("fused"), Recorder("cudnn"), Recorder("flash4")
    key = lambda rows, r=1: table_key("fwd", r, False, 32, torch.bfloat16, rows)  # noqa: E731
    kern = AutoKernel({"fused": fused, "cudnn": other, "flash4": third},
                      {key(16): "cudnn", key(LONG_ROWS * 8): "flash4"})
    for rows, want in ((16, other), (LONG_ROWS, other), (LONG_ROWS + 8, third), (LONG_ROWS * 8, third)):
        assert kern.pick("fwd", _plan(rows), False, Q, Q) is want, rows
    assert kern.pick("fwd", _plan(16, 2), False, Q, Q) is fused  # a dilated pattern: not listed
    classless = AutoKernel({"fused": fused, "cudnn": other},
                           {table_key("fwd", 1, False, 32, torch.bfloat16): "cudnn", key(16): "fused"})
    assert classless.pick("fwd", _plan(16), False, Q, Q) is fused
    assert classless.pick("fwd", _plan(LONG_ROWS * 2), False, Q, Q) is other
    assert classless.pick("fwd", _plan(LONG_ROWS), False, Q, Q) is fused  # mid: the short entry
    mid = AutoKernel({"fused": fused, "cudnn": other, "flash4": third},
                     {key(16): "cudnn", key(LONG_ROWS): "flash4"})
    for rows, want in ((SHORT_ROWS, other), (SHORT_ROWS + 8, third), (LONG_ROWS, third), (LONG_ROWS + 8, fused)):
        assert mid.pick("fwd", _plan(rows), False, Q, Q) is want, rows


def test_tables_keyed_by_rows_read_as_length_classes():
    """``/M<rows>`` keys (tables written before classes) stand for the class of their rows; of two in one class
    the one measured at more rows, and a class key itself, wins."""
    base = "fwd/dense/full/D32/bfloat16"
    got = normalize_choices({f"{base}/M1024": "fused", f"{base}/M2048": "cudnn", f"{base}/M4096": "fused",
                             f"{base}/M32768": "flash4", f"{base}/M65536": "cudnn-det",
                             "bwd/dense/full/D32/bfloat16/M1024": "fused"})
    assert got == {f"{base}/short": ("cudnn",), f"{base}/mid": ("fused",), f"{base}/long": ("cudnn-det",),
                   "bwd/dense/full/D32/bfloat16/short": ("fused",)}
    for order in (1, -1):
        items = [(f"{base}/short", ("cudnn", "fused")), (f"{base}/M2048", "flash4")][::order]
        assert normalize_choices(dict(items)) == {f"{base}/short": ("cudnn", "fused")}
    with pytest.raises(ValueError, match="table entry"):
        normalize_choices({base: ()})
    assert [length_class(n) for n in (0, SHORT_ROWS, SHORT_ROWS + 1, LONG_ROWS, LONG_ROWS + 1)] == [
        "short", "short", "mid", "mid", "long"]
    with pytest.raises(ValueError, match="rows"):
        length_class(-1)


def test_ranked_entry_takes_the_first_implementation_that_runs():
    """An entry ranks implementations fastest first: where the first cannot run (flash-attn-4 absent), the next
    measured one runs (said once); ``available_choices`` drops names not offered on a device, so ``dispatch``'s
    auto kernel never meets an absent one."""
    fused, det = Recorder("fused"), Recorder("cudnn-det")
    absent = Recorder("flash4", refuse="flash-attn-4 is not installed")
    key = table_key("bwd", 1, False, 32, torch.bfloat16, LONG_ROWS * 2)
    kern = AutoKernel({"fused": fused, "cudnn-det": det, "flash4": absent}, {key: ("flash4", "cudnn-det")})
    with pytest.warns(UserWarning, match="'flash4' for bwd .* not installed\\); running 'cudnn-det'"):
        assert kern.pick("bwd", _plan(LONG_ROWS * 2), False, Q, Q) is det
    assert available_choices({key: ("flash4", "cudnn-det"), "fwd/x": ("flash4",)}, {"fused", "cudnn-det"}) == {
        key: ("cudnn-det",)}


def test_auto_names_flash4_only_where_it_is_available(monkeypatch):
    """``dispatch`` offers flash4 to ``auto`` only where it is installed and the GPU runs it: otherwise the table's
    flash4 entries fall to their next measured implementation, never to flash4."""
    fused = Recorder("fused")
    key = table_key("fwd", 1, False, 32, torch.bfloat16, LONG_ROWS * 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU")
    monkeypatch.setattr(auto_table, "TABLE", {"Imaginary GPU": {"choices": {key: ("flash4", "cudnn")}}})
    for available in (False, True):
        monkeypatch.setattr(dispatch, "_auto_kernels", {})
        monkeypatch.setattr(dispatch, "flash4_unavailable",
                            lambda device, ok=available: None if ok else "flash-attn-4 is not installed")
        assert ("flash4" in dispatch.auto_implementations(torch.device("cpu"))) is available
        chosen = dispatch._measured(torch.device("cpu"), fused)
        assert isinstance(chosen, AutoKernel)
        assert chosen.choices[key] == (("flash4", "cudnn") if available else ("cudnn",))
        assert ("flash4" in chosen.impls) is available


def test_auto_follows_the_table_per_pattern_and_direction():
    fused, other = Recorder("fused"), Recorder("cudnn")
    choices = {
        table_key("fwd", 1, False, 32, torch.bfloat16): "cudnn",   # dense forward
        table_key("bwd", 2, False, 32, torch.bfloat16): "cudnn",   # dilated backward (deterministic entry)
        table_key("fwd", 2, True, 32, torch.bfloat16): "cudnn",    # causal dilated forward
        table_key("fwd", 1, False, 64, torch.bfloat16): "fused",   # another head dim: irrelevant here
    }
    kern = AutoKernel({"fused": fused, "cudnn": other}, choices)
    _run(kern, causal=False)
    _run(kern, causal=True)
    assert other.seen == [("fwd", 1, False), ("bwd", 2, False), ("fwd", 2, True)]
    assert fused.seen == [("bwd", 1, False), ("fwd", 2, False), ("fwd", 1, True), ("bwd", 1, True), ("bwd", 2, True)]


def test_deterministic_entries_never_name_a_racy_backward():
    racy = Recorder("cudnn", deterministic=False)
    with pytest.raises(ValueError, match="not deterministic.*bwd/dense/causal/D128/float16 -> cudnn"):
        AutoKernel({"fused": Recorder("fused"), "cudnn": racy},
                   {table_key("bwd", 1, True, 128, torch.float16): "cudnn"})
    AutoKernel({"fused": Recorder("fused"), "cudnn": racy},  # the nondeterministic entry may
               {table_key("bwd-any", 1, True, 128, torch.float16): "cudnn"})
    assert not CudnnKernel().deterministic_backward and FusedKernel().deterministic_backward


def test_nondeterministic_backward_only_when_allowed():
    choices = {table_key("bwd", 1, False, 32, torch.bfloat16): "fused",
               table_key("bwd-any", 1, False, 32, torch.bfloat16): "cudnn"}
    for allow, want in ((False, "fused"), (True, "cudnn")):
        fused, other = Recorder("fused"), Recorder("cudnn")
        kern = AutoKernel({"fused": fused, "cudnn": other}, choices, allow_nondeterministic=allow)
        assert kern.pick("bwd", PLANS[0], False, Q, Q) is (other if want == "cudnn" else fused)
        assert kern.pick("fwd", PLANS[0], False, Q, Q) is fused  # unmeasured: fused


def test_unsupported_choice_falls_back_to_fused_and_bad_tables_raise():
    fused, other = Recorder("fused"), Recorder("cudnn", refuse="needs a CUDA device")
    kern = AutoKernel({"fused": fused, "cudnn": other}, {table_key("fwd", 1, False, 32, torch.bfloat16): "cudnn"})
    with pytest.warns(UserWarning, match="'cudnn' for fwd .* cannot run here \\(needs a CUDA device\\)"):
        assert kern.pick("fwd", PLANS[0], False, Q, Q) is fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not on every call
        assert kern.pick("fwd", PLANS[0], False, Q, Q) is fused
    with pytest.raises(ValueError, match="not among"):
        AutoKernel({"fused": fused}, {table_key("fwd", 1, False, 32, torch.bfloat16): "flash"})
    with pytest.raises(ValueError, match="'fused'"):
        AutoKernel({"cudnn": other}, {})


def test_a_cudnn_det_forward_without_the_frontend_runs_torchs_cudnn_forward():
    """The frontend is optional: a forward entry naming cudnn-det (its forward is the frontend's graph) runs
    the same cuDNN kernel through torch's op where the frontend is missing; a backward entry runs fused
    (torch's cuDNN backward is not deterministic); with no cuDNN at all the forward runs fused too."""
    fused, cudnn = Recorder("fused"), Recorder("cudnn")
    det = Recorder("cudnn-det", refuse="needs NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend")
    choices = {table_key(d, 1, False, 32, torch.bfloat16): "cudnn-det" for d in ("fwd", "bwd")}
    kern = AutoKernel({"fused": fused, "cudnn": cudnn, "cudnn-det": det}, choices)
    with pytest.warns(UserWarning, match="'cudnn-det' for fwd .* cannot run here .* running 'cudnn'"):
        assert kern.pick("fwd", PLANS[0], False, Q, Q) is cudnn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (said once per choice and reason: the forward's warning said it)
        assert kern.pick("bwd", PLANS[0], False, Q, Q) is fused
    no_cudnn = AutoKernel({"fused": fused, "cudnn": Recorder("cudnn", refuse="needs a CUDA device"),
                           "cudnn-det": det}, choices)
    with pytest.warns(UserWarning, match="running 'fused'"):
        assert no_cudnn.pick("fwd", PLANS[0], False, Q, Q) is fused


def test_dispatch_wraps_fused_only_for_measured_gpus(monkeypatch):
    fused = Recorder("fused")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU")
    monkeypatch.setattr(dispatch, "_auto_kernels", {})
    monkeypatch.setattr(auto_table, "TABLE", {})
    assert dispatch._measured(torch.device("cpu"), fused) is fused
    monkeypatch.setattr(dispatch, "_auto_kernels", {})
    monkeypatch.setattr(auto_table, "TABLE", {"Imaginary GPU": {"choices": {
        table_key("fwd", 1, False, 32, torch.bfloat16): "cudnn"}}})
    chosen = dispatch._measured(torch.device("cpu"), fused)
    assert isinstance(chosen, AutoKernel) and chosen.impls["fused"] is fused
    assert isinstance(chosen.impls["cudnn"], CudnnKernel) and isinstance(chosen.impls["cudnn-dkdv"], CudnnDkdvKernel)
    assert chosen.impls["cudnn-det"].name == "cudnn-det" and chosen.impls["cudnn-det"].deterministic_backward
    assert dispatch._measured(torch.device("cpu"), fused) is chosen  # one kernel per GPU model


def test_dispatch_skips_the_lookup_when_every_applicable_choice_is_fused(monkeypatch):
    """A table that only picks another implementation for nondeterministic backward entries (the H200's)
    gives the plain fused kernel unless nondeterminism is allowed; a bad table is refused either way."""
    fused, racy = Recorder("fused"), Recorder("cudnn", deterministic=False)
    impls = {"fused": fused, "cudnn": racy}
    choices = {table_key("fwd", 1, False, 32, torch.bfloat16): "fused",
               table_key("bwd", 1, False, 32, torch.bfloat16): "fused",
               table_key("bwd-any", 1, False, 32, torch.bfloat16): "cudnn"}
    assert dispatch.auto_for(choices, impls, allow_nondeterministic=False) is fused
    chosen = dispatch.auto_for(choices, impls, allow_nondeterministic=True)
    assert isinstance(chosen, AutoKernel) and chosen.pick("bwd", PLANS[0], False, Q, Q) is racy
    with pytest.raises(ValueError, match="not deterministic"):
        dispatch.auto_for({table_key("bwd", 1, False, 32, torch.bfloat16): "cudnn"}, impls,
                          allow_nondeterministic=False)


def test_named_cudnn_kernel_refuses_cpu():
    x = torch.randn(1, 16, 2, 32)
    with pytest.raises(ValueError, match="kernel='cudnn' cannot run"):
        dispatch.select_kernel("cudnn", x, x)
    assert "cudnn" in dispatch.KERNEL_NAMES


# ---------------------------------------------------------------------------
# the library end to end with a mixed AutoKernel


MIXES = {  # cuDNN's backward is not deterministic: it can only be a bwd-any entry (AutoKernel allows it here)
    "cudnn-dense-fused-dilated": lambda d, dt: {
        table_key(direction, 1, causal, d, dt): "cudnn" for direction in ("fwd", "bwd-any") for causal in (False, True)},
    "fused-fwd-cudnn-bwd": lambda d, dt: {
        table_key("bwd-any", r, causal, d, dt): "cudnn" for r in (1, 2) for causal in (False, True)},
    "cudnn-dkdv-everywhere": lambda d, dt: {
        table_key(direction, r, causal, d, dt): "cudnn-dkdv"
        for direction in ("fwd", "bwd") for r in (1, 2) for causal in (False, True)},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("causal", [False, True])
def test_library_with_mixed_auto_kernel(mix, causal):
    seed = seeded("auto-lib", mix, causal)
    dtype = torch.bfloat16 if CUDA else torch.float32
    n, heads, kv_heads, dim = (1024, 8, 2, 64) if CUDA else (16, 4, 2, 16)
    segs, rates = ([256, 1024], [1, 4]) if CUDA else ([8, 16], [1, 2])
    ops = None if CUDA else MathOps()
    kern = AutoKernel({"fused": FusedKernel(), "cudnn": CudnnKernel(ops), "cudnn-dkdv": CudnnDkdvKernel(ops)},
                      MIXES[mix](dim, dtype), allow_nondeterministic=True)
    q = torch.randn(2, n, heads, dim, device=DEVICE, dtype=dtype).requires_grad_()
    k = torch.randn(2, n, kv_heads, dim, device=DEVICE, dtype=dtype).requires_grad_()
    v = torch.randn(2, n, kv_heads, dim, device=DEVICE, dtype=dtype).requires_grad_()
    dout = torch.randn(2, n, heads, dim, device=DEVICE, dtype=dtype)
    out = dilated_attention(q, k, v, segs, rates, causal=causal, kernel=kern)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    x64 = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    o64 = dense_dilated_attention(*x64, segs, rates, causal=causal)
    g64 = torch.autograd.grad(o64, x64, dout.double().cpu())
    xl = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ol = dense_dilated_attention(*xl, segs, rates, causal=causal)
    gl = torch.autograd.grad(ol, xl, dout)
    ctx = f"({mix}, causal={causal}, seed {seed})"
    assert_within_rule("out", out, o64, ol, context=ctx)
    for name, g, w, p in zip(("dq", "dk", "dv"), grads, g64, gl):
        assert_within_rule(name, g, w, p, context=ctx)


def test_a_pick_is_remembered_per_geometry_only():
    """``pick`` is asked twice per pattern and direction on every call, so it is remembered; what an
    implementation's ``supports`` reads (here a unit-stride head dim) keys it, so another layout is asked anew."""

    class UnitStride(Recorder):
        def supports(self, q, k):
            self.asked = getattr(self, "asked", 0) + 1
            return None if q.stride(-1) == 1 else "needs a unit-stride head dim"

    fused, other = Recorder("fused"), UnitStride("cudnn")
    kern = AutoKernel({"fused": fused, "cudnn": other}, {table_key("fwd", 1, False, 32, torch.bfloat16): "cudnn"})
    assert kern.pick("fwd", PLANS[0], False, Q, Q) is other
    assert kern.pick("fwd", PLANS[0], False, Q, Q) is other and other.asked == 1
    strided = Q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, head dim stride != 1
    with pytest.warns(UserWarning, match="needs a unit-stride head dim") as caught:
        assert kern.pick("fwd", PLANS[0], False, strided, strided) is fused
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not the library's frames
    assert other.asked == 2 and kern.pick("fwd", PLANS[0], False, Q, Q) is other and other.asked == 2


def test_auto_warns_where_the_table_never_measured_an_available_implementation(monkeypatch):
    """A GPU model without a table, or with one measured before an implementation available here existed, gets
    one warning naming what ``auto`` cannot choose; a table that measured everything available gets none."""
    fused = Recorder("fused")
    key = table_key("fwd", 1, False, 32, torch.bfloat16, LONG_ROWS * 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU")
    monkeypatch.setattr(dispatch, "flash4_unavailable", lambda device: None)  # flash4 "installed"
    everything = sorted(dispatch.auto_implementations(torch.device("cpu")))
    for table, expected in (({}, "no kernel table was measured on Imaginary GPU"),
                            ({"measured": ["cudnn", "cudnn-det", "cudnn-dkdv", "fused"]},
                             r"measured without \['flash4', 'flash4-nondet'\]"),
                            ({"measured": everything}, None)):
        monkeypatch.setattr(auto_table, "TABLE", {"Imaginary GPU": {"choices": {key: "cudnn"}, **table}} if table
                            else {})
        monkeypatch.setattr(dispatch, "_auto_kernels", {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dispatch._measured(torch.device("cpu"), fused)
            dispatch._measured(torch.device("cpu"), fused)  # once per GPU model
        gaps = [str(w.message) for w in caught if "kernel table" in str(w.message)]
        if expected is None:
            assert gaps == []
        else:
            assert len(gaps) == 1 and re.search(expected, gaps[0]) and "--write-table" in gaps[0], gaps
            assert {w.filename for w in caught if "kernel table" in str(w.message)} == {__file__}


def test_the_shipped_tables_say_what_they_measured():
    for gpu, entry in auto_table.TABLE.items():
        named = {name for names in entry["choices"].values() for name in ranked(names)}
        assert named <= set(entry["measured"]), (gpu, named - set(entry["measured"]))
