"""One public API: docs/api.md's table of public names is the whole of it.

Every module of the package is read (its source, not imported: optional dependencies need not be installed), and
each name in a module's ``__all__`` must be in the table under that module's path; every name of the table must
exist; the count api.md states is the table's.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dilated_attention"
API = ROOT / "docs" / "api.md"


def _table() -> tuple[list[str], int]:
    """The qualified names of api.md's "Public names" table and the count its text states."""
    text = API.read_text()
    section = text.split("\n## Public names\n", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `(dilated_attention[\w.]*)` \|", section, re.M)
    stated = re.search(r"these (\d+) names", section)
    assert stated, "api.md's Public names section states how many names there are ('these N names')"
    return names, int(stated.group(1))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exported(path: Path) -> list[str] | None:
    """The module's ``__all__`` as its source assigns it (a literal list or tuple), or None without one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = ast.literal_eval(node.value)
            found = (found or []) + list(value) if isinstance(node, ast.AugAssign) else list(value)
    return found


def _exports() -> dict[str, list[str]]:
    return {_module_name(path): names for path in sorted(PACKAGE.rglob("*.py"))
            if (names := _exported(path)) is not None}


def test_api_md_states_the_number_of_public_names():
    names, stated = _table()
    assert len(names) == len(set(names)), "a name is listed twice"
    assert stated == len(names), f"api.md says {stated} public names, its table lists {len(names)}"


def test_every_exported_name_is_documented():
    public = set(_table()[0])
    missing = [f"{module}.{name}" for module, names in _exports().items() for name in names
               if f"{module}.{name}" not in public]
    assert not missing, (
        f"{len(missing)} name(s) in a module's __all__ are not in docs/api.md's Public names table: "
        f"{missing}. Document each there (a public name) or drop it from __all__ (an internal one)")


@pytest.mark.parametrize("qualified", _table()[0])
def test_every_documented_name_exists(qualified):
    module, _, name = qualified.rpartition(".")
    assert hasattr(importlib.import_module(module), name), f"api.md lists {qualified}, which does not exist"


def test_the_reader_of_all_sees_every_form(tmp_path):
    """The rule is read from the source as Python would run it: a list, a tuple, an extension with +=."""
    text = '__all__ = ["a", "b"]\n__all__ += ("c",)\nx = 1\n'
    scope: dict = {}
    exec(text, scope)
    source = tmp_path / "probe.py"
    source.write_text(text)
    assert _exported(source) == scope["__all__"] == ["a", "b", "c"]
    source.write_text("x = 1\n")
    assert _exported(source) is None
