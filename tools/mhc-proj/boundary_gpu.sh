#!/usr/bin/env bash
# The fused layer boundary of mhc-proj (issue #33) on a GPU host, in one call:
#
#   tools/mhc-proj/boundary_gpu.sh OUTDIR        (from the repository root; ~6 min on an H100)
#
# 1. installs the peer wheels in .whl/ (Liger-Kernel 0.8.5) into .site/ and, in the
#    background, compiles Liger's mHC Triton kernels for C = 4096 and 7168 (its first call
#    at these widths compiles for minutes: done while we build, the bench finds them in
#    Triton's cache; the caches tools/gpu_run.sh carries in .gpu-cache/ are restored first);
# 2. builds mhc-proj for sm_90 only (CUDAARCHS=90, all cores) into .gpu-build/;
# 3. runs the GPU tests of the boundary (tests/test_boundary.py -m gpu: CUDA vs the C++ CPU
#    path, float64, batch invariance, CUDA graphs, torch.compile, checkpointing, autocast);
# 4. benchmarks: one boundary fwd / fwd+bwd at 32K and 2K tokens, C = 4096 and 7168, n = 4,
#    default and deterministic mode, as a fraction of its HBM floor (the copy ceiling is
#    measured in the same process); chains of 2 and 4 layers, fused vs our unfused layers
#    vs Liger's LigerMHC chain; then a 12-layer GPT step fused vs unfused.
# Writes into OUTDIR: summary.md (printed last), log.txt, build.txt, tests.txt, bench.txt,
# bench-boundary.json (kernel-bench/1), gpt.txt, gpt-step.json, env.json, resources.txt
# (registers / spills of the boundary kernels). A failing step prints its last lines into
# summary.md and the run goes on.
set -uo pipefail
out="${1:?usage: tools/mhc-proj/boundary_gpu.sh OUTDIR}"
mkdir -p "$out"; out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export PYTHONUNBUFFERED=1
log="$out/log.txt"; steps="$out/steps.md"; fails="$out/failures.md"
: >"$log"; : >"$steps"; : >"$fails"
t_start=$SECONDS
say() { echo "$*" | tee -a "$log"; }
step() {  # step NAME LIMIT_S FILE CMD...: run under a time limit, record status and tail
  local name="$1" limit="$2" file="$3"; shift 3
  local t0=$SECONDS
  say "=== $name (limit ${limit} s, at $((SECONDS - t_start)) s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$file" 2>&1
  local rc=$?
  local status="ok"; [ $rc -ne 0 ] && status="FAILED (rc=$rc)"
  [ $rc -eq 124 ] && status="TIMED OUT after ${limit} s"
  say "=== $name: $status in $((SECONDS - t0)) s"
  echo "| $name | $status | $((SECONDS - t0)) s | $(tail -n 1 "$file" | cut -c1-90) |" >>"$steps"
  if [ $rc -ne 0 ]; then
    { echo "### $name: $status"; echo '```'; grep -E "error|Error|FAILED|assert" "$file" | head -n 40
      echo "..."; tail -n 25 "$file"; echo '```'; } >>"$fails"
  fi
  return $rc
}

site="$root/.site"; build="$root/.gpu-build"
mkdir -p "$site"
export PYTHONPATH="$build:$site${PYTHONPATH:+:$PYTHONPATH}"
# the compile caches tools/gpu_run.sh carries in .gpu-cache/ (Triton: Liger's kernels), if any
cache_root="${GPU_CACHE_ROOT:-/tmp/gpu-compile-cache}"; mkdir -p "$cache_root"
if compgen -G "$root/.gpu-cache/gpu-cache.tar.xz.*" >/dev/null; then
  cat "$root"/.gpu-cache/gpu-cache.tar.xz.* | tar -xJ -C "$cache_root" 2>>"$log" \
    && say "compile cache restored from .gpu-cache/"
fi
export TRITON_CACHE_DIR="$cache_root/triton" TORCHINDUCTOR_CACHE_DIR="$cache_root/inductor"
if compgen -G ".whl/liger_kernel*.whl" >/dev/null; then
  step "install liger-kernel" 60 "$out/install.txt" python3 -m pip install -q --no-index \
    --no-deps --no-compile --target "$site" --upgrade .whl/liger_kernel*.whl
else
  say "no .whl/liger_kernel*.whl: the liger-kernel rows will be skipped"
fi
python3 - >"$out/env.json" 2>>"$log" <<'PY'
import datetime, json, platform, torch
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
       "float8_e4m3fn": hasattr(torch, "float8_e4m3fn")}
