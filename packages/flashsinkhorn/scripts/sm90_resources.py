"""Static sm_90 resource usage of the Sinkhorn-loop kernels, without a GPU.

    PYTHONPATH=packages/flashsinkhorn/src python3 packages/flashsinkhorn/scripts/sm90_resources.py

Compiles (Triton AOT, target ``cuda:90``; needs only the ptxas/cuobjdump that ship with
Triton) the second-order ``_row_lse_kernel`` as launched by ``solve_potentials`` (64 x 64 x
64 tiles, 4 warps, 2 stages), the main ``_softmin_kernel`` at the same tiles and at its
tuned d = 64 config (128 x 64, 8 warps, 4 stages), and a row-LSE variant that keeps its row
tile on chip like the main kernel (``_row_stationary_dot``). Prints registers, stack (spill)
bytes, and the counts of wgmma / cvt.rna.tf32 / cp.async instructions in the PTX, for
precision tf32 and tf32x3; also the second-order ``_row_apply_kernel`` (HVP passes).
See NOTES.md, "Why the HVP's Sinkhorn loop is slow".
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashsinkhorn import kernels as K
from flashsinkhorn.kernels import _load_rows, _online_lse_step, _row_stationary_dot
from flashsinkhorn.second_order import _stream as S

TARGET = GPUTarget("cuda", 90, 32)
PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "cvt.rna.tf32": r"cvt\.rna\.tf32",
    "cp.async": r"cp\.async\.(ca|cg)",
}


@triton.jit
def _row_lse_preloaded(
    X, Y, G, OUT, n, m, D, scale, NUM_D: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``_row_lse_kernel`` without labels, with the main kernel's row-stationary dot."""
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    x0 = offs_m
    if NUM_D == 1:
        x0 = _load_rows(X, offs_m, mask_m, tl.arange(0, BLOCK_D), D, D, EVEN_D)
    run_max = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, m, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < m
        s = _row_stationary_dot(
            x0, X, Y, offs_m, offs_n, mask_m, mask_n, D,
            NUM_D, EVEN_D, BLOCK_D, PRECISION, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        gj = tl.load(G + offs_n, mask=mask_n, other=-float("inf"))
        t = s * (2.0 * scale) + gj[None, :] * scale
        run_max, run_sum, _, _ = _online_lse_step(run_max, run_sum, t)
    lse2 = run_max + tl.log2(run_sum)
    tl.store(OUT + offs_m, -lse2 / scale, mask=mask_m)


def _types(ptr="", i32="", fp32="", i32ptr=""):
    """name -> Triton type of the run-time arguments (space-separated names)."""
    out = {}
    for names, t in ((ptr, "*fp32"), (i32ptr, "*i32"), (i32, "i32"), (fp32, "fp32")):
        out.update({k: t for k in names.split()})
    return out


def _report(name, fn, types, constexprs, warps, stages):
    names = list(fn.arg_names)
    sig = {k: ("constexpr" if k in constexprs else types[k]) for k in names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(k.asm["cubin"])
        fh.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", fh.name], capture_output=True, text=True
        ).stdout
    res = " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))
    counts = ", ".join(f"{p} {len(re.findall(r, ptx))}" for p, r in PATTERNS.items())
    print(f"| {name} | {warps} warps, {stages} stages | {res} | {counts} |")


def main():
    print(f"triton {triton.__version__}, target sm_90 (static compile, no GPU)")
    print("| kernel | launch | registers, stack bytes | PTX instructions |")
    print("|---|---|---|---|")
    lse_t = _types("X Y G LT OUT", "n m D sxm sym slt", "scale", i32ptr="LX LY")
    pre_t = _types("X Y G OUT", "n m D", "scale")
    sm_t = _types(
        "X Y BIAS CX OUT LSE V VBAR LY W",
        "N M D DV K2 N_KEY M_KEY",
        "dot_scale inv_eps2 eps_ln2 damping w_scale",
        i32ptr="LX",
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
    for prec in ("tf32", "tf32x3"):
        lse_c = dict(HAS_LABELS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, PRECISION=prec)
        _report(f"second-order _row_lse_kernel {prec} 64x64", S._row_lse_kernel, lse_t, lse_c, 4, 2)
        pre_c = dict(NUM_D=1, EVEN_D=True, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, PRECISION=prec)
        _report(f"row-LSE, row tile preloaded {prec} 64x64", _row_lse_preloaded, pre_t, pre_c, 4, 2)
        for bm, w, st in ((64, 4, 2), (128, 8, 4)):
            sm_c = dict(BLOCK_D=64, NUM_D=1, EVEN_D=True, BLOCK_DV=16, HAS_V=False)
            sm_c.update(HAS_LABELS=False, HAS_LSE=False, PREC=prec, BLOCK_M=bm, BLOCK_N=64)
            _report(f"main _softmin_kernel {prec} {bm}x64", K._softmin_kernel, sm_t, sm_c, w, st)


if __name__ == "__main__":
    main()
