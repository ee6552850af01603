#!/usr/bin/env bash
# Multi-node torchrun for dilated_attention: run this once on every node.
#
#   launch/multinode.sh [options] [--] SCRIPT [SCRIPT ARGS...]
#
#   --nnodes N          nodes in the job                          (env NNODES, default 1)
#   --node-rank R       this node's index, 0..N-1                 (env NODE_RANK, default 0)
#   --master HOST:PORT  rendezvous endpoint, a host every node reaches (env MASTER_ADDR, MASTER_PORT;
#                       default 127.0.0.1:29500)
#   --nproc P           processes (GPUs) per node                 (env NPROC_PER_NODE, default: GPUs seen, else 1)
#   --env FILE          environment file sourced first            (env ENV_FILE, default launch/torchrun_env.sh)
#   --id ID             rendezvous id shared by the job's nodes   (env RDZV_ID, default $SLURM_JOB_ID or "dilated_attention")
#
# Other knobs: PYTHON (interpreter holding torch, default python3), RDZV_CONF (extra c10d
# rendezvous settings, e.g. join_timeout=120), MAX_RESTARTS (default 0: a failed rank ends the job).
#
# Example, two nodes of 8 GPUs (node0 is reachable from node1):
#   node0$ launch/multinode.sh --nnodes 2 --node-rank 0 --master node0:29500 benchmarks/bench_scaling.py
#   node1$ launch/multinode.sh --nnodes 2 --node-rank 1 --master node0:29500 benchmarks/bench_scaling.py
# Under SLURM: sbatch launch/slurm_multinode.sbatch (it calls this script on each node).
#
# Rendezvous is c10d (torchrun's TCP store on the endpoint host; the agent whose host matches
# the endpoint serves it, the others connect). With c10d, ranks are assigned in join order per
# node; --node-rank is passed on for logs and for sites that check it.
set -euo pipefail
cd "$(dirname "$0")/.."

nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
endpoint="${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}"
nproc=${NPROC_PER_NODE:-}
env_file=${ENV_FILE:-launch/torchrun_env.sh}
rdzv_id=${RDZV_ID:-${SLURM_JOB_ID:-dilated_attention}}

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [ $# -ge 2 ] || { echo "multinode.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) need "$@"; nnodes=$2; shift 2 ;;
    --node-rank) need "$@"; node_rank=$2; shift 2 ;;
    --master) need "$@"; endpoint=$2; shift 2 ;;
    --nproc) need "$@"; nproc=$2; shift 2 ;;
    --env) need "$@"; env_file=$2; shift 2 ;;
    --id) need "$@"; rdzv_id=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "multinode.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "multinode.sh: no script given (see --help)" >&2; exit 2; }
case "$nnodes$node_rank" in *[!0-9]*) echo "multinode.sh: --nnodes ($nnodes) and --node-rank ($node_rank) must be integers" >&2; exit 2 ;; esac
if [ "$node_rank" -ge "$nnodes" ]; then
  echo "multinode.sh: --node-rank ($node_rank) must be below --nnodes ($nnodes)" >&2; exit 2
fi
case "$endpoint" in *:*) ;; *) echo "multinode.sh: --master must be HOST:PORT, got $endpoint" >&2; exit 2 ;; esac
if [ -z "$nproc" ]; then
  nproc=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [ "$nproc" -gt 0 ] || nproc=1
fi

if [ -n "$env_file" ]; then
  [ -f "$env_file" ] || { echo "multinode.sh: env file $env_file not found" >&2; exit 2; }
  # shellcheck disable=SC1090
  source "$env_file"
fi

rdzv_conf=()
[ -n "${RDZV_CONF:-}" ] && rdzv_conf=(--rdzv_conf="$RDZV_CONF")
echo "[multinode] node $node_rank/$nnodes, $nproc procs, rendezvous c10d at $endpoint (id $rdzv_id)" >&2
exec "${PYTHON:-python3}" -m torch.distributed.run \
  --nnodes="$nnodes" --node_rank="$node_rank" --nproc_per_node="$nproc" \
  --rdzv_backend=c10d --rdzv_endpoint="$endpoint" --rdzv_id="$rdzv_id" "${rdzv_conf[@]}" \
  --max_restarts="${MAX_RESTARTS:-0}" \
  "$@"
