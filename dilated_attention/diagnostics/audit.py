"""Contiguity audit: find strided views reaching code that assumes contiguous memory.

The crash it looks for: an index gather along the sequence of a head-sliced view
(``k[:, :, h0:h1]``), fine on one GPU and an "illegal memory access" on eight,
because the kernel assumed contiguous memory. Two audits:

* **static** (``scan_paths``): an AST scan of Python files for
  ``index_select``/``gather``/P2P sends/collective inputs/Triton launches whose
  tensor argument is a slice, ``transpose``/``permute``/``narrow``/``select``/
  ``expand``/``as_strided``/``unfold``/``diagonal``/``.T``/``.mT`` of something
  (directly, or through a local name assigned from one, until ``.contiguous()``
  or ``.clone()`` makes it safe), and ``.view(...)`` straight after
  ``transpose``/``permute``. Reports ``file:line: why``. A line may opt out with
  a ``# audit: ok`` comment (say why next to it).
* **runtime** (``runtime_audit``): while active, every tensor that reaches the
  library's communication entry point (``CommBackend.exchange``), a kernel
  chosen by ``select_kernel`` (``forward_pattern``/``backward_pattern``) and,
  optionally, ``torch.distributed`` P2P calls is checked, and every
  non-contiguous (for sends) or misaligned tensor is recorded with its shape,
  strides, storage offset and the calling frame outside the library.
"""

from __future__ import annotations

import ast
import contextlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from .. import hooks
from ..comm.base import CommBackend
from ..kernels.protocol import call_tensors
from ..kernels.wrapper import KernelWrapper

VIEW_METHODS = {"transpose", "permute", "narrow", "select", "expand", "expand_as", "as_strided", "unfold",
                "diagonal", "t", "swapaxes", "swapdims", "movedim", "moveaxis", "unbind", "split", "chunk",
                "tensor_split"}
VIEW_ATTRS = {"T", "mT", "mH", "H"}
REORDERING = {"transpose", "permute", "t", "swapaxes", "swapdims", "movedim", "moveaxis", "T", "mT"}
SAFE_METHODS = {"contiguous", "clone", "copy", "detach_copy"}
GATHERS = {"index_select", "gather", "take_along_dim"}
SENDS = {"send", "isend", "send_recv", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
         "all_to_all_single", "broadcast", "all_reduce"}
P2P_OPS = {"P2POp"}
SUPPRESS = "audit: ok"


@dataclass
class StaticFinding:
    path: str
    line: int
    why: str

    def text(self) -> str:
        return f"{self.path}:{self.line}: {self.why}"


def _view_origin(node: ast.AST, tainted: dict[str, str]) -> str | None:
    """If ``node`` evaluates to a view with no contiguity guarantee, how it was made (else None)."""
    if isinstance(node, ast.Subscript):
        sl = node.slice
        if isinstance(sl, ast.Slice) and sl.step is None:
            return _view_origin(node.value, tainted)  # x[a:b] cuts the outermost dim: as contiguous as x
        parts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if any(isinstance(p, ast.Slice) and (p.lower or p.upper or p.step) for p in parts):
            return "a slice"
        return _view_origin(node.value, tainted)
    if isinstance(node, ast.Attribute) and node.attr in VIEW_ATTRS:
        return f".{node.attr}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        name = node.func.attr
        if name in SAFE_METHODS:
            return None
        if name in VIEW_METHODS:
            return f".{name}()"
        if name in ("view", "reshape", "unflatten", "flatten", "squeeze", "unsqueeze", "to", "float", "half",
                    "bfloat16", "double", "detach", "requires_grad_"):
            return _view_origin(node.func.value, tainted)  # these keep (or may keep) the strides of their input
        return None
    if isinstance(node, ast.Name):
        return tainted.get(node.id)
    return None


