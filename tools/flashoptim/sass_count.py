"""Offline instruction counts of flashoptim's step kernel and pre-pass for sm_90 (no GPU).

    PYTHONPATH=packages/flashoptim/src /work/venv36/bin/python tools/flashoptim/sass_count.py \
        [--mode adamw,sgd,lion] [--config 2048,1,4] [--prepass] [--matrix] [--dump DIR]

Compiles with ``triton.compile`` for ``cuda:90`` (use the GPU host's triton: /work/venv36 has
3.6), disassembles the cubin with the bundled ``nvdisasm`` and counts SASS instructions by
class (MUFU, conversions, FP32, INT/logic, memory) in the whole kernel, the chunk loop (the
largest backward branch) and the tile loop (the largest one without an inner loop), per
element (divided by the elements a thread handles per tile), with registers and spills.
``--matrix``: every mode of ``sass_dump.MODES``, registers and spills only. The numbers the
design notes quote came from this script (docs/design/flashoptim.md).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_dump import MODES, P_TYPES, _signature, base_consts, compile_fn, kernels  # noqa: E402

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
    (the tile loop; ``loop_body`` is the chunk loop around it, its prologue included)."""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="adamw,sgd,lion", help="names from sass_dump.MODES")
    ap.add_argument("--config", default="2048,1,4", help="BLOCK,PF,warps")
    ap.add_argument("--prepass", action="store_true", help="also the finiteness pre-pass")
    ap.add_argument("--matrix", action="store_true", help="every mode: registers, spills")
    ap.add_argument("--dump", default=None, help="write each kernel's SASS and PTX here")
    a = ap.parse_args(argv)
    step, prepass, chunk, sub, legacy = kernels()
    block, pf, warps = (int(x) for x in a.config.split(","))
    modes = dict(MODES)
    names = list(modes) if a.matrix else a.mode.split(",")
    for name in names:
        consts = dict(base_consts(chunk), BLOCK=block, PF=pf, **legacy)
        consts.update(modes[name])
        k = compile_fn(step, _signature(step, consts), consts, warps)
        if a.matrix:
            regs, spills = _regs_spills(k)
            print(f"{name}: regs {regs}, spills {spills}")
            continue
        report(f"{name}-b{block}w{warps}pf{pf}", k, block / (32 * warps), a.dump)
    if a.prepass:
        for g, gname in P_TYPES.items():
            consts = dict(ALIGNED=True, N16=True, G_DTYPE=g, UNIT=chunk, SUB=sub, BLOCK=1024)
            consts["INDEX64"] = False
            sig = {"units": "*i32", "nunits": "i32", "tab": "*i64", "g_base": f"*{gname}"}
            sig.update(flag="*i32", mark="i32")
            k = compile_fn(prepass, sig, consts, 4)
            report(f"prepass-{gname}", k, sub / 128, a.dump)  # one trip: SUB elements
    return 0


if __name__ == "__main__":
    sys.exit(main())
