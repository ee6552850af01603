#!/usr/bin/env bash
# One device call for the fused kernel: GPU tests, compute-sanitizer, benchmark.
#   GPU1: pytest tests/test_fused.py (4 shards in parallel) then memcheck + racecheck
#   GPU0: benchmarks/bench_kernel.py (alone on its GPU, so timings are clean)
# Everything lands in $OUT (tests.log, sanitizer.log, bench.log, kernel_<gpu>.{json,md,png}).
# Needs: PYTHONPATH with the repo (and .carry_fused for pytest/einops if missing there).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.:${PWD}/.carry_fused PYTHONUNBUFFERED=1
BENCH_ARGS=${BENCH_ARGS:-}
T_TESTS=${T_TESTS:-240}
T_SAN=${T_SAN:-150}
T_BENCH=${T_BENCH:-330}
GPUS=$(python3 -c "import torch;print(torch.cuda.device_count())")
B_GPU=0; T_GPU=$(( GPUS > 1 ? 1 : 0 ))
{
  nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  which compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer
} 2>&1 | tee "$OUT/tests.log"

# benchmark on its own GPU, started first
( CUDA_VISIBLE_DEVICES=$B_GPU timeout $T_BENCH python3 benchmarks/bench_kernel.py --out "$OUT" $BENCH_ARGS > "$OUT/bench.log" 2>&1; echo "bench exit $?" >> "$OUT/bench.log" ) &
BENCH_PID=$!

# tests: 4 shards on the other GPU
for shard in "forward_backward and float32" "forward_backward and float16 and not bfloat16" "forward_backward and bfloat16" "not forward_backward"; do
  ( OMP_NUM_THREADS=6 CUDA_VISIBLE_DEVICES=$T_GPU timeout $T_TESTS python3 -m pytest tests/test_fused.py -q -p no:cacheprovider -k "$shard" > "/tmp/shard_${shard// /_}.log" 2>&1; echo "shard '$shard' exit $?" >> "/tmp/shard_${shard// /_}.log" ) &
done
wait $(jobs -p | grep -v "^$BENCH_PID$") 2>/dev/null
for f in /tmp/shard_*.log; do echo "=== $f"; cat "$f"; done >> "$OUT/tests.log"

# sanitizer: warm the Triton cache first, then memcheck and racecheck (SAN=0 skips)
if [ "${SAN:-1}" = "1" ]; then
CS=$(which compute-sanitizer 2>/dev/null || echo /usr/local/cuda/bin/compute-sanitizer)
{
  echo "=== warm run"; CUDA_VISIBLE_DEVICES=$T_GPU timeout 120 python3 scripts/fused_sanitizer_cases.py; echo "warm exit $?"
  for tool in memcheck racecheck; do
    echo "=== $tool"; CUDA_VISIBLE_DEVICES=$T_GPU timeout $T_SAN "$CS" --tool $tool --error-exitcode 9 --print-limit 20 python3 scripts/fused_sanitizer_cases.py; echo "$tool exit $?"
  done
} > "$OUT/sanitizer.log" 2>&1
fi
wait $BENCH_PID
echo "############ summary"
grep -E "passed|failed|error|exit" "$OUT/tests.log" | tail -20
[ -f "$OUT/sanitizer.log" ] && grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit|FAILED|all sanitizer" "$OUT/sanitizer.log"
tail -45 "$OUT/bench.log"