def _reordered(node: ast.AST, tainted: dict[str, str]) -> str | None:
    """Was ``node`` produced by a transpose/permute (so ``.view`` on it may fail)?"""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in REORDERING:
            return f".{node.func.attr}()"
        if node.func.attr in ("unsqueeze", "squeeze", "narrow", "select", "float", "to"):
            return _reordered(node.func.value, tainted)
    if isinstance(node, ast.Attribute) and node.attr in REORDERING:
        return f".{node.attr}"
    if isinstance(node, ast.Name) and tainted.get(node.id, "").lstrip(".").rstrip("()") in REORDERING:
        return tainted[node.id]
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, lines: list[str]) -> None:
        self.path, self.lines = path, lines
        self.findings: list[StaticFinding] = []
        self.scopes: list[dict[str, str]] = [{}]

    @property
    def tainted(self) -> dict[str, str]:
        return self.scopes[-1]

    def report(self, node: ast.AST, why: str) -> None:
        line = self.lines[node.lineno - 1] if 0 < node.lineno <= len(self.lines) else ""
        if SUPPRESS not in line:
            self.findings.append(StaticFinding(self.path, node.lineno, why))

    def visit_FunctionDef(self, node) -> None:
        self.scopes.append({})
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        origin = _view_origin(node.value, self.tainted)
        for target in node.targets:
            names = [target] if isinstance(target, ast.Name) else (
                list(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [])
            for n in names:
                if isinstance(n, ast.Name):
                    if origin:
                        self.tainted[n.id] = origin
                    else:
                        self.tainted.pop(n.id, None)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else (func.id if isinstance(func, ast.Name) else "")
        tainted = self.tainted
        if name in GATHERS:
            # x.index_select(dim, idx) or torch.index_select(x, dim, idx)
            recv = func.value if isinstance(func, ast.Attribute) else None
            is_module = isinstance(recv, ast.Name) and recv.id in ("torch", "F")
            subject = node.args[0] if (is_module or recv is None) and node.args else recv
            origin = _view_origin(subject, tainted) if subject is not None else None
            if origin:
                self.report(node, f"{name} on a view made by {origin} with no contiguity guarantee (the multi-GPU "
                                  "'illegal memory access' pattern): make it .contiguous() first, or read it "
                                  "through strided views (views.dilated_view) instead of gathering")
        elif name in SENDS or name in P2P_OPS:
            args = node.args[1:2] if name in P2P_OPS else node.args[:1]
            if name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "all_to_all_single"):
                args = node.args[:2]
            for arg in args:
                origin = _view_origin(arg, tainted)
                if origin:
                    self.report(node, f"{name} gets a view made by {origin}: communication reads raw memory, a "
                                      "strided view sends the wrong bytes or faults; pack it into a contiguous buffer")
        elif name == "view" and isinstance(func, ast.Attribute):
            origin = _reordered(func.value, tainted)
            if origin:
                self.report(node, f".view() after {origin}: the strides no longer allow a view (RuntimeError for "
                                  "some shapes); use .reshape() or make it .contiguous() first")
        if isinstance(func, ast.Subscript) and node.args:  # Triton launch: kernel[grid](tensors..., strides...)
            passes_strides = any("stride" in ast.unparse(a) for a in node.args)
            if not passes_strides:
                for arg in node.args:
                    origin = _view_origin(arg, tainted)
                    if origin:
                        self.report(node, f"kernel launch {ast.unparse(func.value)}[...] gets a view made by {origin} "
                                          "but no strides: the kernel will index it as if it were contiguous")


def scan_source(source: str, path: str = "<string>") -> list[StaticFinding]:
    tree = ast.parse(source, filename=path)
    scanner = _Scanner(path, source.splitlines())
    scanner.visit(tree)
    return scanner.findings


def scan_paths(paths: list[str]) -> tuple[list[StaticFinding], int]:
    """``(findings, number of files scanned)`` for files and directory trees (``.py`` files)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build", "dist")]
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    findings = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            src = fh.read()
        try:
            findings += scan_source(src, f)
        except SyntaxError as exc:
            findings.append(StaticFinding(f, exc.lineno or 0, f"not parsable as Python ({exc.msg})"))
    return findings, len(files)


def default_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- runtime ---------------------------------------------------------------------------------------------


@dataclass
class RuntimeFinding:
    entry: str
    tensor: str
    shape: tuple
    stride: tuple
    storage_offset: int
    why: str
    caller: str
    severity: str = "error"  # or "note": legal, but worth knowing (a copy the kernel makes)

    def text(self) -> str:
        return (f"{self.severity}: {self.entry}: {self.tensor} shape {self.shape} stride {self.stride} offset {self.storage_offset} "
                f"{self.why} (called from {self.caller})")


@dataclass
class RuntimeAudit:
    findings: list[RuntimeFinding] = field(default_factory=list)
    checked: int = 0

    def dedup(self) -> list[RuntimeFinding]:
        seen, out = set(), []
        for f in self.findings:
            key = (f.entry, f.tensor, f.shape, f.stride, f.why, f.caller)
            if key not in seen:
                seen.add(key)
                out.append(f)
        return out


_LIB = os.path.dirname(default_root())


def _caller() -> str:
    """The innermost frame outside this library, torch and the stdlib's threading machinery."""
    pkg = os.path.realpath(default_root())
    for f in reversed(traceback.extract_stack()[:-2]):
        if os.path.realpath(f.filename).startswith(pkg) or (os.sep + "torch" + os.sep) in f.filename or "contextlib" in f.filename:
            continue
        return f"{os.path.relpath(f.filename)}:{f.lineno} ({f.name})"
    return "inside the library"


