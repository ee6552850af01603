#!/usr/bin/env bash
# The main job: ring-dilated attention over a sequence sharded across 4 CPU ranks
# (gloo), or across every local GPU (NCCL) when there are several; one table per backend.
# Rank 0 prints for the job; a bad argument is one line and exit status 2.
# Extra arguments go to launch/demo.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
case " $* " in *" --help "*|*" -h "*) exec python launch/demo.py --help ;; esac
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
nproc=${NPROC:-$([ "$gpus" -gt 1 ] && echo "$gpus" || echo 4)}
# check the arguments once, before torchrun starts the ranks: a bad one is one line, exit status 2
WORLD_SIZE=$nproc python launch/demo.py --check-args "$@"
# demo.py sets each CPU rank's threads itself; setting this keeps torchrun from warning about it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --standalone --nproc_per_node="$nproc" launch/demo.py "$@"
