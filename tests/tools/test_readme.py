"""Docs that run: every ```python block of README.md and of docs/*.md is executed on CPU.

Conventions for README authors (comment lines at the very top of a block):

* ``# ranks: N`` (text may follow the number) -- the block is a per-rank
  script, as under ``torchrun --nproc_per_node=N``: it runs on N spawned gloo ranks. Without the marker, a
  block that uses ``comm=``, ``dist.`` or ``torch.distributed`` runs on 2 ranks.
  The process group already exists there: ``dist.init_process_group(...)`` (any
  backend) and ``dist.destroy_process_group()`` in a block are no-ops.
* ``# continues`` (e.g. ``# continues the block above``) -- runs after the previous
  block, in the same namespace and on the same ranks (the chain takes the
  largest rank count of its blocks).
* ``# needs-gpu: <reason>`` -- the only way to skip a block: skipped without CUDA,
  and the reason is required.

Blocks run with ``__name__ == "__main__"`` and must be small enough for a CPU
(a few seconds). Each chain is one test, named by the file and line it starts on
(``README.md:91``, ``docs/diagnostics.md:60``); a chain never crosses files. Every chain runs in spawned
processes (one spawn per rank count) set up as a user's CPU process: Triton's kernels not interpreted
(``testing.spawn.UNINTERPRETED``; the kernel tests check them in the interpreter).
"""

from __future__ import annotations

import glob
import os
import re
import traceback
from dataclasses import dataclass, field

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
DISTRIBUTED = re.compile(r"\bcomm=|\bdist\.|torch\.distributed")


@dataclass
class Chain:
    line: int  # line of the first block's opening fence
    sources: list[tuple[int, str]] = field(default_factory=list)  # (line of the code's first line, code)
    ranks: int = 1
    needs_gpu: str | None = None
    path: str = "README.md"  # the file, relative to the repository root

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks(text: str) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` for every ```python block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append((start, "\n".join(body) + "\n"))
        i += 1
    return out


def _markers(code: str) -> dict[str, str]:
    """The directives among the block's leading comment lines."""
    found = {}
    for line in code.splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"#\s*(ranks|needs-gpu)\s*:\s*(.*)$", line)
        if m and m.group(1) == "ranks":  # "# ranks: 2 (torchrun --nproc_per_node=2 ...)": the number counts
            found["ranks"] = (m.group(2).split() or [""])[0]
        elif m:
            found[m.group(1)] = m.group(2).strip()
        elif re.match(r"#\s*continues\b", line):
            found["continues"] = ""
    return found


def chains(text: str, path: str = "README.md") -> list[Chain]:
    out: list[Chain] = []
    for line, code in _blocks(text):
        marks = _markers(code)
        if "continues" in marks:
            if not out:
                raise ValueError(f"{path}:{line}: '# continues' on the first python block")
            chain = out[-1]
        else:
            chain = Chain(line, path=path)
            out.append(chain)
        chain.sources.append((line + 1, code))
        if "ranks" in marks:
            if not marks["ranks"].isdigit() or int(marks["ranks"]) < 1:
                raise ValueError(f"{path}:{line}: '# ranks:' needs a positive int, got {marks['ranks']!r}")
            chain.ranks = max(chain.ranks, int(marks["ranks"]))
        elif DISTRIBUTED.search(code):
            chain.ranks = max(chain.ranks, 2)
        if "needs-gpu" in marks:
            if not marks["needs-gpu"]:
                raise ValueError(f"{path}:{line}: '# needs-gpu:' must give the reason")
            chain.needs_gpu = marks["needs-gpu"]
    return out


def run_chain(chain: Chain) -> None:
    """Execute the chain's blocks in one fresh namespace (exceptions propagate)."""
    namespace = {"__name__": "__main__"}
    for line, code in chain.sources:
        # compile with the file's line numbers, so a traceback points into the markdown file
        exec(compile("\n" * (line - 1) + code, os.path.join(ROOT, chain.path), "exec"), namespace)


