"""Importable checks behind ``scripts/`` (one module per question a user asks).

They sit above the library: the call path imports nothing from here, and debug mode and the runtime
audit see calls through the kernel hooks of ``hooks.py`` (the kernel-failure guard, which every call
uses, is ``kernels/guard.py``).

* ``checks``: environment, strided views, each kernel vs the oracle, ring smoke test (``diagnose.py``)
* ``debug``: debug mode (``DILATED_ATTENTION_DEBUG=1`` / ``debug(...)``): checked kernels and sends, repro on error
* ``repro``: capture a call into a small JSON, replay it against the fp64 oracle (``repro.py``)
* ``fuzz``: random valid/invalid calls against the oracle (``fuzz.py``)
* ``sanitize`` / ``launch_trace``: compute-sanitizer runs summarised per kernel and Python frame (``sanitize.py``)
* ``audit``: static and runtime contiguity audit (``contiguity_audit.py``)
* ``health``: distributed ring health check and per-link bandwidth (``diagnose.py ring --distributed``)
"""

from .checks import check_kernels, check_ring, check_views, env_report

# The debug context manager is dilated_attention.debug (diagnostics.debug is its module).
__all__ = ["check_kernels", "check_ring", "check_views", "env_report"]
