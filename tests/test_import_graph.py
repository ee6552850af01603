"""The package's import graph, parsed from source (imports inside functions included): layers point down.

* no cycles among the package's modules;
* the core (everything but ``diagnostics/``, ``testing/``, ``models/``, ``tools/``, command-line modules and
  the package's ``__init__``) imports nothing from those or from a command-line module (one that imports
  ``argparse``);
* the package's ``__init__`` loads ``diagnostics/`` only on request (inside a function, or under an
  ``if`` whose test reads ``os.environ``; any other ``if`` or ``try`` does not count): debug mode plugs in at the
  kernel hooks, never on the call path;
* a module imports the package's own modules at module level, except where a lazy import keeps an
  optional dependency (or an optional tool) off the import path: ``LAZY`` says why for each;
* planning decides each pattern's route and never runs one: ``planning``, ``memory`` and the routes themselves
  (``ring.routes``) reach none of the ring's executor modules (``PLANNERS``, ``RING_EXECUTORS``);
* importing the package leaves torch's Dynamo unloaded (a subprocess checks).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "dilated_attention"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
ABOVE_CORE = (f"{PACKAGE}.diagnostics", f"{PACKAGE}.testing", f"{PACKAGE}.models", f"{PACKAGE}.tools")

LAZY = {
    (PACKAGE, f"{PACKAGE}.diagnostics.debug"): "dilated_attention.debug, loaded on first use",
    (f"{PACKAGE}.kernels.fused", f"{PACKAGE}.kernels._fused_triton"): "its kernels need Triton at import",
    (f"{PACKAGE}.merge", f"{PACKAGE}.merge._triton"): "its kernels need Triton at import",
    (f"{PACKAGE}.comm", f"{PACKAGE}.comm.collective"): "a backend's module loads when the backend is named",
    (f"{PACKAGE}.comm", f"{PACKAGE}.comm.fairscale"): "a backend's module loads when the backend is named",
    (f"{PACKAGE}.comm", f"{PACKAGE}.comm.deepspeed"): "a backend's module loads when the backend is named",
}


# What plans a call, and the ring's modules that run one: the first never reach the second.
PLANNERS = (f"{PACKAGE}.planning", f"{PACKAGE}.memory", f"{PACKAGE}.ring.routes", f"{PACKAGE}.ring.layout",
            f"{PACKAGE}.ring.documents")
RING_EXECUTORS = tuple(f"{PACKAGE}.ring.{m}" for m in ("block", "kv_ring", "cross_share", "square_split", "swapped",
                                                       "stacking", "side_streams", "padding"))


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    conditional: bool  # in the body of an ``if`` on the environment (``os.environ``)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(source: str, level: int, module: str | None) -> str:
    """The absolute name ``from <level dots><module>`` names inside ``source``."""
    if level == 0:
        return module or ""
    base = source.split(".") if _is_package(source) else source.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _targets(node: ast.AST, source: str) -> list[str]:
    """The package's modules an import statement loads."""
    names = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(source, node.level, node.module)
        # ``from pkg import name``: the submodule ``pkg.name`` where there is one, else ``pkg`` itself
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return sorted({n for n in names if n in MODULES})


