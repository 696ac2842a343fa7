#!/usr/bin/env bash
# flashsinkhorn issue #30 on the GPU host (H100 / H200, triton 3.6, no network), one call:
#
#   OUT=/some/dir bash tools/flashsinkhorn/gpu_hopper.sh     (carry .whl for the peer)
#
# 1. installs the peer wheels carried in .whl/ (flash-sinkhorn 0.4.1) into .site/;
# 2. the GPU tests of the sm_90 kernels (plan application, debias self kernel, Gluon row
#    recomputation, sampling, and the softmin / one-pass tests they build on), limit 210 s,
#    spread over 8 pytest-xdist workers if installed (the suites are compile-bound);
# 3. tools/flashsinkhorn/hopper30.py: errors against float64, times, fractions of the floor,
#    SamplesLoss against flash-sinkhorn 0.4.1 in the same process, limit 270 s;
# writes under $OUT: tests.txt (pytest, -rA: every test's outcome), hopper30.json (+ per stage
# parts), hopper30.md (the table), env.txt; prints the table last. At most 8.3 minutes.
set -uo pipefail
out="${OUT:-${1:-/tmp/gpu_hopper}}"
mkdir -p "$out"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export PYTHONUNBUFFERED=1
t0=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl >"$out/pip.txt" 2>&1 \
        || echo "peer wheels: pip failed (see pip.txt)"
fi
export PYTHONPATH="$root/.site:$root/packages/flashsinkhorn/src:${PYTHONPATH:-}"
{
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    python3 -c "import flash_sinkhorn as f; print('flash-sinkhorn', getattr(f, '__version__', '?'))" 2>&1
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

xdist=""
python3 -c "import xdist" 2>/dev/null && xdist="-n 8"
tests=(packages/flashsinkhorn/tests/test_plan_hopper.py packages/flashsinkhorn/tests/test_self_hopper.py
       packages/flashsinkhorn/tests/test_sampling.py packages/flashsinkhorn/tests/test_softmin_hopper.py
       packages/flashsinkhorn/tests/test_symmetric.py)
echo "=== GPU tests (limit 210 s) $xdist"
timeout --signal=INT --kill-after=15 210 python3 -m pytest -m gpu -p no:cacheprovider -c pyproject.toml \
    --rootdir . -q -rA --durations=12 $xdist "${tests[@]}" >"$out/tests.txt" 2>&1
echo "tests rc=$? after $((SECONDS - t0)) s"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/tests.txt" | grep -v "^PASSED" | tail -40
# the first lines of each failure (enough to fix from this output alone)
grep -E "^E   " "$out/tests.txt" | head -60

echo "=== hopper30 (limit 270 s)"
timeout --kill-after=15 270 python3 tools/flashsinkhorn/hopper30.py --out "$out/hopper30.json" \
    --budget 240 >"$out/hopper30.log" 2>&1
rc=$?
grep -E "^\[|TIMEOUT|Error|error" "$out/hopper30.log" | cut -c1-400 | tail -80
echo "hopper30 rc=$rc after $((SECONDS - t0)) s"
echo
head -c 2000 "$out/env.txt" | head -3
tail -n 40 "$out/tests.txt" | grep -E "passed|failed" | tail -1
cat "$out/hopper30.md" 2>/dev/null || tail -30 "$out/hopper30.log"
