"""Offline sm_90 SASS of flashoptim's default kernels, one file per mode, for before/after
comparisons of a refactor (no GPU needed; use the GPU host's triton, /work/venv36 = 3.6).

    PYTHONPATH=packages/flashoptim/src /work/venv36/bin/python tools/flashoptim/sass_dump.py OUT
    diff -r OUT_BEFORE OUT_AFTER        # or: compare the printed sha256 per file

Compiles the step kernel at each autotuning config of the default (BLOCK 2048 / PF 1 on 4
and 8 warps) for every mode the optimizers reach (optimizer kind, parameter dtype, master
bits, quantize, rounding, scale dtype, decay, Nesterov, finiteness check, capturable,
unaligned buckets, the rounding draw's two forms, 64-bit indexing) and the finiteness
pre-pass for each gradient dtype, then writes the instruction stream of each cubin
(``cuobjdump -sass``, instruction lines only: the kernel's symbol name and the file headers
are dropped, so a renamed kernel with the same code compares equal).

Also reads the layout of the last commit before the split of ``_core.py`` (1cd3e42:
``_core._step_kernel_v4`` with ``LEAN=2, PARTS=31``), so the same command gives the
"before" side from an old checkout.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
SCALARS = [
    "lr",
    "b1",
    "one_m_b1",
    "b2",
    "one_m_b2",
    "eps",
    "wd",
    "decay_mult",
    "step_size",
    "inv_sqrt_bc2",
    "one_m_damp",
]


def kernels():
    """(step kernel, pre-pass kernel, chunk size, pre-pass trip size, legacy constexprs)."""
    try:
        try:
            from flashoptim_fused import _step_kernel as k
        except ImportError:  # before the rename (issue #20)
            from flashoptim import _step_kernel as k
        try:
            from flashoptim_fused import _prepass_kernel as pk
        except ImportError:  # before the pre-pass had its own module (2026-12-02)
            pk = k

        return k._step_kernel, pk._nonfinite_kernel, k.CHUNK, pk.PREPASS_SUB, {}
    except ImportError:
        from flashoptim import _core as k  # 1cd3e42 and before

        legacy = dict(LEAN=2, PARTS=k.LEAN_ALL, WAVES=0)
        return k._step_kernel_v4, k._nonfinite_kernel_v4, k.V4_UNIT, k.V4_PREPASS_SUB, legacy


# (name, constexpr overrides): the modes the optimizers and tests reach
MODES = [
    ("adamw", {}),
    ("adamw_nocheck", dict(CHECK_SKIP=False)),
    ("adamw_draw_unhoisted", dict(LEAN=1, DRAW_HOIST=False)),
    ("adamw_fp16", dict(P_DTYPE=2)),
    ("adamw_fp32", dict(P_DTYPE=0, ECC=0)),
    ("adamw_ecc16", dict(ECC=16)),
    ("adamw_nomaster", dict(ECC=0)),
    ("adamw_fp32_states", dict(QUANT=False)),
    ("adamw_nosr", dict(SR=False)),
    ("adamw_fp32_scales", dict(SCALE_F32=True)),
    ("adam_coupled", dict(DECOUPLED=False)),
    ("adamw_capturable", dict(CHECK_SKIP=False, SCALARS_ON_DEVICE=True)),
    ("adamw_unaligned", dict(ALIGNED=False, N16=False)),
    ("sgd", dict(KIND=1, DECOUPLED=False)),
    ("sgd_nesterov", dict(KIND=1, DECOUPLED=False, NESTEROV=True)),
    ("sgd_plain", dict(KIND=1, DECOUPLED=False, HAS_MOM=False)),
    ("sgdw", dict(KIND=1)),
    ("lion", dict(KIND=2)),
    ("lion_nocheck", dict(KIND=2, CHECK_SKIP=False)),
    ("adamw_index64", dict(INDEX64=True)),  # new after 1cd3e42 (there: the adamw code)
]
CONFIGS = [(2048, 4, 1), (2048, 8, 1)]  # BLOCK, warps, PF
P_TYPES = {0: "fp32", 1: "bf16", 2: "fp16"}


def _signature(fn, consts):
    p = P_TYPES[consts["P_DTYPE"]]
    sdt = "fp32" if consts["SCALE_F32"] else "bf16"
    quant = consts["QUANT"]
    sig = {
        "units": "*i32",
        "nunits": "i32",
        "tab": "*i64",
        "p_base": f"*{p}",
        "g_base": f"*{p}",
        "c_base": "*i16" if consts["ECC"] == 16 else ("*i8" if consts["ECC"] else f"*{p}"),
        "m_base": ("*i8" if quant else "*fp32") if consts["HAS_MOM"] else f"*{p}",
        "ms_base": f"*{sdt}" if quant and consts["HAS_MOM"] else f"*{p}",
        "v_base": ("*u8" if quant else "*fp32") if consts["KIND"] == 0 else f"*{p}",
        "vs_base": f"*{sdt}" if quant and consts["KIND"] == 0 else f"*{p}",
        "first": "i32",
        "step_mix": "i32",
        "skip_flag": "*i32",
        "epoch": "i32",
    }
    for s in SCALARS:
        sig[s] = "fp32"
    if consts["SCALARS_ON_DEVICE"]:
        sig["lr"] = "*i32"
    return sig


def compile_fn(fn, sig, consts, warps):
    names = fn.arg_names
    consts = {k: v for k, v in consts.items() if k in names}
    sig = dict(sig, **{k: "constexpr" for k in consts})
    sig = {k: sig[k] for k in names}
    ptrs = [i for i, k in enumerate(names) if str(sig[k]).startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptrs}  # as the GPU specializes
    cidx = {(names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=cidx, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=1))


INSN = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(.*;)")


def sass_lines(kernel) -> str:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run(
            [os.path.join(bindir, "cuobjdump"), "-sass", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    lines = [m.group(1).split(";")[0].strip() for m in map(INSN.match, out.splitlines()) if m]
    return "\n".join(lines) + "\n"


def base_consts(chunk: int) -> dict:
    """The step kernel's constexprs of the default mode (AdamW, bf16, 24-bit master, 8-bit
    states, stochastic rounding, checked, aligned) without the config."""
    return dict(
        KIND=0,
        ECC=8,
        QUANT=True,
        SR=True,
        P_DTYPE=1,
        DECOUPLED=True,
        NESTEROV=False,
        HAS_MOM=True,
        SCALE_F32=False,
        ALIGNED=True,
        N16=True,
        CHECK_SKIP=True,
        ASM=True,
        UNIT=chunk,
        GROUP_SIZE=32,
        SCALARS_ON_DEVICE=False,
        DRAW_HOIST=True,
        INDEX64=False,
        MAXIMIZE=False,
    )


# FlashMuon's two passes (``_muon_kernel``, after 1cd3e42): (name, constexpr overrides)
MUON_MODES = [
    ("momentum", {}),
    ("momentum_nocheck", dict(CHECK_SKIP=False)),
    ("momentum_plain", dict(NESTEROV=False)),
    ("momentum_fp32_states", dict(QUANT=False)),
    ("momentum_unaligned", dict(ALIGNED=False, N16=False)),
    ("update", {}),
    ("update_nocheck", dict(CHECK_SKIP=False)),
    ("update_nosr", dict(SR=False)),
    ("update_fp32", dict(P_DTYPE=0, ECC=0)),
    ("update_unaligned", dict(ALIGNED=False, N16=False)),
]


def muon_files(chunk: int) -> dict:
    """SASS of the FlashMuon passes at their one config (BLOCK 2048, PF 1, 4 warps); prints
    registers and spills per mode. Empty before the Muon kernels existed."""
    try:
        from flashoptim_fused import _muon_kernel as mk
    except ImportError:
        return {}
    base = dict(QUANT=True, NESTEROV=True, SCALE_F32=False, ECC=8, SR=True, P_DTYPE=1)
    base.update(ALIGNED=True, N16=True, CHECK_SKIP=True, ASM=True, UNIT=chunk, BLOCK=2048)
    base.update(PF=1, GROUP_SIZE=32, DRAW_HOIST=True, INDEX64=False, MAXIMIZE=False)
    files = {}
    for name, over in MUON_MODES:
        consts = dict(base, **over)
        p = P_TYPES[consts["P_DTYPE"]]
        sig = {"units": "*i32", "nunits": "i32", "tab": "*i64", "skip_flag": "*i32", "epoch": "i32"}
        sig["step_mix"] = "i32"  # both passes since the momentum's stochastic rounding
        if name.startswith("momentum"):
            fn = mk._momentum_kernel
            sig.update(g_base="*bf16", u_base="*bf16", one_m_mu="fp32")
            sig.update(m_base="*i8" if consts["QUANT"] else "*fp32", ms_base="*bf16")
        else:
            fn = mk._update_kernel
            sig.update(p_base=f"*{p}", c_base="*i8" if consts["ECC"] else f"*{p}")
            sig.update(o_base="*bf16", lr="fp32", decay_mult="fp32")
        k = compile_fn(fn, sig, consts, 4)
        from sass_count import _regs_spills  # (imports this module)

        regs, spills = _regs_spills(k)
        print(f"muon-{name}: {regs} registers, {spills} bytes of stack", file=sys.stderr)
        files[f"muon-{name}-b2048w4pf1.sass"] = sass_lines(k)
    return files


def main(argv=None) -> int:
    out = (argv or sys.argv[1:] or ["sass-out"])[0]
    os.makedirs(out, exist_ok=True)
    step, prepass, chunk, sub, legacy = kernels()
    base = base_consts(chunk)
    files = {}
    for name, over in MODES:
        for block, warps, pf in CONFIGS:
            consts = dict(base, BLOCK=block, PF=pf, **legacy)
            consts.update(over)
            consts = {k: v for k, v in consts.items() if k in step.arg_names}  # older kernels
            if "DRAW_HOIST" in over and "LEAN" in legacy:  # the legacy name of the choice
                consts["LEAN"] = 2 if over["DRAW_HOIST"] else 1
            k = compile_fn(step, _signature(step, consts), consts, warps)
            files[f"step-{name}-b{block}w{warps}pf{pf}.sass"] = sass_lines(k)
    for g, gname in P_TYPES.items():
        for aligned in (True, False):
            consts = dict(ALIGNED=aligned, N16=aligned, G_DTYPE=g, UNIT=chunk, SUB=sub, BLOCK=1024)
            for index64 in (False, True) if gname == "bf16" and aligned else (False,):
                consts["INDEX64"] = index64  # new after 1cd3e42
                sig = {"units": "*i32", "nunits": "i32", "tab": "*i64", "g_base": f"*{gname}"}
                sig.update(flag="*i32", mark="i32")
                k = compile_fn(prepass, sig, consts, 4)
                name = f"prepass-{gname}-{'aligned' if aligned else 'unaligned'}"
                files[name + ("-index64" if index64 else "") + ".sass"] = sass_lines(k)
    files.update(muon_files(chunk))
    for fname, text in sorted(files.items()):
        with open(os.path.join(out, fname), "w") as f:
            f.write(text)
        h = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{h}  {text.count(chr(10)):5d}  {fname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
