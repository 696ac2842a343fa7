"""The Gluon sm_90 softmin pass (``_softmin_hopper.py``) against float64 and the Triton kernel.

GPU tests (marker ``gpu``) need an sm_90 GPU (H100 / H200). The CPU tests check the reasons
the kernel declines inputs and compile it offline for sm_90 with the ptxas that ships with
triton, so that CI's triton notices a Gluon API change without a GPU.
"""

import importlib
import math
import os
import pkgutil
import subprocess

import pytest
import torch

import flashsinkhorn
from flashsinkhorn import _softmin_hopper as H

EPS = 0.01
# potentials in cost units at eps = 0.01 on the clouds below; the operands are exactly
# representable (tf32-rounded fp32, bf16), so only fp32 accumulation and exp2 err
ATOL = 1e-4


def _find(name):
    """``name`` from wherever the package keeps it (its modules may be regrouped)."""
    if hasattr(flashsinkhorn, name):
        return getattr(flashsinkhorn, name)
    for info in pkgutil.walk_packages(flashsinkhorn.__path__, "flashsinkhorn."):
        if info.name.endswith(("_softmin_hopper", "bench", "demo")):
            continue
        mod = importlib.import_module(info.name)
        if hasattr(mod, name):
            return getattr(mod, name)
    raise ImportError(f"flashsinkhorn has no {name!r}")


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(
    not (H.HAS_GLUON and _sm90()), reason="needs an sm_90 GPU and triton's Gluon"
)


def _problem(B, N, M, D, precision, seed=0):
    """Clouds as the benchmarks draw them (x, y uniform in [0, 1/sqrt(d)]^d, y shifted),
    centered, in the kernel's operand form; cost |x - y|^2 (c2 = 2)."""
    gen = torch.Generator().manual_seed(seed)
    s = 1 / math.sqrt(D)
    x = torch.rand(B, N, D, generator=gen) * s
    y = torch.rand(B, M, D, generator=gen) * s + 0.5 * s
    c = (x.sum(1) + y.sum(1)) / (N + M)
    x, y = x - c[:, None], y - c[:, None]
    if precision == "tf32":
        xk, yk = _find("round_to_tf32")(x), _find("round_to_tf32")(y)
    else:
        xk, yk = x.bfloat16(), y.bfloat16()
    b = torch.rand(B, M, generator=gen) + 0.1
    p = dict(
        x=xk.cuda(),
        y=yk.cuda(),
        g=(0.01 * torch.randn(B, M, generator=gen)).cuda(),
        logb=torch.log(b / b.sum(-1, keepdim=True)).cuda(),
        cx=(x * x).sum(-1).cuda(),
        cy=(y * y).sum(-1).cuda(),
    )
    return p


def _ref(p, damping):
    """float64 reference on the kernel's own operands: (out, lse2)."""
    softmin_ref = _find("softmin_ref")
    out, lse2, _ = softmin_ref(
        p["x"].double(),
        p["y"].double(),
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=damping,
    )
    return out, lse2


def _triton(p, precision, damping, guess=None):
    out, lse2, _ = flashsinkhorn.softmin(
        p["x"],
        p["y"],
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=damping,
        precision=precision,
        backend="triton",
        want_lse=True,
        guess=guess,
    )
    return out, lse2


def _hopper(p, precision, damping, guess=None, config=None, counter=None):
    return H.softmin_hopper(
        p["x"],
        p["y"],
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=damping,
        precision=precision,
        want_lse=True,
        guess=guess,
        config=config,
        fallback_rows=counter,
    )


def _err(a, b, rows=None):
    d = (a.double() - b.double()).abs()
    return float(d.max() if rows is None else d[rows].max())


def _check(out, lse, ref, ref_lse, err_triton, tag):
    assert torch.isfinite(out).all(), tag
    err = _err(out, ref)
    # flash-attention's rule: at most 2x the reference implementation's error
    assert err <= 2 * err_triton + 1e-6 and err < ATOL, (tag, err, err_triton)
    assert _err(lse, ref_lse) < ATOL / (EPS * H.LN2), tag


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------

