#!/usr/bin/env bash
# flashoptim lean tile math (v4 LEAN) check on one H200, run from the repo root:
#   bash packages/flashoptim/scripts/gpu_check_lean.sh OUTDIR
# 1. GPU tests of tests/test_lean.py (lean vs default tile math, bitwise on the GPU: bf16
#    AdamW/Adam/SGD/Lion incl. a skipped step; fp16/fp32; int16 corrections, fp32 scales,
#    no SR, no master, fp32 states; every other tuning config), in two pytest processes at
#    once (Triton compiles are the cost)                                   <= 55 s
# 2. ONE process, old vs new interleaved, 537M params (8 x 8192^2 bf16): AdamW without and
#    with the finiteness check, SGD momentum, Lion; median of 30 CUDA-event steps each,
#    ms and fraction of the 4.21 TB/s ceiling; the single default config (BLOCK 1024,
#    4 warps, PF 2: FLASHOPTIM_NO_AUTOTUNE=1, so both sides run the same config and the
#    tuner's 40 compiles are skipped); OUTDIR/lean_bench.{json,txt}           <= 60 s
set -uo pipefail
out="${1:?usage: gpu_check_lean.sh OUTDIR}"
mkdir -p "$out"
export PYTHONPATH=packages/flashoptim/src PYTHONUNBUFFERED=1
t0=$SECONDS
ts() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/log.txt"; }
timeout 20 python3 -c "import flashoptim, torch, triton; print('ours:', flashoptim.__file__, torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$out/log.txt"
ts "gpu tests"
T=packages/flashoptim/tests/test_lean.py
PT="python3 -m pytest -v -rfE -p no:cacheprovider -c pyproject.toml --rootdir . -m gpu"
timeout -k 3 55 $PT "$T" -k "test_gpu_lean_equals_default and not options" >"$out/tests-a.txt" 2>&1 &
pa=$!
timeout -k 3 55 $PT "$T" -k "options or other_dtypes or every_config" >"$out/tests-b.txt" 2>&1 &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
ts "gpu tests rc=$ra,$rb | $(tail -1 "$out/tests-a.txt") | $(tail -1 "$out/tests-b.txt")"
ts "bench"
FLASHOPTIM_NO_AUTOTUNE=1 timeout -k 3 60 python3 packages/flashoptim/scripts/lean_bench.py "$out" \
  --reps 30 >"$out/bench.txt" 2>&1
ts "bench rc=$?"
cat "$out/bench.txt"
grep -hE "PASSED|FAILED|ERROR|passed|failed" "$out/tests-a.txt" "$out/tests-b.txt" | tail -30; true
