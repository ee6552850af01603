"""The installed tools reject bad counts, rates and sizes before doing anything: one line naming the argument, exit 2;
ranks' lines are written whole."""

from __future__ import annotations

import io

import pytest

from dilated_attention.launch_utils import say
from dilated_attention.tools import diagnose, fuzz


@pytest.mark.parametrize("tool, argv, message", [
    (fuzz, ["--cases", "-3"], "argument --cases: must be a positive integer, got -3"),
    (fuzz, ["--cases", "0"], "argument --cases: must be a positive integer, got 0"),
    (fuzz, ["--cases", "many"], "argument --cases: must be a positive integer, got 'many'"),
    (fuzz, ["--seconds", "-5"], "argument --seconds: must be a positive number, got -5"),
    (fuzz, ["--seconds", "inf"], "argument --seconds: must be a positive number, got inf"),
    (fuzz, ["--world-sizes", "1,0"], "argument --world-sizes: must be a positive integer, got 0"),
    (fuzz, ["--world-sizes", ","], "argument --world-sizes: must be comma-separated positive numbers, got ','"),
    (fuzz, ["--invalid-fraction", "1.5"], "argument --invalid-fraction: must be a fraction in [0, 1], got 1.5"),
    (fuzz, ["--option-rate", "-0.1"], "argument --option-rate: must be a fraction in [0, 1], got -0.1"),
    (diagnose, ["kernels", "--seq-len", "-256"], "argument --seq-len: must be a positive integer, got -256"),
    (diagnose, ["kernels", "--head-dim", "0"], "argument --head-dim: must be a positive integer, got 0"),
    (diagnose, ["ring", "--timeout", "0"], "argument --timeout: must be a positive number, got 0"),
    (diagnose, ["ring", "--iters", "-1"], "argument --iters: must be a positive integer, got -1"),
    (diagnose, ["ring", "--sizes-mb", "1,-16"], "argument --sizes-mb: must be a positive number, got -16"),
])
def test_bad_counts_exit_2_naming_the_argument(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        tool.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith(message), err


def test_good_counts_parse():
    """(Only parsing: a valid --cases must not be refused.)"""
    with pytest.raises(SystemExit) as exited:
        fuzz.main(["--cases", "3", "--seconds", "1.5", "--world-sizes", "1,2", "--option-rate", "0", "--help"])
    assert exited.value.code == 0


class _Writes(io.StringIO):
    """A stream that records each write call separately."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_say_writes_each_ranks_lines_whole_in_one_write():
    out = _Writes()
    say("ping rank 0 -> rank 1 ok\nall_gather of 2 ok", 1, file=out)
    say("no rank here", file=out)
    assert out.writes == ["[rank 1] ping rank 0 -> rank 1 ok\n[rank 1] all_gather of 2 ok\n", "no rank here\n"]
