"""The sm_90 debias kernel (``_symmetric_hopper.self_sums_hopper``: x against itself, each
tile pair once), the Gluon recomputation of flagged rows (``softmin_rows_hopper``) and the
Gluon first level of plan sampling (``_sample_hopper``): GPU tests against float64 and
the Triton kernels, CPU tests of the dispatch's fallback and offline sm_90 compiles.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from test_softmin_hopper import EPS, _problem, _triton_tool, needs_sm90

import flashsinkhorn
from flashsinkhorn import _sample_hopper, _softmin_hopper, _symmetric_hopper, primitives
from flashsinkhorn.reference import softmin_ref


def _self_problem(B, N, d, precision, seed, zero_weights=False):
    p = _problem(B, N, 3, d, precision, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(B, N, generator=gen) + 0.1
    if zero_weights:
        a[0, ::5] = 0.0
    loga = torch.log(a / a.sum(-1, keepdim=True)).cuda()
    f = (0.01 * torch.randn(B, N, generator=gen)).cuda()
    return p["x"], loga, f, p["cx"]


def _self_ref(x, loga, f, cx, damping):
    return softmin_ref(x.double(), x.double(), f, loga, cx, cx, eps=EPS, c2=2.0, damping=damping)[0]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d,precision", [(64, "tf32"), (64, "bf16"), (512, "tf32"), (100, "tf32")])
@pytest.mark.parametrize("N", [1, 129, 1000])
def test_self_update_matches_float64_and_triton(monkeypatch, d, precision, N):
    """The self update through the dispatch (its size threshold lowered so small problems
    take the Gluon kernel) against float64 and the Triton symmetric kernel; the kernel is
    called (no silent fallback)."""
    from flashsinkhorn import _config

    monkeypatch.setattr(_config, "SM90_MIN_SCORES", 1)
    calls = []
    real = _symmetric_hopper.self_sums_hopper
    monkeypatch.setattr(
        _symmetric_hopper, "self_sums_hopper", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    x, loga, f, cx = _self_problem(2, N, d, precision, seed=N + d)
    damping = 0.9
    ref = _self_ref(x, loga, f, cx, damping)
    kw = dict(eps=EPS, c2=2.0, damping=damping, precision=precision)
    got = primitives.self_softmin(x, loga, f, cx, backend="auto", **kw)
    assert calls and not primitives.SM90_FAILED, primitives.SM90_FAILED
    tri = primitives.self_softmin(x, loga, f, cx, backend="triton", check=False, **kw)
    err = float((got.double() - ref).abs().max())
    err_t = float((tri.double() - ref).abs().max())
    assert err <= 2 * err_t + 1e-6 and err < 1e-4, (err, err_t)


@pytest.mark.gpu
@needs_sm90
def test_self_update_hostile_potentials_and_zero_weights(monkeypatch):
    """Potentials far from their fixed point (the sums over- and underflow) and zero
    weights: the flagged rows are recomputed by the Gluon fallback launch, exactly."""
    from flashsinkhorn import _config

    monkeypatch.setattr(_config, "SM90_MIN_SCORES", 1)
    x, loga, f, cx = _self_problem(2, 777, 64, "tf32", seed=3, zero_weights=True)
    f = f.clone()
    f[:, 0::3] += 1e3 * EPS
    f[:, 1::3] -= 1e3 * EPS
    ref = _self_ref(x, loga, f, cx, 1.0)
    got = primitives.self_softmin(x, loga, f, cx, eps=EPS, c2=2.0, precision="tf32")
    assert not primitives.SM90_FAILED, primitives.SM90_FAILED
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    assert float((got.double() - ref)[finite].abs().max()) < 1e-4


@pytest.mark.gpu
@needs_sm90
def test_softmin_rows_hopper_recomputes_only_flagged_rows():
    p = _problem(2, 700, 900, 64, "tf32", seed=9)
    ref = softmin_ref(
        p["x"].double(), p["y"].double(), p["g"], p["logb"], p["cx"], p["cy"], eps=EPS, c2=2.0
    )[0]
    out = torch.full((2, 700), 7.0, device="cuda")
    flags = torch.zeros(2, 700, dtype=torch.bool, device="cuda")
    flags[0, 5] = flags[1, 64:130] = True
    _softmin_hopper.softmin_rows_hopper(
        p["x"],
        p["y"],
        p["g"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=EPS,
        c2=2.0,
        damping=1.0,
        precision="tf32",
        flags=flags,
        out=out,
    )
    assert (out[~flags] == 7.0).all()
    assert float((out[flags].double() - ref[flags]).abs().max()) < 1e-4


@pytest.mark.gpu
@needs_sm90
def test_debiased_samples_loss_auto_matches_triton():
    """SamplesLoss(debias=True) fwd + grad at 3000 points (9M scores: every pass on the
    sm_90 kernels under "auto") equals the portable kernels' within tf32."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(3000, 64, generator=gen) / 8).cuda().requires_grad_()
    y = (torch.rand(2900, 64, generator=gen) / 8 + 1 / 16).cuda()
    out = {}
    for backend in ("auto", "triton"):
        loss = flashsinkhorn.SamplesLoss(blur=0.05, debias=True, backend=backend)
        v = loss(x, y)
        (g,) = torch.autograd.grad(v, x)
        out[backend] = (float(v), g)
    assert not primitives.SM90_FAILED, primitives.SM90_FAILED
    assert abs(out["auto"][0] - out["triton"][0]) < 1e-5 * abs(out["triton"][0]) + 1e-7
    gmax = float(out["triton"][1].abs().max())
    assert float((out["auto"][1] - out["triton"][1]).abs().max()) < 2e-3 * gmax


