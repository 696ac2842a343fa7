"""Static sm_90 resource usage of the second-order kernels, without a GPU.

    PYTHONPATH=packages/flashsinkhorn/src python3 packages/flashsinkhorn/scripts/sm90_resources.py

Compiles (Triton AOT, target ``cuda:90``; needs only the ptxas/cuobjdump that ship with
Triton) the kernels on the HVP's path and prints registers, stack (spill) bytes, and the
counts of wgmma / cvt.rna.tf32 / cp.async instructions in the PTX:

- the Sinkhorn loop of ``solve_potentials`` (triton backend), D <= 128: since 2026-11-29 the
  main ``_softmin_kernel`` (through ``kernels.softmin``, one feature chunk), at precision
  tf32x3 (the second-order default) and tf32 for the fixed no-autotune config (64 x 64,
  4 warps, 2 stages) and every config the autotuner may pick for D <= 128, at d = 64 and
  d = 128, with and without labels; and at precision ieee (d = 64), which keeps the old
  kernel because the main one spills more there;
- the same loop for D > 128 (OTDD at d = 784): the second-order ``_row_lse_kernel`` as
  before, and the main kernel at its large-D configs for comparison (both spill);
- the HVP / CG passes: the second-order ``_row_apply_kernel`` (unchanged, still spills).

See NOTES.md, "Why the HVP's Sinkhorn loop is slow" and "The HVP's Sinkhorn loop on the main
kernel".
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashsinkhorn import kernels as K
from flashsinkhorn.second_order import _stream as S

TARGET = GPUTarget("cuda", 90, 32)
PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "cvt.rna.tf32": r"cvt\.rna\.tf32",
    "cp.async": r"cp\.async\.(ca|cg)",
}


def _types(ptr="", i32="", fp32="", i32ptr=""):
    """name -> Triton type of the run-time arguments (space-separated names)."""
    out = {}
    for names, t in ((ptr, "*fp32"), (i32ptr, "*i32"), (i32, "i32"), (fp32, "fp32")):
        out.update({k: t for k in names.split()})
    return out


def cubin_resources(cubin: bytes) -> str:
    """ "REG:n STACK:n" of a compiled kernel, from the cuobjdump shipped with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", fh.name], capture_output=True, text=True
        ).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))


def _report(name, fn, types, constexprs, warps, stages):
    names = list(fn.arg_names)
    sig = {k: ("constexpr" if k in constexprs else types[k]) for k in names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    res = cubin_resources(k.asm["cubin"])
    counts = ", ".join(f"{p} {len(re.findall(r, ptx))}" for p, r in PATTERNS.items())
    print(f"| {name} | {warps} warps, {stages} stages | {res} | {counts} |")


def main():
    print(f"triton {triton.__version__}, target sm_90 (static compile, no GPU)")
    print("| kernel | launch | registers, stack bytes | PTX instructions |")
    print("|---|---|---|---|")
    sm_t = _types(
        "X Y BIAS CX OUT LSE V VBAR W",
        "N M D DV K2 N_KEY M_KEY",
        "dot_scale inv_eps2 eps_ln2 damping w_scale",
        i32ptr="LX LY",
    )
    app_t = _types(
        "X Y F G LT W OUT1 A B U OUT2",
        "n m D E K1 K2 sxm sym slt swm sam sbm sum_ so1 so2",
        "scale",
        i32ptr="LX LY",
    )
    for prec in ("tf32", "tf32x3"):
        # the CG matvec (W a vector, no Q) and the HVP's first row pass at d = 64 (W with
        # 64 columns per grid chunk, Q of E = 2d, U with d + 1 columns)
        app = dict(HAS_LABELS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, PRECISION=prec)
        vec = dict(app, HAS_Q=False, W_VEC=True, U_VEC=True, BLOCK_E=16, BLOCK_K1=16)
        _report(f"second-order _row_apply_kernel, CG matvec, {prec} 64x64",
                S._row_apply_kernel, app_t, dict(vec, BLOCK_K2=16), 4, 2)  # fmt: skip
        first = dict(app, HAS_Q=True, W_VEC=False, U_VEC=False, BLOCK_E=64, BLOCK_K1=64)
        _report(f"second-order _row_apply_kernel, HVP first pass, {prec} 64x64",
                S._row_apply_kernel, app_t, dict(first, BLOCK_K2=128), 4, 2)  # fmt: skip
    # the Sinkhorn loop of solve_potentials, D <= 128: main _softmin_kernel, B = 1
    base = dict(BLOCK_DV=16, HAS_V=False, HAS_LSE=False, NUM_D=1)
    small = [K._FIXED] + [c for c in K._TUNE_SMALL_D if c != K._FIXED]
    for d, prec, lab in ((64, "tf32x3", False), (64, "tf32", False), (64, "tf32x3", True),
                         (128, "tf32x3", False), (64, "ieee", False)):  # fmt: skip
        for bm, bn, w, st in small:
            sm_c = dict(base, BLOCK_D=d, EVEN_D=True, HAS_LABELS=lab, PREC=prec)
            sm_c.update(BLOCK_M=bm, BLOCK_N=bn)
            tag = " labels" if lab else ""
            _report(f"main _softmin_kernel d={d}{tag} {prec} {bm}x{bn}", K._softmin_kernel,
                    sm_t, sm_c, w, st)  # fmt: skip
    # D > 128 (OTDD, d = 784 with labels) and ieee: the loop keeps the second-order kernel;
    # the main kernel at its large-D configs for comparison (13 chunks of 64)
    lse_t = _types("X Y G LT OUT", "n m D sxm sym slt", "scale", i32ptr="LX LY")
    for prec, lab in (("tf32x3", False), ("tf32x3", True), ("ieee", False)):
        lse_c = dict(HAS_LABELS=lab, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, PRECISION=prec)
        _report(f"second-order _row_lse_kernel labels={lab} {prec} 64x64 (any d)",
                S._row_lse_kernel, lse_t, lse_c, 4, 2)  # fmt: skip
    for bm, bn, w, st in K._TUNE_LARGE_D:
        sm_c = dict(base, BLOCK_D=64, NUM_D=13, EVEN_D=False, HAS_LABELS=True, PREC="tf32x3")
        sm_c.update(BLOCK_M=bm, BLOCK_N=bn)
        _report(f"main _softmin_kernel d=784 labels tf32x3 {bm}x{bn}", K._softmin_kernel,
                sm_t, sm_c, w, st)  # fmt: skip


if __name__ == "__main__":
    main()
