"""Importable checks behind ``scripts/`` (one module per question a user asks).

* ``checks``: environment, strided views, each kernel vs the oracle, ring smoke test (``diagnose.py``)
* ``debug``: debug mode (``DILATED_ATTENTION_DEBUG=1`` / ``debug(...)``): checked kernels and sends, repro on error
* ``repro``: capture a call into a small JSON, replay it against the fp64 oracle (``repro.py``)
* ``fuzz``: random valid/invalid calls against the oracle (``fuzz.py``)
* ``guard``: kernel-failure guard (explained CUDA errors, SDPA fallback on launch-resource errors)
* ``sanitize`` / ``launch_trace``: compute-sanitizer runs summarised per kernel and Python frame (``sanitize.py``)
* ``audit``: static and runtime contiguity audit (``contiguity_audit.py``)
* ``health``: distributed ring health check and per-link bandwidth (``diagnose.py ring --distributed``)
"""

from .checks import check_kernels, check_ring, check_views, env_report

# The debug context manager is dilated_attention.debug (diagnostics.debug is its module).
__all__ = ["check_kernels", "check_ring", "check_views", "env_report"]