# the shipped default of every regime: one feature chunk per tile (d = 64, and d = 128 with
# 512-byte rows), several chunks with x resident (512 bf16), x streamed with 256-wide tiles
# (512 tf32; d = 1024 runs the same code with more chunks: tools/flashsinkhorn/hopper_check.py)
CASES = [(64, "tf32"), (64, "bf16"), (128, "tf32"), (512, "tf32"), (512, "bf16")]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d,precision", CASES)
def test_hopper_matches_float64_and_triton(d, precision):
    B, N, M, damping = 2, 777, 1299, 0.9  # odd sizes: partial row blocks and column tiles
    p = _problem(B, N, M, d, precision, seed=d)
    ref, ref_lse = _ref(p, damping)
    t_out, _ = _triton(p, precision, damping)
    err_t = _err(t_out, ref)
    # a good guess (3 eps off, alternating sign): no row needs the fallback
    sign = torch.tensor([1.0, -1.0], device="cuda").repeat(N)[:N]
    guess = ref.float() + 3 * EPS * sign
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse = _hopper(p, precision, damping, guess=guess, counter=counter)
    assert int(counter) == 0
    _check(out, lse, ref, ref_lse, err_t, ("shift", d, precision))
    # no guess: the running max in the main launch
    out, lse = _hopper(p, precision, damping)
    _check(out, lse, ref, ref_lse, err_t, ("online", d, precision))
    assert _err(out, t_out) < ATOL


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d", [64, 512])
def test_hopper_hostile_guess_falls_back_exactly(d):
    B, N, M = 2, 777, 1299
    p = _problem(B, N, M, d, "tf32", seed=7)
    ref, ref_lse = _ref(p, 1.0)
    err_t = _err(_triton(p, "tf32", 1.0)[0], ref)
    guess = ref.float().clone()
    guess[:, 0::3] += 1e4 * EPS  # the sums underflow
    guess[:, 1::3] -= 1e4 * EPS  # the sums overflow
    guess[1, 5] = float("nan")
    n_bad = B * (len(range(0, N, 3)) + len(range(1, N, 3))) + 1  # row 5 (5 % 3 == 2)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse = _hopper(p, "tf32", 1.0, guess=guess, counter=counter)
    assert int(counter) == n_bad
    _check(out, lse, ref, ref_lse, err_t, ("hostile", d))


@pytest.mark.gpu
@needs_sm90
def test_hopper_zero_weights_match_triton():
    B, N, M = 2, 300, 500
    p = _problem(B, N, M, 64, "tf32", seed=3)
    p["logb"][0, ::7] = float("-inf")  # some zero column weights
    p["logb"][1] = float("-inf")  # a problem with no mass: out is +inf
    ref, ref_lse = _ref(p, 1.0)
    t_out, _ = _triton(p, "tf32", 1.0)
    for guess in (None, torch.zeros(B, N, device="cuda")):
        out, lse = _hopper(p, "tf32", 1.0, guess=guess)
        assert torch.isinf(out[1]).all() and (out[1] > 0).all()
        assert _err(out[0], ref[0]) <= 2 * _err(t_out[0], ref[0]) + 1e-6
        assert _err(out[0], ref[0]) < ATOL


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "B,N,M,d",
    [
        (1, 1, 1, 64),
        (3, 64, 128, 64),
        (2, 65, 129, 64),
        (1, 200, 1, 64),
        (2, 301, 257, 100),
        (1, 150, 333, 16),
    ],
)
def test_hopper_tile_edges(B, N, M, d):
    p = _problem(B, N, M, d, "tf32", seed=N + M)
    ref, ref_lse = _ref(p, 1.0)
    err_t = _err(_triton(p, "tf32", 1.0)[0], ref)
    out, lse = _hopper(p, "tf32", 1.0, guess=ref.float())
    _check(out, lse, ref, ref_lse, err_t, (B, N, M, d))


