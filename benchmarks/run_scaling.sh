#!/usr/bin/env bash
# The scaling benchmark on the GPUs of this machine: one torchrun per GPU count K, then the
# table, plots and the cost model's predictions of them (with this GPU's constants where
# cost_model.PRESETS has them). About 6-8 minutes on 4 x H200 with the defaults.
#
#   OUT=benchmarks/results benchmarks/run_scaling.sh [--worlds 1,2,4] [bench_scaling.py options...]
#
# Writes into $OUT (default benchmarks/results): scaling_<gpu>_x<K>.json per K, scaling_<gpu>.png
# and scaling_<gpu>.md (the table), <gpu> the model as benchmarks/gpu_tag.py names it (h200);
# everything printed also goes to $LOG (default /tmp/scaling_<gpu>.log).
# Defaults: K = 1, 2, 4, 8 up to the GPUs present; 32768 tokens per GPU; LongNet and full
# attention, causal and not, strategies ring/head/hybrid, peers torch_cp, ulysses and
# ring_flash_attn, and the max-length probe (60 s budget per K). Options after --worlds go to
# bench_scaling.py, e.g. --tokens 8192,16384,32768,65536 (sweep), --backend deepspeed,
# --peers '' (none), --no-probe, --profile (after the timed cases, a few profiled steps of the
# ring and head cases: where NCCL runs with no compute beside it; --profile-cases picks others,
# --profile-trace DIR keeps the Chrome traces). A peer whose package does not import (deepspeed
# for ulysses, ring-flash-attn with flash-attn for ring_flash_attn) is recorded as skipped. PYTHON
# names the interpreter (default python3). Each K is bounded by K_TIMEOUT seconds (default 180;
# 300 with any --profile option, 420 with --compile: each compiled case compiles afresh).
# Waits: stream-ordered by default (DILATED_ATTENTION_TIMEOUT is not set here: what a user gets, and
# what the peers get); --waits host measures host-timed waits (a host sync per exchange). Each JSON
# records the mode (meta.waits). --layouts contiguous,zigzag adds zigzag rings where the package
# accepts layout= (skipped with the reason otherwise).
# --memory-bound 0.4,0 runs the library under set_memory_bound (head chunks) into scaling_<gpu>-bound_*.
# --pipelined times steps back to back (no sync between them) into scaling_<gpu>-pipelined_*.
# SMOKE=1 rehearses the whole script on CPU (gloo, tiny sizes, K = 1, 2).
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the header above is the manual
  echo "usage: OUT=benchmarks/results benchmarks/run_scaling.sh [--worlds 1,2,4] [bench_scaling.py options...]"
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"

worlds=""
if [ "${1:-}" = "--worlds" ]; then worlds=$2; shift 2; fi
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
extra=()
if [ -n "${SMOKE:-}" ]; then  # CPU rehearsal of this script: gloo ranks, tiny sizes
  gpus=2; extra=(--smoke); slug=cpu; export DS_ACCELERATOR=cpu
elif [ "$gpus" -lt 1 ]; then
  echo "run_scaling.sh: no GPU visible (SMOKE=1 rehearses this script on CPU)" >&2
  exit 2
else
  slug=$("$PY" benchmarks/gpu_tag.py)
  export DS_ACCELERATOR=cuda
fi
if [ -z "$worlds" ]; then
  for k in 1 2 4 8; do [ "$k" -le "$gpus" ] && worlds="$worlds${worlds:+,}$k"; done
fi
k_timeout=180
for arg in "$@"; do  # the profile adds a few seconds per profiled case, compiling more
  case "$arg" in
    --profile|--profile-*) [ "$k_timeout" -lt 300 ] && k_timeout=300 ;;
    --compile) k_timeout=420 ;;
    --memory-bound|--memory-bound=*) bound=-bound ;;  # its own files: the default run's stay
    --pipelined|--pipelined=*) pipelined=-pipelined ;;
  esac
done
gpu=$slug  # the cost model's constants for this GPU, where it has them (cost_model.PRESETS)
preset=()
"$PY" -c "import sys; sys.path[:0] = ['benchmarks', '.']; from cost_model_lib import PRESETS; sys.exit(sys.argv[1] not in PRESETS)" "$gpu" \
  2>/dev/null && preset=(--gpu "$gpu")
slug=$slug${bound:-}${pipelined:-}
k_timeout=${K_TIMEOUT:-$k_timeout}
log=${LOG:-/tmp/scaling_${slug}.log}
: >"$log"

export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-5}
start=$SECONDS
status=0
for k in ${worlds//,/ }; do
  echo "=== K=$k ($((SECONDS - start)) s elapsed) ===" | tee -a "$log"
  timeout --kill-after=20 "$k_timeout" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$k" \
    benchmarks/bench_scaling.py --out "$OUT" --tag "$slug" --probe-seconds "${PROBE_SECONDS:-60}" \
    --seconds-per-measurement "${SECONDS_PER_MEASUREMENT:-2}" "${extra[@]}" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "K=$k failed (exit $rc); continuing" | tee -a "$log"
    status=1
  fi
done
echo "=== done in $((SECONDS - start)) s ===" | tee -a "$log"
shopt -s nullglob
jsons=("$OUT"/scaling_"${slug}"_x*.json)
if [ ${#jsons[@]} -gt 0 ]; then
  "$PY" benchmarks/plot_scaling.py "${jsons[@]}" --png "$OUT/scaling_${slug}.png" --md "$OUT/scaling_${slug}.md" 2>&1 | tee -a "$log"
  echo "--- cost model vs these measurements ---" | tee -a "$log"
  "$PY" benchmarks/cost_model.py "${preset[@]}" --validate "${jsons[@]}" 2>&1 | tail -n 40 | tee -a "$log"
fi
exit $status
