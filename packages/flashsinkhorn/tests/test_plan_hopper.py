"""The Gluon sm_90 plan application (``_plan_hopper.py``, the softmin pass with V) against
float64 and the Triton kernel; the dispatch and its fallback when a kernel fails.

GPU tests (marker ``gpu``) need an sm_90 GPU. The CPU tests check the launcher's layout of
V (the kernel's column relabelling, emulated in torch), the configurations, the fallback
guard, and compile the kernel offline for sm_90 with the ptxas that ships with triton.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from test_softmin_hopper import EPS, _problem, _triton_tool, needs_sm90

import flashsinkhorn
from flashsinkhorn import _plan_hopper as P
from flashsinkhorn import primitives
from flashsinkhorn.reference import softmin_ref

# vbar's error relative to max |V| (the weights are rounded to tf32 / bf16 for the tensor
# cores: 2^-12 / 2^-9 relative each; the row sums add the rounded weights)
VTOL = {"tf32": 5e-4, "bf16": 4e-3}
ATOL = 1e-4  # out, in cost units (as test_softmin_hopper)


def _values(p, DV, precision, seed):
    """V (B, M, DV), exactly representable in the kernel's dtype (so that only the
    weights' rounding errs), as fp32."""
    gen = torch.Generator().manual_seed(seed)
    B, M = p["g"].shape
    v = torch.randn(B, M, DV, generator=gen)
    v = v.bfloat16().float() if precision == "bf16" else flashsinkhorn.operands.round_to_tf32(v)
    return v.cuda()


def _errs(res, ref, v):
    out, lse, vbar = res
    vmax = float(v.abs().max())
    e_out = float((out.double() - ref[0]).abs().max())
    e_v = float((vbar.double() - ref[2]).abs().max()) / vmax
    return e_out, e_v, lse


def _triton_errs(p, v, precision, damping, ref):
    res = primitives.softmin(
        p["x"],
        p["y"],
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=damping,
        v=v,
        precision=precision,
        backend="triton",
        want_lse=True,
    )
    return _errs(res, ref, v)[:2]


def _plan(p, v, precision, damping, **kw):
    return P.plan_hopper(
        p["x"],
        p["y"],
        v,
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=damping,
        precision=precision,
        want_lse=True,
        **kw,
    )


def _ref(p, v, damping):
    return softmin_ref(
        p["x"].double(),
        p["y"].double(),
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=damping,
        v=v,
    )


def _check(res, ref, v, precision, err_t, tag):
    assert torch.isfinite(res[2]).all(), tag
    e_out, e_v, lse = _errs(res, ref, v)
    assert e_out <= 2 * err_t[0] + 1e-6 and e_out < ATOL, (tag, e_out, err_t)
    assert e_v <= max(2 * err_t[1], VTOL[precision]), (tag, e_v, err_t)
    assert float((lse.double() - ref[1]).abs().max()) < ATOL / (EPS * 0.6931), tag


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------

