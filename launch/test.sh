#!/usr/bin/env bash
# The test suite (CPU: gloo ranks, Triton interpreter for the fused kernel). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
# two workers (pytest-xdist): the 2-core CI machine runs the suite in three quarters of the time (18.7 against
# 24.2 min); TEST_WORKERS overrides (0: one process), and so does a -n among the extra args. loadgroup keeps the
# tests sharing a module's rank spawn on one worker (tests/conftest.py), so it runs once
exec python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
