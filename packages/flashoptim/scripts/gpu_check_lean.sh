#!/usr/bin/env bash
# flashoptim lean tile math (v4 LEAN) check on one H200, run from the repo root:
#   bash packages/flashoptim/scripts/gpu_check_lean.sh OUTDIR
# 1. GPU tests of tests/test_lean.py (lean vs default tile math, bitwise on the GPU: bf16
#    AdamW/Adam/SGD/Lion incl. a skipped step; fp16/fp32; int16 corrections, fp32 scales,
#    no SR, no master, fp32 states; every other tuning config; unaligned gradient
#    views), in four pytest processes at once (Triton compiles are the cost)    <= 52 s
# 2. ONE process, old vs new interleaved, 537M params (8 x 8192^2 bf16): AdamW without and
#    with the finiteness check, SGD momentum, Lion; median of 30 CUDA-event steps each,
#    ms and fraction of the 4.21 TB/s ceiling; the single default config (BLOCK 1024,
#    4 warps, PF 2: FLASHOPTIM_NO_AUTOTUNE=1, so both sides run the same config and the
#    tuner's 40 compiles are skipped); OUTDIR/lean_bench.{json,txt}           <= 57 s
# 3. if time is left (total <= 120 s): AdamW without / with the check at BLOCK 2048 on
#    4 warps, PF 1 (16 elements per thread: the lean tile loop is 68.9 SASS/elem there
#    against 73.0 at BLOCK 1024, 80 registers), old vs new; lean_bench_b2048.{json,txt}
set -uo pipefail
out="${1:?usage: gpu_check_lean.sh OUTDIR}"
mkdir -p "$out"
export PYTHONPATH=packages/flashoptim/src PYTHONUNBUFFERED=1
t0=$SECONDS
ts() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/log.txt"; }
timeout 10 python3 -c "import flashoptim, torch, triton; print('ours:', flashoptim.__file__, torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$out/log.txt"
ts "gpu tests"
T=packages/flashoptim/tests/test_lean.py
PT="python3 -m pytest -v -rfE -p no:cacheprovider -c pyproject.toml --rootdir . -m gpu"
# four processes (most important first): bf16 per optimizer; storage options; fp16/fp32
# and unaligned gradients; the other tuning configs
pids=""
n=0
for k in "test_gpu_lean_equals_default and not options" "options" "other_dtypes or unaligned" "every_config"; do
  n=$((n + 1))
  timeout -k 2 50 $PT "$T" -k "$k" >"$out/tests-$n.txt" 2>&1 &
  pids="$pids $!"
done
rcs=""
for p in $pids; do wait "$p"; rcs="$rcs $?"; done
ts "gpu tests rc=$rcs"
for f in "$out"/tests-?.txt; do ts "  $(basename "$f"): $(tail -1 "$f")"; done
ts "bench"
FLASHOPTIM_NO_AUTOTUNE=1 timeout -k 2 55 python3 packages/flashoptim/scripts/lean_bench.py "$out" \
  --reps 30 >"$out/bench.txt" 2>&1
ts "bench rc=$?"
left=$((118 - SECONDS + t0))
if [ "$left" -gt 12 ]; then
  FLASHOPTIM_NO_AUTOTUNE=1 timeout -k 2 "$left" python3 packages/flashoptim/scripts/lean_bench.py \
    "$out" --reps 20 --rows adamw_nocheck,adamw --config 2048,0,1,4 --tag _b2048 \
    >"$out/bench-b2048.txt" 2>&1
  ts "bench BLOCK 2048 / 4 warps rc=$?"
fi
cat "$out/bench.txt" "$out/bench-b2048.txt" 2>/dev/null
grep -hE "PASSED|FAILED|ERROR|passed|failed" "$out"/tests-?.txt | tail -30; true
