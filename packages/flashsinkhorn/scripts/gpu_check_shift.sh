#!/usr/bin/env bash
# The "shift" softmin variant on the H200 in one call (NOTES.md, "`shift`: no running max"):
#   bash packages/flashsinkhorn/scripts/gpu_check_shift.sh OUTDIR
# Run from anywhere (it cds to the repo root); no network. Writes OUTDIR/env.txt,
# OUTDIR/shift.json + OUTDIR/shift.txt (timing table: one 50k pass default vs shift at
# d = 64 tf32 / bf16 and d = 512 tf32, one fixed-eps iteration, SamplesLoss fwd; 110 s
# budget for starting rows, 170 s hard limit) and OUTDIR/tests.txt (the gpu-marked tests
# of the variants selected by -k shift, one kernel config; 300 s limit).
set -uo pipefail
out="${1:?usage: gpu_check_shift.sh OUTDIR}"
root="$(cd "$(dirname "$0")/../../.." && pwd)"; cd "$root"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root/packages/flashsinkhorn/src${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__)"
} >"$out/env.txt" 2>&1
t0=$SECONDS
timeout 170 python3 packages/flashsinkhorn/scripts/shift_gpu_check.py "$out/shift.json" 110 \
  >"$out/shift.txt" 2>&1
echo "shift_gpu_check rc=$? in $((SECONDS - t0)) s" | tee -a "$out/shift.txt"
t0=$SECONDS
FLASHSINKHORN_NO_AUTOTUNE=1 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
  -c pyproject.toml --rootdir . --tb=short -k shift \
  packages/flashsinkhorn/tests/test_softmin_variants.py >"$out/tests.txt" 2>&1
echo "tests rc=$? in $((SECONDS - t0)) s" | tee -a "$out/tests.txt"
cat "$out/shift.txt"; tail -5 "$out/tests.txt"
