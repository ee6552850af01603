"""Integrations with other libraries (imported on demand: each needs its library installed)."""
