#!/usr/bin/env bash
# One GPU call for flashoptim on the H200 host (no network, no hatchling):
#   bash packages/flashoptim/gpu_run.sh OUTDIR
# Installs the peers from .whl/ and .whl-bnb/ into .site-flashoptim (ours stays FIRST on
# PYTHONPATH; the peer flashoptim 0.1.4 is loaded by path as flashoptim_peer), then runs the
# GPU tests, the benchmark suite, a block-size sweep and the training-parity run.
set -uo pipefail
out="${1:?usage: gpu_run.sh OUTDIR}"
mkdir -p "$out"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
site="$root/.site-flashoptim"
t0=$SECONDS
ts() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/log.txt"; }
whls=$(ls .whl/flashoptim-*.whl .whl/torchao-*.whl .whl-bnb/bitsandbytes-*.whl 2>/dev/null)
[ -n "$whls" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
  $whls >>"$out/log.txt" 2>&1
export PYTHONPATH="$root/packages/flashoptim/src:$site"
export PYTHONUNBUFFERED=1
python3 -c "import flashoptim, torch, triton; print('ours:', flashoptim.__file__, torch.__version__, triton.__version__)" | tee -a "$out/log.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$out/log.txt" 2>&1
ts "bench"
timeout "${FO_BENCH_TIMEOUT:-150}" python3 -m flashoptim.bench --json "$out/bench-flashoptim.json" \
  --peer-flashoptim-path "$site" ${FO_BENCH_ARGS:-} >"$out/bench.txt" 2>&1
ts "bench rc=$?"
# @gpu tests first (kernel v1 and v2 vs the CPU path on large and 2,050-tensor layouts, v2
# autotuning applies the step once, measured memory, FSDP2), then the interpreter-style
# kernel tests on CUDA (both kernels) and the lost-update test.
ts "gpu tests"
timeout "${FO_GPU_TEST_TIMEOUT:-120}" python3 -m pytest -q -rfE -p no:cacheprovider -c pyproject.toml --rootdir . -s \
  -m gpu packages/flashoptim/tests/test_kernels.py packages/flashoptim/tests/test_gpu.py \
  >"$out/tests-gpu.txt" 2>&1
ts "gpu tests rc=$? $(tail -1 "$out/tests-gpu.txt")"
timeout "${FO_TEST_TIMEOUT:-150}" python3 -m pytest -q -rfE -p no:cacheprovider -c pyproject.toml --rootdir . -s \
  -m "not gpu" packages/flashoptim/tests/test_kernels.py \
  "packages/flashoptim/tests/test_optimizers.py::test_lost_update" >"$out/tests.txt" 2>&1
ts "tests rc=$? $(tail -1 "$out/tests.txt")"
for cfg in ${FO_SWEEP:-}; do  # v1 BLOCK,WARPS pairs, e.g. FO_SWEEP="1024,4 2048,8" (v2 autotunes)
  set -- ${cfg/,/ }
  echo "## BLOCK=$1 NUM_WARPS=$2" >>"$out/sweep.txt"
  FLASHOPTIM_BLOCK=$1 FLASHOPTIM_NUM_WARPS=$2 timeout 30 python3 -m flashoptim.bench --layout large \
    --providers ours_nocheck,ours_sgd --reps 10 >>"$out/sweep.txt" 2>&1
done
ts "sweep done"
[ "${FO_SKIP_PARITY:-0}" = 1 ] || timeout "${FO_PARITY_TIMEOUT:-170}" python3 -m flashoptim.parity --out "$out" ${FO_PARITY_ARGS:-} \
  >"$out/parity.txt" 2>&1
ts "parity rc=$?"
grep "v2 config" "$out/bench.txt"; tail -28 "$out/bench.txt"
grep -E "^\||##" "$out/sweep.txt" 2>/dev/null; tail -3 "$out/tests-gpu.txt" "$out/tests.txt"
grep -E "seed" "$out/parity.txt" 2>/dev/null; true
