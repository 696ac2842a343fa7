"""Static sm_90 SASS of flashsinkhorn's default kernels, without a GPU: hash it, compare it.

    # triton 3.6 (the H200 host's version) with CPU torch, from the repo root:
    PYTHONPATH=packages/flashsinkhorn/src python \
        tools/flashsinkhorn/sass_check.py --json after.json [--compare before.json]

What it does: runs the package's own public launchers (``softmin`` with and without a
``guess`` and with ``v``, ``self_softmin``, the second-order ``row_apply``)
on small CPU tensors whose sizes have the same integer specializations as the benchmark
problems (multiples of 16), with Triton's launch replaced by a recorder: every kernel the
launcher would start is captured with the exact signature, constexprs and attributes the JIT
computes. Each capture is then compiled offline for ``GPUTarget("cuda", 90, 32)`` at every
tile config the package can launch it with on the GPU (the autotune space, or the fixed
config of the plan application and second-order passes), and the SASS (cuobjdump, with the
kernel's name replaced by ``KERNEL``) is hashed. ``--compare`` prints, per kernel and
config, whether the SASS is identical to an earlier ``--json`` (for example one made from a
``git archive`` of the previous commit), and exits 1 if any differs or is missing.

It runs with the package at any commit since 1cd3e42 (the old ``flashsinkhorn.kernels``
layout or the split one): it only uses the public functions and reads the tile configs
from wherever the package keeps them. Registers / stack bytes come with each row;
``--loops`` adds per-loop instruction counts (MUFU FFMA FADD FMNMX SHFL HGMMA per tile per
thread, the SASS between a backward branch and its target).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions, not the interpreter
os.environ["FLASHSINKHORN_NO_AUTOTUNE"] = "1"  # one config per launch: captured, then swept

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import driver as _driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

# the running-max, shift and self-transport kernels' tile spaces (BLOCK_M, BLOCK_N, warps,
# stages) as the package defines them; read from the package below and checked equal
TUNE_SMALL_D = [
    (128, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (64, 128, 4, 4),
    (256, 64, 8, 3),
]
TUNE_LARGE_D = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)]
PLAN_APPLY = (128, 64, 8, 3)  # with V, DV <= 64
PLAN_APPLY_WIDE = (64, 64, 8, 3)  # with V, DV > 64 (256-wide output chunks)
SELF_TUNE = [(128, 8, 2), (128, 8, 3), (64, 4, 3)]  # (BLOCK, warps, stages)
SAMPLE_TUNE = [(64, 128, 4, 3), (128, 128, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2)]

# kernel name -> role (old names first: the shift kernel was MODE 8 of the variant kernel)
ROLES = {
    "_softmin_kernel": "running-max",
    "_softmin_variant_kernel": "shift",
    "_softmin_shift_kernel": "shift",
    "_self_softmin_kernel": "self-symmetric",
    "_row_apply_kernel": "second-order-row-apply",
    "_softmax_sample_kernel": "sample",
    "_sample_blocks_kernel": "sample",
    "_sample_pick_kernel": "sample-pick",
    "_keys_kernel": "sample-keys",
}
# constexprs that only selected a mode of a deleted kernel (dropped before comparing)
DROPPED = {"MODE", "LOOP_STAGES"}


class _StubDriver:
    """Just enough of a CUDA driver for the JIT to specialize and compile for sm_90."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):  # pragma: no cover - one config per launch, never benchmarks
        raise RuntimeError("sass_check does not benchmark")


CAPTURED: list[dict] = []


def _recording_run(self, *args, grid, warmup, **kwargs):
    """JITFunction.run without compiling or launching: record what would be compiled."""
    kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[0]
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    CAPTURED.append(
        dict(
            fn=self,
            signature=signature,
            constexprs=constexprs,
            attrs=attrs,
            num_warps=options.num_warps,
            num_stages=options.num_stages,
        )
    )
    return None


