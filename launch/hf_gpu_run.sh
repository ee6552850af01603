#!/usr/bin/env bash
# The Hugging Face example on GPUs: one GPU (dilated vs transformers' sdpa, bf16), all local GPUs
# under torchrun/NCCL (sequence parallel: the same global length, and a length that grows with the
# GPUs), and fp32 losses of one GPU vs all GPUs (must agree). Needs >= 2 GPUs for the parallel part.
#
#   OUT=/tmp/hf bash launch/hf_gpu_run.sh     # writes $OUT/hf_gpu.log and $OUT/hf_gpu_summary.txt
#
# Offline machines: a tested transformers (5.23-5.24) and its dependencies install from .whl-hf/
# (pip download 'transformers>=5.23,<5.25' --python-version 3.12 --only-binary=:all: -d .whl-hf),
# einops from .whl/.
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the header above is the manual
  echo "usage: OUT=/tmp/hf bash launch/hf_gpu_run.sh"; sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hf_gpu}
mkdir -p "$OUT"
LOG=$OUT/hf_gpu.log
SUMMARY=$OUT/hf_gpu_summary.txt
: >"$LOG"
export PYTHONPATH=/tmp/site_hf:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python -c "import einops" 2>/dev/null || pip install -q --no-deps --target /tmp/site .whl/einops*.whl >>"$LOG" 2>&1
python -c "import transformers, sys; sys.exit(not transformers.__version__.startswith(('5.23.', '5.24.')))" 2>/dev/null ||
  pip install -q --no-index --find-links .whl-hf --target /tmp/site_hf 'transformers>=5.23,<5.25' >>"$LOG" 2>&1
python -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" | tee -a "$LOG"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
export OMP_NUM_THREADS=4

run() {  # run <label> <command...>: log everything, keep the "done:" line
  echo "### $1: ${*:2}" >>"$LOG"
  local out
  out=$(timeout 240 "${@:2}" 2>&1)
  local rc=$?
  echo "$out" >>"$LOG"
  local done_line
  done_line=$(echo "$out" | grep "\[hf_llama\] done:" | tail -1)
  echo "$1 (rc=$rc): ${done_line:-no result, see hf_gpu.log}" | tee -a "$SUMMARY"
}

: >"$SUMMARY"
BIG="--device cuda --dtype bf16 --steps 8 --batch 1 --vocab 32000 --hidden 1024 --heads 16 --kv-heads 4 --layers 4"
run "1 GPU, dilated, N=32768" python launch/hf_llama_train.py $BIG --seq-len 32768 --segments 2048,8192,32768 --rates 1,2,4
run "1 GPU, sdpa (dense causal), N=32768" python launch/hf_llama_train.py $BIG --seq-len 32768 --attn sdpa
if [ "$NGPU" -ge 2 ]; then
  TR="torchrun --standalone --nproc_per_node=$NGPU"
  run "$NGPU GPUs, dilated SP, N=32768" $TR launch/hf_llama_train.py $BIG --seq-len 32768 --segments 2048,8192,32768 --rates 1,2,4
  S=$((32768 * NGPU))
  run "$NGPU GPUs, dilated SP, N=$S" $TR launch/hf_llama_train.py $BIG --seq-len $S --segments 2048,8192,$S --rates 1,2,4
  # fp32: one GPU and all GPUs must give the same losses, step for step
  SMALL="--device cuda --dtype fp32 --steps 5 --seq-len 4096 --segments 512,4096 --rates 1,2"
  python launch/hf_llama_train.py $SMALL >"$OUT/one.txt" 2>&1
  $TR launch/hf_llama_train.py $SMALL >"$OUT/many.txt" 2>&1
  cat "$OUT/one.txt" "$OUT/many.txt" >>"$LOG"
  python - "$OUT/one.txt" "$OUT/many.txt" <<'EOF' | tee -a "$SUMMARY"
import re, sys
one, many = ([float(x) for x in re.findall(r"step \d+/\d+  loss (\S+)", open(p).read())] for p in sys.argv[1:])
ok = len(one) == len(many) == 5 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(many, one))
print(f"fp32 losses, 1 GPU {one} vs all GPUs {many}: {'MATCH' if ok else 'MISMATCH'}")
EOF
  rm -f "$OUT/one.txt" "$OUT/many.txt"
fi
echo "--- summary ($SUMMARY)"
cat "$SUMMARY"
