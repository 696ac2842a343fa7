"""Offline instruction count of the step kernels for sm_90 (no GPU needed).

    python packages/flashoptim/scripts/sass_count.py [--kernel v2|v3|v4|all] [--dump DIR]
        [--prepass] [--matrix] [--block 1024 --warps 4] [--pf 2  (v4's L2 prefetch)]

Compiles the v2/v3 step kernel (and the finiteness pre-passes) with ``triton.compile`` for
``cuda:90``, disassembles the cubin with the bundled ``nvdisasm``/``cuobjdump`` and counts
SASS instructions by class (MUFU, conversions F2I/I2F/FRND/F2F, FP32, INT/logic, memory) in
the whole kernel and per element of the main loop (the longest backward-branching block,
divided by the elements a thread handles per iteration). Registers and spills from the cubin.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashoptim import _core

TARGET = GPUTarget("cuda", 90, 32)

CLASSES = [
    ("mufu", r"^MUFU"),
    ("conv", r"^(F2I|I2F|FRND|F2F|I2I|F2FP)"),
    ("fp32", r"^(FADD|FMUL|FFMA|FMNMX|FSETP|FSEL|FCHK|FSET)"),
    ("imad", r"^IMAD"),
    (
        "int",
        r"^(IADD3|LOP3|SHF|PRMT|ISETP|SEL|LEA|IMNMX|VIADD|VIMNMX|SGXT|BMSK|ICMP|IABS|POPC|FLO"
        r"|PLOP3|P2R|R2P|BREV|LOP)",
    ),
    ("mem", r"^(LDG|STG|LDS|STS|LD|ST|ATOM|RED|LDC|ULDC)"),
    ("shfl", r"^SHFL"),
    ("ctrl", r"^(BRA|EXIT|BSYNC|BSSY|BAR|WARPSYNC|NOP|CALL|RET|YIELD)"),
]


def _sig_v2(p_dt="bf16"):
    sig = {
        "units": "*i32",
        "nunits": "i32",
        "tab": "*i64",
        "p_base": f"*{p_dt}",
        "g_base": f"*{p_dt}",
        "c_base": "*i8",
        "m_base": "*i8",
        "ms_base": "*bf16",
        "v_base": "*u8",
        "vs_base": "*bf16",
    }
    for k in [
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
    ]:
        sig[k] = "fp32"
    sig["first"] = "i32"
    sig["step_mix"] = "i32"
    sig["skip_flag"] = "*i32"
    sig["epoch"] = "i32"  # v4 only (dropped for the others by the argument filter)
    return sig


LEAN_ARG = [0]  # --lean (v4's LEAN constexpr)
PARTS_ARG = [None]  # --parts (v4's PARTS bits; None: all at LEAN > 0, none at LEAN 0)

MODES = {  # name: (KIND, HAS_MOM)
    "adamw": (0, True),
    "sgd": (1, True),
    "lion": (2, True),
}


def _parts():
    if PARTS_ARG[0] is not None:
        return PARTS_ARG[0]
    return _core.LEAN_ALL if LEAN_ARG[0] else 0


def compile_step(fn, mode="adamw", extra=None, block=1024, warps=4, sr=True, pf=2):
    kind, has_mom = MODES[mode]
    sig = _sig_v2()
    consts = dict(
        KIND=kind,
        ECC=8,
        QUANT=True,
        SR=sr,
        P_DTYPE=1,
        DECOUPLED=True,
        NESTEROV=False,
        HAS_MOM=has_mom,
        SCALE_F32=False,
        ALIGNED=True,
        N16=True,
        UNIT=_core.V4_UNIT if fn is _core._step_kernel_v4 else _core.V2_UNIT,
        BLOCK=block,
        WAVES=8,
        PF=pf,  # v4 only
        GROUP_SIZE=32,
        SCALARS_ON_DEVICE=False,
        CHECK_SKIP=True,
        ASM=True,
        LEAN=LEAN_ARG[0],  # v4 only
        PARTS=_parts(),  # v4 only
    )
    consts.update(extra or {})
    argnames = fn.arg_names
    for k in list(consts):
        if k not in argnames:
            consts.pop(k)
    for k in consts:
        sig[k] = "constexpr"
    sig = {k: sig[k] for k in argnames}
    attrs = {}
    # pointer args 16-byte aligned (as Triton specializes on the GPU)
    ptr_idx = [i for i, k in enumerate(argnames) if str(sig[k]).startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_idx}
    cidx = {(argnames.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=cidx, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=1))


def sass_of(kernel) -> str:
    cubin = kernel.asm["cubin"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        out = subprocess.run(
            [os.path.join(bindir, "nvdisasm"), "-c", "-hex", path], capture_output=True, text=True
        )
        if out.returncode:
            out = subprocess.run(
                [os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True, text=True
            )
        return out.stdout


INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def parse(sass: str):
    """[(address, opcode, operands)] with branch targets given as addresses."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lm = LABEL.match(line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            ins.append((addr, m.group(3), m.group(4)))
    out = []
    for addr, op, args in ins:
        lm = re.search(r"\((\.L_x_\d+)\)", args)
        if lm and lm.group(1) in labels:
            args = f"0x{labels[lm.group(1)]:x}"
        out.append((addr, op, args))
    return out


