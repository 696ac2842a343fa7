#!/usr/bin/env bash
# The one command for a CUDA host without network or nox (the H100/H200 host).
#
#   tools/gpu_run.sh OUTDIR [PACKAGE ...]      (default: all three packages)
#
# 1. restores the compile caches carried in .gpu-cache/ (Triton and Gluon kernels, Inductor,
#    the built mhc-proj extension; see "Compile caches" in docs/architecture.md);
# 2. installs the peer wheels carried in .whl/ and .whl-bnb/ (if present) into .site/;
# 3. builds mhc-proj for the visible GPU only (or reuses the extension built from the same
#    C++/CUDA sources) while the pure-Python packages' GPU tests already run;
# 4. runs every package's @pytest.mark.gpu tests, the three packages side by side, each spread
#    over GPU_TEST_WORKERS processes (pytest-xdist, if installed): the suites are
#    compile-bound, and the host has 16 cores; the slowest tests of the last run (their
#    times kept with the caches) start first (tools/gpu_order.py; GPU_ORDER=0: not);
# 5. runs each package's benchmark CLI's GPU suite, one after another (nothing else runs
#    on the GPU while they time), and any extra script named in GPU_EXTRA (each a
#    "name|limit|command" entry, separated by ';', run after the benchmarks; the variable
#    GPU_OUT names OUTDIR for them);
# 6. saves the compile caches as OUTDIR/gpu-cache.tar.xz.NN (15 MiB parts: carry them back
#    as .gpu-cache/ in the next call) unless GPU_SAVE_CACHE=0;
# and writes into OUTDIR:
#   log.txt                 everything printed (per-step logs: tests-<pkg>.txt, ...)
#   bench-<package>.json    benchmark results (schema kernel-bench/1)
#   env.json                GPU, driver and library versions
#   test-times-<pkg>.json   every GPU test's seconds (setup + call + teardown) in this run
#                           and earlier ones: the next run starts the slowest first
#   summary.md              pass/fail/skip counts and time per step, the slowest tests, then
#                           the tables (printed last)
# With GPU_PACK=1 everything but summary.md and the cache parts is packed into
# OUTDIR/results.tar.gz at the end (the device tool returns at most 8 files).
# Limits in seconds per step (a step past its limit gets SIGINT, then SIGKILL 20 s later, is
# marked TIMED OUT, and the run goes on; pytest prints the failures it has so far):
# LIMIT_BUILD (300), LIMIT_TESTS (300, each package), LIMIT_BENCH_<pkg> (150), with <pkg>
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

# Compile caches. One fixed folder (Triton's group files and Inductor's index hold absolute
# paths), restored from the parts carried in .gpu-cache/. The restored files get an old
# access time, so that when the saved archive would be too large, what this run did not
# read can be dropped first.
cache_root="${GPU_CACHE_ROOT:-/tmp/gpu-compile-cache}"
mkdir -p "$cache_root"
run_start=$(date +%s)
if compgen -G "$root/.gpu-cache/gpu-cache.tar.xz.*" >/dev/null; then
  if cat "$root"/.gpu-cache/gpu-cache.tar.xz.* | tar -xJ -C "$cache_root" 2>>"$log"; then
    find "$cache_root" -type f -exec touch -a -d 2000-01-01 {} + 2>/dev/null
    say "compile cache restored: $(du -sh "$cache_root" | cut -f1) in $cache_root"
  else
    say "compile cache in .gpu-cache/ could not be read; starting cold"
  fi
else
  say "no compile cache carried (.gpu-cache/): a cold run"
fi
export TRITON_CACHE_DIR="$cache_root/triton" TORCHINDUCTOR_CACHE_DIR="$cache_root/inductor"
export GPU_OUT="$out"

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
  --durations=10 --durations-min=1 "${workers[@]}" ${GPU_PYTEST_ARGS:-})