# ---------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------


def test_self_update_falls_back_when_the_kernel_fails(monkeypatch):
    """A failing Gluon self kernel (compile error on the host, simulated) makes the sm_90
    self update return None (the caller then runs the plain pass), recorded once."""
    monkeypatch.setattr(primitives, "SM90_FAILED", {})

    def broken(*a, **k):
        raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(_symmetric_hopper, "self_sums_hopper", broken)
    x = torch.zeros(1, 8, 16)
    z = torch.zeros(1, 8)
    with pytest.warns(RuntimeWarning, match="self d=16"):
        assert primitives._self_update_sm90(x, z, z, z, 0.1, 2.0, 1.0, "tf32") is None
    assert "simulated" in primitives.SM90_FAILED["self d=16 tf32"]


_CHILD = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton
from flashsinkhorn import _sample_hopper as Sm, _symmetric_hopper as Y
bin_ = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
res = []
for kind, D, dt, mode in json.loads(sys.argv[1]):
    dtype = getattr(torch, dt)
    if kind == "self":
        k = Y.compile_symmetric_for_sm90(D, dtype, self_pass=True)
    else:
        k = Sm.compile_sample_for_sm90(D, dtype, **mode)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(k.asm["cubin"])
        fh.flush()
        usage = subprocess.run([bin_, "--dump-resource-usage", fh.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([bin_, "-sass", fh.name], capture_output=True, text=True).stdout
    res.append(dict(stack=[int(s) for s in re.findall(r"STACK:(\d+)", usage)],
                    shared=k.metadata.shared, hgmma="HGMMA" in sass, ex2="MUFU.EX2" in sass,
                    atom=re.search(r"\b(ATOMG?|REDG?)\.", sass) is not None))
print("RESULT " + json.dumps(res))
"""

OFFLINE = [
    ("self", 64, "float32", {}),
    ("self", 512, "bfloat16", {}),
    ("sample", 64, "float32", {}),
    ("sample", 64, "bfloat16", dict(online=True, fallback_pass=True)),
]


@pytest.fixture(scope="module")
def offline_compiles():
    if not (_sample_hopper.HAS_GLUON and _triton_tool("ptxas") and _triton_tool("cuobjdump")):
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
def test_compiles_for_sm90_offline(offline_compiles, case):
    r = offline_compiles[case]
    assert r["stack"] and max(r["stack"]) == 0, r  # no register spills
    assert r["shared"] <= _softmin_hopper.SMEM_LIMIT and r["hgmma"] and r["ex2"], r
    assert r["atom"] == (OFFLINE[case][0] == "self"), r  # the self kernel's column sums


def test_sample_config_tiles_are_blocks():
    for D, dt in (
        (64, torch.float32),
        (512, torch.float32),
        (512, torch.bfloat16),
        (1024, torch.float32),
    ):
        cfg = _sample_hopper.sample_config(D, dt)
        assert cfg.block_n == _sample_hopper.TILE == flashsinkhorn._config.SAMPLE_BLOCK
        _softmin_hopper._check_config(cfg, D, dt)
    assert math.isfinite(_sample_hopper.SAFE_HI)
