"""Run a Python script, printing one marker line per Triton kernel launch with the frame that made it.

    python -m dilated_attention.diagnostics.launch_trace script.py [args...]

Each launch prints ``[dilated_attention.launch] <kernel> from <file:line (function)>``
(the innermost frame outside Triton and torch) ``via <file:line (function)>`` (the
innermost frame outside our kernels: the strategy or the user's code). Under
compute-sanitizer with ``CUDA_LAUNCH_BLOCKING=1`` a report printed after a marker
belongs to that launch; ``sanitize.summarise`` relies on this.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from .sanitize import MARK

_SKIP = (os.sep + "triton" + os.sep, os.sep + "torch" + os.sep, "launch_trace.py", "<frozen")
_KERNELS = os.sep.join(("dilated_attention", "kernels", ""))


def _frame(f) -> str:
    return f"{os.path.relpath(f.filename) if not f.filename.startswith('<') else f.filename}:{f.lineno} ({f.name})"


def describe_launch(name: str) -> str:
    stack = traceback.extract_stack()[:-2]
    inner = next((f for f in reversed(stack) if not any(s in f.filename for s in _SKIP)), None)
    outer = next((f for f in reversed(stack) if not any(s in f.filename for s in _SKIP) and _KERNELS not in f.filename),
                 None)
    text = f"{name} from {_frame(inner) if inner else '?'}"
    if outer is not None and outer is not inner:
        text += f" via {_frame(outer)}"
    return text


def _hook(metadata) -> None:
    try:
        data = metadata if isinstance(metadata, dict) else metadata.get()  # Triton's LazyDict
        name = data["name"]
    except Exception:  # a Triton version whose metadata we do not know: still mark the launch
        name = "triton kernel"
    print(f"{MARK} {describe_launch(name)}", flush=True)


def install() -> bool:
    """Register the launch hook with Triton; ``False`` if Triton is missing or has no hook."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    try:
        from triton import knobs

        knobs.runtime.launch_enter_hook.add(_hook)  # Triton >= 3.4: a chain of hooks
        return True
    except (ImportError, AttributeError):
        pass
    try:
        from triton.compiler import CompiledKernel

        CompiledKernel.launch_enter_hook = _hook  # older Triton: one class attribute
        return True
    except (ImportError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m dilated_attention.diagnostics.launch_trace script.py [args...]")
    if not install():
        print(f"{MARK} (Triton launch hook unavailable: launches are not attributed)", flush=True)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
