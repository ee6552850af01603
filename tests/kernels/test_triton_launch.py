"""``triton_support.launch``: a later launch of the same specialization calls the compiled kernel's launcher with
the arguments Triton would pass (every parameter in signature order), and anything Triton specializes on sends
the launch through Triton again. Checked with stand-ins for Triton's kernel objects (the direct path needs a GPU;
the GPU kernel tests run every launch of the library through it)."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import triton_support


class _Compiled:
    """A compiled kernel's surface: ``run`` records what the launcher got."""

    function, packed_metadata = "function-handle", "packed"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *args) -> None:
        self.log.append(("direct", args))


class _Jitted:
    """A jitted kernel's surface: ``fn[grid](*args, **kwargs)`` launches through Triton and returns the compiled
    kernel; ``arg_names`` is its signature."""

    arg_names = ["x", "n", "scale", "BLOCK", "EVEN"]

    def __init__(self) -> None:
        self.log: list = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def through_triton(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled
        return through_triton


@pytest.fixture
def direct(monkeypatch):
    """``launch`` as on a GPU with a supported Triton: its direct path on."""
    monkeypatch.setattr(triton_support, "DIRECT", True)
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(triton_support, "_hooked", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    triton_support._COMPILED.clear()
    yield
    triton_support._COMPILED.clear()


def _aligned(numel: int = 64, offset: int = 0) -> torch.Tensor:
    base = torch.randn(numel + 16)
    shift = (-base.data_ptr() // base.element_size()) % 4  # to a 16-byte boundary (fp32)
    return base[shift + offset:shift + offset + numel]


def test_a_repeated_launch_calls_the_compiled_launcher_with_every_parameter_in_order(direct):
    fn, x = _Jitted(), _aligned()
    meta = dict(EVEN=True, BLOCK=32)  # (any order: placed by the signature)
    triton_support.launch(fn, (3, 2), (x, 48, 0.5), meta, num_warps=4)
    y = _aligned()
    triton_support.launch(fn, (3, 2), (y, 48, 0.25), meta, num_warps=4)
    assert [entry[0] for entry in fn.log] == ["triton", "direct"]
    assert fn.log[0][1:] == ((3, 2), (x, 48, 0.5), dict(EVEN=True, BLOCK=32, num_warps=4))
    args = fn.log[1][1]
    assert args[:4] == (3, 2, 1, 1234)  # grid (z defaults to 1), then the current stream
    assert args[4:9] == ("function-handle", "packed", None, None, None)  # no launch metadata, no hooks
    assert args[9] is y and args[10:] == (48, 0.25, 32, True)  # the new tensor and float; constexprs in order


@pytest.mark.parametrize("change", ["int", "alignment", "dtype", "meta", "options"])
def test_what_triton_specializes_on_goes_through_triton_again(direct, change):
    fn, x = _Jitted(), _aligned()
    triton_support.launch(fn, (1,), (x, 48, 0.5), dict(BLOCK=32, EVEN=True), num_warps=4)
    args, meta, options = [x, 48, 0.5], dict(BLOCK=32, EVEN=True), dict(num_warps=4)
    if change == "int":
        args[1] = 49  # (48 is divisible by 16, 49 not: Triton compiles another kernel)
    elif change == "alignment":
        args[0] = _aligned(offset=1)  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = x.double()
    elif change == "meta":
        meta["EVEN"] = False
    else:
        options["num_warps"] = 8
    triton_support.launch(fn, (1,), tuple(args), meta, **options)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_a_kernel_whose_constexprs_are_not_all_given_always_goes_through_triton(direct):
    fn, x = _Jitted(), _aligned()
    for _ in range(2):
        triton_support.launch(fn, (1,), (x, 48, 0.5), dict(BLOCK=32), num_warps=4)  # (EVEN left to its default)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_the_interpreter_gets_no_launch_options(monkeypatch):
    monkeypatch.setattr(triton_support, "interpreting", lambda: True)
    fn, x = _Jitted(), _aligned()
    triton_support.launch(fn, (1,), (x, 48, 0.5), dict(BLOCK=32, EVEN=True), num_warps=4, num_stages=3)
    assert fn.log == [("triton", (1,), (x, 48, 0.5), dict(BLOCK=32, EVEN=True))]


def test_a_prepared_launch_calls_the_compiled_launcher_after_its_first_call(direct):
    fn, x, y = _Jitted(), _aligned(), _aligned()
    prepared = triton_support.Prepared(fn, (3, 2), dict(EVEN=True, BLOCK=32), num_warps=4)
    prepared(x, 48, 0.5)
    prepared(y, 48, 0.5)
    assert [entry[0] for entry in fn.log] == ["triton", "direct"]
    assert fn.log[0][1:] == ((3, 2, 1), (x, 48, 0.5), dict(EVEN=True, BLOCK=32, num_warps=4))
    args = fn.log[1][1]
    assert args[:9] == (3, 2, 1, 1234, "function-handle", "packed", None, None, None)
    assert args[9] is y and args[10:] == (48, 0.5, 32, True)


@pytest.mark.parametrize("path", ["hook", "device"])
def test_a_prepared_launch_goes_through_triton_under_a_hook_or_on_another_device(direct, monkeypatch, path):
    fn, x = _Jitted(), _aligned()
    prepared = triton_support.Prepared(fn, (1,), dict(BLOCK=32, EVEN=True), num_warps=4)
    prepared(x, 48, 0.5)
    if path == "hook":
        monkeypatch.setattr(triton_support, "_hooked", lambda: True)
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    prepared(x, 48, 0.5)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]


def test_a_prepared_launch_under_the_interpreter_always_goes_through_triton(direct, monkeypatch):
    monkeypatch.setattr(triton_support, "interpreting", lambda: True)
    fn, x = _Jitted(), _aligned()
    prepared = triton_support.Prepared(fn, (2,), dict(BLOCK=32, EVEN=True), num_warps=4)
    prepared(x, 48, 0.5)
    prepared(x, 48, 0.5)
    assert [entry[0] for entry in fn.log] == ["triton", "triton"]
    assert fn.log[1][3] == dict(BLOCK=32, EVEN=True)  # (no launch options for the interpreter)