# Each package's per-test times of the last run, kept with the compile caches: the slowest
# start first, spread over the workers' first batches (tools/gpu_order.py, a pytest plugin;
# GPU_ORDER=0 keeps pytest's order). The plugin goes on the path alone: tools/ itself holds
# folders named like the packages (an import of a missing peer would find them).
plugins="$(mktemp -d)"
cp tools/gpu_order.py "$plugins/"
order_env() {  # order_env PACKAGE: sets the array "order", the env prefix of its pytest
  order=()
  [ "${GPU_ORDER:-1}" = 1 ] || return 0
  order=(env "GPU_TEST_TIMES=$cache_root/test-times/$1.json" "PYTHONPATH=$PYTHONPATH:$plugins"
    PYTEST_PLUGINS=gpu_order)
}
has() { local p; for p in "${packages[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
pids=()
if [ "${GPU_SKIP_TESTS:-0}" != 1 ]; then
  for pkg in "${packages[@]}"; do
    [ "$pkg" = mhc-proj ] && continue
    order_env "$pkg"
    step "gpu tests $pkg" "${LIMIT_TESTS:-300}" "$out/tests-$pkg.txt" "${order[@]}" "${pytest_gpu[@]}" "packages/$pkg/tests" &
    pids+=($!)
  done
fi
built=0
# The mhc-proj extension depends only on its C++/CUDA sources, the CMake file, the compiler,
# the GPU and the Python ABI: keyed on those, a build is reused and only the Python files are
# copied (the wheel is src/mhc_proj plus the two modules). CMake builds for the visible GPU.
mhc_build() {
  local key dir
  key=$( (cat packages/mhc-proj/CMakeLists.txt packages/mhc-proj/pyproject.toml
          find packages/mhc-proj/csrc -type f | LC_ALL=C sort | xargs cat
          nvcc --version 2>&1; echo "CUDAARCHS=${CUDAARCHS:-}"
          nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>&1
          python3 -c 'import sys, pybind11; print(sys.version, pybind11.__version__)'
         ) | sha256sum | cut -c1-16)
  dir="$cache_root/mhc-proj/$key"
  if compgen -G "$dir/*.so" >/dev/null; then
    echo "mhc-proj: reusing the extension built from the same sources ($key)"
    rm -rf "$site/mhc_proj" && mkdir -p "$site" && cp -r packages/mhc-proj/src/mhc_proj "$site/" &&
      cp "$dir"/*.so "$site/mhc_proj/"
    return
  fi
  echo "mhc-proj: building (sources $key)"
  python3 -m pip install -v --no-build-isolation --no-deps --target "$site" --upgrade \
    packages/mhc-proj || return 1
  rm -rf "$cache_root/mhc-proj" && mkdir -p "$dir" && cp "$site"/mhc_proj/*.so "$dir/"
}
if has mhc-proj; then
  export -f mhc_build; export cache_root site
  step "build mhc-proj" "${LIMIT_BUILD:-300}" "$out/build-mhc-proj.txt" bash -c mhc_build && built=1
  grep -E "mhc_proj: (building|GPUs|no GPU)|reusing" "$out/build-mhc-proj.txt" | tee -a "$log"
  if [ $built = 1 ] && [ "${GPU_SKIP_TESTS:-0}" != 1 ]; then
    order_env mhc-proj
    step "gpu tests mhc-proj" "${LIMIT_TESTS:-300}" "$out/tests-mhc-proj.txt" "${order[@]}" "${pytest_gpu[@]}" packages/mhc-proj/tests
  fi
fi
for pid in "${pids[@]}"; do wait "$pid"; done
rm -rf "$plugins"
for f in "$cache_root"/test-times/*.json; do  # every test's seconds, per package
  [ -f "$f" ] && cp "$f" "$out/test-times-$(basename "$f")"
done

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

save_cache() {  # the caches as 15 MiB parts under OUTDIR (at most GPU_CACHE_MAX_MIB in all)
  local max_mib="${GPU_CACHE_MAX_MIB:-45}" size
  rm -f "$out"/gpu-cache.tar.xz.*
  tar -C "$cache_root" -cf - . | xz -T0 -6 | split -b 15M -d -a 2 - "$out/gpu-cache.tar.xz."
  size=$(cat "$out"/gpu-cache.tar.xz.* | wc -c)
  if [ "$size" -gt $((max_mib * 1048576)) ]; then
    # too large: keep the cache entries (top-level folders of each cache) that this run
    # wrote or read, drop the rest
    say "compile cache $((size / 1048576)) MiB > ${max_mib} MiB: keeping what this run used"
    find "$cache_root" -mindepth 2 -maxdepth 2 -type d | while read -r entry; do
      if [ -z "$(find "$entry" -type f \( -newermt "@$run_start" -o -newerat "@$run_start" \) -print -quit)" ]; then
        rm -rf "$entry"
      fi
    done
    rm -f "$out"/gpu-cache.tar.xz.*
    tar -C "$cache_root" -cf - . | xz -T0 -6 | split -b 15M -d -a 2 - "$out/gpu-cache.tar.xz."
    size=$(cat "$out"/gpu-cache.tar.xz.* | wc -c)
    if [ "$size" -gt $((max_mib * 1048576)) ]; then
      say "compile cache still $((size / 1048576)) MiB: not saved"; rm -f "$out"/gpu-cache.tar.xz.*
      return
    fi
  fi
  say "compile cache saved: $(ls "$out"/gpu-cache.tar.xz.* | wc -l) part(s), $((size / 1048576)) MiB"
}
if [ "${GPU_SAVE_CACHE:-1}" = 1 ]; then
  if command -v xz >/dev/null; then save_cache; else say "no xz on this host: compile cache not saved"; fi
fi

{
  echo "# GPU run summary"
  echo
  echo "$(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null), total $((SECONDS)) s"
  echo
  echo "| step | status | time | last line |"
  echo "|---|---|---|---|"
  cat "$steps"
  echo
  echo "Slowest tests:"
  echo '```'
  for f in "$out"/tests-*.txt; do
    [ -f "$f" ] || continue
    sed -n '/slowest .*durations/,/^$/p' "$f" | grep -E '^[0-9.]+s ' | sed "s|^|$(basename "$f" .txt): |"
  done | sort -t' ' -k2 -rn | head -n 10
  echo '```'
  echo
  if compgen -G "$out/bench-*.json" >/dev/null; then
    python3 tools/report.py --stdout "$out"/bench-*.json 2>&1 | grep -v '^$' || true
  fi
} >"$out/summary.md"
rm -f "$steps"
if [ "${GPU_PACK:-0}" = 1 ]; then
  (cd "$out" && find . -type f ! -name summary.md ! -name 'gpu-cache.tar.xz.*' ! -name results.tar.gz \
    -print0 | tar --null -czf results.tar.gz -T - &&
    find . -type f ! -name summary.md ! -name 'gpu-cache.tar.xz.*' ! -name results.tar.gz -delete &&
    find . -mindepth 1 -type d -empty -delete)
fi
cat "$out/summary.md"
