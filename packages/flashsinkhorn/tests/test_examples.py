"""The example scripts run end to end at their smoke sizes on the CPU: the GPU second-order
script writes its results case by case (the H200 run keeps whatever finished before a time
limit); the data-parallel flow-matching example and the multi-GPU run's script run on gloo."""

import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "..", "..", "..", "tools", "flashsinkhorn", "gpu_second_order.py")


def test_gpu_second_order_smoke(tmp_path):
    out = tmp_path / "so"
    cases = "hvp,hvp_peer,otdd,newton_step,hvp_accuracy"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(out), "--smoke", "--cases", cases],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    events = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    ends = {e["case"]: e["status"] for e in events if e["event"] == "case_end"}
    assert ends == dict.fromkeys(cases.split(","), "ok")
    rows = json.loads((out / "bench-second-order.json").read_text())["results"]
    hvp_row = next(r for r in rows if r["bench"] == "hvp" and r["provider"] == "ours")
    assert hvp_row["time_ms"] > 0 and hvp_row["metrics"]["cg_iters"] > 0
    acc = next(r for r in rows if r["bench"] == "hvp_accuracy")["accuracy"]
    assert acc["rel_err_tf32x3"] < 1e-4  # torch path on the CPU: float32 vs float64
    # one summary line per row (and one for our first HVP call), written as they came
    assert len((out / "summary.md").read_text().splitlines()) == 3 + len(rows)
    assert any(e["event"] == "first_call" and e["case"] == "hvp" for e in events)


def test_dp_flow_matching_example_runs_on_cpu(tmp_path):
    """The data-parallel OT flow-matching example, 2 gloo ranks, a few steps: the global
    coupling trains and its pairs are closer than independent ones (the per-rank coupling
    is the one-process solve, tested elsewhere)."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "dp_flow_matching.py")
    out = tmp_path / "fm.json"
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--world",
            "2",
            "--steps",
            "4",
            "--batch",
            "32",
            "--n-eval",
            "100",
            "--couplings",
            "global",
            "independent",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["coupling"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"global", "independent"}
    assert rows["global"]["pair_sq_dist"] < rows["independent"]["pair_sq_dist"]
    assert all(
        r["divergence_1_euler"] >= 0 or abs(r["divergence_1_euler"]) < 1e-3 for r in rows.values()
    )


SCALING = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "tools", "flashsinkhorn", "dist_scaling.py"
)


@pytest.mark.skipif(not os.path.exists(SCALING), reason="the monorepo's tools/ is not here")
def test_dist_scaling_script_runs_on_cpu(tmp_path):
    """The multi-GPU run's script, its logic on 2 gloo ranks (torchrun, tiny sizes): every
    case writes an ok row, the sharded values equal the one-GPU ones and the draws agree."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            SCALING,
            "--cpu",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench-dist.json").read_text())["results"]
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    benches = {r["bench"] for r in rows}
    assert {
        "dist_iteration",
        "dist_samples_loss",
        "dist_sample_plan",
        "dist_flow_matching",
    } <= benches
    sharded = [r for r in rows if r["provider"] == "ours-sharded"]
    assert all(r["metrics"].get("value_rel_diff", 0) < 1e-5 for r in sharded)
    draws = next(r for r in sharded if r["bench"] == "dist_sample_plan")
    assert draws["metrics"]["same_draws_as_one_gpu"] > 0.99


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shuffled_regression_hybrid_detects_saddle_and_converges():
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from shuffled_regression import shuffled_regression  # the example (not in the wheel)

    # adam_lr 0.2: the saddle is escaped after 40 Adam steps (180 at the default 0.05)
    r = shuffled_regression(
        n=40,
        p=3,
        q=2,
        eps=0.3,
        seed=0,
        backend="torch",
        sinkhorn_iter=300,
        check_every=10,
        max_adam=200,
        newton_iters=20,
        adam_lr=0.2,
    )
    h = r["history"]
    lam = [e["lambda_min"] for e in h if e["phase"] == "adam" and "lambda_min" in e]
    assert lam[0] < 0  # starts in a saddle region
    assert r["switch_iter"] is not None
    newton = [e for e in h if e["phase"] == "newton"]
    assert newton[-1]["grad_norm"] < 1e-8
    assert all(e["lambda_min"] > -1e-8 for e in newton if "lambda_min" in e)
    gn = [e["grad_norm"] for e in newton if e["grad_norm"] > 1e-11]
    ratios = [b / a for a, b in zip(gn, gn[1:])]
    # superlinear (the forcing tolerance sqrt|g| gives order 1.5): shrinking ratios
    assert len(ratios) >= 3 and all(r2 < r1 for r1, r2 in zip(ratios[-3:], ratios[-2:])), gn
    assert ratios[-1] < 0.05, gn


def test_registration_example_smoke():
    """The multiscale registration example at its smoke size: the rigid then non-rigid
    flows bring the source closer to where its points belong on the target."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "registration.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [float(v) for v in re.findall(r"mean error(?: before)?:? ([0-9.]+)", proc.stdout)]
    assert len(errors) == 3 and errors[2] < errors[1] < errors[0], proc.stdout