def _on_environment(test: ast.expr) -> bool:
    """Whether an ``if`` test reads the environment (``os.environ``, however ``os`` was imported)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "environ" for n in ast.walk(test))


def _edges(source: str, text: str | None = None) -> list[Edge]:
    """The imports of module ``source`` (its file, or ``text`` in its place)."""
    tree = ast.parse(MODULES[source].read_text() if text is None else text, str(MODULES[source]))
    edges = []

    def visit(node: ast.AST, in_function: bool, conditional: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                edges.extend(Edge(source, t, child.lineno, in_function, conditional) for t in _targets(child, source))
            function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If):  # only the body of an ``if`` on the environment is on request
                asked = conditional or _on_environment(child.test)
                visit(ast.Module(body=child.body, type_ignores=[]), function, asked)
                visit(ast.Module(body=child.orelse, type_ignores=[]), function, conditional)
            else:
                visit(child, function, conditional)

    visit(tree, False, False)
    return edges


EDGES = [edge for name in MODULES for edge in _edges(name)]


def _is_cli(name: str) -> bool:
    tree = ast.parse(MODULES[name].read_text())
    return any(isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names)
               or isinstance(n, ast.ImportFrom) and n.module == "argparse" for n in ast.walk(tree))


def _above_core(name: str) -> bool:
    return name.startswith(ABOVE_CORE) or _is_cli(name)


def test_the_graph_sees_every_module_and_its_imports():
    assert {f"{PACKAGE}.functional", f"{PACKAGE}.kernels.dispatch", f"{PACKAGE}.diagnostics.debug"} <= set(MODULES)
    assert any(e.source == f"{PACKAGE}.planning" and e.target == f"{PACKAGE}.kernels.dispatch" for e in EDGES)
    assert any(e.in_function for e in EDGES)  # function-level imports are edges too


def test_no_import_cycles():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for e in EDGES:
        if e.target != e.source:
            graph[e.source].add(e.target)
    # Tarjan's strongly connected components: any component of two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    detail = [[f"{e.source} -> {e.target} (line {e.line})" for e in EDGES
               if e.source in c and e.target in c and e.source != e.target] for c in cycles]
    assert not cycles, f"import cycles: {detail}"


def _reached(name: str) -> set[str]:
    """Every module ``name`` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        source = todo.pop()
        for edge in (e for e in EDGES if e.source == source):
            if edge.target not in seen:
                seen.add(edge.target)
                todo.append(edge.target)
    return seen


def test_planning_reaches_no_ring_executor():
    assert set(RING_EXECUTORS) <= set(MODULES), sorted(set(RING_EXECUTORS) - set(MODULES))
    for name in PLANNERS:
        assert not _reached(name) & set(RING_EXECUTORS), (name, sorted(_reached(name) & set(RING_EXECUTORS)))
    assert f"{PACKAGE}.ring.kv_ring" in _reached(f"{PACKAGE}.execution")  # (the check can see an executor)


def test_the_core_imports_nothing_above_it():
    core = [name for name in MODULES if name != PACKAGE and not _above_core(name)]
    assert f"{PACKAGE}.functional" in core and f"{PACKAGE}.kernels.guard" in core and f"{PACKAGE}.caches" in core
    bad = [f"{e.source} -> {e.target} (line {e.line})" for e in EDGES if e.source in core and _above_core(e.target)]
    assert not bad, f"the core imports diagnostics/, testing/, models/, tools/ or a command line: {bad}"


def _loaded_unasked(edges: list[Edge]) -> list[str]:
    return [f"line {e.line}: {e.target}" for e in edges
            if e.source == PACKAGE and _above_core(e.target) and not (e.in_function or e.conditional)]


def test_the_package_loads_diagnostics_only_on_request():
    bad = _loaded_unasked(EDGES)
    assert not bad, f"dilated_attention/__init__.py imports above the core unconditionally: {bad}"


def test_only_an_if_on_the_environment_or_a_function_counts_as_on_request():
    """The rule above, on sources standing in for the package's ``__init__``: it must catch what it is for."""
    debug = "from .diagnostics import debug\n"
    indented = "    " + debug
    asked = ["import os\nif os.environ.get('X'):\n" + indented, "def load():\n" + indented,
             "import os as _os\nif _os.environ.get('X') == '1':\n" + indented]
    unasked = [debug, "if True:\n" + indented, "try:\n" + indented + "except ImportError:\n    pass\n",
               "import os\nif os.environ.get('X'):\n    pass\nelse:\n" + indented]
    for text in asked:
        assert not _loaded_unasked(_edges(PACKAGE, text)), text
    for text in unasked:
        assert _loaded_unasked(_edges(PACKAGE, text)), text


def test_own_modules_are_imported_at_module_level():
    lazy = {(e.source, e.target) for e in EDGES if e.in_function}
    unexplained = sorted(lazy - set(LAZY))
    assert not unexplained, f"function-level imports of the package's modules without a reason in LAZY: {unexplained}"
    stale = sorted(set(LAZY) - lazy)
    assert not stale, f"LAZY names imports that are no longer lazy: {stale}"


def test_importing_the_package_leaves_dynamo_unloaded():
    """Dynamo costs a second at import, and imported after ``init_process_group`` it keeps the default group
    alive past ``destroy_process_group``: the package loads it only when a call is compiled."""
    import subprocess
    import sys

    code = "import sys, dilated_attention; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", run.stdout
