#!/bin/bash
# mhc-proj issue #4 GPU check (helper of 2026-12-01): the float64-stage variants of the n = 4
# fp32 Birkhoff forward against the default, in one process.
#   thread-wave      (bench ours-wave):     default polish, float64 grid = one wave of resident
#                                           blocks (bitwise the default's results)
#   thread-fb2       (bench ours-fb2):      + polish updates its plan (no 16 double exps/iter)
#   thread-fb2-occ3  (bench ours-fb2-occ3): the same kernel capped at 3 blocks/SM (L1 spills)
#   thread-c10       (bench ours-c10):      thread-fb2 + fp32 continuation from logit range 10 (16)
#   thread-c10ls     (bench ours-c10ls):    thread-c10 + line searches with one log1p per trial
# Then (appended) the Sinkhorn-20 backward variants thread-e, thread-e-occ3 vs thread.
# Usage, from the repository root: bash packages/mhc-proj/scripts/gpu_check.sh OUTDIR
# (MHC_PREBUILT=DIR skips the build). Step limits 150 s for the build (it passed 70 s on the
# host on 2026-12-01), 35 + 40 s for the Birkhoff tests and bench, 25 + 25 s for Sinkhorn,
# then an optional sigma 2-3 bench; every step is also capped so the total stays <= 275 s.
# Writes OUTDIR/{env.txt,build.log,resources.txt,tests.txt,bench.log,bench.json,summary.txt}.
OUT=${1:?usage: bash packages/mhc-proj/scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
# cap N: N seconds, or what is left of a 275 s total if less (at least 1)
cap() { local left=$(( 275 - $(el) )); [ "$left" -lt 1 ] && left=1; echo $(( $1 < left ? $1 : left )); }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1

# MHC_PREBUILT=DIR: use a module built elsewhere (e.g. here for Python 3.12, see
# docs/gpu-pending.md) instead of building on the host (the build needs > 70 s there now)
SITE=${MHC_PREBUILT:-$PWD/.site-mhc}
if [ -z "${MHC_PREBUILT:-}" ]; then
  rm -rf .site-mhc
  CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 150 python3 -m pip install --no-build-isolation --no-deps \
    --target .site-mhc packages/mhc-proj > "$OUT/build.log" 2>&1
  echo "build rc=$? at $(el) s" | tee "$OUT/summary.txt"
else
  echo "prebuilt module in $SITE" | tee "$OUT/summary.txt"
fi
export PYTHONPATH=$SITE

# registers / spills of the fallback kernels (expected: default 164 regs, fb2 246, occ3 168)
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$CUOBJ" --dump-resource-usage "$SITE"/mhc_proj/_cuda*.so 2>&1 \
  | grep -A1 "birkhoff_fwd_fallbackILi4\|birkhoff_fwd_f32_threadILi4\|sinkhorn4_bwd_threadILi20" \
  > "$OUT/resources.txt"

# GPU tests of the change (test_fb2.py: layouts vs thread, CPU path, float64 reference, NaN
# isolation, graph capture, 1M accuracy row) plus the CPU/GPU agreement and graph tests of
# the default path.
timeout $(cap 35) python3 -m pytest -q -s -m gpu packages/mhc-proj/tests/test_fb2.py \
  "packages/mhc-proj/tests/test_accuracy.py::test_cuda_matches_cpu_path" \
  "packages/mhc-proj/tests/test_accuracy.py::test_cuda_graph_capture" > "$OUT/tests.txt" 2>&1
echo "tests rc=$? at $(el) s: $(tail -1 "$OUT/tests.txt")" | tee -a "$OUT/summary.txt"

# old vs new in the same process: fwd and fwd_bwd, B = 1M and 16M, sigma 1 and 10 (48 cases)
timeout $(cap 40) python3 -m mhc_proj.bench --providers ours ours-wave ours-fb2 ours-fb2-occ3 ours-c10 ours-c10ls \
  --mode fwd fwd_bwd --batch 1048576 16777216 --sigma 1 10 --json "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(el) s" | tee -a "$OUT/summary.txt"
python3 - "$OUT/bench.json" >> "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows.get("results", rows) if isinstance(rows, dict) else rows
t = {}
for r in rows:
    p = r["params"]
    t[(r["provider"], r["mode"], p["B"], p["sigma"])] = r.get("time_ms")
print("| mode | B | sigma | ours | ours-wave | ours-fb2 | ours-fb2-occ3 | ours-c10 | ours-c10ls |")
print("|---|---|---|---|---|---|---|---|---|")
for mode in ("fwd", "fwd_bwd"):
    for b in (1048576, 16777216):
        for s in (1.0, 10.0):
            cells = [t.get((p, mode, b, s)) for p in ("ours", "ours-wave", "ours-fb2", "ours-fb2-occ3", "ours-c10", "ours-c10ls")]
            print(f"| {mode} | {b} | {s} | " + " | ".join("—" if c is None else f"{c:.4g}" for c in cells) + " |")
for p in ("ours", "ours-wave", "ours-fb2", "ours-fb2-occ3", "ours-c10", "ours-c10ls"):
    a, b = t.get((p, "fwd", 16777216, 10.0)), t.get((p, "fwd", 16777216, 1.0))
    if a and b:
        print(f"{p}: fwd 16M sigma10/sigma1 = {a / b:.2f}x")
PY
echo "total $(el) s" | tee -a "$OUT/summary.txt"

# ---- second variant: Sinkhorn-20 backward with the rescaled adjoint (thread-e, thread-e-occ3)
timeout $(cap 25) python3 -m pytest -q -m gpu packages/mhc-proj/tests/test_sinkhorn_rescaled.py \
  > "$OUT/tests-sinkhorn.txt" 2>&1
echo "sinkhorn tests rc=$? at $(el) s: $(tail -1 "$OUT/tests-sinkhorn.txt")" | tee -a "$OUT/summary.txt"
timeout $(cap 25) python3 -m mhc_proj.bench --providers ours-sinkhorn20 ours-sinkhorn20-e \
  ours-sinkhorn20-e-occ3 --mode bwd fwd_bwd --batch 1048576 16777216 --sigma 1 \
  --json "$OUT/bench-sinkhorn.json" > "$OUT/bench-sinkhorn.log" 2>&1
echo "sinkhorn bench rc=$? at $(el) s" | tee -a "$OUT/summary.txt"
python3 - "$OUT/bench-sinkhorn.json" >> "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
t = {(r["provider"], r["mode"], r["params"]["B"]): r.get("time_ms") for r in rows}
ps = ("ours-sinkhorn20", "ours-sinkhorn20-e", "ours-sinkhorn20-e-occ3")
print("| mode | B | " + " | ".join(ps) + " |")
print("|---|---|---|---|---|")
for mode in ("bwd", "fwd_bwd"):
    for b in (1048576, 16777216):
        cells = [t.get((p, mode, b)) for p in ps]
        print(f"| {mode} | {b} | " + " | ".join("—" if c is None else f"{c:.4g}" for c in cells) + " |")
PY

# ---- optional, if time is left (the c10 layouts' model cost at sigma 2-3): fwd 16M
if [ $(( 195 - $(el) )) -gt 12 ]; then
  timeout $(cap 20) python3 -m mhc_proj.bench --providers ours ours-c10 ours-c10ls --mode fwd \
    --batch 16777216 --sigma 2 3 --json "$OUT/bench-sigma23.json" > "$OUT/bench-sigma23.log" 2>&1
  echo "sigma 2-3 bench rc=$? at $(el) s" | tee -a "$OUT/summary.txt"
  grep -E "^\| ours" "$OUT/bench-sigma23.log" >> "$OUT/summary.txt"
fi
echo "total $(el) s" | tee -a "$OUT/summary.txt"
