#!/usr/bin/env bash
# The test suite (CPU: gloo ranks, Triton interpreter for the fused kernel). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
exec python -m pytest -q "$@"
