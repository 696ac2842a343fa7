#!/usr/bin/env bash
# The one command for a CUDA host without network or nox (the H200 host).
#
#   tools/gpu_run.sh OUTDIR [PACKAGE ...]      (default: all three packages)
#
# 1. installs the peer wheels carried in .whl/ and .whl-bnb/ (if present) into .site/;
# 2. builds mhc-proj (while the pure-Python packages' GPU tests already run);
# 3. runs every package's @pytest.mark.gpu tests, the packages side by side, each spread
#    over GPU_TEST_WORKERS processes (pytest-xdist, if installed): the suites are
#    compile-bound, and the host has 16 cores;
# 4. runs each package's benchmark CLI's GPU suite, one after another (nothing else runs
#    on the GPU while they time), and any extra script named in GPU_EXTRA (each a
#    "name|limit|command" entry, separated by ';', run after the benchmarks);
# and writes into OUTDIR:
#   log.txt                 everything printed (per-step logs: tests-<pkg>.txt, ...)
#   bench-<package>.json    benchmark results (schema kernel-bench/1)
#   env.json                GPU, driver and library versions
#   summary.md              pass/fail and time per step, then the tables (printed last)
# Limits in seconds per step (a step past its limit gets SIGINT, then SIGKILL 20 s later, is
# marked TIMED OUT, and the run goes on; pytest prints the failures it has so far):
# LIMIT_BUILD (300), LIMIT_TESTS (240, each package), LIMIT_BENCH_<pkg> (150), with <pkg>
# the import name. GPU_PYTEST_ARGS: extra pytest args; BENCH_ARGS_<pkg>: extra
# bench args; GPU_SKIP_TESTS=1 / GPU_SKIP_BENCH=1 skip a phase; GPU_BENCH_PACKAGES (space
# separated) limits the benchmarks to those packages.
set -uo pipefail
out="${1:?usage: tools/gpu_run.sh OUTDIR [PACKAGE ...]}"; shift
mkdir -p "$out"; out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
packages=("$@")
[ ${#packages[@]} -eq 0 ] && packages=(mhc-proj flashsinkhorn flashoptim)
log="$out/log.txt"; steps="$out/steps.md"
: >"$log"; : >"$steps"
export PYTHONUNBUFFERED=1
say() { echo "$*" | tee -a "$log"; }
step() {  # step NAME LIMIT_S LOGFILE CMD...: run under a time limit, record in the summary
  local name="$1" limit="$2" file="$3"; shift 3
  local t0=$SECONDS
  say "=== $name (limit ${limit} s): $*"
  # SIGINT first: pytest then prints its summary (the failures so far) before it stops
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$file" 2>&1
  local rc=$?
  local status="ok"; [ $rc -ne 0 ] && status="FAILED (rc=$rc)"
  [ $rc -eq 124 ] && status="TIMED OUT after ${limit} s"
  say "=== $name: $status in $((SECONDS - t0)) s ($(tail -n 1 "$file" | cut -c1-120))"
  echo "| $name | $status | $((SECONDS - t0)) s | $(tail -n 1 "$file" | cut -c1-100) |" >>"$steps"
  return $rc
}

site="$root/.site"
for wheels in .whl .whl-bnb; do
  if compgen -G "$wheels/*.whl" >/dev/null; then
    step "install peers from $wheels" 120 "$out/install-$wheels.txt" python3 -m pip install -q \
      --no-index --no-deps --no-compile --target "$site" --upgrade "$wheels"/*.whl
  fi
done
# our sources first (ours imports as flashoptim_fused, the flashoptim 0.1.4 peer as flashoptim)
export PYTHONPATH="$root/packages/flashsinkhorn/src:$root/packages/flashoptim/src:$site${PYTHONPATH:+:$PYTHONPATH}"

python3 - >"$out/env.json" 2>>"$log" <<'PY'
import datetime, json, platform, subprocess
import torch
env = {"python": platform.python_version(), "torch": torch.__version__,
       "cuda": torch.version.cuda,
       "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
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
cat "$out/env.json" >>"$log"

workers=()
if python3 -c "import xdist" 2>/dev/null; then workers=(-n "${GPU_TEST_WORKERS:-4}"); fi
# GPU_PYTEST_ARGS is split on spaces on purpose (several pytest arguments)
pytest_gpu=(python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -c pyproject.toml --rootdir .
  "${workers[@]}" ${GPU_PYTEST_ARGS:-})

has() { local p; for p in "${packages[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
pids=()
if [ "${GPU_SKIP_TESTS:-0}" != 1 ]; then
  for pkg in "${packages[@]}"; do
    [ "$pkg" = mhc-proj ] && continue
    step "gpu tests $pkg" "${LIMIT_TESTS:-240}" "$out/tests-$pkg.txt" "${pytest_gpu[@]}" "packages/$pkg/tests" &
    pids+=($!)
  done
fi
built=0
if has mhc-proj; then
  step "build mhc-proj" "${LIMIT_BUILD:-300}" "$out/build-mhc-proj.txt" python3 -m pip install \
    -q --no-build-isolation --no-deps --target "$site" --upgrade packages/mhc-proj && built=1
  if [ $built = 1 ] && [ "${GPU_SKIP_TESTS:-0}" != 1 ]; then
    step "gpu tests mhc-proj" "${LIMIT_TESTS:-240}" "$out/tests-mhc-proj.txt" "${pytest_gpu[@]}" packages/mhc-proj/tests
  fi
fi
for pid in "${pids[@]}"; do wait "$pid"; done

if [ "${GPU_SKIP_BENCH:-0}" != 1 ]; then
  for pkg in ${GPU_BENCH_PACKAGES:-${packages[@]}}; do
    import_name="${pkg//-/_}"  # (also names LIMIT_BENCH_* / BENCH_ARGS_*)
    module="$import_name"; [ "$pkg" = flashoptim ] && module=flashoptim_fused
    [ "$pkg" = mhc-proj ] && [ $built != 1 ] && continue
    limit="LIMIT_BENCH_${import_name}"; extra="BENCH_ARGS_${import_name}"
    step "bench $pkg" "${!limit:-150}" "$out/bench-$pkg.txt" python3 -m "$module.bench" \
      --json "$out/bench-$pkg.json" ${!extra:-}
  done
fi

IFS=';' read -r -a extras <<<"${GPU_EXTRA:-}"
for entry in "${extras[@]}"; do
  [ -z "${entry// }" ] && continue
  IFS='|' read -r name limit cmd <<<"$entry"
  step "$name" "$limit" "$out/extra-${name// /_}.txt" bash -c "$cmd"
done

{
  echo "# GPU run summary"
  echo
  echo "| step | status | time | last line |"
  echo "|---|---|---|---|"
  cat "$steps"
  echo
  if compgen -G "$out/bench-*.json" >/dev/null; then
    python3 tools/report.py --stdout "$out"/bench-*.json 2>&1 | grep -v '^$' || true
  fi
} >"$out/summary.md"
rm -f "$steps"
cat "$out/summary.md"
