#!/usr/bin/env bash
# One GPU call for flashsinkhorn with per-step time limits (the H200 host, no network):
#   bash packages/flashsinkhorn/scripts/gpu.sh OUTDIR [TEST_LIMIT_S] [BENCH_LIMIT_S]
# Installs the carried peer wheels (.whl/), runs the gpu-marked tests (one kernel config:
# FLASHSINKHORN_NO_AUTOTUNE=1), then the benchmark GPU suite (autotuned), writing
# OUTDIR/{env.txt,tests.txt,bench.txt,bench-flashsinkhorn.json,summary.md}.
# Env: GPU_TEST_PATH (default the tests folder), GPU_TEST_K (pytest -k), BENCH_ARGS.
set -uo pipefail
out="${1:?usage: gpu.sh OUTDIR}"; tl="${2:-110}"; bl="${3:-200}"
root="$(cd "$(dirname "$0")/../../.." && pwd)"; cd "$root"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site --upgrade \
    .whl/geomloss*.whl .whl/flash_sinkhorn*.whl >/dev/null 2>&1 || echo "peer install failed"
fi
export PYTHONPATH="$root/packages/flashsinkhorn/src:$root/.site${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__)"
} >"$out/env.txt" 2>&1
t0=$SECONDS
FLASHSINKHORN_NO_AUTOTUNE=1 timeout "$tl" python3 -m pytest -q -m gpu -p no:cacheprovider \
  -c pyproject.toml --rootdir . --durations=15 --tb=short -k "${GPU_TEST_K:-}" \
  ${GPU_TEST_PATH:-packages/flashsinkhorn/tests} >"$out/tests.txt" 2>&1
echo "tests rc=$? in $((SECONDS - t0)) s" | tee -a "$out/tests.txt"
t0=$SECONDS
TRITON_PRINT_AUTOTUNING=1 timeout "$bl" python3 -m flashsinkhorn.bench --json "$out/bench-flashsinkhorn.json" ${BENCH_ARGS:-} \
  >"$out/bench.txt" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s" | tee -a "$out/bench.txt"
python3 tools/report.py --stdout "$out/bench-flashsinkhorn.json" >"$out/summary.md" 2>&1
tail -5 "$out/tests.txt"; tail -40 "$out/bench.txt"