@pytest.mark.gpu
@needs_sm90
def test_auto_backend_runs_the_sm90_kernel_on_large_passes(monkeypatch):
    # 2100 x 2100 = 4.4M scores: above _config.SM90_MIN_SCORES, so backend="auto" takes the
    # Gluon pass and backend="triton" the portable kernel; both against float64
    from flashsinkhorn import _config, primitives

    N = M = 2100
    assert N * M >= _config.SM90_MIN_SCORES
    p = _problem(1, N, M, 64, "tf32", seed=5)
    ref, _ = _ref(p, 1.0)
    calls = []
    real = H.softmin_hopper
    monkeypatch.setattr(H, "softmin_hopper", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert primitives.sm90_pass_reason(p["x"], p["y"], "tf32") is None
    outs = {}
    for backend in ("auto", "triton"):
        outs[backend] = flashsinkhorn.softmin(
            p["x"],
            p["y"],
            p["g"],
            p["logb"],
            p["cx"],
            p["cy"],
            eps=EPS,
            c2=2.0,
            backend=backend,
            guess=ref.float(),
        )[0]
        assert len(calls) == 1, backend  # the "auto" call only
    err_t = _err(outs["triton"], ref)
    assert _err(outs["auto"], ref) <= 2 * err_t + 1e-6 and err_t < ATOL
    # what the Gluon pass declines goes to the Triton kernel: a small pass, other precisions
    assert "scores" in primitives.sm90_pass_reason(p["x"][:, :100], p["y"], "tf32")
    assert primitives.sm90_pass_reason(p["x"], p["y"], "ieee") is not None


# ---------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------


def test_unsupported_reasons_name_the_input():
    x = torch.zeros(2, 10, 64)
    y = torch.zeros(2, 12, 64)
    if not H.HAS_GLUON:
        assert "Gluon" in H.unsupported_reason(x, y)
        return
    cases = [
        (dict(v=torch.zeros(2, 12, 3)), "V average"),
        (dict(labels=(None,)), "label cost"),
        (dict(center=torch.zeros(2, 64)), "center="),
        (dict(precision="ieee"), "'ieee'"),
        (dict(precision="bf16"), "torch.bfloat16"),
    ]
    for kw, word in cases:
        precision = kw.pop("precision", "tf32")
        reason = H.unsupported_reason(x, y, precision, **kw)
        assert reason is not None and word in reason, (kw, reason)
    assert "16-byte rows" in H.unsupported_reason(x[..., :3], y[..., :3])
    assert "16-byte rows" in H.unsupported_reason(
        x[..., :6].bfloat16(), y[..., :6].bfloat16(), "bf16"
    )
    assert "(B, N, D)" in H.unsupported_reason(x[0], y[0])
    assert "CUDA" in H.unsupported_reason(x, y)  # CPU tensors
    with pytest.raises(NotImplementedError, match="label cost"):
        z = torch.zeros(2, 12)
        H.softmin_hopper(x, y, z, z, x[..., 0], z, eps=0.1, c2=2.0, labels=(None,))


def test_config_checks_and_defaults():
    for D, dt in (
        (64, torch.float32),
        (64, torch.bfloat16),
        (512, torch.float32),
        (512, torch.bfloat16),
        (1024, torch.float32),
        (1024, torch.bfloat16),
        (100, torch.float32),
        (4096, torch.float32),
    ):
        cfg = H.default_config(D, dt)
        H._check_config(cfg, D, dt)  # the defaults pass their own checks
        assert H.smem_bytes(cfg, D, dt) <= H.SMEM_LIMIT
    bad = [
        H.HopperConfig(block_k=64, stages=1),  # tile j + 1 lands while tile j is read
        H.HopperConfig(block_n=64),
        H.HopperConfig(block_n=256),  # one chunk per tile: two 64 x 256 accumulators
        H.HopperConfig(pingpong=True),  # turns need several chunks per tile
        H.HopperConfig(block_k=24),
        H.HopperConfig(block_k=48, stages=4),  # 192-byte rows: not whole swizzle rows
        H.HopperConfig(block_k=64, stages=8),  # 8 x 32 KiB of y stages: too much smem
    ]
    for cfg in bad:
        with pytest.raises(ValueError, match="config"):
            H._check_config(cfg, 64, torch.float32)
    H._check_config(H.HopperConfig(block_n=256, block_k=32, pingpong=True), 64, torch.float32)
    # the measured winners: 256-wide tiles where x streams, 128-wide where it stays resident
    big = H.default_config(512, torch.float32)
    assert (big.block_n, big.x_resident, big.pingpong) == (256, False, True)
    assert H.default_config(512, torch.bfloat16).block_n == 128


def _triton_tool(name):
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


# Compiled in a child process: CI sets TRITON_INTERPRET=1 before Python starts, and under
# the interpreter triton's own jit helpers (gl.sum, gl.max, ...) cannot be compiled.
_CHILD = r"""
import json, os, re, subprocess, sys, tempfile
import torch
import triton
from dataclasses import replace
from flashsinkhorn import _softmin_hopper as H
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
res = []
for D, dt, over, mode in json.loads(sys.argv[1]):
    dtype = getattr(torch, dt)
    cfg = H.default_config(D, dtype)
    cfg = replace(cfg, **over)
    k = H.compile_for_sm90(D, dtype, cfg, **mode)
    ptx = k.asm["ptx"]
    stack = None
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(k.asm["cubin"])
            fh.flush()
            out = subprocess.run([tool, "--dump-resource-usage", fh.name],
                                 capture_output=True, text=True).stdout
        stack = [int(v) for v in re.findall(r"STACK:(\d+)", out)]
    needles = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "ex2.approx",
               "setmaxnreg")
    res.append(dict(ws=not mode.get("fallback_pass"), shared=k.metadata.shared, stack=stack,
                    found={n: n in ptx for n in needles}))
print("RESULT " + json.dumps(res))
"""

# (D, dtype, config overrides, mode): the d = 64 default (one chunk per tile, x resident,
# pipe), the fallback launch (inline loads, online max), the large-D path at a small D
# (feature chunks released as they retire, x streamed, 256-wide tiles, ping-pong turns),
# two stage counts
OFFLINE = [
    (64, "float32", {}, {}),
    (64, "bfloat16", {}, dict(online=True, fallback_pass=True)),
    (
        128,
        "float32",
        dict(block_n=256, block_k=32, stages=4, pingpong=True, x_resident=False),
        dict(has_lse=True, count=True),
    ),
    (64, "bfloat16", dict(stages=2), {}),
    (64, "bfloat16", dict(stages=3), {}),
]


@pytest.fixture(scope="module")
def offline_compiles():
    if not (H.HAS_GLUON and _triton_tool("ptxas")):
        pytest.skip("needs Gluon and triton's ptxas")
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(flashsinkhorn.__file__))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(OFFLINE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("case", range(3))
def test_compile_for_sm90_offline(offline_compiles, case):
    r = offline_compiles[case]
    for needle, found in r["found"].items():
        assert found == (needle != "setmaxnreg" or r["ws"]), (needle, r)
    assert r["shared"] <= H.SMEM_LIMIT
    if r["stack"] is not None:
        assert r["stack"] and max(r["stack"]) == 0, r  # no register spills


def test_compile_keeps_configs_distinct(offline_compiles):
    # a config change must reach the kernel: one more y stage (128 x 64 bf16) of smem and
    # its two mbarriers
    a, b = offline_compiles[3], offline_compiles[4]
    assert 128 * 64 * 2 <= b["shared"] - a["shared"] <= 128 * 64 * 2 + 64
