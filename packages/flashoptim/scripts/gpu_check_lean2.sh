#!/usr/bin/env bash
# Which lean part (v4 LEAN, FLASHOPTIM_LEAN_PARTS bits) breaks GPU bit-equality, and what the
# bitwise-proven parts buy. One H200, repo root, <= 100 s:
#   bash packages/flashoptim/scripts/gpu_check_lean2.sh OUTDIR
# (CPU dry run: TRITON_INTERPRET=1 FO_SMOKE=1 ..., tiny tensors; PARTS are GPU-only there)
# Bits (_core.LEAN_*): 1 ST scale stores from registers, 2 UNPACK bf16 shift/mask,
# 4 CVT cvt.rn.bf16x2, 8 Q2 SIMD16 q and 1/q, 16 PIN explicit fma of the two-product sums.
# 1. three processes at once (compile-bound, no timing): scripts/lean_parts_check.py
#    bitwise for AdamW wd 0.1 and Adam wd 0.1 eps 0 (every variant: unpinned_all = the
#    failing 2026-12-01 run, triton_only, pin_only, each part + PIN, all + PIN) and SGD
#    Nesterov (unpinned_all, pin_only, all + PIN): 1M + odd sizes, 3 steps, BLOCK 1024 /
#    4 warps / PF 2.
#    OUTDIR/parts_{adamw,sgd,adam}.{json,txt}: bitwise per variant, differing elements per
#    state, first 5 (tensor, index, old hex, new hex); a fourth process compiles the
#    bench's kernels meanwhile (16M params)                                   <= 45 s
# 2. the parts every file proved (pick), then one process: AdamW no-check and check,
#    537M params, 20 interleaved CUDA-event steps of: old (today's default) and old+PIN
#    at BLOCK 1024/4w/PF 2, lean with the proven parts there, old and lean at BLOCK
#    2048/4w/PF 1. OUTDIR/parts_bench.{json,txt}                                 <= 50 s
set -uo pipefail
out="${1:?usage: gpu_check_lean2.sh OUTDIR}"
mkdir -p "$out"
export PYTHONPATH=packages/flashoptim/src PYTHONUNBUFFERED=1
S=packages/flashoptim/scripts/lean_parts_check.py
t0=$SECONDS
ts() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/log.txt"; }
ts "bitwise per part"
timeout -k 2 45 python3 "$S" bitwise "$out" --opt adamw --variants all ${FO_SMOKE:+--smoke} >"$out/bitwise-adamw.txt" 2>&1 &
pa=$!
timeout -k 2 45 python3 "$S" bitwise "$out" --opt sgd --variants quick ${FO_SMOKE:+--smoke} >"$out/bitwise-sgd.txt" 2>&1 &
ps=$!
timeout -k 2 45 python3 "$S" bitwise "$out" --opt adam --variants all ${FO_SMOKE:+--smoke} >"$out/bitwise-adam.txt" 2>&1 &
pc=$!
# meanwhile compile the bench's kernels into Triton's cache (16M params, same specializations;
# the lean side with all parts, the expected pick)
timeout -k 2 45 python3 "$S" bench "$out" --parts 31 --reps 1 --small --tag _warm ${FO_SMOKE:+--smoke} >"$out/bench-warm.txt" 2>&1 &
pw=$!
wait $pa; ra=$?
wait $ps; rs=$?
wait $pc; rc=$?
wait $pw; rw=$?
ts "bitwise rc= $ra $rs $rc (warm-up rc=$rw)"
cat "$out"/parts_adamw.txt "$out"/parts_sgd.txt "$out"/parts_adam.txt 2>/dev/null | tee -a "$out/log.txt"
parts=$(timeout 10 python3 "$S" pick "$out" 2>>"$out/log.txt" | tail -1)
parts=${parts:-31}
ts "bench with PARTS=$parts (proven parts)"
left=$((98 - SECONDS + t0))
[ "$left" -gt 50 ] && left=50
timeout -k 2 "$left" python3 "$S" bench "$out" --parts "$parts" --reps 20 ${FO_SMOKE:+--smoke --reps 2} >"$out/bench.txt" 2>&1
ts "bench rc=$?"
cat "$out/bench.txt" | tee -a "$out/log.txt"
true
