"""The sharding-invariance contract (``grid.py``, docs/flashoptim.md "Sharding"): for the
same gradients, parameters, codes, scales, corrections, fp32 states and step counts are bit
for bit those of one process, under FSDP2 (``fully_shard``) on 1, 2, 3 and 4 gloo ranks with
uneven and empty shards, HSDP on a 2 x 2 mesh, DDP, tied weights, 50 steps; and a
torch.distributed.checkpoint saved on 4 ranks resumes on 2, saved again resumes on 1, and
ends where the uninterrupted run ends, bit for bit.

The gradients are set directly (the same full gradient on every rank, each rank its rows):
the contract is the optimizer's; how FSDP reduces gradients (summation order) is torch's.
The gloo runs step on the CPU path, bit for bit the Triton kernel's math
(``test_kernel_rows_equal_cpu_path`` checks that for the per-row layout; ``test_cpu.py`` and
``test_step_kernel.py`` for the rest). Without a process group, row shards stepped as
separate tensors equal the whole tensors on the CPU path and, on a GPU, through the CUDA
kernel (``test_gpu_row_shards_equal_the_whole``).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _checks import INTERP
from test_distributed import _finish, _spawn

import flashoptim_fused as fo
from flashoptim_fused import _plan, grid

STEPS = 50
# name -> shape: rows of 64 (the flat grid), rows of 40 and 33 (end inside a group: split
# rows), rows of 96 in 5 rows (4 ranks: 2, 2, 1, 0 rows), 1-D (fp32 states), a tied pair
SHAPES = {"emb": (13, 40), "w1": (37, 64), "w2": (5, 96), "conv": (6, 3, 11), "b1": (37,)}
OPTS = {
    "adamw": (fo.FlashAdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (fo.FlashSGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "lion": (fo.FlashLion, dict(lr=1e-3, weight_decay=0.1)),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            w = torch.randn(shape, generator=g) * 0.5
            self.register_parameter(name, torch.nn.Parameter(w.bfloat16()))
        self.head = self.emb  # tied: one parameter under two names


def _grad(step: int, name: str, shape) -> torch.Tensor:
    """The full gradient of parameter ``name`` at ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(step * 100 + sorted(SHAPES).index(name))
    scale = 10.0 ** (step % 7 - 3)  # changing magnitudes: scales move every step
    return (torch.randn(shape, generator=g) * scale).bfloat16()


def _set_grads(model, step):
    from torch.distributed.tensor import distribute_tensor

    for name, p in model.named_parameters():
        g = _grad(step, name, SHAPES[name]).to(p.device)
        if hasattr(p, "_local_tensor"):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def _train(model, opt, steps):
    for s in steps:
        _set_grads(model, s)
        opt.step()
        opt.zero_grad()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model, opt) -> dict:
    """Every parameter and state, gathered to full tensors (scales: (rows, groups))."""
    sd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    out = {n: _full(p.detach()).cpu().clone() for n, p in model.named_parameters()}
    for i, st in sd["state"].items():
        for k, v in st.items():
            out[f"{names[i]}.{k}"] = _full(v).cpu().clone() if torch.is_tensor(v) else v
    return out


def _shard(model, mesh=None):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    return model


def _reference(opt_name, steps=STEPS, dev="cpu") -> dict:
    model = Net().to(dev)
    Opt, kw = OPTS[opt_name]
    opt = Opt(model.parameters(), **kw)
    _train(model, opt, range(steps))
    return _snapshot(model, opt)


