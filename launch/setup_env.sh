# Sourced by demo.sh and test.sh: create .venv and install the package with every backend, at the
# tested versions (launch/constraints.txt). Idempotent: re-installs only when pyproject.toml or the
# constraints changed.
set -euo pipefail
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=".venv/.installed-$(cat pyproject.toml launch/constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing into .venv at the tested versions (first run takes a minute or two)..."
  # torch first, or deepspeed/fairscale pull in a multi-GB CUDA build on CPU machines. Without a GPU, the CPU
  # build from PyTorch's index, unless pip has an index or mirror of its own configured (kept as it is);
  # TORCH_INDEX_URL (empty: pip's own index) and TORCH_SPEC override.
  if ! python -c "import torch" 2>/dev/null; then
    if [ -z "${TORCH_INDEX_URL+set}" ]; then
      TORCH_INDEX_URL=
      pip_config=$(python -m pip config list 2>/dev/null || true)  # (read whole: grep -q would cut pip's pipe)
      if ! command -v nvidia-smi >/dev/null 2>&1 && ! grep -qE "index-url|find-links" <<<"$pip_config"; then
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
      fi
    fi
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
  extras=all  # a GPU machine also gets the cuDNN frontend (kernel "cudnn-det")
  python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" && extras=all,cudnn
  python -m pip install -q -c launch/constraints.txt -e ".[$extras]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
