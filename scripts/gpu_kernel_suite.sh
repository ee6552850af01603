#!/usr/bin/env bash
# The block kernels on one GPU machine in one call: GPU tests, compute-sanitizer memcheck, benchmark.
#
#   bash scripts/gpu_kernel_suite.sh          # one H200 or H100; about 5.5 minutes
#
# Phase 1 (correctness, in parallel): pytest of the fused kernel (and its replays), the merges and combines, the
#   cuDNN and auto kernels, and CUDA-graph capture, on CUDA
#   (pytest-xdist workers), and memcheck on small fused + cuDNN cases (after a warm run that
#   fills Triton's cache).
# Phase 2 (alone on the GPU, so timings are clean): benchmarks/bench_kernel.py at its default
#   configuration (B=1 N=32768 H=16 D=128 bf16, LongNet w=2048..32768, r=1..16, causal and not),
#   the measured auto table, full attention vs cuDNN SDPA, extra table entries (D=64 bf16, D=128 fp16).
# With 2+ GPUs the phases overlap (bench on GPU 0, the rest on GPU 1).
# A failing or timed-out part never stops the others; each says so in the summary at the end.
# Writes 3 files to $OUT: suite.log (everything), kernel_<gpu>.json (results, markdown inside,
# auto table), kernel_<gpu>.png.
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the header above is the manual
  echo "usage: OUT=/tmp/out bash scripts/gpu_kernel_suite.sh"; sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T_TESTS=${T_TESTS:-240}     # pytest, all workers (an H100 with the sanitizer beside it needs more than 170 s)
T_SAN=${T_SAN:-140}         # warm run + memcheck
T_BENCH=${T_BENCH:-180}
WORKERS=${WORKERS:-8}
BENCH_ARGS=${BENCH_ARGS:---table-extra 64:bfloat16,128:float16}
LOG="$OUT/suite.log"
TMP=$(mktemp -d)
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

{
  stamp "environment"
  nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
  python3 -c "import xdist" 2>/dev/null && echo "pytest-xdist available" || echo "pytest-xdist missing: tests run in one process"
  python3 -c "import cudnn; print('cudnn frontend', cudnn.__version__)" 2>/dev/null || echo "cudnn frontend missing: cudnn-det not measured"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo "")
  echo "compute-sanitizer: ${CS:-not found}"
} > "$LOG" 2>&1
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo "")
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 1)
B_GPU=0
T_GPU=$(( GPUS > 1 ? 1 : 0 ))

run_tests() {
  local xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n $WORKERS"
  stamp "pytest (GPU $T_GPU)"
  CUDA_VISIBLE_DEVICES=$T_GPU OMP_NUM_THREADS=2 timeout -s INT -k 15 "$T_TESTS" python3 -m pytest -q -p no:cacheprovider $xdist \
    tests/kernels/test_fused.py tests/kernels/test_fused_replay.py tests/kernels/test_triton_launch.py tests/test_merge.py \
    tests/test_combine.py tests/kernels/test_cudnn.py tests/kernels/test_cudnn_frontend.py tests/kernels/test_auto.py \
    tests/kernels/test_cuda_graphs.py -rfE 2>&1 | tail -60
  echo "pytest exit ${PIPESTATUS[0]} (130 or 124 = timed out: the failures so far are listed above)"
}

run_sanitizer() {
  stamp "sanitizer (GPU $T_GPU)"
  if [ -z "$CS" ]; then echo "sanitizer exit skipped (compute-sanitizer not found)"; return; fi
  local t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$T_GPU timeout 100 python3 scripts/fused_sanitizer_cases.py --cudnn > "$TMP/warm.log" 2>&1
  echo "warm run exit $? ($(( $(date +%s) - t0 ))s)"; tail -3 "$TMP/warm.log"
  local what left rc
  for what in fused cudnn; do  # fused first: the kernels we own; then the cuDNN pattern kernel's calls
    left=$(( T_SAN - ($(date +%s) - t0) ))
    [ "$left" -lt 20 ] && left=20
    CUDA_VISIBLE_DEVICES=$T_GPU timeout "$left" "$CS" --tool memcheck --error-exitcode 9 --print-limit 20 \
      python3 scripts/fused_sanitizer_cases.py $([ $what = cudnn ] && echo --only-cudnn) > "$TMP/memcheck_$what.log" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|Invalid|FAILED|all sanitizer" "$TMP/memcheck_$what.log" | head -20
    echo "memcheck $what exit $rc (124 = timed out; 9 = errors found) after $(( $(date +%s) - t0 ))s"
  done
}