def _check(audit: RuntimeAudit, entry: str, name: str, t, *, must_be_contiguous: bool) -> None:
    if not isinstance(t, torch.Tensor):
        return
    audit.checked += 1
    why, severity = [], "error"
    if must_be_contiguous and not t.is_contiguous():
        why.append("is not contiguous")
    if t.numel() and t.data_ptr() % t.element_size():
        why.append(f"is misaligned (data pointer {t.data_ptr():#x} not a multiple of {t.element_size()})")
    elif t.numel() and t.is_cuda and t.data_ptr() % 16 and must_be_contiguous:
        why.append(f"is not 16-byte aligned (data pointer {t.data_ptr():#x})")
    if not why and not must_be_contiguous and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        why.append("has a non-unit stride in its last dim (legal; a kernel reading rows as vectors copies it)")
        severity = "note"
    if why:
        audit.findings.append(RuntimeFinding(entry, name, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                                             " and ".join(why), _caller(), severity))


class _AuditedKernel(KernelWrapper):
    """Records what reaches a PatternKernel, then calls it."""

    def __init__(self, kernel, audit: RuntimeAudit) -> None:
        super().__init__(kernel)
        self.audit = audit

    def call(self, op, args, kwargs):
        entry = f"{self.name}.{op} (pattern {args[3].index})"
        for n, t in call_tensors(op, args):
            _check(self.audit, entry, n, t, must_be_contiguous=False)
        return super().call(op, args, kwargs)


@contextlib.contextmanager
def runtime_audit(*, kernels: bool = True, comm: bool = True, torch_p2p: bool = False) -> Iterator[RuntimeAudit]:
    """Record non-contiguous/misaligned tensors reaching kernels and sends while the block runs.

    Patches (and restores on exit) ``CommBackend.exchange`` (every ring step and all-to-all) and, with ``torch_p2p``,
    ``torch.distributed``'s ``send``/``isend``/``P2POp``; sees every kernel a call plans
    through a kernel hook (``hooks.py``). The calls still run (a send of a strided view
    still raises the library's own error after being recorded).
    """
    audit = RuntimeAudit()
    saved: list[tuple[object, str, object]] = []

    def patch(owner, attr, new):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    if comm:
        original_exchange = CommBackend.exchange

        def exchange(self, sends, recvs, *args, **kwargs):
            for x, dst in sends:
                _check(audit, f"{self.name}.exchange (to rank {dst})", "send", x, must_be_contiguous=True)
            for x, src in recvs:
                _check(audit, f"{self.name}.exchange (from rank {src})", "recv", x, must_be_contiguous=True)
            return original_exchange(self, sends, recvs, *args, **kwargs)

        patch(CommBackend, "exchange", exchange)
    hook = (lambda kernel, call: _AuditedKernel(kernel, audit)) if kernels else None
    if hook is not None:
        hooks.add_kernel_hook(hook)
    if torch_p2p:
        for fname in ("send", "isend"):
            original = getattr(dist, fname)

            def wrapped(tensor, *args, _original=original, _name=fname, **kwargs):
                _check(audit, f"torch.distributed.{_name}", "tensor", tensor, must_be_contiguous=True)
                return _original(tensor, *args, **kwargs)

            patch(dist, fname, wrapped)
        original_op = dist.P2POp

        class P2POp(original_op):  # type: ignore[misc, valid-type]
            def __new__(cls, op, tensor, *args, **kwargs):
                _check(audit, f"torch.distributed.P2POp({getattr(op, '__name__', op)})", "tensor", tensor,
                       must_be_contiguous=True)
                return original_op.__new__(cls, op, tensor, *args, **kwargs)

        patch(dist, "P2POp", P2POp)
    try:
        yield audit
    finally:
        if hook is not None:
            hooks.remove_kernel_hook(hook)
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
