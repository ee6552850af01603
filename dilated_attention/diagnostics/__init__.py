"""Importable checks behind ``scripts/diagnose.py`` (one function per question a user asks)."""

from .checks import check_kernels, check_ring, check_views, env_report

__all__ = ["check_kernels", "check_ring", "check_views", "env_report"]
