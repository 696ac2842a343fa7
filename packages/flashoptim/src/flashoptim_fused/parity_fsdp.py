"""Training parity under FSDP2 (``fully_shard``) on several GPUs, and a resharded resume.

    python -m flashoptim_fused.parity_fsdp --out DIR               # GPUs: world = all GPUs (NCCL)
    python -m flashoptim_fused.parity_fsdp --smoke --out DIR       # CPU, 2 gloo processes, seconds

The byte-level GPT of :mod:`flashoptim_fused.parity`, every block and the root sharded with
``fully_shard``; the global batch and data order are those of the single-GPU parity run
(each rank takes its slice of the batch; FSDP2 averages the gradients). Per seed:

- ``torch_adamw``: fp32 sharded parameters, bf16 compute and fp32 gradient reduction
  through ``MixedPrecisionPolicy`` (the FSDP2 form of the single-GPU run's autocast),
  fused torch AdamW on the local shards;
- ``flash_adamw``: bf16 sharded parameters, FlashAdamW on the local shards (int8
  correction, companded 8-bit states of each shard); FSDP2 reduces the gradients in the
  parameters' dtype, bf16;
- ``flash_adamw_fp32_reduce`` (optional, ``--optimizers``): the same with the gradient
  reduction in fp32 (``MixedPrecisionPolicy(reduce_dtype=float32)``; the reduced gradient is
  cast back to bf16), which isolates the effect of the bf16 reduction.

Per run: the loss curve (mean over ranks), validation loss, peak memory of every rank and
tokens/s. The first FlashAdamW run also saves a ``torch.distributed.checkpoint`` at half
the steps, and then a world-size-1 process loads it (resharding), checks that the loaded
optimizer state equals the saved one bit for bit (gathered: codes, scales, fp32 states,
corrections and steps; docs/flashoptim.md, "Sharding") and trains the remaining steps;
its losses are compared with the uninterrupted run's (the gradient reduction order differs
between world sizes, so they agree to rounding, not bitwise).
Writes ``parity_fsdp.json`` into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import flashoptim_fused as fo
from flashoptim_fused.parity import (
    GPT,
    add_optimizers_option,
    load_corpus,
    lr_schedule,
    parse_optimizers,
    summarize,
)


def _configs(cuda: bool) -> dict:
    if cuda:
        return dict(d=512, layers=8, heads=8, ctx=256, batch=64, steps=600, lr=1e-3, val_batches=20)
    return dict(d=32, layers=2, heads=2, ctx=32, batch=8, steps=8, lr=3e-3, val_batches=2)


def _sharded_model(cfg, seed, name, device, dtype=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)  # same initial weights on every rank and as the 1-GPU run
    model = GPT(cfg["d"], cfg["layers"], cfg["heads"], cfg["ctx"]).to(device)
    if name == "flash_adamw":
        model = model.to(dtype or torch.bfloat16)
        kw = {}
    elif name == "flash_adamw_fp32_reduce":
        model = model.to(dtype or torch.bfloat16)
        kw = dict(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    else:
        kw = dict(
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _fp32_masters(cfg, seed, name, device) -> list:
    """The fp32 init of the FlashAdamW model, sharded like its bf16 parameters (the same
    model built in fp32 and sharded the same way): load_master_weights keeps it as the master
    weights, as the 1-GPU run does."""
    return [p.detach() for p in _sharded_model(cfg, seed, name, device, torch.float32).parameters()]


OPTIMIZERS = ("torch_adamw", "flash_adamw", "flash_adamw_fp32_reduce")


def _optimizer(model, cfg, name, device):
    if name.startswith("flash_adamw"):
        return fo.FlashAdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(
        model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95), **kw
    )


def _batches(train, cfg, seed, steps):
    """The global batches of the single-GPU parity run (same generator, same order)."""
    g = torch.Generator().manual_seed(1000 + seed)
    B, T = cfg["batch"], cfg["ctx"]
    for _ in range(steps):
        ix = torch.randint(0, train.numel() - T - 1, (B,), generator=g)
        yield torch.stack([train[i : i + T + 1] for i in ix])


def _train(model, opt, sched, batches, first, last, rank, world, device):
    """Steps ``first .. last - 1``; returns the global mean loss of each step."""
    losses = []
    for s, xb in enumerate(batches):
        if s < first:
            continue
        if s >= last:
            break
        per = xb.shape[0] // world
        xb = xb[rank * per : (rank + 1) * per].to(device)
        loss = F.cross_entropy(model(xb[:, :-1]).float().view(-1, 256), xb[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # equal slices: the mean of the means is the global mean
        losses.append(mean / world)
    return [x.item() for x in losses]


def _val_loss(model, val, cfg, rank, world, device):
    gv = torch.Generator().manual_seed(7)
    B, T = cfg["batch"], cfg["ctx"]
    per = B // world
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for _ in range(cfg["val_batches"]):
            ix = torch.randint(0, val.numel() - T - 1, (B,), generator=gv)
            xb = torch.stack([val[i : i + T + 1] for i in ix])[rank * per : (rank + 1) * per]
            xb = xb.to(device)
            total += F.cross_entropy(model(xb[:, :-1]).float().view(-1, 256), xb[:, 1:].reshape(-1))
    dist.all_reduce(total)
    return total.item() / (world * cfg["val_batches"])


def _gathered_state(model, opt) -> dict:
    """FlashAdamW's state, gathered to full tensors (all ranks take part)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {}
    for fqn, st in get_optimizer_state_dict(model, opt)["state"].items():
        out[fqn] = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()
            if torch.is_tensor(v)
            else v
            for k, v in st.items()
        }
    return out