def _tile_configs(pkg):
    """The package's tile spaces; must equal the ones above (else the sweep is wrong)."""
    found = {}
    for mod_name in ("flashsinkhorn._config", "flashsinkhorn.kernels"):
        try:
            mod = __import__(mod_name, fromlist=["x"])
        except ImportError:
            continue
        for ours, names in (
            ("TUNE_SMALL_D", ("TUNE_SMALL_D", "_TUNE_SMALL_D")),
            ("TUNE_LARGE_D", ("TUNE_LARGE_D", "_TUNE_LARGE_D")),
        ):
            for n in names:
                if hasattr(mod, n):
                    found[ours] = [tuple(c) for c in getattr(mod, n)]
    for k, v in found.items():
        if v != globals()[k]:
            raise SystemExit(f"the package's {k} {v} differs from sass_check's {globals()[k]}")
    if len(found) != 2:
        raise SystemExit(f"tile configs not found in the package: {sorted(found)}")


def _sass(cubin: bytes, name: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "-sass", fh.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    # the kernel's name (and its mangled forms) is the only thing allowed to differ
    out = out.replace(name, "KERNEL")
    return "\n".join(line for line in out.splitlines() if "code for sm_" not in line)


def _resources(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        usage = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", fh.name],
            capture_output=True,
            text=True,
        ).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+", usage))


LOOP_OPS = ("MUFU", "FFMA", "FADD", "FMNMX", "SHFL", "HGMMA")


def loop_counts(sass: str) -> str:
    """Per loop of the SASS (a backward BRA and its target): the instructions of one
    iteration and the counts of LOOP_OPS, e.g. "290: 32 32 68 0 4 8"."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    out = []
    for addr, txt in ins:
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t.split() for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = Counter((w[1] if w[0].startswith("@") else w[0]).split(".")[0] for w in body)
            out.append(f"{len(body)}: " + " ".join(str(ops[o]) for o in LOOP_OPS))
    return "; ".join(out)


def _configs_for(role, constexprs, num_warps, num_stages):
    """(name, constexpr overrides, warps, stages) for every GPU config of one capture."""
    if role in ("running-max", "shift", "sample"):
        if constexprs.get("HAS_V"):
            wide = constexprs["BLOCK_DV"] > 64
            bm, bn, w, st = PLAN_APPLY_WIDE if wide else PLAN_APPLY
            return [(f"{bm}x{bn}/{w}w/{st}s", dict(BLOCK_M=bm, BLOCK_N=bn), w, st)]
        space = TUNE_SMALL_D if constexprs["NUM_D"] == 1 else TUNE_LARGE_D
        extra = {}
        if role == "sample" and "FAST_LOG2" in constexprs:  # the per-score kernel (<= #30)
            space, extra = SAMPLE_TUNE, dict(FAST_LOG2=True)
        elif role == "sample":
            space = SAMPLE_TUNE
        return [
            (f"{bm}x{bn}/{w}w/{st}s", dict(BLOCK_M=bm, BLOCK_N=bn, **extra), w, st)
            for bm, bn, w, st in space
        ]
    if role == "sample-keys":  # launched at Triton's defaults
        return [("1024/4w/3s", {}, 4, 3)]
    if role == "sample-pick":  # the GPU's rows and feature chunk (the capture's: the
        # interpreter's)
        return [("8 rows/16 features/4w", dict(ROWS=8, BLOCK_D=16), 4, 3)]
    if role == "self-symmetric":
        return [(f"{b}/{w}w/{st}s", dict(BLOCK=b), w, st) for b, w, st in SELF_TUNE]
    # second order: the GPU's fixed 64 x 64 tiles, 4 warps, 2 stages
    bd = constexprs["BLOCK_D"]
    return [("64x64/4w/2s", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=bd), 4, 2)]


def _scenarios():
    """(name, callable) pairs; each runs the public launchers once on CPU tensors."""
    import flashsinkhorn as fs

    try:
        from flashsinkhorn import kernels as K  # the layout up to 1cd3e42
    except ImportError:
        K = fs
    from flashsinkhorn import _hessian_triton as S

    gen = torch.Generator().manual_seed(0)
    n = 4096  # same integer specializations (multiples of 16) as the 50k benchmarks

    def clouds(d, dtype=torch.float32):
        x = torch.rand(1, n, d, generator=gen).to(dtype)
        y = torch.rand(1, n, d, generator=gen).to(dtype)
        return x, y

    def sm(d, precision, *, guess=False, v=None, labels=False, want_lse=False):
        kdt = torch.bfloat16 if precision == "bf16" else torch.float32
        x, y = clouds(d, kdt)  # prepared operands, as Problem passes them
        g = torch.zeros(1, n)
        logb = torch.full((1, n), -8.0)
        cx, cy = torch.zeros(1, n), torch.zeros(1, n)
        lab = None
        if labels:
            lab = (
                torch.zeros(1, n, dtype=torch.int32),
                torch.zeros(1, n, dtype=torch.int32),
                torch.rand(16, 16),
                0.5,
            )
        vv = None if v is None else torch.rand(1, n, v).to(kdt)
        K.softmin(
            x,
            y,
            g,
            logb,
            cx,
            cy,
            eps=0.01,
            c2=2.0,
            v=vv,
            labels=lab,
            precision=precision,
            backend="triton",
            want_lse=want_lse,
            guess=torch.zeros(1, n) if guess else None,
        )

    def self_sm(d, precision):
        x, _ = clouds(d)
        K.self_softmin(
            x,
            torch.full((1, n), -8.0),
            torch.zeros(1, n),
            torch.zeros(1, n),
            eps=0.01,
            c2=1.0,
            precision=precision,
            backend="triton",
            check=False,
        )

    def so_apply(d):
        x, y = clouds(d)
        S.row_apply(
            x[0], y[0], torch.zeros(n), torch.zeros(n), 0.01, torch.rand(n), backend="triton"
        )

    def sample(d, precision):
        from flashsinkhorn.sampling import softmax_sample

        kdt = torch.bfloat16 if precision == "bf16" else torch.float32
        x, y = clouds(d, kdt)
        softmax_sample(
            x,
            y,
            torch.zeros(1, n),
            torch.full((1, n), -8.0),
            torch.zeros(1, n),
            eps=0.01,
            c2=2.0,
            seed=1,
            precision=precision,
            backend="triton",
        )

    out = []
    for d in (64, 512, 1024, 3):
        for prec in ("tf32", "bf16", "tf32x3", "ieee") if d == 64 else ("tf32",):
            out.append((f"shift d={d} {prec}", lambda d=d, p=prec: sm(d, p, guess=True)))
            out.append((f"cold d={d} {prec}", lambda d=d, p=prec: sm(d, p)))
    out += [
        (
            "shift d=64 tf32 labels lse",
            lambda: sm(64, "tf32", guess=True, labels=True, want_lse=True),
        ),
        ("shift d=512 bf16", lambda: sm(512, "bf16", guess=True)),
        ("cold d=64 tf32x3 labels", lambda: sm(64, "tf32x3", labels=True)),
        ("plan-apply d=64 DV=64 tf32 lse", lambda: sm(64, "tf32", v=64, want_lse=True)),
        ("plan-apply d=512 DV=512 tf32", lambda: sm(512, "tf32", v=512)),
        ("plan-apply d=64 DV=64 bf16", lambda: sm(64, "bf16", v=64)),
        ("self d=64 tf32", lambda: self_sm(64, "tf32")),
        ("sample d=64 tf32", lambda: sample(64, "tf32")),
        ("sample d=512 tf32", lambda: sample(512, "tf32")),
        ("self d=512 tf32", lambda: self_sm(512, "tf32")),
        ("second-order row_apply d=64", lambda: so_apply(64)),
    ]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the hashes here")
    ap.add_argument("--compare", help="an earlier --json: report identical / different")
    ap.add_argument("--only", help="substring of the scenario names to run")
    ap.add_argument(
        "--loops",
        action="store_true",
        help="also print per-loop instruction counts (" + " ".join(LOOP_OPS) + ")",
    )
    args = ap.parse_args(argv)

    _tile_configs(None)
    # the launchers check for CUDA tensors or the interpreter at call time: claim the
    # interpreter there (kernels were decorated without it, so they stay JIT functions)
    os.environ["TRITON_INTERPRET"] = "1"
    _driver.set_active(_StubDriver())
    JITFunction.run = _recording_run

    rows = {}
    t_all = time.time()
    for name, run in _scenarios():
        if args.only and args.only not in name:
            continue
        CAPTURED.clear()
        run()
        if not CAPTURED:
            raise SystemExit(f"{name}: no kernel launch captured")
        for cap in list(CAPTURED):  # the sampling scenario launches the keys kernel first
            _compile_capture(name, cap, rows, args)
    print(
        f"{len(rows)} kernels compiled in {time.time() - t_all:.0f} s (triton "
        f"{triton.__version__}, sm_90)"
    )
    return _finish(rows, args)


def _compile_capture(name, cap, rows, args):
    """Compile one captured launch at every config it can run with; record the rows."""
    fn = cap["fn"]
    fname = fn.fn.__name__
    role = ROLES.get(fname, fname)
    consts = {k[0] if isinstance(k, tuple) else k: v for k, v in cap["constexprs"].items()}
    for cfg_name, over, warps, stages in _configs_for(role, _by_name(fn, consts), 0, 0):
        cexpr = dict(cap["constexprs"])
        for key in list(cexpr):
            pname = fn.arg_names[key[0]] if isinstance(key, tuple) else key
            if pname in over:
                cexpr[key] = over[pname]
        t0 = time.time()
        k = triton.compile(
            ASTSource(fn=fn, signature=cap["signature"], constexprs=cexpr, attrs=cap["attrs"]),
            target=TARGET,
            options=dict(num_warps=warps, num_stages=stages),
        )
        dt = time.time() - t0
        sass = _sass(k.asm["cubin"], k.metadata.name)
        sig = {p: t for p, t in cap["signature"].items() if p not in DROPPED}
        key = f"{name} | {role} | {cfg_name}"
        rows[key] = dict(
            sass_sha256=hashlib.sha256(sass.encode()).hexdigest()[:16],
            resources=_resources(k.asm["cubin"]),
            sass_lines=sass.count("\n"),
            compile_s=round(dt, 2),
            signature=" ".join(f"{p}:{t}" for p, t in sig.items() if t != "constexpr"),
        )
        if args.loops:
            rows[key]["loops"] = loop_counts(sass)
        print(
            f"{key}: {rows[key]['sass_sha256']} {rows[key]['resources']} "
            f"({dt:.1f} s)" + (f" loops {rows[key]['loops']}" if args.loops else ""),
            flush=True,
        )


def _finish(rows, args):
    """Write ``--json``; with ``--compare``, the table against an earlier run (exit 1 when
    any kernel differs or is missing)."""
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"triton": triton.__version__, "rows": rows}, fh, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as fh:
            before = json.load(fh)["rows"]
        bad = 0
        print("\n| kernel | config | SASS | registers |\n|---|---|---|---|")
        for key in sorted(set(before) | set(rows)):
            b, a = before.get(key), rows.get(key)
            if b is None or a is None:
                state, bad = ("new" if b is None else "missing"), bad + 1
            elif b["sass_sha256"] == a["sass_sha256"] and b["signature"] == a["signature"]:
                state = "identical"
            else:
                state, bad = "DIFFERENT", bad + 1
            res = (a or b)["resources"]
            print(f"| {key.rsplit(' | ', 1)[0]} | {key.rsplit(' | ', 1)[1]} | {state} | {res} |")
        print(f"\n{len(rows) - bad} of {len(set(before) | set(rows))} identical")
        return 1 if bad else 0
    return 0


def _by_name(fn, consts):
    """constexprs keyed by parameter name (the JIT keys them by position)."""
    out = {}
    for k, v in consts.items():
        out[fn.arg_names[k] if isinstance(k, int) else k] = v
    return out


if __name__ == "__main__":
    sys.exit(main())
