"""A repository script (``benchmarks/``, ``scripts/``, ``launch/``) loaded as a module, so that a test calls its
functions in this process, without an interpreter start-up."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType


def load_script(path: str) -> ModuleType:
    """The script at ``path`` as a module named after its file (it is executed once per call)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