def classify(op):
    for name, pat in CLASSES:
        if re.match(pat, op):
            return name
    return "other"


def loop_body(ins):
    """Instructions of the largest backward branch range (the element loop)."""
    best = None
    for addr, op, args in ins:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", args)
            if not m:
                continue
            tgt = int(m.group(1), 16)
            if tgt < addr:
                body = [x for x in ins if tgt <= x[0] <= addr]
                if best is None or len(body) > len(best):
                    best = body
    return best or ins


def inner_loop(ins):
    """Instructions of the largest backward branch range that holds no other backward branch
    (v4: the tile loop; ``loop_body`` is the chunk loop around it, prologue included)."""
    best = None
    for addr, op, args in ins:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", args)
            if not m or int(m.group(1), 16) >= addr:
                continue
            tgt = int(m.group(1), 16)
            body = [x for x in ins if tgt <= x[0] <= addr]
            inner = [
                x
                for x in body[:-1]
                if x[1].startswith("BRA")
                and re.search(r"0x([0-9a-f]+)", x[2])
                and tgt <= int(re.search(r"0x([0-9a-f]+)", x[2]).group(1), 16) < x[0]
            ]
            if not inner and (best is None or len(body) > len(best)):
                best = body
    return best or ins


def summary(ins):
    c = collections.Counter(classify(op) for _, op, _ in ins)
    ops = collections.Counter(op.split(".")[0] for _, op, _ in ins)
    return c, ops


def _regs_spills(k):
    """(registers, spilled bytes) of the cubin, from ptxas-style info (cuobjdump -res-usage)."""
    regs = getattr(k, "n_regs", None)
    spills = getattr(k, "n_spills", None)
    if regs is None:
        m = re.search(r"\.maxnreg|REG:(\d+)", _res_usage(k) or "")
        regs = int(m.group(1)) if m and m.group(1) else None
        m = re.search(r"STACK:(\d+)", _res_usage(k) or "")
        spills = int(m.group(1)) if m else None
    return regs, spills


def _res_usage(k):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        out = subprocess.run(
            [os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True
        )
        return out.stdout


def report(name, k, per_thread_elems, dump=None):
    sass = sass_of(k)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, name + ".sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(dump, name + ".ptx"), "w") as f:
            f.write(k.asm["ptx"])
    ins = parse(sass)
    body = loop_body(ins)
    c, ops = summary(body)
    n = len(body)
    regs, spills = _regs_spills(k)
    e = per_thread_elems
    print(
        f"{name}: {len(ins)} SASS total, loop body {n} ({n / e:.1f}/elem), regs {regs}, "
        f"spills {spills}"
    )
    tl_body = inner_loop(ins)
    ct, _ = summary(tl_body)
    if len(tl_body) != n:
        print(f"   tile loop {len(tl_body)} ({len(tl_body) / e:.1f}/elem)")
    print("   per elem: " + ", ".join(f"{kk} {v / e:.2f}" for kk, v in sorted(c.items())))
    print("   top ops: " + ", ".join(f"{o}:{v}" for o, v in ops.most_common(18)))
    return dict(
        total=len(ins),
        body=n,
        per_elem=n / e,
        tile_loop_per_elem=len(tl_body) / e,
        tile_classes={k2: v / e for k2, v in ct.items()},
        classes={k2: v / e for k2, v in c.items()},
        regs=regs,
        spills=spills,
    )


def compile_prepass(fn, block=1024, warps=4):
    """The finiteness pre-pass (v2: one unit per program; v3: persistent), bf16 gradients."""
    sig = {"units": "*i32", "nunits": "i32", "tab": "*i64", "g_base": "*bf16", "flag": "*i32"}
    sig["mark"] = "i32"  # v4 only
    unit = _core.V4_UNIT if fn is _core._nonfinite_kernel_v4 else _core.V2_UNIT
    consts = dict(
        ALIGNED=True, N16=True, G_DTYPE=1, UNIT=unit, SUB=_core.V4_PREPASS_SUB, BLOCK=block
    )
    argnames = fn.arg_names
    consts = {k: v for k, v in consts.items() if k in argnames}
    for k in consts:
        sig[k] = "constexpr"
    sig = {k: sig[k] for k in argnames}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(argnames) if sig[k][0] == "*"}
    cidx = {(argnames.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=cidx, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=1))