def _rank_worker(rank: int, world_size: int, payload: list[dict]) -> dict[str, str]:
    """Run every chain of this rank count on this rank: ``name -> ""`` (ok) or the traceback."""
    import torch.distributed as dist

    os.environ.setdefault("DILATED_ATTENTION_TIMEOUT", "60")  # a broken block fails instead of hanging
    real = dist.init_process_group, dist.destroy_process_group
    # the group exists; blocks are written for torchrun and create/destroy it themselves
    dist.init_process_group = dist.destroy_process_group = lambda *a, **k: None
    results = {}
    try:
        for item in payload:
            chain = Chain(item["line"], [tuple(s) for s in item["sources"]], item["ranks"], path=item["path"])
            try:
                run_chain(chain)
                results[chain.name] = ""
            except BaseException:  # noqa: BLE001 - report any failure of the block, keep the others running
                results[chain.name] = traceback.format_exc()
    finally:
        dist.init_process_group, dist.destroy_process_group = real
    return results


CHAINS: list[Chain] = []
for _doc in DOCS:
    with open(_doc) as _f:
        CHAINS += chains(_f.read(), os.path.relpath(_doc, ROOT))


@pytest.fixture(scope="module")
def chain_results() -> dict[str, list[str]]:
    """One spawn per rank count, running all of that count's chains: ``name -> [error per rank]``."""
    from dilated_attention.testing.spawn import UNINTERPRETED, spawn_ranks

    out: dict[str, list[str]] = {}
    cuda = torch.cuda.is_available()
    if any("deepspeed" in code for c in CHAINS if c.ranks > 1 for _, code in c.sources):
        from dilated_attention.comm.deepspeed import prebuild_ops

        prebuild_ops()  # DeepSpeed compiles a CPU op on first use: once here, not in every rank
    for ranks in sorted({c.ranks for c in CHAINS}):
        todo = [c for c in CHAINS if c.ranks == ranks and (cuda or c.needs_gpu is None)]
        if todo:
            payload = [{"line": c.line, "sources": c.sources, "ranks": c.ranks, "path": c.path} for c in todo]
            for per_rank in spawn_ranks(_rank_worker, ranks, payload, env=UNINTERPRETED):
                for name, err in per_rank.items():
                    out.setdefault(name, []).append(err)
    return out


def test_readme_has_python_blocks():
    assert any(c.path == "README.md" for c in CHAINS), "README.md has no ```python block"


@pytest.mark.parametrize("chain", CHAINS, ids=[c.name for c in CHAINS])
def test_readme_block_runs(chain, request):
    if chain.needs_gpu is not None and not torch.cuda.is_available():
        pytest.skip(f"needs a GPU: {chain.needs_gpu}")
    errors = request.getfixturevalue("chain_results")[chain.name]
    assert len(errors) == chain.ranks
    failed = [(r, e) for r, e in enumerate(errors) if e]
    assert not failed, f"rank {failed[0][0]}:\n{failed[0][1]}"


def test_conventions_parse():
    """The markers, on a made-up README."""
    text = "\n".join([
        "```python", "x = 1", "```",
        "```python", "# continues the block above", "y = x + 1", "```",
        "```python", "# ranks: 3 (torchrun --nproc_per_node=3 x.py)", "import torch.distributed as dist", "```",
        "```python", "out = f(q, comm=comm)", "```",
        "```python", "# needs-gpu: bf16 fused kernel", "import torch", "```",
        "```bash", "echo not python", "```",
    ])
    got = chains(text)
    assert [(c.line, len(c.sources), c.ranks, c.needs_gpu) for c in got] == [
        (1, 2, 1, None), (8, 1, 3, None), (12, 1, 2, None), (15, 1, 1, "bf16 fused kernel")]
    with pytest.raises(ValueError, match="must give the reason"):
        chains("```python\n# needs-gpu:\nx = 1\n```")
    with pytest.raises(ValueError, match="on the first python block"):
        chains("```python\n# continues\nx = 1\n```")