def _state_equal(saved: dict, loaded: dict) -> dict:
    """Every saved tensor (codes, group scales, fp32 states, corrections, steps) equals the
    resumed one bit for bit: the quantization groups never cross a row, so a reshard moves
    whole rows of codes and scales (docs/flashoptim.md, "Sharding")."""
    exact = 0
    for fqn, st in saved.items():
        got = loaded.get(fqn, {})
        for k, v in st.items():
            w = got.get(k)
            if torch.is_tensor(v):
                same = torch.is_tensor(w) and v.shape == w.shape and v.dtype == w.dtype
                same = same and torch.equal(_bits(v), _bits(w))
            else:
                same = v == w
            if not same:
                return {"ok": False, "why": f"{fqn}.{k} differs after the reshard"}
            exact += torch.is_tensor(v)
    return {"ok": True, "exact_arrays": exact}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (NaN and -0.0 compare by their bits)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def _worker(rank, world, init, cfg, seeds, names, out, ckpt, data):
    cuda = torch.cuda.is_available() and cfg.get("cuda", False)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world
    )
    train, val = data
    runs = []
    try:
        for seed in seeds:
            for name in names:
                model = _sharded_model(cfg, seed, name, device)
                opt = _optimizer(model, cfg, name, device)
                if name.startswith("flash_adamw"):
                    opt.load_master_weights(_fp32_masters(cfg, seed, name, device))
                sched = lr_schedule(opt, cfg["steps"])
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                steps = cfg["steps"]
                save_at = steps // 2 if (name == "flash_adamw" and seed == seeds[0]) else None
                t0 = time.perf_counter()
                batches = list(_batches(train, cfg, seed, steps))
                if save_at is None:
                    losses = _train(model, opt, sched, batches, 0, steps, rank, world, device)
                    saved_state = None
                else:
                    import torch.distributed.checkpoint as dcp
                    from torch.distributed.checkpoint.state_dict import (
                        get_model_state_dict,
                        get_optimizer_state_dict,
                    )

                    losses = _train(model, opt, sched, batches, 0, save_at, rank, world, device)
                    sd = {
                        "model": get_model_state_dict(model),
                        "optim": get_optimizer_state_dict(model, opt),
                    }
                    dcp.save(sd, checkpoint_id=ckpt)
                    saved_state = _gathered_state(model, opt)
                    losses += _train(
                        model, opt, sched, batches, save_at, steps, rank, world, device
                    )
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                peak = torch.tensor(
                    [torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0],
                    device=device,
                )
                peaks = [torch.zeros_like(peak) for _ in range(world)]
                dist.all_gather(peaks, peak)
                run = dict(
                    optimizer=name,
                    seed=seed,
                    world=world,
                    losses=losses,
                    final_train_loss=sum(losses[-50:]) / len(losses[-50:]),
                    val_loss=_val_loss(model, val, cfg, rank, world, device),
                    peak_mem_mib_per_rank=[p.item() for p in peaks],
                    tokens_per_s=steps * cfg["batch"] * cfg["ctx"] / dt,
                    save_at=save_at,
                )
                runs.append(run)
                if rank == 0:
                    peaks_mib = [round(p) for p in run["peak_mem_mib_per_rank"]]
                    print(
                        f"{name} seed {seed} world {world}: train {run['final_train_loss']:.4f}"
                        f" val {run['val_loss']:.4f} peak per rank {peaks_mib} MiB"
                        f" {run['tokens_per_s']:.0f} tok/s",
                        flush=True,
                    )
                    if saved_state is not None:
                        torch.save(saved_state, ckpt + ".state.pt")
                del model, opt
        if rank == 0:
            with open(out, "w") as f:
                json.dump(runs, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _resume_worker(rank, init, cfg, seed, out, ckpt, data):
    """World size 1: load the 2-rank checkpoint (resharded), check the state, finish."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    cuda = torch.cuda.is_available() and cfg.get("cuda", False)
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=0, world_size=1)
    try:
        model = _sharded_model(cfg, seed, "flash_adamw", device)
        opt = _optimizer(model, cfg, "flash_adamw", device)
        sched = lr_schedule(opt, cfg["steps"])
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=ckpt)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        save_at = cfg["steps"] // 2
        for _ in range(save_at):
            sched.step()  # the schedule is not in the checkpoint: advance it to the save point
        check = _state_equal(torch.load(ckpt + ".state.pt"), _gathered_state(model, opt))
        batches = list(_batches(data[0], cfg, seed, cfg["steps"]))
        losses = _train(model, opt, sched, batches, save_at, cfg["steps"], 0, 1, device)
        with open(out, "w") as f:
            json.dump({"state_check": check, "losses_after_resume": losses}, f)
    finally:
        dist.destroy_process_group()


def _spawn(fn, args, nprocs, result_path):
    """mp.spawn; a rank that aborts in gloo/NCCL teardown after the results were written
    (a known c10d shutdown race on loaded hosts) is reported, not fatal."""
    try:
        mp.spawn(fn, args=args, nprocs=nprocs)
    except mp.ProcessExitedException as e:
        if e.signal_name != "SIGABRT" or not os.path.exists(result_path):
            raise
        warnings.warn(f"a rank aborted in teardown after writing its results: {e}", stacklevel=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashoptim_fused.parity_fsdp")
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model")
    ap.add_argument(
        "--world", type=int, default=None, help="processes (default: all GPUs; 2 on CPU)"
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=None, help="default 3 on GPUs, 1 on CPU")
    add_optimizers_option(ap, OPTIMIZERS)
    a = ap.parse_args(argv)
    names = parse_optimizers(a.optimizers, OPTIMIZERS)
    cuda = torch.cuda.is_available() and not a.smoke
    world = a.world or (torch.cuda.device_count() if cuda else 2)
    if world < 2:
        raise SystemExit(f"parity_fsdp needs at least 2 processes; got world={world}")
    cfg = _configs(cuda)
    cfg["cuda"] = cuda
    if a.steps:
        cfg["steps"] = a.steps
    seeds = list(range(a.seeds if a.seeds is not None else (3 if cuda else 1)))
    corpus = load_corpus(24_000_000 if cuda else 300_000)
    cut = int(corpus.numel() * 0.95)
    data = (corpus[:cut], corpus[cut:])
    os.makedirs(a.out, exist_ok=True)
    if cfg["batch"] % world:
        raise SystemExit(f"the global batch {cfg['batch']} must divide among world={world} ranks")
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        runs_path, resume_path = os.path.join(d, "runs.json"), os.path.join(d, "resume.json")
        init = "file://" + os.path.join(d, "store")
        _spawn(_worker, (world, init, cfg, seeds, names, runs_path, ckpt, data), world, runs_path)
        init1 = "file://" + os.path.join(d, "store1")
        _spawn(_resume_worker, (init1, cfg, seeds[0], resume_path, ckpt, data), 1, resume_path)
        with open(runs_path) as f:
            runs = json.load(f)
        with open(resume_path) as f:
            resume = json.load(f)
    ref = next(r for r in runs if r["optimizer"] == "flash_adamw" and r["save_at"] is not None)
    tail = ref["losses"][ref["save_at"] :]
    resume["max_abs_loss_diff_vs_uninterrupted"] = max(
        abs(x - y) for x, y in zip(resume["losses_after_resume"], tail)
    )
    summary = summarize(runs, "peak_mem_mib_per_rank")
    summary["verdict"].update(
        resume_state_ok=resume["state_check"]["ok"],
        resume_max_abs_loss_diff=resume["max_abs_loss_diff_vs_uninterrupted"],
    )
    env = {"torch": torch.__version__, "world": world, "backend": "nccl" if cuda else "gloo"}
    if cuda:
        env["gpu"] = torch.cuda.get_device_name(0)
    result = {"config": cfg, "env": env, "summary": summary, "runs": runs, "resume": resume}
    with open(os.path.join(a.out, "parity_fsdp.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
