#!/bin/bash
# mhc-proj GPU check of the reciprocal-replay Sinkhorn-20 backward (thread-rs, thread-rp,
# thread-r-occ3; NOTES.md "Sinkhorn-20 backward: reciprocal replay"): one call, <= 120 s.
#   1. registers / stack / shared memory of the Sinkhorn backward kernels (cuobjdump, if any)
#   2. GPU tests: tests/test_sinkhorn_recip.py (the new kernels vs float64, vs the CPU path
#      and vs the default thread-e-occ3 kernel; autograd, leading dims, graph capture) and
#      the default backward's autograd test (limit 75 s)
#   3. one process: Sinkhorn-20 bwd and fwd_bwd at B = 16M and 1M, the default
#      (thread-e-occ3), thread-rs, thread-rp and thread-r-occ3 interleaved per repetition
#      (limit 40 s)
# Usage, from the repository root (prebuilt module, torch with CUDA, no network):
#   bash packages/mhc-proj/scripts/gpu_check_sinkbwd.sh OUTDIR
# MHC_SITE overrides the module directory (default .gpu/site-mhc-new).
# Writes OUTDIR/{env.txt,resources.txt,tests.txt,sinkbwd.md,sinkbwd.json,timing.log,summary.txt}.
OUT=${1:?usage: bash packages/mhc-proj/scripts/gpu_check_sinkbwd.sh OUTDIR}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
# cap N: N seconds, or what is left of a 120 s total if less (at least 1)
cap() { local left=$(( 120 - $(el) )); [ "$left" -lt 1 ] && left=1; echo $(( $1 < left ? $1 : left )); }
SITE=${MHC_SITE:-$PWD/.gpu/site-mhc-new}
export PYTHONPATH=$SITE
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1
  timeout 20 python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "module: $SITE ($(cat "$SITE/BUILT_FROM" 2>/dev/null))"
} > "$OUT/env.txt" 2>&1
echo "module: $SITE ($(cat "$SITE/BUILT_FROM" 2>/dev/null | cut -c1-60))" | tee "$OUT/summary.txt"

# 1. resources (REG / STACK / SHARED per kernel; the stashes are dynamic: thread-rs 27
#    slots = 55296 B per block, thread-rp 37 slots = 75776 B)
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
timeout 20 "$CUOBJ" --dump-resource-usage "$SITE"/mhc_proj/_cuda*.so 2>&1 \
  | grep -A1 "sinkhorn4_bwd_thread\|sinkhorn4_bwd_recip\|sinkhorn4_bwd_pipe" > "$OUT/resources.txt"

# 2. GPU tests
timeout "$(cap 75)" python3 -m pytest -q -p no:cacheprovider -m gpu \
  packages/mhc-proj/tests/test_sinkhorn_recip.py \
  "packages/mhc-proj/tests/test_sinkhorn.py::test_cuda_bwd_variant_through_autograd" \
  > "$OUT/tests.txt" 2>&1
echo "tests rc=$? at $(el) s: $(tail -1 "$OUT/tests.txt")" | tee -a "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -20 >> "$OUT/summary.txt"

# 3. timing, one process, variants interleaved
timeout "$(cap 40)" python3 packages/mhc-proj/scripts/sinkbwd_timing.py --out "$OUT" \
  --batch 16777216 1048576 --variants thread-e-occ3 thread-rs thread-rp thread-r-occ3 \
  --reps 25 \
  > "$OUT/timing.log" 2>&1
echo "timing rc=$? at $(el) s" | tee -a "$OUT/summary.txt"
grep -E "^\|" "$OUT/timing.log" | tee -a "$OUT/summary.txt"
echo "total $(el) s" | tee -a "$OUT/summary.txt"
