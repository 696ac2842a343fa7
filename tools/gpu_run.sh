#!/usr/bin/env bash
# The one command for a CUDA host without network or nox (the H200 host).
#
#   tools/gpu_run.sh OUTDIR [PACKAGE ...]      (default: all three packages)
#
# Installs peer wheels carried in .whl/ and .whl-bnb/ (if present), builds mhc-proj,
# puts the pure-Python packages on PYTHONPATH, runs each package's gpu-marked tests and
# its benchmark CLI's GPU suite, and writes into OUTDIR:
#   log.txt                 everything printed
#   bench-<package>.json    benchmark results (shared schema kernel-bench/1)
#   env.json                GPU, driver and library versions
#   summary.md              pass/fail per step and the benchmark tables (printed last)
# Extra pytest args: GPU_PYTEST_ARGS; extra bench args per package: BENCH_ARGS_<pkg>
# (e.g. BENCH_ARGS_flashsinkhorn="--quick"). Set GPU_SKIP_TESTS=1 / GPU_SKIP_BENCH=1.
# Time limits in seconds per step (a step past its limit is killed and marked FAILED, and
# the run goes on): LIMIT_TESTS_<pkg>, LIMIT_BENCH_<pkg> (default 300 each), with <pkg>
# the import name (flashsinkhorn, mhc_proj, flashoptim); LIMIT_SECOND_ORDER (default 240)
# for flashsinkhorn's second-order GPU script (SECOND_ORDER_ARGS, GPU_SKIP_SECOND_ORDER=1).
set -uo pipefail
out="${1:?usage: tools/gpu_run.sh OUTDIR [PACKAGE ...]}"; shift
mkdir -p "$out"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
packages=("$@")
[ ${#packages[@]} -eq 0 ] && packages=(mhc-proj flashsinkhorn flashoptim)
log="$out/log.txt"; summary="$out/summary.md"
: >"$log"; : >"$summary"
export PYTHONUNBUFFERED=1
say() { echo "$*" | tee -a "$log"; }
step() {  # step NAME LIMIT_S CMD...: run under a time limit, log, record in the summary
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  say "=== $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local status="ok"; [ $rc -ne 0 ] && status="FAILED (rc=$rc)"
  say "=== $name: $status in $((SECONDS - t0)) s"
  echo "| $name | $status | $((SECONDS - t0)) s |" >>"$summary.steps"
  return $rc
}
: >"$summary.steps"

site="$root/.site"
for wheels in .whl .whl-bnb; do
  if compgen -G "$wheels/*.whl" >/dev/null; then
    step "install peers from $wheels" 120 python3 -m pip install -q --no-index --no-deps \
      --no-compile --target "$site" --upgrade "$wheels"/*.whl
  fi
done
export PYTHONPATH="$root/packages/flashsinkhorn/src:$root/packages/flashoptim/src:$site${PYTHONPATH:+:$PYTHONPATH}"

python3 - >"$out/env.json" 2>>"$log" <<'PY'
import json, platform, subprocess, datetime
import torch
env = {"python": platform.python_version(), "torch": torch.__version__,
       "cuda": torch.version.cuda, "date": datetime.datetime.utcnow().isoformat() + "Z"}
try:
    import triton; env["triton"] = triton.__version__
except Exception as e:
    env["triton"] = repr(e)
if torch.cuda.is_available():
    env["gpu"] = torch.cuda.get_device_name(0)
    env["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
try:
    env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except Exception:
    pass
print(json.dumps(env, indent=1))
PY
cat "$out/env.json" | tee -a "$log"

for pkg in "${packages[@]}"; do
  import_name="${pkg//-/_}"
  if [ "$pkg" = mhc-proj ]; then
    step "build mhc-proj" 300 python3 -m pip install -q --no-build-isolation --no-deps \
      --target "$site" --upgrade packages/mhc-proj || continue
  fi
  limit_tests="LIMIT_TESTS_${import_name}"; limit_bench="LIMIT_BENCH_${import_name}"
  if [ "${GPU_SKIP_TESTS:-0}" != 1 ]; then
    step "gpu tests $pkg" "${!limit_tests:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      -c pyproject.toml --rootdir . packages/$pkg/tests ${GPU_PYTEST_ARGS:-}
  fi
  if [ "${GPU_SKIP_BENCH:-0}" != 1 ]; then
    var="BENCH_ARGS_${import_name}"
    step "bench $pkg" "${!limit_bench:-300}" python3 -m "$import_name.bench" --json "$out/bench-$pkg.json" ${!var:-}
  fi
  # flashsinkhorn's second-order applications (HVP vs flash-sinkhorn, OTDD at 60k, shuffled
  # regression) write their own JSON and figures into OUTDIR/second-order.
  if [ "$pkg" = flashsinkhorn ] && [ "${GPU_SKIP_SECOND_ORDER:-0}" != 1 ] \
     && [ -f packages/flashsinkhorn/examples/gpu_second_order.py ]; then
    step "second-order flashsinkhorn" "${LIMIT_SECOND_ORDER:-240}" python3 \
      packages/flashsinkhorn/examples/gpu_second_order.py --out "$out/second-order" ${SECOND_ORDER_ARGS:-}
  fi
done

{
  echo "# GPU run summary"
  echo
  echo "| step | status | time |"
  echo "|---|---|---|"
  cat "$summary.steps"
  echo
  if compgen -G "$out/bench-*.json" >/dev/null; then
    python3 tools/report.py --stdout "$out"/bench-*.json 2>&1 || true
  fi
} >"$summary"
rm -f "$summary.steps"
cat "$summary"
