#!/usr/bin/env bash
# The main job: ring-dilated attention over a sequence sharded across 4 CPU ranks
# (gloo), or across every local GPU (NCCL) when there are several; one table per backend.
# Extra arguments go to launch/demo.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
case " $* " in *" --help "*|*" -h "*) exec python launch/demo.py --help ;; esac
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
nproc=${NPROC:-$([ "$gpus" -gt 1 ] && echo "$gpus" || echo 4)}
exec torchrun --standalone --nproc_per_node="$nproc" launch/demo.py "$@"
