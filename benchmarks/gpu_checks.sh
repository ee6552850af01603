#!/usr/bin/env bash
# A 2-GPU machine in one call: kernel benchmark (GPU 0) + kernel diagnostics (GPU 1), then the
# NCCL harness, the demo with every backend, and the ring benchmark with the fused kernel, causal
# and not. Installs the wheels in build/whl (fairscale, deepspeed and the deepspeed dependencies
# an image may lack) first. Results and logs go to $OUT (default /tmp/out).
#
#   OUT=/tmp/out bash benchmarks/gpu_checks.sh
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the header above is the manual
  echo "usage: OUT=/tmp/out bash benchmarks/gpu_checks.sh"; sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site build/whl/*.whl
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=8
log="$OUT/checks.log"
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$log" 2>&1
( CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_kernel.py --out "$OUT" --methods fused,sdpa-flash,sdpa-cudnn > "$OUT/bench_kernel.log" 2>&1; echo "bench_kernel exit $?" >> "$OUT/bench_kernel.log" ) &
bench=$!
{ echo "=== diagnose kernels bf16 (GPU 1)"; CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/diagnose.py kernels --device cuda --dtype bfloat16 --seq-len 1024 --head-dim 128; echo "exit $?"
  echo "=== diagnose views"; CUDA_VISIBLE_DEVICES=1 python3 scripts/diagnose.py views --device cuda; echo "exit $?"; } >> "$log" 2>&1
wait $bench
run() { echo "=== $*"; timeout 240 "$@" 2>&1 | grep -v -E "FutureWarning|return func|UserWarning"; echo "exit ${PIPESTATUS[0]}"; }
{ run torchrun --standalone --nproc_per_node=2 -m dilated_attention.testing.harness --backend collective
  run torchrun --standalone --nproc_per_node=2 launch/demo.py --heads 16 --head-dim 128 --iters 5
  run torchrun --standalone --nproc_per_node=2 launch/demo.py --heads 16 --head-dim 128 --iters 5 --causal --kernel sdpa
  run torchrun --standalone --nproc_per_node=2 benchmarks/bench_ring.py --kernel fused --out "$OUT" --iters 10
  run torchrun --standalone --nproc_per_node=2 benchmarks/bench_ring.py --kernel fused --causal --out "$OUT" --iters 10
} >> "$log" 2>&1
tail -40 "$OUT/bench_kernel.log"; grep -E "passed|exit|ok|FAIL|match|│" "$log" | tail -60
