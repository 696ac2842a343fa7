"""Which lean part breaks GPU bit-equality, and what the bitwise-proven parts buy.

    PYTHONPATH=packages/flashoptim/src python3 packages/flashoptim/scripts/lean_parts_check.py \
        bitwise OUTDIR --opt adamw|sgd [--variants all|quick] [--smoke]
    ... bench OUTDIR --parts 0x1f [--reps 20] [--smoke]
    ... pick OUTDIR            (prints the PARTS bits every bitwise file proved, for bench)

``bitwise``: the failing cases of tests/test_lean.py (AdamW wd 0.1 / SGD Nesterov momentum
0.9 / Adam wd 0.1 eps 0; bf16, sizes 1,000,003 + 4097 + 31 + 3 units + 1, 3 steps of
randn / mixed / zero gradients, FLASHOPTIM_NO_AUTOTUNE=1: BLOCK 1024 / 4 warps / PF 2)
for each variant (default side PARTS, lean side PARTS): ``bitwise`` True/False, the
number of differing elements per state (``param`` = the bf16 weights) and the first 5
differing (tensor, index, old, new) in hex. Writes OUTDIR/parts_<opt>.json and .txt.

``bench``: AdamW without / with the finiteness check, 537M params (8 x 8192^2 bf16);
sides, interleaved per round (median and p20-p80 of ``reps`` CUDA-event steps):
old (PARTS 0, today's default) and old+PIN at BLOCK 1024 / 4 warps / PF 2; lean with
``--parts`` at the same config; old and lean at BLOCK 2048 / 4 warps / PF 1. Ratios:
lean / old at each config, old 2048 / old 1024 (is (2048, 0, 1) on 4 warps worth adding to
the tuning space on its own?). Bitwise: lean vs old with the same PIN bit, and old 2048 vs
old 1024 (must be equal: same math). Writes OUTDIR/parts_bench.json and .txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import flashoptim as fo
from flashoptim import _core, bench

P = dict(ST=_core.LEAN_ST, UNPACK=_core.LEAN_UNPACK, CVT=_core.LEAN_CVT, Q2=_core.LEAN_Q2)
PIN = _core.LEAN_PIN
ALL = _core.LEAN_ALL
# name: (default side PARTS, lean side PARTS). "unpinned_all" is FLASHOPTIM_LEAN=1 as the
# H200 ran it on 2026-12-01 (failed); "triton_only": the lean draw and FSET floor alone.
VARIANTS = {  # most informative first: the JSON is written after each (a timeout keeps them)
    "unpinned_all": (0, ALL & ~PIN),
    "pin_only": (PIN, PIN),
    "all+PIN": (PIN, ALL),
    **{f"{k}+PIN": (PIN, b | PIN) for k, b in P.items()},
    "triton_only": (0, 0),
}
QUICK = ("unpinned_all", "pin_only", "all+PIN")
OPTS = {
    "adamw": (fo.FlashAdamW, dict(weight_decay=0.1)),
    "sgd": (fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    # failed on the H200 too, though its PTX fma order matches the default's (fma_order.py)
    "adam": (fo.FlashAdam, dict(weight_decay=0.1, eps=0.0)),
}
U = _core.V4_UNIT


def _grad(kind, n, dtype, gen):  # as tests/test_v3.py's
    g = torch.randn(n, generator=gen)
    if kind == "zero":
        g = torch.zeros(n)
    elif kind == "mixed":
        g = g * torch.logspace(-30, 10, n)[torch.randperm(n, generator=gen)]
        g[::7] = 0.0
    return g.to(dtype)


def _bits(t):
    t = t.detach()
    if not t.is_floating_point():
        return t
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _hex(x, nbytes):
    return f"{int(x) & ((1 << (8 * nbytes)) - 1):0{2 * nbytes}x}"


def _diff(a, pa, b, pb):
    """{state: {"n": differing elements, "first": [(tensor, index, old hex, new hex)]}}."""
    res = {}

    def add(key, ti, x, y):
        bx, by = _bits(x).reshape(-1), _bits(y).reshape(-1)
        d = (bx != by).nonzero().reshape(-1)
        r = res.setdefault(key, dict(n=0, first=[]))
        r["n"] += int(d.numel())
        nb = bx.element_size()
        for i in d[: 5 - len(r["first"])].tolist():
            r["first"].append((ti, i, _hex(bx[i].item(), nb), _hex(by[i].item(), nb)))

    for ti, (p, q) in enumerate(zip(pa, pb)):
        add("param", ti, p, q)
        for k, v in a.state[p].items():
            if torch.is_tensor(v) and v.dim() > 0 and k != "step":
                add(k, ti, v, b.state[q][k])
    return res


def run_pair(opt_name, old_parts, new_parts, dev, sizes, steps=3):
    Opt, kw = OPTS[opt_name]
    gen = torch.Generator().manual_seed(0)
    ps = [(torch.randn(n, generator=gen) * 0.1).bfloat16().to(dev) for n in sizes]
    out = []
    for lean, parts in ((False, old_parts), (True, new_parts)):
        qs = [p.clone().requires_grad_() for p in ps]
        opt = Opt(qs, lr=1e-2, backend="triton", kernel="v4", **kw)
        opt._lean, opt._lean_parts = lean, parts
        out.append((opt, qs))
    kinds = ("randn", "mixed", "zero")
    for s in range(steps):
        grads = [
            _grad(kinds[(s + i) % 3], n, torch.bfloat16, gen).to(dev) for i, n in enumerate(sizes)
        ]
        for opt, qs in out:
            for q, g in zip(qs, grads):
                q.grad = g.clone()
            opt.step()
    (a, pa), (b, pb) = out
    d = _diff(a, pa, b, pb)
    return dict(bitwise=all(r["n"] == 0 for r in d.values()), diff=d)


def cmd_bitwise(a) -> int:
    os.environ["FLASHOPTIM_NO_AUTOTUNE"] = "1"
    dev = torch.device("cpu" if a.smoke else "cuda")
    sizes = (40, 33, 1) if a.smoke else (1_000_003, 4097, 31, 3 * U, 1)
    names = list(VARIANTS) if a.variants == "all" else list(QUICK)
    res = dict(opt=a.opt, sizes=sizes, variants={})
    lines = [f"# {a.opt}: sizes {sizes}, 3 steps, BLOCK 1024 / 4 warps / PF 2"]
    path = os.path.join(a.outdir, f"parts_{a.opt}")
    for name in names:
        old, new = VARIANTS[name]
        t0 = time.time()
        try:
            r = run_pair(a.opt, old, new, dev, sizes)
        except Exception as e:  # report, keep going
            r = dict(bitwise=None, error=f"{type(e).__name__}: {e}"[:400])
        r.update(old_parts=old, new_parts=new, s=round(time.time() - t0, 1))
        res["variants"][name] = r
        with open(path + ".json", "w") as f:
            json.dump(res, f, indent=1)
        line = f"{a.opt:6s} {name:13s} old {old:#04x} new {new:#04x} bitwise {r['bitwise']}"
        line += f"  ({r['s']} s)"
        if "error" in r:
            line += "  " + r["error"]
        for k, v in r.get("diff", {}).items():
            if v["n"]:
                line += f"\n    {k}: {v['n']} differ; first (tensor, index, old, new): {v['first']}"
        print(line, flush=True)
        lines.append(line)
    with open(path + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


def cmd_pick(a) -> int:
    """PARTS for the bench from the AdamW and SGD files: PIN if pin_only passed, plus each
    part whose <part>+PIN passed (a file without that variant: all+PIN's verdict)."""
    ok = None
    for fn in (os.path.join(a.outdir, f"parts_{o}.json") for o in ("adamw", "sgd")):
        if not os.path.exists(fn):  # AdamW and SGD decide (the bench is AdamW)
            continue
        v = json.load(open(fn))["variants"]
        parts = 0
        if v.get("pin_only", {}).get("bitwise"):
            parts |= PIN
            for k, b in P.items():
                r = v.get(f"{k}+PIN")
                if r is None and v.get("all+PIN", {}).get("bitwise"):
                    parts |= b  # not tested alone here, proven together
                elif r is not None and r.get("bitwise"):
                    parts |= b
        elif v.get("triton_only", {}).get("bitwise", True) is False:
            parts = -1  # not even the Triton parts: bench the plain lean anyway (0)
        ok = parts if ok is None else ok & parts
    print(max(ok or 0, 0))
    return 0


def _step_ms(opt):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    opt.step()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1)


