"""Without CUDA the fused kernel runs in Triton's interpreter. Triton decides at its import whether its
own library functions (``tl.sum``, ``tl.zeros``, ...) are interpreted, and importing the library may
import Triton (through torch's compile machinery), so the variable is set before any test module loads."""

import functools
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@functools.cache
def _shares_module_fixture(path: str) -> bool:
    """Whether the test file ``path`` declares a module-scoped fixture (most spawn gloo ranks)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)) as f:
            return re.search(r"scope\s*=\s*[\"']module[\"']", f.read()) is not None
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without it installed, nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (``launch/test.sh``): the tests of a file with a module-scoped fixture go to one worker,
    so the fixture runs once, not once per worker; every other test is its own unit, as under ``load``. (xdist's
    own ``xdist_group`` marks do not reach its scheduler under pytest 9.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_module_fixture(path) else nodeid

    return ModuleFixtureScheduling(config, log)