MATRIX = [  # (param dtype, constexpr overrides) the GPU tests and options reach
    ("bf16", {}),
    ("fp16", dict(P_DTYPE=2)),
    ("fp32", dict(P_DTYPE=0, ECC=0)),
    ("bf16", dict(ECC=16)),
    ("bf16", dict(ECC=0)),
    ("bf16", dict(QUANT=False)),
    ("bf16", dict(SR=False)),
    ("bf16", dict(SCALE_F32=True)),
    ("bf16", dict(KIND=1, NESTEROV=True)),
    ("bf16", dict(KIND=1, HAS_MOM=False)),
    ("bf16", dict(KIND=1, DECOUPLED=False)),
    ("bf16", dict(KIND=2)),
    ("bf16", dict(DECOUPLED=False)),
    ("bf16", dict(CHECK_SKIP=False, SCALARS_ON_DEVICE=True)),
    ("bf16", dict(ALIGNED=False, N16=False)),
]


def compile_matrix(fn):
    """Compile ``fn`` (v3 step kernel) for every mode of MATRIX: registers and spills."""
    for p_dt, extra in MATRIX:
        sig = _sig_v2(p_dt)
        if extra.get("SCALE_F32"):
            sig["ms_base"] = sig["vs_base"] = "*fp32"
        if extra.get("ECC") == 16:
            sig["c_base"] = "*i16"
        if extra.get("QUANT") is False:
            sig["m_base"] = sig["v_base"] = "*fp32"
        consts = dict(
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
            UNIT=_core.V4_UNIT if fn is _core._step_kernel_v4 else _core.V2_UNIT,
            BLOCK=1024,
            WAVES=8,
            PF=2,
            GROUP_SIZE=32,
            SCALARS_ON_DEVICE=False,
            CHECK_SKIP=True,
            ASM=True,
            LEAN=LEAN_ARG[0],
            PARTS=_parts(),
        )
        consts.update(extra)
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        if consts["SCALARS_ON_DEVICE"]:
            sig["lr"] = "*i32"
        for k in consts:
            sig[k] = "constexpr"
        sig = {k: sig[k] for k in fn.arg_names}
        cidx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        ptrs = [i for i, k in enumerate(fn.arg_names) if str(sig[k]).startswith("*")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in ptrs}  # as the GPU specializes
        src = ASTSource(fn=fn, signature=sig, constexprs=cidx, attrs=attrs)
        k = triton.compile(src, target=TARGET, options=dict(num_warps=4, num_stages=1))
        regs, spills = _regs_spills(k)
        print(f"{fn.__name__} {p_dt} {extra}: regs {regs}, spills {spills}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="all")
    ap.add_argument("--mode", default="adamw,sgd,lion")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--prepass", action="store_true", help="also the finiteness pre-passes")
    ap.add_argument("--matrix", action="store_true", help="compile every mode, regs/spills")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--pf", type=int, default=2, help="v4: L2 prefetch distance in tiles")
    ap.add_argument("--lean", type=int, default=0, help="v4: LEAN tile math (0 v3's, 1, 2)")
    ap.add_argument("--parts", type=lambda x: int(x, 0), default=None, help="v4: PARTS bits")
    a = ap.parse_args(argv)
    LEAN_ARG[0] = a.lean
    PARTS_ARG[0] = a.parts
    ks = ["v2", "v3"] if a.kernel == "all" else a.kernel.split(",")
    if a.matrix:
        for kv in ks if a.kernel != "all" else ["v3"]:
            compile_matrix(getattr(_core, f"_step_kernel_{kv}"))
        return 0
    if a.prepass:
        for kv, fn, e in [
            ("v2", _core._nonfinite_kernel_v2, 2048),  # one unit per program
            ("v3", _core._nonfinite_kernel_v3, 2048),  # one unit per loop trip (unrolled)
            ("v4", _core._nonfinite_kernel_v4, 2048),  # one SUB (2 tiles) per loop trip
        ]:
            report(f"prepass-{kv}", compile_prepass(fn), e / 128, a.dump)
    for mode in a.mode.split(","):
        for kv in ks:
            if kv == "v2":
                k = compile_step(_core._step_kernel_v2, mode)
            else:
                fn = getattr(_core, f"_step_kernel_{kv}", None)
                if fn is None:
                    print(f"no {kv} kernel")
                    continue
                k = compile_step(fn, mode, block=a.block, warps=a.warps, pf=a.pf)
            # one tile (BLOCK elements) per iteration over the program's threads
            report(f"{kv}-{mode}", k, a.block / (32 * a.warps), a.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