def _equal(a, b) -> bool:
    return all(r["n"] == 0 for r in _diff(a["opt"], a["ps"], b["opt"], b["ps"]).values())


def cmd_bench(a) -> int:
    os.environ["FLASHOPTIM_NO_AUTOTUNE"] = "1"
    dev = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        shapes = [(64, 48), (33,)]
    elif a.small:  # the same kernel specializations as "large", compiled into Triton's cache
        shapes = [(1024, 8192)] * 2
    else:
        shapes = bench.layout_shapes("large")
    n = sum(torch.Size(s).numel() for s in shapes)
    c1024 = (dict(BLOCK=1024, WAVES=0, PF=2), 4)
    c2048 = (dict(BLOCK=2048, WAVES=0, PF=1), 4)
    parts = a.parts
    sides_def = [  # name, lean, PARTS, config
        ("old_1024", False, 0, c1024),
        ("oldpin_1024", False, PIN, c1024),
        ("lean_1024", True, parts, c1024),
        ("old_2048", False, 0, c2048),
        ("lean_2048", True, parts, c2048),
    ]
    res = dict(env=bench.env_info(), parts=parts, n_params=n, reps=a.reps, rows=[])
    lines = [f"# lean PARTS {parts:#04x}; ms median (p20-p80) of {a.reps} interleaved steps"]
    gen = torch.Generator(device=dev).manual_seed(0)
    ps0 = [(torch.randn(s, device=dev, generator=gen) * 0.02).bfloat16() for s in shapes]
    gs = [(torch.randn(s, device=dev, generator=gen) * 1e-3).bfloat16() for s in shapes]
    for row, moved, kw in (
        ("adamw_nocheck", bench.MOVED["ours_nocheck"], dict(check_finite=False)),
        ("adamw", bench.MOVED["ours"], {}),
    ):
        sides = []
        try:
            for name, lean, pp, (cfg, warps) in sides_def:
                if name == "oldpin_1024" and row == "adamw":
                    continue  # PIN's cost: the no-check row says it (one compile less)
                ps = [torch.nn.Parameter(p.clone()) for p in ps0]
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
                opt = fo.FlashAdamW(ps, lr=1e-4, kernel="v4", backend="triton", **kw)
                opt._lean, opt._lean_parts = lean, pp
                sides.append(dict(name=name, opt=opt, ps=ps, cfg=cfg, warps=warps, t=[]))

            def step(s):
                _core.V4_DEFAULT, _core.V4_DEFAULT_WARPS = s["cfg"], s["warps"]
                if a.smoke:
                    s["opt"].step()
                    return 0.0
                return _step_ms(s["opt"])

            for s in sides:  # compile + 3 warm-up steps
                for _ in range(4):
                    step(s)
            for r in range(a.reps):
                order = sides if r % 2 == 0 else sides[::-1]
                for s in order:
                    s["t"].append(step(s))
            out = dict(row=row)
            for s in sides:
                ts = sorted(s["t"])
                med, p20, p80 = (ts[min(len(ts) - 1, int(f * len(ts)))] for f in (0.5, 0.2, 0.8))
                gbps = moved * n / (med * 1e-3) / 1e9 if med else 0.0
                out[s["name"]] = dict(
                    ms=med, p20=p20, p80=p80, frac=gbps / (bench.CEILING_TBPS * 1e3)
                )
            by = {s["name"]: s for s in sides}
            ref = "oldpin_1024" if parts & PIN and "oldpin_1024" in by else "old_1024"
            ref_ok = ref == "oldpin_1024" or not parts & PIN
            out["bitwise"] = {
                f"lean_1024 vs {ref}": _equal(by["lean_1024"], by[ref]) if ref_ok else None,
                "lean_2048 vs lean_1024": _equal(by["lean_2048"], by["lean_1024"]),
                "old_2048 vs old_1024": _equal(by["old_2048"], by["old_1024"]),
            }
            ms = {k: out[k]["ms"] or 1.0 for k in by}
            ms.setdefault("oldpin_1024", float("nan"))
            out["ratios"] = {
                "lean/old @1024": ms["lean_1024"] / ms["old_1024"],
                "oldpin/old @1024": ms["oldpin_1024"] / ms["old_1024"],
                "lean/old @2048": ms["lean_2048"] / ms["old_2048"],
                "old 2048/1024": ms["old_2048"] / ms["old_1024"],
                "lean 2048 / old 1024": ms["lean_2048"] / ms["old_1024"],
            }
        except Exception as e:  # report, keep going
            out = dict(row=row, error=f"{type(e).__name__}: {e}"[:500])
        finally:
            _core.V4_DEFAULT, _core.V4_DEFAULT_WARPS = c1024
            del sides
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        res["rows"].append(out)
        with open(os.path.join(a.outdir, f"parts_bench{a.tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
        if "error" in out:
            text = f"{row}: error {out['error']}"
        else:
            text = f"{row}:\n" + "\n".join(
                f"  {k:12s} {v['ms']:.3f} ({v['p20']:.3f}-{v['p80']:.3f}) ms, "
                f"{v['frac']:.3f} of ceiling"
                for k, v in out.items()
                if isinstance(v, dict) and "ms" in v
            )
            text += "\n  " + "  ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items())
            text += "\n  bitwise: " + ", ".join(f"{k} {v}" for k, v in out["bitwise"].items())
        print(text, flush=True)
        lines.append(text)
    with open(os.path.join(a.outdir, f"parts_bench{a.tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("bitwise", "bench", "pick"))
    ap.add_argument("outdir")
    ap.add_argument("--opt", default="adamw", choices=tuple(OPTS))
    ap.add_argument("--variants", default="all", choices=("all", "quick"))
    ap.add_argument("--parts", type=lambda x: int(x, 0), default=ALL)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny tensors on the CPU (interpreter)")
    ap.add_argument("--small", action="store_true", help="bench: 16M params (cache warm-up)")
    ap.add_argument("--tag", default="", help="bench: suffix of the output files")
    a = ap.parse_args(argv)
    os.makedirs(a.outdir, exist_ok=True)
    return dict(bitwise=cmd_bitwise, bench=cmd_bench, pick=cmd_pick)[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