try:
    import triton; env["triton"] = triton.__version__
except Exception as e:
    env["triton"] = repr(e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
print(json.dumps(env, indent=1))
PY
cat "$out/env.json" >>"$log"

# Liger's Triton kernels for both widths, at the bench's shape, while the build runs
warm_pid=""
if python3 -c "import liger_kernel" 2>/dev/null; then
  ( timeout 330 python3 - >"$out/liger-warm.txt" 2>&1 <<'PY'
import time, torch
from liger_kernel.transformers import LigerMHC
for c in (4096, 7168):
    t0 = time.time()
    m = LigerMHC(torch.nn.Identity(), hc=4, c=c, phi_dtype=torch.bfloat16).cuda()
    x = torch.randn(8, 4096, 4, c, device="cuda").bfloat16().requires_grad_(True)
    m(x).backward(torch.randn_like(x))
    torch.cuda.synchronize()
    print(f"liger C={c}: first fwd+bwd {time.time() - t0:.1f} s", flush=True)
PY
  ) &
  warm_pid=$!
fi

built=0
rm -rf "$build"
# Hopper only (the quickest build), every core
step "build mhc-proj (sm_90)" 330 "$out/build.txt" env CUDAARCHS=90 \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" python3 -m pip install -q --no-build-isolation \
  --no-deps --target "$build" packages/mhc-proj && built=1
if [ $built = 1 ]; then
  so=$(ls "$build"/mhc_proj/_cuda*.so 2>/dev/null | head -n 1)
  if [ -n "$so" ] && command -v cuobjdump >/dev/null; then
    cuobjdump -res-usage "$so" 2>/dev/null | grep -A1 "bnd_" | grep -E "Function|REG" \
      | paste - - | sed -E 's/[[:space:]]+/ /g' >"$out/resources.txt" || true
  fi
fi
[ -n "$warm_pid" ] && { wait "$warm_pid"; say "liger warm-up: $(tr '\n' ' ' <"$out/liger-warm.txt" | tail -c 300)"; }

if [ $built = 1 ]; then
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n 4)
  step "gpu tests (test_boundary.py)" 150 "$out/tests.txt" python3 -m pytest -q -rfE -m gpu \
    -p no:cacheprovider -c pyproject.toml --rootdir . "${workers[@]}" \
    packages/mhc-proj/tests/test_boundary.py
  step "bench hc_boundary hc_chain" 200 "$out/bench.txt" python3 -m mhc_proj.bench \
    --bench hc_boundary hc_chain --json "$out/bench-boundary.json"
  step "gpt step (12 layers, fused vs unfused)" 90 "$out/gpt.txt" python3 \
    tools/mhc-proj/gpt_boundary_step.py --json "$out/gpt-step.json"
fi

{
  echo "# mhc-proj fused boundary (#33): GPU run"
  echo
  echo "GPU: $(python3 -c 'import json,sys; e=json.load(open(sys.argv[1])); print(e.get("gpu"), "| torch", e.get("torch"), "| triton", e.get("triton"), "| CUDA", e.get("cuda"))' "$out/env.json" 2>/dev/null); total $((SECONDS - t_start)) s"
  echo
  echo "| step | status | time | last line |"
  echo "|---|---|---|---|"
  cat "$steps"
  echo
  if [ -s "$out/tests.txt" ]; then echo "tests: $(grep -E "passed|failed|error" "$out/tests.txt" | tail -n 1)"; echo; fi
  if [ -s "$out/bench.txt" ]; then
    echo "## Benchmarks (from bench.txt; copy ceiling: $(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["env"].get("copy_ceiling_gbps", 0)), "GB/s")' "$out/bench-boundary.json" 2>/dev/null))"
    echo
    grep -m1 -A1 -E "^\| bench \|" "$out/bench.txt" || true
    grep -E "^\| (hc_boundary|hc_chain) " "$out/bench.txt" || true
    echo
    sed -n '/^| C | one more boundary/,$p' "$out/bench.txt"
    grep -E "^- (error|skipped)" "$out/bench.txt" || true
    echo
  fi
  if [ -s "$out/gpt.txt" ]; then echo "## GPT step"; echo; grep -E "^(GPT|\||fused)" "$out/gpt.txt"; echo; fi
  if [ -s "$out/resources.txt" ]; then echo "## Boundary kernels (registers, spills)"; echo; sed 's/^/    /' "$out/resources.txt" | head -n 40; echo; fi
  if [ -s "$fails" ]; then echo "## Failures"; echo; cat "$fails"; fi
} >"$out/summary.md"
rm -f "$steps"
cat "$out/summary.md"
