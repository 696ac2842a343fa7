#!/usr/bin/env bash
# mhc-proj's layer work (#29) on a CUDA host in one call (H100 / H200, no network):
#
#   tools/mhc-proj/gpu_layer.sh OUTDIR          (from the repository root; .whl/ carried)
#
# 1. installs Liger-Kernel's wheel from .whl/ into .site/ (pure Python, the peer);
# 2. builds mhc-proj for sm_90 only (CUDAARCHS=90, all cores) into build/gpu-site/, while a
#    warm-up process compiles LigerMHC's Triton kernels into triton's disk cache (its first
#    call took about two minutes on the H200: compile and autotune);
# 3. the GPU tests of the layer: under torch.autocast("cuda") against the explicit-bf16
#    run, the hypothesis fuzz of the layer under autocast, DeepSeek's formulation end to
#    end, the paper-API aliases, the layer against float64 and the CPU path;
# 4. the training example at GPT-2-small size (12 blocks, width 768, n = 4, bf16 autocast),
#    exact projection vs Sinkhorn-20, GPT_BUDGET seconds of training (default 90) + plot;
# 5. the layer benchmark: ours (exact and Sinkhorn-20) vs LigerMHC, fwd and fwd+bwd, 32K
#    tokens, C = 7168, n = 4, bf16 stream, identity sublayer, in the same process.
# Writes OUTDIR/summary.json (steps, test counts, the example's table, the bench rows),
# summary.md (printed last), build.txt, build-check.txt, tests.txt (65 GPU tests), gpt/
# (JSON, PNG), gpt.txt, bench-layer.json and bench.txt. Expected total on an H100: about
# 7 minutes (build ~2.5, tests ~1.5, example ~2, bench ~1.5; not yet run on a GPU).
# Limits (seconds): LIMIT_BUILD 300, LIMIT_TESTS 150, LIMIT_GPT 240, LIMIT_BENCH 200.
set -uo pipefail
out="${1:?usage: tools/mhc-proj/gpu_layer.sh OUTDIR}"
mkdir -p "$out"; out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export PYTHONUNBUFFERED=1
steps="$out/steps.tsv"; : >"$steps"
say() { echo "$*" | tee -a "$out/log.txt"; }
step() {  # step NAME LIMIT_S LOGFILE CMD...
  local name="$1" limit="$2" file="$3"; shift 3
  local t0=$SECONDS
  say "=== $name (limit ${limit} s)"
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$file" 2>&1
  local rc=$?
  local status="ok"; [ $rc -ne 0 ] && status="FAILED (rc=$rc)"; [ $rc -eq 124 ] && status="TIMED OUT"
  say "=== $name: $status in $((SECONDS - t0)) s | $(tail -n 1 "$file" | cut -c1-110)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$(tail -n 1 "$file" | cut -c1-200)" >>"$steps"
  return $rc
}

site="$root/.site"; build="$root/build/gpu-site"  # both git-ignored
# the compile caches tools/gpu_run.sh carries in .gpu-cache/ (Triton kernels: Liger's), if any
cache_root="${GPU_CACHE_ROOT:-/tmp/gpu-compile-cache}"; mkdir -p "$cache_root"
if compgen -G "$root/.gpu-cache/gpu-cache.tar.xz.*" >/dev/null; then
  cat "$root"/.gpu-cache/gpu-cache.tar.xz.* | tar -xJ -C "$cache_root" 2>>"$out/log.txt" \
    && say "compile cache restored from .gpu-cache/"
fi
export TRITON_CACHE_DIR="$cache_root/triton"
if compgen -G ".whl/liger_kernel-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" --upgrade \
    .whl/liger_kernel-*.whl >"$out/install.txt" 2>&1 || say "liger-kernel install failed"
fi
export PYTHONPATH="$build:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)" | tee -a "$out/log.txt"

# Liger's kernels compile into triton's disk cache while nvcc builds ours
timeout 240 python3 - >"$out/liger-warmup.txt" 2>&1 <<'PY' &
import torch
from liger_kernel.transformers import LigerMHC
layer = LigerMHC(torch.nn.Identity(), hc=4, c=7168, phi_dtype=torch.bfloat16).cuda()
x = torch.randn(8, 4096, 4, 7168, device="cuda", dtype=torch.bfloat16, requires_grad=True)
layer(x).sum().backward()
torch.cuda.synchronize()
print("liger warm-up done")
PY
warm=$!

rm -rf "$build"
step build "${LIMIT_BUILD:-300}" "$out/build.txt" env CUDAARCHS=90 \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" python3 -m pip install -v --no-build-isolation \
  --no-deps --target "$build" packages/mhc-proj
