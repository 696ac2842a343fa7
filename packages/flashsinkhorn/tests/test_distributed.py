"""Sharded solve, SamplesLoss, plan operations and sampling over gloo (CPU) process groups
of 2 and 3 ranks, uneven shards: every rank's result equals its slice of the one-process
result on the whole problem (float64; the torch backend, plus one interpreter case for the
Triton path). The worlds are spawned once per size (module fixture: starting processes
costs seconds) and run every case of ``_dist_worker.py``; each test reads its case's result.
"""

import json
import os
import socket
import time

import _dist_worker as W
import pytest
import torch
import torch.multiprocessing as mp

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLDS = (2, 3)
TIMEOUT_S = 600  # the whole world; a deadlock fails here (and gloo's own 120 s timeout)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world, out_dir):
    ctx = mp.start_processes(
        W.main,
        args=(world, _free_port(), str(out_dir), list(W.CASES)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    t0 = time.time()
    while not ctx.join(timeout=5):
        if time.time() - t0 > TIMEOUT_S:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the world of {world} ranks did not finish in {TIMEOUT_S} s")
    out = {}
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
            out[r] = json.load(fh)
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return {w: _run_world(w, tmp_path_factory.mktemp(f"world{w}")) for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(W.CASES))
def test_sharded_equals_one_process(worlds, world, case):
    for rank, results in worlds[world].items():
        assert results.get(case) == "ok", f"rank {rank} of {world}:\n{results.get(case)}"


def test_cases_have_docstrings_or_names():
    """Every case the worlds run is listed (a typo in a case name would skip it silently)."""
    assert len(W.CASES) >= 8 and all(callable(f) for f in W.CASES.values())


@pytest.mark.gpu
def test_gpu_world_of_one_nccl_stream_equals_plain():
    """CUDA, the Triton kernels: a one-rank NCCL group with the chunked (stream) exchange
    forced into several chunks per pass gives the one-process solve's potentials and value
    (tf32, fixed iterations) and the same sampled draws up to near ties."""
    import torch.distributed as dist

    import flashsinkhorn as fs
    from flashsinkhorn import distributed

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.rand(3000, 64, generator=gen).cuda() / 8
        y = (torch.rand(2500, 64, generator=gen) / 8 + 1 / 16).cuda()
        kw = dict(eps=0.01, tol=None, max_iter=20)
        ref = fs.solve(x, y, **kw)
        r = fs.solve(
            x,
            y,
            process_group=distributed.Sharding(
                dist.group.WORLD, exchange="stream", chunk_bytes=700 * 260
            ),
            **kw,
        )
        assert torch.allclose(r.f, ref.f, atol=1e-5, rtol=1e-5)
        assert torch.allclose(r.g, ref.g, atol=1e-5, rtol=1e-5)
        assert abs(float(r.value - ref.value)) < 1e-5 * abs(float(ref.value))
        same = (fs.sample_plan(r, seed=3) == fs.sample_plan(ref, seed=3)).float().mean()
        assert float(same) > 0.99
    finally:
        dist.destroy_process_group()
