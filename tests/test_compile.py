"""torch.compile and torch.func tests (``compile_cases.py``), run in a process of their own.

Compiling in a process imports parts of Triton's runtime that break Triton's interpreter, which the
fused-kernel tests use on CPU later in the same pytest run; a child process keeps them apart.
"""

import os
import subprocess
import sys


def test_compile_and_func_cases():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(here, "compile_cases.py")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
