"""Static sm_90 view of the softmin kernel variants, without a GPU.

    PYTHONPATH=packages/flashsinkhorn/src python3 \
        packages/flashsinkhorn/scripts/softmin_variants_sm90.py

Compiles (Triton AOT, target ``cuda:90``, the local Triton and its ptxas) the default
``_softmin_kernel`` and each ``_softmin_variant_kernel`` mode (kernels.py,
FLASHSINKHORN_SOFTMIN_VARIANT) at d = 64 and d = 512 and prints registers / stack bytes
and the order of the tensor-core and exp instructions in the SASS (after ptxas, which
reorders): ``H8`` = 8 HGMMA (wgmma) issued, ``DEP`` = WARPGROUP.DEPBAR (wait for wgmma),
``E34`` = 34 MUFU.EX2, ``BAR`` = bar.sync, ``BRA`` = branch (the main loop is between the
first two BRA). "serialized" is ptxas waiting after every wgmma (as many DEPBAR as HGMMA):
it does that to a whole kernel when an in-flight accumulator register is read. A loop where
HGMMA and EX2 interleave with no DEPBAR between them runs the tile's dot during the exps
(the overlap the "pipe" variant is for).

With the argument ``shift`` it prints instead the default kernel against the "shift"
variant at d = 64 (tf32 and bf16 operands, every small-d autotune config): registers,
shared memory, and per loop (each backward branch of the SASS) the instructions of one
tile per thread with the counts of MUFU (exp2), FFMA, FADD, FMNMX (row max), SHFL, HGMMA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashsinkhorn import kernels as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_resources import cubin_resources  # noqa: E402  (the sibling script's helper)

TARGET = GPUTarget("cuda", 90, 32)


def _signature(fn, constexprs, bf16):
    types = {}
    for names, t in (
        ("X Y BIAS CX OUT LSE V VBAR W GUESS", "*fp32"),
        ("LX LY FALLBACK", "*i32"),
        ("N M D DV K2 N_KEY M_KEY", "i32"),
        ("dot_scale inv_eps2 eps_ln2 damping w_scale", "fp32"),
    ):
        types.update({k: t for k in names.split()})
    if bf16:
        types["X"] = types["Y"] = "*bf16"
    return {k: ("constexpr" if k in constexprs else types[k]) for k in fn.arg_names}


def _compile_kernel(fn, constexprs, warps, stages, bf16):
    sig = _signature(fn, constexprs, bf16)
    # what the JIT specializes at the 50k problem: 16-byte aligned pointers, and N, M, D
    # multiples of 16 (without it 16-bit loads are scalar and never use cp.async)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, k in enumerate(fn.arg_names)
        if sig[k].startswith("*") or k in ("N", "M", "D")
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def _compile(fn, constexprs, warps, stages, bf16):
    k = _compile_kernel(fn, constexprs, warps, stages, bf16)
    return cubin_resources(k.asm["cubin"]), sass_order(k.asm["cubin"])


def _sass(cubin):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([tool, "-sass", fh.name], capture_output=True, text=True).stdout


LOOP_OPS = ("MUFU", "FFMA", "FADD", "FMNMX", "SHFL", "HGMMA")


def loop_counts(cubin):
    """Per loop of the SASS (a backward BRA and its target): (instructions, Counter of
    opcodes without modifiers), in program order."""
    ins = []
    for line in _sass(cubin).splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    out = []
    for addr, txt in ins:
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t.split() for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = Counter((w[1] if w[0].startswith("@") else w[0]).split(".")[0] for w in body)
            out.append((len(body), ops))
    return out


def shift_main():
    """Default kernel vs the "shift" variant at d = 64 (static sm_90, per-tile counts)."""
    print(f"triton {triton.__version__}, target sm_90 (static compile, no GPU)\n")
    print("| kernel | operands | config (BM, BN, warps, stages) | registers, stack | smem | "
          "loops: instructions per tile per thread (" + " ".join(LOOP_OPS) + ") |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    base = dict(BLOCK_D=64, NUM_D=1, EVEN_D=True, HAS_LABELS=False, HAS_LSE=False, PREC="tf32")
    for label, bf16 in (("tf32", False), ("bf16", True)):
        for bm, bn, w, st in K._TUNE_SMALL_D + [K._FIXED]:
            kinds = [("default", K._softmin_kernel,
                      dict(base, BLOCK_DV=16, HAS_V=False, BLOCK_M=bm, BLOCK_N=bn)),
                     ("shift", K._softmin_variant_kernel,
                      dict(base, MODE=K._VARIANT_MODE["shift"], COUNT_FALLBACK=False,
                           LOOP_STAGES=st, BLOCK_M=bm, BLOCK_N=bn))]  # fmt: skip
            for name, fn, c in kinds:
                k = _compile_kernel(fn, c, w, st, bf16)
                loops = "; ".join(
                    f"{n}: " + " ".join(str(ops[o]) for o in LOOP_OPS)
                    for n, ops in loop_counts(k.asm["cubin"])
                )
                print(f"| {name} | {label} | {bm}, {bn}, {w}, {st} | "
                      f"{cubin_resources(k.asm['cubin'])} | {k.metadata.shared} | {loops} |",
                      flush=True)  # fmt: skip


SASS_TOKENS = (
    ("H", r"HGMMA"),
    ("DEP", r"WARPGROUP\.DEPBAR"),
    ("E", r"MUFU\.EX2"),
    ("BAR", r"\bBAR\.SYNC"),
    ("BRA", r"\bBRA\b"),
)


def sass_order(cubin):
    """Compressed order of HGMMA / DEPBAR / EX2 / BAR / BRA in the SASS of a cubin, and
    whether ptxas serialized the wgmma (a DEPBAR per HGMMA). Needs Triton's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        sass = subprocess.run([tool, "-sass", fh.name], capture_output=True, text=True).stdout
    toks = [name for line in sass.splitlines() for name, pat in SASS_TOKENS if re.search(pat, line)]
    out, prev, n = [], None, 0
    for t in toks + [None]:
        if t == prev:
            n += 1
            continue
        if prev is not None:
            out.append(prev + (str(n) if n > 1 else ""))
        prev, n = t, 1
    n_h, n_dep = toks.count("H"), toks.count("DEP")
    serialized = n_h > 2 and n_dep >= n_h - 1
    return ("serialized: " if serialized else "") + " ".join(out)


