"""FlashMuon on several processes (gloo): FSDP2 shards against one process's run, and
DTensor row shards orthogonalised once, on an owner rank (fp32 momenta bit for bit, 8-bit
low-rank momenta with all-reduced factor sums)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from test_muon import _params

import flashoptim_fused as fo
from flashoptim_fused import reference
from flashoptim_fused.muon import LOWRANK_P as LOW_P
from flashoptim_fused.muon import LOWRANK_R as LOW_R
from flashoptim_fused.muon import matrix_shape

# ------------------------------------------------------------------------- FSDP2 (gloo)


def _fsdp_net():
    torch.manual_seed(0)
    # 33 rows: uneven shards on 2 ranks (17 + 16)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 8))


def _fsdp_train(model, opt, rank, world, steps, nan_at=None):
    g = torch.Generator().manual_seed(5)
    for s in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        h = slice(rank * 8 // world, (rank + 1) * 8 // world)
        ((model(x[h]) - y[h]) ** 2).mean().backward()
        if s == nan_at and rank == 1:  # one rank's shard only: every rank must skip
            p = next(q for q in model.parameters() if q.ndim == 2)
            p.grad._local_tensor.view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad()


def _fsdp_worker(rank, world, init, out):
    from test_distributed import _finish
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = _fsdp_net()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = fo.FlashMuon(model.named_parameters(), lr=0.02)
        _fsdp_train(model, opt, rank, world, 4, nan_at=2)
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        _finish(rank, out, dict(params=full, skipped=opt.skipped_steps))
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_gloo_processes_match_one():
    """FSDP2 (DTensor shards, uneven) on 2 gloo processes: each matrix all-gathered for its
    orthogonalisation; the parameters after 4 steps (the third skipped on both ranks for a
    NaN in rank 1's shard) match one process's run with the whole batch."""
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    from test_distributed import _spawn

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        _spawn(_fsdp_worker, (2, "file://" + os.path.join(d, "store"), out), 2, d)
        got = torch.load(out)
    model = _fsdp_net()
    opt = fo.FlashMuon(model.named_parameters(), lr=0.02)
    g = torch.Generator().manual_seed(5)
    for s in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        if s == 2:  # the skipped step
            continue
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert got["skipped"] == 1
    for a, b in zip(got["params"], model.parameters()):
        # the mean of two half-batch gradients vs the whole batch's: fp32 round-off, then
        # the bf16 Newton-Schulz and the int8 momentum codes round the same values apart
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=2e-3)


# row shards: uneven (33 on 2 and 3 ranks), two of one shape (one owner's batch or two
# owners), a tall and a wide one, and 2 rows (one rank of 3 holds none)
SHARD_SHAPES = [(33, 7), (40, 24), (40, 24), (24, 40), (2, 16)]
# quantized: low-rank momenta (both sides >= 32; rows of 40 end inside a group)
SHARD_SHAPES_Q = [(33, 40), (40, 48), (40, 48), (48, 40), (2, 16)]


def _shard_run(world, rank=0, mesh=None, steps=2, quantize=False):
    """FlashMuon on SHARD_SHAPES (fp32 momentum: elementwise the same on any split) or
    SHARD_SHAPES_Q (``quantize``) with the same gradients each step; DTensor row shards when
    ``mesh`` is given. Returns the full parameters, the matrices this process orthogonalised
    and the low-rank factors (P gathered by rows)."""
    from flashoptim_fused import muon as muon_mod

    shapes = SHARD_SHAPES_Q if quantize else SHARD_SHAPES
    full = _params(shapes=shapes, seed=3)
    ps = full
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        ps = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in full]
    seen = []
    ns = muon_mod.newton_schulz

    def counting(x, *a, **k):
        seen.extend([tuple(x.shape[-2:])] * (x.shape[0] if x.ndim == 3 else 1))
        return ns(x, *a, **k)

    muon_mod.newton_schulz = counting
    try:
        opt = fo.FlashMuon(ps, lr=0.02, quantize=quantize)
        for s in range(steps):
            g = torch.Generator().manual_seed(50 + s)
            for p, f in zip(ps, full):
                grad = torch.randn(f.shape, generator=g).bfloat16()
                if mesh is not None:
                    grad = distribute_tensor(grad, mesh, [Shard(0)])
                p.grad = grad
            opt.step()
    finally:
        muon_mod.newton_schulz = ns
    out = [p.full_tensor() if mesh is not None else p for p in ps]
    sd = opt.state_dict()["state"]
    factors = [
        tuple(
            st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k] for k in (LOW_P, LOW_R)
        )
        for st in sd.values()
        if LOW_P in st
    ]
    return [o.detach().clone() for o in out], seen, factors


def _owner_worker(rank, world, quantize, init, out):
    from test_distributed import _finish
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        params, seen, factors = _shard_run(world, rank, mesh, quantize=quantize)
        every = [None] * world
        dist.all_gather_object(every, seen)
        _finish(rank, out, dict(params=params, seen=every, factors=factors))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,quantize", [(2, False), (3, True)])
def test_row_shards_orthogonalised_once_on_an_owner(world, quantize):
    """DTensor row shards on 2 and 3 gloo processes: every matrix is orthogonalised on one
    rank only (each step: the ranks' matrices add up to the matrices, once each, and every
    rank owns some). fp32 momenta: the parameters after 2 steps equal one process's bit for
    bit. 8-bit low-rank momenta: the factors' sums over the row shards (all-reduced) round
    in another order than one process's products, so the factors agree to bf16 roundings and
    the parameters to a few of their ulps."""
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    from test_distributed import _spawn

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        args = (world, quantize, "file://" + os.path.join(d, "store"), out)
        _spawn(_owner_worker, args, world, d)
        got = torch.load(out)
    ref, seen, factors = _shard_run(1, quantize=quantize)
    shapes = SHARD_SHAPES_Q if quantize else SHARD_SHAPES
    per_step = sorted(matrix_shape(torch.empty(s)) for s in shapes)
    per_step = [(min(a, b), max(a, b)) for a, b in per_step]
    wide = sorted(sorted(s) for r in got["seen"] for s in r)
    assert wide == sorted([list(s) for s in per_step] * 2)
    assert all(got["seen"][r] for r in range(min(world, len(shapes))))
    assert len(seen) == 2 * len(shapes)
    if not quantize:
        for a, b in zip(got["params"], ref):
            assert torch.equal(a, b)
        return
    assert len(factors) == len(got["factors"]) == 4
    for (P, R), (Pg, Rg) in zip(factors, got["factors"]):
        low, low_g = reference.lowrank_ref(P, R), reference.lowrank_ref(Pg, Rg)
        assert (low - low_g).abs().max() <= 2**-7 * low.abs().max()
    for a, b in zip(got["params"], ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=1e-4)