def _worker(rank, world, init, out, phases, dev):
    """Run ``phases`` in order in one process group (one spawn per world size: the
    processes' start-up is most of the cost on a 2-core machine). A phase: ``tag``, ``mesh``
    (None: FSDP2 over all ranks; "hsdp": a 2 x (world / 2) mesh, replicated x sharded),
    ``opts``, ``steps`` (first, stop), optionally ``load`` (a DCP checkpoint to resume),
    ``save_at`` / ``save``, ``ddp`` (also a plain replicated model, as DDP steps it). ``dev``:
    "cpu" (gloo, the CPU path) or "cuda" (NCCL, one GPU per rank, the CUDA kernel)."""
    if dev == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if dev == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.device_mesh import init_device_mesh

        results = {}
        for job in phases:
            mesh = init_device_mesh(dev, (world,))  # (fully_shard's default: CUDA if any)
            if job["mesh"] == "hsdp":
                mesh = init_device_mesh(dev, (2, world // 2), mesh_dim_names=("rep", "shard"))
            for opt_name in job["opts"]:
                Opt, kw = OPTS[opt_name]
                model = _shard(Net().to(dev), mesh)
                opt = Opt(model.parameters(), **kw)
                start, stop = job["steps"]
                if job.get("load"):
                    sd = {"model": get_model_state_dict(model)}
                    sd["optim"] = get_optimizer_state_dict(model, opt)
                    dcp.load(sd, checkpoint_id=job["load"] + opt_name)
                    set_model_state_dict(model, sd["model"])
                    set_optimizer_state_dict(model, opt, sd["optim"])
                save_at = job.get("save_at")
                for s in range(start, stop):
                    _train(model, opt, [s])
                    if save_at is not None and s + 1 == save_at:
                        sd = {"model": get_model_state_dict(model)}
                        sd["optim"] = get_optimizer_state_dict(model, opt)
                        dcp.save(sd, checkpoint_id=job["save"] + opt_name)
                results[f"{job['tag']}/{opt_name}"] = _snapshot(model, opt)
            if job.get("ddp"):  # plain replicated tensors, every rank the whole step
                plain = Net().to(dev)
                Opt, kw = OPTS["adamw"]
                o2 = Opt(plain.parameters(), **kw)
                _train(plain, o2, range(STEPS))
                results[f"{job['tag']}-ddp/adamw"] = _snapshot(plain, o2)
        _finish(rank, out, results)
    finally:
        dist.destroy_process_group()


def _run(world, phases, d, dev="cpu"):
    out = os.path.join(d, f"w{world}.pt")
    init = "file://" + os.path.join(d, f"w{world}.store")
    _spawn(_worker, (world, init, out, phases, dev), world, d)
    return torch.load(out, weights_only=False)


def _assert_identical(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), what
    for k, v in ref.items():
        w = got[k]
        if torch.is_tensor(v):
            assert v.shape == w.shape and v.dtype == w.dtype, (what, k)
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            a = v.view(bits[v.element_size()]) if v.is_floating_point() else v
            b = w.view(bits[w.element_size()]) if w.is_floating_point() else w
            assert torch.equal(a, b), (what, k, int((a != b).sum()))
        else:
            assert v == w, (what, k)


@pytest.fixture(scope="module")
def refs():
    return {o: _reference(o) for o in OPTS}


def test_states_cover_every_grid_case(refs):
    """The reference run exercises what the contract names: the flat grid (rows of 64),
    split rows (40, 33), fp32 states (1-D), a tied pair, all moving."""
    r = refs["adamw"]
    assert r["w1.exp_avg_scale"].shape == (37, 2)
    assert r["emb.exp_avg_scale"].shape == (13, 2)  # rows of 40: 32 + 8
    assert r["conv.exp_avg_scale"].shape == (6, 2)  # rows of 33: 32 + 1
    assert r["b1.exp_avg"].dtype == torch.float32 and "b1.exp_avg_codes" not in r
    assert "head" not in r and r["emb.step"] == STEPS


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")
def test_fsdp2_meshes_and_reshard_are_bit_identical(refs):
    """FSDP2 on 1, 2, 3, 4 ranks (uneven and empty shards), HSDP 2 x 2, DDP; a DCP checkpoint
    saved on 4 ranks at step 25 resumed on 2, saved there at 40 and resumed on 1: every
    parameter and state bit for bit the one-process run's after 50 steps."""
    all_opts = list(OPTS)
    got = {}
    with tempfile.TemporaryDirectory() as d:
        ck = os.path.join(d, "ck")
        full = dict(mesh=None, opts=all_opts, steps=(0, STEPS))
        got.update(
            _run(
                4,
                [
                    dict(full, tag="fsdp4", save_at=25, save=ck + "25"),
                    dict(tag="hsdp2x2", mesh="hsdp", opts=["adamw"], steps=(0, STEPS)),
                ],
                d,
            )
        )
        resume2 = dict(tag="4->2", mesh=None, opts=all_opts, steps=(25, STEPS), load=ck + "25")
        resume2.update(save_at=40, save=ck + "40")
        got.update(_run(2, [dict(full, tag="fsdp2", ddp=True), resume2], d))
        resume1 = dict(tag="4->2->1", mesh=None, opts=all_opts, steps=(40, STEPS), load=ck + "40")
        got.update(_run(1, [dict(full, tag="fsdp1"), resume1], d))
        got.update(_run(3, [dict(full, tag="fsdp3")], d))
    expected = ["fsdp1", "fsdp2", "fsdp3", "fsdp4", "4->2", "4->2->1"]
    want = {f"{t}/{o}" for t in expected for o in all_opts} | {"hsdp2x2/adamw", "fsdp2-ddp/adamw"}
    assert set(got) == want
    for key, snap in got.items():
        _assert_identical(snap, refs[key.split("/")[1]], key)


@pytest.mark.gpu
def test_gpu_fsdp2_on_several_gpus_is_bit_identical():
    """On a host with 2 or more GPUs (NCCL, the CUDA kernel on each rank's shards): FSDP2 on
    up to 4 GPUs (HSDP 2 x 2 on 4), a DCP checkpoint saved there at step 25 and resumed on
    one GPU: every parameter and state bit for bit the one-GPU run's after 50 steps."""
    n = torch.cuda.device_count()
    if n < 2 or not dist.is_nccl_available():
        pytest.skip(f"needs 2 or more GPUs and NCCL ({n} GPU)")
    refs = {o: _reference(o, dev="cuda") for o in OPTS}
    world, all_opts = min(n, 4), list(OPTS)
    with tempfile.TemporaryDirectory() as d:
        ck = os.path.join(d, "ck")
        phases = [dict(tag=f"fsdp{world}", mesh=None, opts=all_opts, steps=(0, STEPS))]
        phases[0].update(save_at=25, save=ck + "25")
        if world == 4:
            phases.append(dict(tag="hsdp2x2", mesh="hsdp", opts=["adamw"], steps=(0, STEPS)))
        got = _run(world, phases, d, dev="cuda")
        resume = dict(tag=f"{world}->1", mesh=None, opts=all_opts, steps=(25, STEPS))
        got.update(_run(1, [dict(resume, load=ck + "25")], d, dev="cuda"))
    assert len(got) == 2 * len(all_opts) + (world == 4)
    for key, snap in got.items():
        _assert_identical(snap, refs[key.split("/")[1]], key)


@pytest.mark.skipif(not INTERP, reason="the kernel under TRITON_INTERPRET=1")
@pytest.mark.parametrize("Opt,kw", [OPTS["adamw"], OPTS["sgd"], OPTS["lion"]])
def test_kernel_rows_equal_cpu_path(Opt, kw):
    """The Triton kernel (interpreted) on split rows (one table entry per row), the flat
    grid and fp32-state tensors equals the CPU path bit for bit over 3 steps: the CPU path
    the gloo tests run is the kernel's math on this grid."""
    shapes = [(3, 40), (2, 33), (4, 64), (7,), (6, 3, 11)]
    g = torch.Generator().manual_seed(1)
    base = [(torch.randn(s, generator=g) * 0.3).bfloat16() for s in shapes]
    pa = [b.clone().requires_grad_() for b in base]
    pb = [b.clone().requires_grad_() for b in base]
    a = Opt(pa, backend="triton", **kw)
    b = Opt(pb, backend="torch", **kw)
    for s in range(3):
        for x, y, shape in zip(pa, pb, shapes):
            x.grad = (torch.randn(shape, generator=g) * 10.0 ** (s - 1)).bfloat16()
            y.grad = x.grad.clone()
        a.step()
        b.step()
    assert a._plans and any(bk["ent"]["rows"] for bk in next(iter(a._plans.values()))["buckets"])
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        for k, v in a.state[x].items():
            w = b.state[y][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, k


def _row_shards_vs_whole(monkeypatch, opt_name: str, dev: str, world: int, steps=4) -> None:
    """One process, no process group: each parameter of ``Net`` whole in one optimizer, and
    cut into the row shards FSDP2 gives ``world`` ranks (torch.chunk's rule: uneven, some
    empty) as separate tensors in another optimizer. Each shard gets its rank's rounding
    stream base and its parameter's seed (as a DTensor shard has); after ``steps`` steps
    the shards, concatenated by rows, equal the whole tensors and states bit for bit."""
    Opt, kw = OPTS[opt_name]
    whole = {n: p.detach().to(dev).requires_grad_() for n, p in Net().named_parameters()}
    shards, bases = {}, {}
    for n, w in whole.items():
        rows = -(-w.shape[0] // world)
        parts = [w.detach()[i * rows : (i + 1) * rows].clone() for i in range(world)]
        shards[n] = [q.requires_grad_() for q in parts]
        for i, q in enumerate(shards[n]):
            bases[id(q)] = i * rows * (w.numel() // w.shape[0])
    a = Opt(list(whole.values()), backend="auto", **kw)
    b = Opt([q for qs in shards.values() for q in qs], backend="auto", **kw)
    for n, w in whole.items():
        a._init_state(w, a.param_groups[0])
        for q in shards[n]:
            b._init_state(q, b.param_groups[0])["seed"] = a.state[w]["seed"]
    with monkeypatch.context() as m:
        real = _plan.global_index_base
        m.setattr(_plan, "global_index_base", lambda p: bases[id(p)] if id(p) in bases else real(p))
        for s in range(steps):
            for n, w in whole.items():
                w.grad = _grad(s, n, SHAPES[n]).to(dev)
                rows = -(-w.shape[0] // world)
                for i, q in enumerate(shards[n]):
                    q.grad = w.grad[i * rows : i * rows + q.shape[0]].clone()
            a.step()
            b.step()
    if world == 4:
        assert shards["w2"][-1].numel() == 0  # 5 rows on 4 ranks: 2, 2, 1, 0
    for n, w in whole.items():
        _assert_identical(_cat_state(b, shards[n]), _cat_state(a, [w]), f"{opt_name}/{n}")


def _cat_state(opt, ps) -> dict:
    """The parameter and each state of ``ps`` (row shards of one tensor), concatenated."""
    out = {"param": torch.cat([p.detach().cpu() for p in ps])}
    for k, v in opt.state[ps[0]].items():
        if torch.is_tensor(v):
            out[k] = torch.cat([opt.state[p][k].cpu() for p in ps])
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_row_shards_equal_the_whole(monkeypatch, opt_name):
    """The CPU path on 3 and 4 row shards of every grid case (uneven, one empty): the
    whole tensors' bits."""
    for world in (3, 4):
        _row_shards_vs_whole(monkeypatch, opt_name, "cpu", world)


@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", list(OPTS))
def test_gpu_row_shards_equal_the_whole(monkeypatch, opt_name):
    """The CUDA kernel on 3 and 4 row shards of every grid case (flat-grid rows, per-row
    table entries, fp32 states; uneven, one empty) in one launch per bucket against the
    whole tensors in theirs: the same bits (the kernel's approximate arithmetic is the
    same on both sides; the groups and rounding streams are the grid's)."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    for world in (3, 4):
        _row_shards_vs_whole(monkeypatch, opt_name, "cuda", world)


def test_grid_rules():
    assert grid.row_len(torch.empty(5, 3, 11)) == 33 and grid.split(torch.empty(5, 3, 11))
    assert not grid.quantizable(torch.empty(100)) and not grid.quantizable(torch.empty(4, 16))
    assert grid.scale_shape(torch.empty(0, 96)) == (0, 3)  # an empty shard
    t = torch.empty(64, 40).t()  # (40, 64) stored as 64 rows of 40: rows in memory order
    assert grid.row_len(t) == 40 and grid.scale_shape(t) == (64, 2)
