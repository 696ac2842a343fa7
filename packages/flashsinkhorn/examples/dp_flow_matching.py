"""Data-parallel OT flow matching on a 2-D toy: one OT coupling of the GLOBAL batch (all
ranks) against one coupling per rank.

Each rank draws its own minibatch of noise x0 ~ N(0, I) and data x1 (8 Gaussians on a
circle) and trains a velocity field v(x, t) (a small MLP under DistributedDataParallel) on
pairs ``(x0_i, x1_j)`` drawn from an entropic OT plan (OT-CFM, Tong et al. 2023):

- ``global``: ``solve(x0, x1, process_group=group)`` couples the global batch (every rank's
  points); ``sample_plan`` draws one partner per source point from its row of the global
  plan and ``gather_rows`` fetches that partner from whichever rank holds it;
- ``local``: each rank couples its own minibatch alone (what data-parallel training does
  without a distributed coupling);
- ``independent``: random pairs (plain conditional flow matching), for scale.

The better the coupling, the closer the pairs are to the OT map and the straighter the
learned flow: the table reports the pairs' mean squared distance during training and the
Sinkhorn divergence between samples generated with 1 and 4 Euler steps and fresh data.

    python packages/flashsinkhorn/examples/dp_flow_matching.py            # 2 gloo ranks, CPU
    python packages/flashsinkhorn/examples/dp_flow_matching.py --world 4 --steps 400
    torchrun --nproc_per_node 2 packages/flashsinkhorn/examples/dp_flow_matching.py  # NCCL
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashsinkhorn as fs
from flashsinkhorn.distributed import gather_rows

COUPLINGS = ("global", "local", "independent")


def sample_data(n, gen, device):
    """8 Gaussians (std 0.3) on the circle of radius 4."""
    k = torch.randint(0, 8, (n,), generator=gen)
    angle = k.to(torch.float32) * (2 * math.pi / 8)
    centers = 4.0 * torch.stack((angle.cos(), angle.sin()), dim=1)
    return (centers + 0.3 * torch.randn(n, 2, generator=gen)).to(device)


class Velocity(torch.nn.Module):
    def __init__(self, width=128):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(3, width),
            torch.nn.SiLU(),
            torch.nn.Linear(width, width),
            torch.nn.SiLU(),
            torch.nn.Linear(width, 2),
        )

    def forward(self, x, t):
        return self.net(torch.cat((x, t), dim=1))


def pairs(coupling, x0, x1, group, eps, seed):
    """The training targets ``x1`` paired with ``x0`` by the coupling."""
    if coupling == "independent":
        return x1
    kw = dict(eps=eps, eps_scaling=0.5, tol=1e-2, max_iter=500, warn=False)
    if coupling == "global":
        r = fs.solve(x0, x1, process_group=group, **kw)
        return gather_rows(x1, fs.sample_plan(r, seed=seed), group)
    r = fs.solve(x0, x1, **kw)
    return x1[fs.sample_plan(r, seed=seed)]


@torch.no_grad()
def generate(model, n, steps, gen, device):
    x = torch.randn(n, 2, generator=gen).to(device)
    for k in range(steps):
        t = torch.full((n, 1), k / steps, device=device)
        x = x + model(x, t) / steps
    return x


def train(group, device, coupling, *, steps=200, batch=256, eps=0.5, lr=2e-3, seed=0, n_eval=2000):
    """One run on this rank (every rank of ``group`` calls it): returns the metrics
    (identical on every rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(seed)  # the same initial model on every rank
    model = Velocity().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group
    )
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
    cost_sum, cost_n, t0 = 0.0, 0, time.perf_counter()
    for step in range(steps):
        x0 = torch.randn(batch, 2, generator=gen).to(device)
        x1 = pairs(coupling, x0, sample_data(batch, gen, device), group, eps, seed=step)
        if step >= steps // 2:  # the pairs' squared distance once the coupling settled
            cost_sum += float(((x1 - x0) ** 2).sum(1).mean())
            cost_n += 1
        t = torch.rand(batch, 1, generator=gen).to(device)
        loss = ((ddp((1 - t) * x0 + t * x1, t) - (x1 - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    step_ms = 1e3 * (time.perf_counter() - t0) / steps
    out = {
        "coupling": coupling,
        "world": world,
        "batch_per_rank": batch,
        "steps": steps,
        "step_ms": step_ms,
        "pair_sq_dist": cost_sum / max(cost_n, 1),
    }
    # sample quality with few Euler steps: the Sinkhorn divergence to fresh data (rank 0's
    # model equals every rank's: DDP keeps them equal)
    eval_gen = torch.Generator().manual_seed(seed + 7)
    ref = sample_data(n_eval, eval_gen, device)
    for n_euler in (1, 4):
        gen_x = generate(model, n_eval, n_euler, eval_gen, device)
        out[f"divergence_{n_euler}_euler"] = float(fs.SamplesLoss(blur=0.1)(gen_x, ref))
    vals = torch.tensor([out["pair_sq_dist"]], dtype=torch.float64, device=device)
    dist.all_reduce(vals, group=group)  # the pairs' distance over all ranks
    out["pair_sq_dist"] = float(vals[0]) / world
    return out


def run_all(group, device, couplings, **kw):
    return [train(group, device, c, **kw) for c in couplings]


def table(rows):
    head = "| coupling | ranks x batch | pair sq. dist. | divergence, 1 Euler step | 4 steps |"
    lines = [head + " ms/step |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['coupling']} | {r['world']} x {r['batch_per_rank']} | "
            f"{r['pair_sq_dist']:.3f} | {r['divergence_1_euler']:.4f} | "
            f"{r['divergence_4_euler']:.4f} | {r['step_ms']:.1f} |"
        )
    return "\n".join(lines)


def _spawned(rank, world, port, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    rows = run_all(
        dist.group.WORLD,
        torch.device("cpu"),
        args.couplings,
        steps=args.steps,
        batch=args.batch,
        eps=args.eps,
        seed=args.seed,
        n_eval=args.n_eval,
    )
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    _shut_down()


def _shut_down():
    """Every rank done (and the DDP modules gone) before the group goes: a gloo rank that
    tore its group down while the other still talked to it aborted once in CI ("terminate
    called without an active exception")."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="gloo ranks to spawn (CPU)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256, help="points per rank and step")
    ap.add_argument("--eps", type=float, default=0.5, help="entropic temperature (cost units)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-eval", type=int, default=2000, help="samples for the divergences")
    ap.add_argument("--couplings", nargs="+", default=list(COUPLINGS), choices=COUPLINGS)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: NCCL on the GPUs
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        rows = run_all(
            dist.group.WORLD,
            device or torch.device("cpu"),
            args.couplings,
            steps=args.steps,
            batch=args.batch,
            eps=args.eps,
            seed=args.seed,
            n_eval=args.n_eval,
        )
        rank = dist.get_rank()
        _shut_down()
        if rank != 0:
            return 0
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out_path = args.json or os.path.join(os.getcwd(), ".dp_flow_matching.json")
        mp.spawn(_spawned, args=(args.world, port, args, out_path), nprocs=args.world)
        with open(out_path) as fh:
            rows = json.load(fh)
        if not args.json:
            os.remove(out_path)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