# (d, precision, DV): one feature chunk per tile (d = 64, 128), several (512), output
# chunks (DV > block_dv), DV not a multiple of 16, DV = 1
CASES = [
    (64, "tf32", 64),
    (64, "bf16", 64),
    (64, "tf32", 3),
    (128, "tf32", 200),
    (512, "tf32", 512),
    (256, "bf16", 70),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d,precision,DV", CASES)
def test_plan_matches_float64_and_triton(d, precision, DV):
    B, N, M, damping = 2, 777, 1299, 0.9  # odd sizes: partial row blocks and column tiles
    p = _problem(B, N, M, d, precision, seed=d + DV)
    v = _values(p, DV, precision, seed=DV)
    ref = _ref(p, v, damping)
    err_t = _triton_errs(p, v, precision, damping, ref)
    sign = torch.tensor([1.0, -1.0], device="cuda").repeat(N)[:N]
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    res = _plan(
        p, v, precision, damping, guess=ref[0].float() + 3 * EPS * sign, fallback_rows=counter
    )
    assert int(counter) == 0
    _check(res, ref, v, precision, err_t, ("shift", d, precision, DV))
    res = _plan(p, v, precision, damping)  # no guess: the online max in the main launch
    _check(res, ref, v, precision, err_t, ("online", d, precision, DV))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d", [64, 512])
def test_plan_hostile_guess_falls_back_exactly(d):
    B, N, M = 2, 777, 1299
    p = _problem(B, N, M, d, "tf32", seed=7)
    v = _values(p, 33, "tf32", seed=1)
    ref = _ref(p, v, 1.0)
    err_t = _triton_errs(p, v, "tf32", 1.0, ref)
    guess = ref[0].float().clone()
    guess[:, 0::3] += 1e4 * EPS  # the sums underflow
    guess[:, 1::3] -= 1e4 * EPS  # the sums overflow
    guess[1, 5] = float("nan")
    n_bad = B * (len(range(0, N, 3)) + len(range(1, N, 3))) + 1
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    res = _plan(p, v, "tf32", 1.0, guess=guess, fallback_rows=counter)
    assert int(counter) == n_bad
    _check(res, ref, v, "tf32", err_t, ("hostile", d))
    # values near the accumulator's range: rows whose P @ V overflows are recomputed
    big = v * 2.0**100
    res = _plan(p, big, "tf32", 1.0, guess=ref[0].float())
    assert torch.isfinite(res[2]).all()
    assert float((res[2].double() - ref[2] * 2.0**100).abs().max()) < 1e-3 * float(big.abs().max())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg",
    [
        P.PlanConfig(block_n=64, block_dv=128),
        P.PlanConfig(block_n=128, block_dv=32, stages=3, v_stages=1),
        P.PlanConfig(block_n=64, block_k=32, block_dv=16, stages=4, v_stages=3),
        P.PlanConfig(block_n=64, block_k=32, block_dv=64, pingpong=True, x_resident=False),
    ],
)
def test_plan_configs(cfg):
    B, N, M, d, DV = 1, 300, 517, 64, 100
    p = _problem(B, N, M, d, "tf32", seed=11)
    v = _values(p, DV, "tf32", seed=2)
    ref = _ref(p, v, 1.0)
    err_t = _triton_errs(p, v, "tf32", 1.0, ref)
    for guess in (None, ref[0].float()):
        _check(_plan(p, v, "tf32", 1.0, guess=guess, config=cfg), ref, v, "tf32", err_t, cfg)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,N,M", [(1, 1, 1), (3, 64, 128), (2, 65, 129), (1, 200, 1)])
def test_plan_tile_edges_and_zero_weights(B, N, M):
    p = _problem(B, N, M, 64, "tf32", seed=N + M)
    if M > 3:
        p["logb"][0, ::3] = float("-inf")
    v = _values(p, 16, "tf32", seed=3)
    ref = _ref(p, v, 1.0)
    err_t = _triton_errs(p, v, "tf32", 1.0, ref)
    _check(_plan(p, v, "tf32", 1.0, guess=ref[0].float()), ref, v, "tf32", err_t, (B, N, M))


