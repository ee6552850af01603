#!/usr/bin/env bash
# The test suite (CPU: gloo ranks, Triton interpreter for the fused kernel). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
# two workers (pytest-xdist): about 25 minutes on a 2-core machine; TEST_WORKERS overrides (0: one process), and so
# does a -n among the extra args. loadgroup keeps the tests that share a file's rank spawn on one worker
# (tests/conftest.py), so it runs once
exec python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
