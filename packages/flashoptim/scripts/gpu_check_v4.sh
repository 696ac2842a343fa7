#!/usr/bin/env bash
# flashoptim kernel v4 check on one H200, run from the repo root:
#   bash packages/flashoptim/scripts/gpu_check_v4.sh OUTDIR
# 1. every GPU-marked test of the suite except the slow v1 ones (-m gpu -k "not v1"), v4's
#    first (v4 vs v3 bitwise on the GPU with every tuning config, then the kernels, the
#    2,050-tensor comparison, memory, FSDP2, CUDA graph)                      <= 150 s
# 2. bench in ONE process, old default (v3 = "ours*") against v4 ("ours_v4*"): 8 x 8192^2
#    bf16 (537M) AdamW without / with the finiteness check, SGD momentum, Lion; then the
#    same rows on 2,050 tensors (54.6M); CUDA-event medians of 20 steps, JSON   <= 120 s
# 3. the finiteness pre-pass alone, v3 vs v4, if time is left (total <= 295 s)
# Each step is one python process; the JSON is rewritten after every bench row.
set -uo pipefail
out="${1:?usage: gpu_check_v4.sh OUTDIR}"
mkdir -p "$out"
export PYTHONPATH=packages/flashoptim/src PYTHONUNBUFFERED=1
t0=$SECONDS
ts() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/log.txt"; }
python3 -c "import flashoptim, torch, triton; print('ours:', flashoptim.__file__, torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$out/log.txt"
ts "gpu tests"
# every test file, v4's and the kernel comparisons first (pytest keeps the order of files
# named one by one; a directory argument would be collected in name order)
T=packages/flashoptim/tests
files="$T/test_v4.py $T/test_kernels.py $T/test_gpu.py"
for f in "$T"/test_*.py; do case " $files " in *" $f "*) ;; *) files="$files $f" ;; esac; done
timeout -k 5 150 python3 -m pytest -v -rfE -p no:cacheprovider -c pyproject.toml --rootdir . \
  -m gpu -k "not v1" $files >"$out/tests-gpu.txt" 2>&1
ts "gpu tests rc=$? $(tail -1 "$out/tests-gpu.txt")"
ts "bench"
timeout -k 5 120 python3 -m flashoptim.bench --layout large --layout small --reps 20 \
  --json "$out/bench-v4.json" \
  --providers ours_nocheck,ours_v4_nocheck,ours,ours_v4,ours_v4_lazy,ours_sgd,ours_v4_sgd,ours_lion,ours_v4_lion \
  >"$out/bench.txt" 2>&1
ts "bench rc=$?"
left=$((295 - SECONDS))
if [ "$left" -gt 15 ]; then
  FLASHOPTIM_NO_AUTOTUNE=1 timeout -k 3 "$left" python3 packages/flashoptim/scripts/prepass_bench.py \
    "$out/prepass.json" v3,v4 \
    >"$out/prepass.txt" 2>&1
  ts "prepass rc=$?"
fi
grep -E "config|error" "$out/bench.txt"; grep -E "^\|" "$out/bench.txt"; cat "$out/prepass.txt" 2>/dev/null
grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/tests-gpu.txt" | tail -40; true
