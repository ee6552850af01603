#!/usr/bin/env bash
# The debugging toolkit on a 1-8 GPU machine, in one call (< 6 minutes). Logs go to $OUT:
#   fuzz.log         scripts/fuzz.py on GPU 0 with the fused kernel (FUZZ_SECONDS, default 60), + its repro if any
#   sanitize.log     scripts/sanitize.py: memcheck + racecheck on the fused-kernel suite, initcheck + synccheck
#                    on a captured repro (GPU 1 when there is one, in parallel with the fuzzer); a debug-mode
#                    shadow check of the fused kernel
#   distributed.log  torchrun on all GPUs: diagnose.py ring --distributed (every installed backend), then the
#                    NCCL harness with every installed backend
# Usage (repo root):  OUT=/tmp/out bash scripts/gpu_diagnostics.sh
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the header above is the manual
  echo "usage: OUT=/tmp/out bash scripts/gpu_diagnostics.sh"; sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
if [ -d .whl ] && ! python3 -c "import deepspeed, fairscale" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl > /dev/null 2>&1
fi
export PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
SAN_GPU=$(( GPUS > 1 ? 1 : 0 ))
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/distributed.log" 2>&1

fuzz() {
  echo "=== fuzz: fused/auto/sdpa, bf16/fp16/fp32, ${FUZZ_SECONDS} s"
  CUDA_VISIBLE_DEVICES=0 timeout $(( FUZZ_SECONDS + 120 )) python3 scripts/fuzz.py --device cuda \
    --kernels fused,auto,sdpa --dtypes bfloat16,float16,float32 --seconds "$FUZZ_SECONDS" --seed 7 \
    --no-progress --out /tmp/fuzz_repro
  echo "fuzz exit $?"
  for f in /tmp/fuzz_repro/*; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done
  echo "=== fuzz: CPU reference/sdpa, 2000 cases (multi-rank cases on 4 gloo ranks)"
  CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 timeout 200 python3 scripts/fuzz.py --cases 2000 \
    --world-sizes 1,2,4 --seed 8 --no-progress --out /tmp/fuzz_repro_cpu
  echo "fuzz cpu exit $?"
}

sanitize() {
  export CUDA_VISIBLE_DEVICES=$SAN_GPU
  echo "=== warm the Triton cache"; timeout 150 python3 scripts/fused_sanitizer_cases.py | tail -2; echo "warm exit $?"
  echo "=== sanitize suite: memcheck, racecheck"
  timeout 330 python3 scripts/sanitize.py --tool memcheck --tool racecheck --timeout 150; echo "sanitize suite exit $?"
  echo "=== capture a fused repro, sanitize it: initcheck, synccheck"
  python3 - <<'PY'
import torch
from dilated_attention.diagnostics import repro
from dilated_attention.testing.compare import as_layout
g = torch.Generator().manual_seed(0)
q = as_layout(torch.randn(1, 256, 8, 64, generator=g), "transposed").to("cuda", torch.bfloat16)
k = as_layout(torch.randn(1, 256, 2, 64, generator=g), "head_slice").to("cuda", torch.bfloat16)
print(repro.capture(q, k, k, [64, 128, 256], [1, 2, 4], causal=True, kernel="fused", path="/tmp/fused_repro.json"))
PY
  timeout 200 python3 scripts/sanitize.py --repro /tmp/fused_repro.json --tool initcheck --tool synccheck --timeout 90
  echo "sanitize repro exit $?"
  echo "=== debug mode: fused kernel shadow-checked against the reference on every call"
  timeout 120 python3 - <<'PY'
import torch
from dilated_attention.diagnostics import debug
from dilated_attention.kernels.fused import FusedKernel
from dilated_attention.patterns import plan_patterns
from dilated_attention.testing.compare import as_layout
calls = 0
with debug.debug(shadow=1.0):
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for causal in (False, True):
            n, h, hk, d = 512, 8, 2, 64
            q = as_layout(torch.randn(2, n, h, d), "transposed").to("cuda", dt)
            k = as_layout(torch.randn(2, n, hk, d), "head_slice").to("cuda", dt)
            v = torch.randn(2, n, hk, d, device="cuda", dtype=dt)
            kern = debug.wrap_kernel(FusedKernel(), {"rank": 0})
            for plan in plan_patterns([128, 256, 512], [1, 2, 4], seq_len=n, local_len=n, num_heads=h, num_kv_heads=hk):
                out, lse = kern.forward_pattern(q, k, v, plan, packed=False, causal=causal, scale=d ** -0.5)
                full, lse_full = torch.randn(q.shape, device="cuda", dtype=dt), torch.randn(q.shape[:3], device="cuda") + 5
                accs = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
                kern.backward_pattern(q, k, v, plan, full, lse_full, torch.randn_like(full), *accs, packed=False,
                                      causal=causal, scale=d ** -0.5)
                calls += 2
print(f"debug mode: {calls} fused calls validated, synchronised and shadow-checked: ok")
PY
  echo "debug exit $?"
}

if [ "$GPUS" -gt 1 ]; then
  fuzz > "$OUT/fuzz.log" 2>&1 &
  FUZZ_PID=$!
  sanitize > "$OUT/sanitize.log" 2>&1
  wait $FUZZ_PID
else
  fuzz > "$OUT/fuzz.log" 2>&1
  sanitize > "$OUT/sanitize.log" 2>&1
fi

{
  unset CUDA_VISIBLE_DEVICES
  echo "=== diagnose.py ring --distributed on $GPUS GPUs"
  timeout 180 torchrun --standalone --nproc_per_node="$GPUS" scripts/diagnose.py ring --distributed --timeout 30 \
    2>&1 | grep -v -E "Warning|warn\(|^\s*$"
  echo "ring --distributed exit ${PIPESTATUS[0]}"
  BACKENDS="--backend collective"
  python3 -c "import fairscale" 2>/dev/null && BACKENDS="$BACKENDS --backend fairscale"
  python3 -c "import deepspeed" 2>/dev/null && BACKENDS="$BACKENDS --backend deepspeed"
  echo "=== harness under torchrun ($BACKENDS)"
  timeout 240 torchrun --standalone --nproc_per_node="$GPUS" -m dilated_attention.testing.harness $BACKENDS \
    2>&1 | grep -E "FAIL|passed|failed|Error" | tail -40
  echo "harness exit ${PIPESTATUS[0]}"
} >> "$OUT/distributed.log" 2>&1

echo "############ summary"
grep -E "cases|FINDING|no finding|exit" "$OUT/fuzz.log"
grep -E "^== |finding|x |SUMMARY|exit|debug mode|cannot" "$OUT/sanitize.log" | head -40
grep -E "FAIL|SLOW|GB/s|healthy|passed|failed|exit" "$OUT/distributed.log" | tail -40