@pytest.mark.gpu
@needs_sm90
def test_auto_runs_the_plan_kernel_and_falls_back_when_it_fails(monkeypatch):
    # 2100 x 2100 = 4.4M scores: backend="auto" takes the Gluon plan application
    from flashsinkhorn import _config

    N = M = 2100
    assert N * M >= _config.SM90_MIN_SCORES
    p = _problem(1, N, M, 64, "tf32", seed=5)
    v = _values(p, 64, "tf32", seed=4)
    ref = _ref(p, v, 1.0)
    calls = []
    real = P.plan_hopper
    monkeypatch.setattr(P, "plan_hopper", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(eps=EPS, c2=2.0, v=v, want_lse=True, guess=ref[0].float())
    args = (p["x"], p["y"], p["g"], p["logb"], p["cx"], p["cy"])
    res = primitives.softmin(*args, backend="auto", **kw)
    assert len(calls) == 1
    err_t = _triton_errs(p, v, "tf32", 1.0, ref)
    _check(res, ref, v, "tf32", err_t, "auto")

    def broken(*a, **k):
        raise RuntimeError("PTX assembly failed (simulated)")

    monkeypatch.setattr(P, "plan_hopper", broken)
    monkeypatch.setattr(primitives, "SM90_FAILED", {})
    with pytest.warns(RuntimeWarning, match="plan d=64"):
        res = primitives.softmin(*args, backend="auto", **kw)
    _check(res, ref, v, "tf32", err_t, "fallback")
    assert "PTX assembly" in next(iter(primitives.SM90_FAILED.values()))


# ---------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_values_match_the_kernels_weight_order(dtype):
    """The launcher's Vt against a torch emulation of the kernel: per column tile, the
    weights relabelled as ``_apply_v`` does (tf32) times the Vt tile give P @ V."""
    B, M, DV, BN, BDV = 2, 300, 20, 128, 16
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(B, M, DV, generator=gen)
    cfg = P.PlanConfig(block_n=BN, block_dv=BDV)
    Mpad = -(-M // BN) * BN
    vt = P.transposed_values(v, cfg, Mpad, dtype)
    assert vt.shape == (B, 32, Mpad) and vt.dtype == dtype
    p = torch.rand(B, 64, Mpad, generator=gen)
    p[..., M:] = 0.0  # the padding columns' weights: exp2(-inf)
    if dtype == torch.float32:  # the kernel's relabelling of the columns within each 8
        q = p.view(B, 64, Mpad // 8, 4, 2).transpose(3, 4).reshape(B, 64, Mpad)
    else:
        q = p
    got = q @ vt.float().transpose(1, 2)
    vk = (
        v.bfloat16().float() if dtype == torch.bfloat16 else flashsinkhorn.operands.round_to_tf32(v)
    )
    want = p[..., :M] @ vk
    assert torch.allclose(got[..., :DV], want, rtol=1e-5, atol=1e-4)
    assert (got[..., DV:] == 0).all()
    # tf32: rounded to nearest (10 mantissa bits), within 2^-11 relative
    if dtype == torch.float32:
        bits = vt.view(torch.int32)
        assert ((bits & 0x1FFF) == 0).all()


def test_plan_config_checks_and_defaults():
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [
        (64, 64, f32),
        (64, 64, bf16),
        (512, 512, f32),
        (512, 512, bf16),
        (1024, 1024, f32),
        (128, 3, f32),
        (8, 1, f32),
        (4096, 64, bf16),
    ]
    for D, DV, dt in cases:
        cfg = P.default_plan_config(D, DV, dt)
        P._check_config(cfg, D, dt)
        assert P.plan_smem_bytes(cfg, D, dt) <= P.SMEM_LIMIT - 8192
    bad = [
        P.PlanConfig(block_n=256),
        P.PlanConfig(block_dv=24),
        P.PlanConfig(block_dv=512),
        P.PlanConfig(block_n=128, block_dv=256),  # registers
        P.PlanConfig(pingpong=True),  # one chunk per tile at d = 64
        P.PlanConfig(stages=1),
        P.PlanConfig(stages=8, v_stages=4),  # shared memory
    ]
    for cfg in bad:
        with pytest.raises(ValueError, match="config"):
            P._check_config(cfg, 64, torch.float32)


def test_default_chunks_are_tma_boxes():
    """Every default feature chunk and output chunk is a power of two (TMA box sides; a
    block_k of 96 at d = 96 failed to build its descriptor)."""
    from flashsinkhorn import _softmin_hopper, _symmetric_hopper

    for D in range(4, 260, 4):
        for dt in (torch.float32, torch.bfloat16):
            if dt == torch.bfloat16 and D % 8:
                continue
            ks = [
                _softmin_hopper.default_config(D, dt).block_k,
                _symmetric_hopper.default_symmetric_config(D, dt).block_k,
                P.default_plan_config(D, D, dt).block_k,
                P.default_plan_config(D, D, dt).block_dv,
            ]
            assert all(k & (k - 1) == 0 and k >= 16 for k in ks), (D, dt, ks)


def test_plan_reasons():
    x, y = torch.zeros(2, 10, 64), torch.zeros(2, 12, 64)
    v = torch.zeros(2, 12, 5)
    reason = P.plan_reason(x, y, v, "tf32")
    assert reason is not None and ("CUDA" in reason or "Gluon" in reason)
    if P.HAS_GLUON:
        assert "(B, M, DV)" not in reason
        assert "'ieee'" in P.plan_reason(x, y, v, "ieee")


def test_sm90_call_records_a_failure_and_stops_calling(monkeypatch):
    monkeypatch.setattr(primitives, "SM90_FAILED", {})
    calls = []

    def broken(a, *, b):
        calls.append((a, b))
        raise ValueError("simulated Gluon compile error")

    with pytest.warns(RuntimeWarning, match="'k d=1'.*simulated"):
        assert primitives.sm90_call("k d=1", broken, 1, b=2) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert primitives.sm90_call("k d=1", broken, 1, b=2) is None
    assert calls == [(1, 2)] and "simulated" in primitives.SM90_FAILED["k d=1"]

    def declines(*a):
        raise NotImplementedError("not this input")

    assert primitives.sm90_call("k d=2", declines) is None
    assert "k d=2" not in primitives.SM90_FAILED  # declining is not a failure
    assert primitives.sm90_call("k d=3", lambda: 7) == 7


_CHILD = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton
from dataclasses import replace
from flashsinkhorn import _plan_hopper as P
bin_ = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
res = []
for D, DV, dt, mode in json.loads(sys.argv[1]):
    k = P.compile_plan_for_sm90(D, DV, getattr(torch, dt), **mode)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(k.asm["cubin"])
        fh.flush()
        usage = subprocess.run([bin_, "--dump-resource-usage", fh.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([bin_, "-sass", fh.name], capture_output=True, text=True).stdout
    res.append(dict(stack=[int(s) for s in re.findall(r"STACK:(\d+)", usage)],
                    shared=k.metadata.shared, shfl_idx=sass.count("SHFL.IDX"),
                    hgmma_rs=len(re.findall(r"HGMMA\.\S+ R\d+, R\d+, gdesc", sass)),
                    ex2="MUFU.EX2" in sass))
print("RESULT " + json.dumps(res))
"""

# the defaults at d = 64 (pipe) and 512 (chunks, ping-pong), the fallback launch
OFFLINE = [
    (64, 64, "float32", {}),
    (64, 64, "bfloat16", {}),
    (512, 512, "float32", dict(has_lse=True, count=True)),
    (64, 64, "float32", dict(online=True, fallback_pass=True)),
]


@pytest.fixture(scope="module")
def offline_compiles():
    if not (P.HAS_GLUON and _triton_tool("ptxas") and _triton_tool("cuobjdump")):
        pytest.skip("needs Gluon and triton's ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(flashsinkhorn.__file__))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(OFFLINE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("case", range(len(OFFLINE)))
def test_plan_compiles_for_sm90_offline(offline_compiles, case):
    r = offline_compiles[case]
    assert r["stack"] and max(r["stack"]) == 0, r  # no register spills
    assert r["shared"] <= P.SMEM_LIMIT and r["ex2"] and r["hgmma_rs"] > 0, r
    if case in (0, 1):
        # the weights reach the P @ V wgmma where the scores' wgmma left them: no shuffle
        assert r["shfl_idx"] == 0, r