run_bench() {
  stamp "benchmark (GPU $B_GPU) $BENCH_ARGS"
  CUDA_VISIBLE_DEVICES=$B_GPU timeout "$T_BENCH" python3 benchmarks/bench_kernel.py --out "$OUT" --no-md $BENCH_ARGS \
    > "$TMP/bench.log" 2>&1
  echo "bench exit $? (124 = timed out: the JSON then holds the main part, 'complete': false)"
}

if [ "$GPUS" -gt 1 ]; then
  run_bench > "$TMP/bench_status.log" 2>&1 &
  BENCH_PID=$!
fi
run_tests > "$TMP/tests.log" 2>&1 &
TESTS_PID=$!
run_sanitizer > "$TMP/san.log" 2>&1
wait "$TESTS_PID"
if [ "$GPUS" -gt 1 ]; then wait "$BENCH_PID"; else run_bench > "$TMP/bench_status.log" 2>&1; fi

{
  echo; echo "======================== tests"; cat "$TMP/tests.log"
  echo; echo "======================== sanitizer"; cat "$TMP/san.log"
  echo; echo "======================== sanitizer warm run (full)"; cat "$TMP/warm.log" 2>/dev/null
  echo; echo "======================== memcheck fused (end)"; tail -60 "$TMP/memcheck_fused.log" 2>/dev/null
  echo; echo "======================== memcheck cudnn (end)"; tail -60 "$TMP/memcheck_cudnn.log" 2>/dev/null
  echo; echo "======================== benchmark"; cat "$TMP/bench_status.log"; cat "$TMP/bench.log"
} >> "$LOG" 2>&1

# compact summary (the reply carries the end of the output)
echo "################ summary ($(( $(date +%s) - START ))s, $GPUS GPU(s))"
grep -E "passed|failed|error" "$TMP/tests.log" | tail -3
grep -E "^FAILED|^ERROR" "$TMP/tests.log" | head -15
grep -E "exit" "$TMP/tests.log" "$TMP/san.log" "$TMP/bench_status.log" | sed "s#$TMP/##"
grep -E "ERROR SUMMARY" "$TMP/san.log"
python3 - "$OUT" <<'EOF'
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/kernel_*.json")
if not files:
    print("no benchmark JSON"); sys.exit()
r = json.load(open(files[0]))
print("bench complete:", r.get("complete"), "| gpu:", r["meta"]["gpu"], "| cudnn", r["meta"].get("cudnn"))
for causal, s in r["summary"].items():
    if causal in ("True", "False"):
        keys = ["library_fwd_bwd_vs_dense_cudnn", "library_auto_any_fwd_bwd_vs_dense_cudnn",
                "library_fused_fwd_bwd_vs_dense_cudnn", "library_fwd_vs_dense_cudnn", "library_auto_any_fwd_vs_dense_cudnn",
                "library_fwd_pipeline_over_kernels", "full_auto_fwd_bwd_vs_cudnn_sdpa", "full_auto_any_fwd_bwd_vs_cudnn_sdpa",
                "cudnn_fwd_extra_bytes_beyond_out_lse", "fused_fwd_extra_bytes_beyond_out_lse"]
        print(f"causal={causal}: " + ", ".join(f"{k}={s[k]:.3g}" for k in keys if k in s))
print("bwd reproducible:", r["summary"].get("bwd_reproducible"))
print("auto choices:", json.dumps(r["summary"].get("auto_choices")))
for row in r["rows"]:
    if row["kind"] in ("fwd kernel", "bwd kernel (+acc zero)", "fwd+bwd pipeline", "api fwd+bwd", "fwd+bwd kernel"):
        print(f"  {row['method']:10s} causal={row['causal']!s:5s} {row['kind']:22s} {row['ms']:8.3f} ms {row['tflops']:6.1f} TF/s")
    elif row["kind"] == "error":
        print(f"  {row['method']:10s} causal={row['causal']!s:5s} ERROR {row['error'][:150]}")
for row in r.get("full_attention", []):
    if row["kind"] != "error":
        print(f"  {row['method']:16s} causal={row['causal']!s:5s} {row['kind']:8s} {row['ms']:8.3f} ms {row['tflops']:6.1f} TF/s")
for name, d in r.get("rel_diff_vs_fused", {}).items():
    print("rel diff vs fused, causal", name, json.dumps(d))
EOF
rm -rf "$TMP"