grep -m1 "mhc_proj: building" "$out/build.txt" | tee -a "$out/log.txt"
wait "$warm" 2>/dev/null

xdist=""; python3 -c "import xdist" 2>/dev/null && xdist="-n 8"
tests=(packages/mhc-proj/tests/test_layer_training.py packages/mhc-proj/tests/test_layer_deepseek.py
       packages/mhc-proj/tests/test_torch_api.py packages/mhc-proj/tests/test_hyper_connection.py
       packages/mhc-proj/tests/test_fuzz.py)
step build-check 60 "$out/build-check.txt" env MHC_PROJ_EXPECT_CUDA=1 python3 -m pytest \
  -c pyproject.toml --rootdir . -p no:cacheprovider -q packages/mhc-proj/tests/test_build.py
step tests "${LIMIT_TESTS:-150}" "$out/tests.txt" python3 -m pytest -c pyproject.toml \
  --rootdir . -p no:cacheprovider -q -m gpu $xdist "${tests[@]}" \
  -k "not test_fuzz_birkhoff and not test_fuzz_sinkhorn"

step gpt "${LIMIT_GPT:-240}" "$out/gpt.txt" python3 packages/mhc-proj/examples/gpt_mhc.py \
  --out "$out/gpt" --time-budget "${GPT_BUDGET:-90}"
python3 packages/mhc-proj/examples/plot_gpt_mhc.py "$out/gpt/gpt_mhc.json" "$out/gpt/gpt_mhc.png" \
  >>"$out/gpt.txt" 2>&1 || say "plot failed (matplotlib?)"

step bench "${LIMIT_BENCH:-200}" "$out/bench.txt" python3 -m mhc_proj.bench --bench hc_layer \
  --providers ours liger-kernel --mode fwd fwd_bwd --json "$out/bench-layer.json"

python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
doc = {"steps": []}
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, sec, last = (line.split("\t") + [""] * 4)[:4]
    doc["steps"].append({"name": name, "status": status, "seconds": int(sec), "last": last})
lines = ["| step | status | s | last line |", "|---|---|---|---|"]
lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['last'][:90]} |" for s in doc["steps"]]
gpt = out / "gpt" / "gpt_mhc.json"
if gpt.exists():
    g = json.loads(gpt.read_text())
    doc["gpt"] = {p: {"steps": len(r["loss"]), "final_loss": r["loss"][-1],
                      "final_val": r["val_loss"][-1], "marginal_max": max(r["marginal_max"]),
                      "seconds": r["seconds"], "peak_memory_gb": r.get("peak_memory_gb")}
                  for p, r in g["runs"].items()}
    doc["gpt_env"], doc["gpt_calibration"] = g["env"], g.get("calibration")
    lines += ["", "| GPT-2-small mHC, bf16 autocast | steps | final loss | final val | H_res marginal max | s | peak GB |",
              "|---|---|---|---|---|---|---|"]
    for p, r in doc["gpt"].items():
        lines.append(f"| {p} | {r['steps']} | {r['final_loss']:.4f} | {r['final_val']:.4f} | "
                     f"{r['marginal_max']:.2e} | {r['seconds']:.0f} | {r['peak_memory_gb'] or 0:.1f} |")
bench = out / "bench-layer.json"
if bench.exists():
    b = json.loads(bench.read_text())
    rows = [r for r in b.get("results", []) if r.get("bench") == "hc_layer"]
    doc["bench_env"] = b.get("env")
    doc["bench"] = []
    lines += ["", "| layer 32K tokens, C 7168, n 4, bf16 | mode | ms | liger / this | peak MiB | of floor |",
              "|---|---|---|---|---|---|"]
    liger = {r["mode"]: r["time_ms"] for r in rows if r["provider"] == "liger-kernel" and r["time_ms"]}
    for r in rows:
        m = r.get("metrics") or {}
        proj = (r.get("params") or {}).get("projection")
        label = f"{r['provider']} ({proj})" if proj else r["provider"]
        ms = r.get("time_ms")
        ratio = liger.get(r["mode"]) / ms if ms and liger.get(r["mode"]) else None
        doc["bench"].append({"label": label, "mode": r["mode"], "time_ms": ms, "status": r["status"],
                             "liger_over_this": ratio, "peak_mem_mib": m.get("peak_mem_mib"),
                             "frac_floor": m.get("frac_floor")})
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"| {label} | {r['mode']} | {fmt(ms, '.3f') if r['status'] == 'ok' else r['status']} | "
                     f"{fmt(ratio, '.2f')} | {fmt(m.get('peak_mem_mib'), '.0f')} | {fmt(m.get('frac_floor'), '.2f')} |")
(out / "summary.json").write_text(json.dumps(doc, indent=1))
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