def main():
    print(f"triton {triton.__version__}, target sm_90 (static compile, no GPU)\n")
    print("| kernel | d | operands | config (BM, BN, warps, stages) | registers, stack | "
          "SASS order |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    cases = [(64, "tf32", False), (64, "bf16", True), (512, "tf32", False)]
    configs = {64: [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3)],
               512: [(128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2),
                     (128, 64, 8, 3), (64, 64, 4, 3)]}  # fmt: skip
    for d, label, bf16 in cases:
        block_d = 64 if d > 128 else d
        num_d = d // block_d
        base = dict(BLOCK_D=block_d, NUM_D=num_d, EVEN_D=True, HAS_LABELS=False, HAS_LSE=False,
                    PREC="tf32")  # fmt: skip
        for bm, bn, w, st in configs[d]:
            kinds = [("default", K._softmin_kernel,
                      dict(base, BLOCK_DV=16, HAS_V=False, BLOCK_M=bm, BLOCK_N=bn))]  # fmt: skip
            for name, mode in K._VARIANT_MODE.items():
                c = dict(
                    base, MODE=mode, LOOP_STAGES=st, BLOCK_M=bm, BLOCK_N=bn, COUNT_FALLBACK=False
                )
                kinds.append((name, K._softmin_variant_kernel, c))
            for name, fn, c in kinds:
                try:
                    res, sched = _compile(fn, c, w, st, bf16)
                except Exception as e:  # noqa: BLE001 - a variant that fails is a row
                    res, sched = "compile error", repr(e)[:120]
                print(f"| {name} | {d} | {label} | {bm}, {bn}, {w}, {st} | {res} | {sched} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    shift_main() if sys.argv[1:] == ["shift"] else main()
