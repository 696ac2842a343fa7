#!/usr/bin/env bash
# flashsinkhorn issue #36 on the GPU host, in one call (< 8 minutes on an H100: at most
# 180 s of tests, 270 s of benchmarks, the peers' install):
#   1. the GPU tests of #36's modules (pytest -m gpu, xdist when present; GPU_TESTS=all for
#      the whole package's), limit LIMIT_TESTS s;
#   2. tools/flashsinkhorn/gpu_bench.py: SamplesLoss fwd+bwd at n = m = 512, 2048, 8192
#      (d = 3, 64) against flash-sinkhorn 0.4.1 and GeomLoss tensorized, 64 ragged problems
#      in one call against a Python loop, and the 50k no-regression rows; with BEFORE_SRC
#      the 50k rows run again on that old source tree in the same call.
#
# usage: tools/flashsinkhorn/gpu_check.sh OUTDIR [BEFORE_SRC]
#   BEFORE_SRC: an old packages/flashsinkhorn/src, e.g. (here, before the device call)
#     mkdir -p .before && git archive 708efd6 packages/flashsinkhorn/src | tar -x -C .before
#   and pass .before/packages/flashsinkhorn/src (.before/ is git-ignored: name it in carry).
# Peers: wheels in .whl/ (tools/gpu_run.sh's staging) are installed into .site/.
# Output under OUTDIR: tests.txt, bench.txt, gpu-bench-36.json, gpu-bench-36.md (the table),
# before.json, summary.md.
set -uo pipefail
out="${1:?usage: tools/flashsinkhorn/gpu_check.sh OUTDIR [BEFORE_SRC]}"
before="${2:-}"
mkdir -p "$out"; out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export PYTHONUNBUFFERED=1
summary="$out/summary.md"; : >"$summary"
step() {  # step NAME LIMIT_S LOGFILE CMD...
  local name="$1" limit="$2" file="$3"; shift 3
  local t0=$SECONDS
  echo "=== $name (limit ${limit} s)"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$file" 2>&1
  local rc=$?
  local status="ok"; [ $rc -ne 0 ] && status="FAILED (rc=$rc)"; [ $rc -eq 124 ] && status="TIMED OUT"
  echo "| $name | $status | $((SECONDS - t0)) s | $(tail -n 1 "$file" | cut -c1-100) |" | tee -a "$summary"
}
site="$root/.site"
if compgen -G ".whl/*.whl" >/dev/null; then
  step "install peers" 90 "$out/install.txt" python3 -m pip install -q --no-index --no-deps \
    --no-compile --target "$site" --upgrade .whl/*.whl
fi
export PYTHONPATH="$root/packages/flashsinkhorn/src:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" \
  | tee "$out/env.txt"
workers=()
if python3 -c "import xdist" 2>/dev/null; then workers=(-n "${GPU_TEST_WORKERS:-8}"); fi
# the GPU tests of #36's modules (GPU_TESTS=all: the whole package's, about 6 minutes with
# 8 workers on the H100: over this script's budget with the benchmarks)
t=packages/flashsinkhorn/tests
tests=("$t"/test_dense.py "$t"/test_varlen.py "$t"/test_loop.py "$t"/test_solver.py
  "$t"/test_samples_loss.py "$t"/test_second_order_autograd.py "$t"/test_compile.py
  "$t"/test_result.py "$t"/test_fuzz.py "$t"/test_capture.py)
[ "${GPU_TESTS:-36}" = all ] && tests=("$t")
step "gpu tests" "${LIMIT_TESTS:-180}" "$out/tests.txt" python3 -m pytest -q -rfE -m gpu \
  -p no:cacheprovider -c pyproject.toml --rootdir . --durations=10 "${workers[@]}" "${tests[@]}"
bargs=(--out "$out")
[ -n "$before" ] && bargs+=(--before "$(cd "$before" && pwd)")
BEFORE_S="${LIMIT_BEFORE:-100}" step "gpu bench" "${LIMIT_BENCH:-270}" "$out/bench.txt" \
  python3 tools/flashsinkhorn/gpu_bench.py "${bargs[@]}"
cat "$summary"
[ -f "$out/gpu-bench-36.md" ] && cat "$out/gpu-bench-36.md"
