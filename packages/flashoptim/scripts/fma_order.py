"""Offline (sm_90, no GPU) check of FMA contraction order, default vs lean v4 tile math.

    python packages/flashoptim/scripts/fma_order.py [--old-parts 16 --new-parts 31]

LLVM fuses the *first* operand of ``fadd(fmul, fmul)`` (both single-use) into the ``fma``;
the operand order comes from LLVM's canonicalization and changes when the surrounding code
does. For 8 modes this lists every such sum in the optimized LLVM IR (source line, first
product, second product; ``argN`` = kernel argument N, ``@L`` = value defined on line L,
``?`` = other), default (LEAN 0) vs lean (LEAN 2), and says SAME / DIFFERENT per mode.
The verdict compares the PTX: every ``fma.rn.f32`` with a scalar argument (b2, one_m_b2,
decay_mult, ...) as (arguments among its factors, addend argument or x).
``--old-parts 0 --new-parts 15`` shows the order differences behind the 2026-12-01 GPU
mismatch; with LEAN_PIN (16) on both sides none may be left.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # sass_count next to this file
import sass_count as sc  # noqa: E402

from flashoptim import _core  # noqa: E402

CASES = {
    "adamw": ("adamw", {}),
    "adam_coupled": ("adamw", dict(DECOUPLED=False)),
    "adamw_fp32_states": ("adamw", dict(QUANT=False)),
    "adamw_fp32_scales": ("adamw", dict(SCALE_F32=True)),
    "sgd_nesterov": ("sgd", dict(DECOUPLED=False, NESTEROV=True)),
    "sgd_momentum_dec": ("sgd", {}),
    "sgd_no_momentum": ("sgd", dict(HAS_MOM=False, DECOUPLED=False)),
    "lion": ("lion", {}),
}
DEF = re.compile(
    r"^\s*(%[\w.]+) = (\w+)(?: \w+)* (float|<2 x float>) ([^,]+), ([^,]+?)(?:, !dbg (!\d+))?$",
    re.M,
)


def two_product_sums(llir: str) -> collections.Counter:
    defs = {}
    for m in DEF.finditer(llir):
        width = 2 if "<2" in m.group(3) else 1
        defs[m.group(1)] = (m.group(2), m.group(4), m.group(5), m.group(6), width)
    head = re.search(r"define ptx_kernel void @\w+\((.*)$", llir, re.M).group(1)
    nargs = len(re.findall(r"%\d+", head))
    locs = dict(re.findall(r"^(!\d+) = !DILocation\(line: (\d+)", llir, re.M))

    def fac(x):
        if re.fullmatch(r"%\d+", x) and int(x[1:]) < nargs:
            return "arg" + x[1:]
        d = defs.get(x)
        return f"@{locs.get(d[3])}" if d else "?"

    res = collections.Counter()
    for op, a, b, d, w in defs.values():
        if op in ("fadd", "fsub"):
            da, db = defs.get(a), defs.get(b)
            if da and db and da[0] == "fmul" and db[0] == "fmul":
                key = (
                    locs.get(d),
                    op,
                    fac(da[1]) + "*" + fac(da[2]),
                    fac(db[1]) + "*" + fac(db[2]),
                )
                res[key] += w
    return res


PARAM = re.compile(r"ld\.param\.b32\s+(%r\d+), \[\w+_param_(\d+)\]")
FMA = re.compile(r"^\s*fma\.rn\.f32\s+%r\d+, (%r\d+), (%r\d+), (%r\d+);", re.M)


def fma_params(ptx: str, argnames) -> collections.Counter:
    """Every ``fma.rn.f32`` with a scalar kernel argument among its operands, as (the
    arguments among the two factors, the argument or "x" that is the addend): which
    product each two-product sum fused, independent of register names."""
    reg = {r: argnames[int(i)] for r, i in PARAM.findall(ptx)}
    res = collections.Counter()
    for a, b, c in FMA.findall(ptx):
        fac = tuple(sorted(reg[x] for x in (a, b) if x in reg))
        if fac or c in reg:
            res[(fac, reg.get(c, "x"))] += 1
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-parts", type=lambda x: int(x, 0), default=_core.LEAN_PIN)
    ap.add_argument("--new-parts", type=lambda x: int(x, 0), default=_core.LEAN_ALL)
    ap.add_argument("--new-lean", type=int, default=2, help="LEAN of the new side (0: PIN alone)")
    ap.add_argument("--pf", default="0,2", help="v4 L2 prefetch values to compile (2: default)")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--warps", type=int, default=4)
    a = ap.parse_args(argv)
    orig_sig = sc._sig_v2
    bad = 0
    cases = [
        (f"{n} pf{pf}", m, e, int(pf)) for pf in a.pf.split(",") for n, (m, e) in CASES.items()
    ]
    for name, mode, extra, pf in cases:
        out = []
        for lean, parts in ((0, a.old_parts), (a.new_lean, a.new_parts)):
            sc.LEAN_ARG[0], sc.PARTS_ARG[0] = lean, parts

            quant = extra.get("QUANT", True)

            def sig(orig=orig_sig, quant=quant):
                s = orig()
                if not quant:
                    s.update(m_base="*fp32", v_base="*fp32")
                return s

            sc._sig_v2 = sig
            try:
                k = sc.compile_step(
                    _core._step_kernel_v4,
                    mode,
                    extra=dict(extra),
                    pf=pf,
                    block=a.block,
                    warps=a.warps,
                )
            finally:
                sc._sig_v2 = orig_sig
            argnames = _core._step_kernel_v4.arg_names
            out.append((two_product_sums(k.asm["llir"]), fma_params(k.asm["ptx"], argnames)))
        # verdict from the PTX (the IR listing misses sums whose operands come in vectors)
        same = out[0][1] == out[1][1]
        bad += not same
        print(f"== {name}: PTX fma operands {'SAME' if same else 'DIFFERENT'}  (old / new)")
        for key in sorted(set(out[0][1]) | set(out[1][1]), key=str):
            print("    fma", key, out[0][1].get(key, 0), out[1][1].get(key, 0))
        for key in sorted(set(out[0][0]) | set(out[1][0]), key=str):
            print("    IR ", key, out[0][0].get(key, 0), out[1][0].get(key, 0))
    print("modes with a different order:", bad)
    return 0


if __name__ == "__main__":
    sys.exit(main())
