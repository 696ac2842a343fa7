"""Capturable mode (``capturable=True``): a step with no host sync and no host decision on
device data, so ``opt.step()`` can be captured in a CUDA graph after one eager warm-up step.

Per param group the plan holds one device step count per bucket (``dstep``) and the
buckets' device scalars (``scal``: int32 [buckets, 14], the kernel's run-time scalars as
fp32 bit patterns, then first, step_mix and the skip flag). Each step: zero the device
flags, run the finiteness pre-pass, advance the step counts where the flag is clear,
compute the scalars in float64 on device, and launch the step kernels, which read the
scalars through a pointer and return at once where the flag is set.
"""

from __future__ import annotations

import torch

from . import _plan
from .reference import ADAM, GOLDEN, M32


def drop_plan(opt, group) -> None:
    """Before a plan rebuild: refuse it during a capture; keep the old plan's step counts."""
    if _plan.capturing():
        raise RuntimeError(
            "flashoptim: the offset tables would need rebuilding during CUDA graph"
            " capture (parameters with gradients or gradient tensors changed since the"
            " warm-up step); run an eager step first and keep .grad tensors static"
        )
    old = opt._plans.pop(id(group), None)
    if old is not None:
        flush_steps(opt, old)


def device_plan(opt, group, ps, out, cache) -> dict:
    """The plan of a group with one device step count per bucket and the buffer of the
    buckets' device scalars (built eagerly, reused by every step)."""
    if any(b["ent"] is None for b in out):
        raise ValueError("capturable=True needs the Triton path for every parameter")
    devs = {b["ent"]["tab"].device for b in out}
    if len(devs) != 1:
        raise ValueError("capturable=True needs all parameters of a group on one device")
    dev = devs.pop()
    if dev not in opt._dflag:
        opt._dflag[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
        opt._dskip[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
    _plan.index_buckets(ps, out)
    plan = dict(
        n=len(ps),
        ps=list(ps),
        dt=any(hasattr(p, "_local_tensor") for p in ps),
        gptrs=tuple(_plan.local(p.grad).data_ptr() for p in ps),
        states=[opt.state[p] for p in ps],
        step=None,
        buckets=out,
        dstep=torch.tensor([b["step"] for b in out], dtype=torch.int64, device=dev),
        scal=torch.zeros(len(out), 14, dtype=torch.int32, device=dev),
        consts=None,
        ckey=None,
    )
    if cache:
        opt._plans[id(group)] = plan
    return dict(group=group, plan=plan, buckets=out, cache=cache, ps=ps)


def flush_steps(opt, plan) -> None:
    """Copy a plan's device step counts into the host ``state["step"]`` (one sync)."""
    if plan.get("dstep") is None:
        return
    for b, v in zip(plan["buckets"], plan["dstep"].tolist(), strict=True):
        b["step"] = int(v)
        for p in b["ps"]:
            opt.state[p]["step"] = int(v)


def sync_steps(opt) -> None:
    if _plan.capturing():
        raise RuntimeError("sync_steps() syncs with the host: not allowed during capture")
    for plan in opt._plans.values():
        flush_steps(opt, plan)


def step_on_device(opt, preps) -> None:
    """The capturable step: the finiteness pre-pass writes device flags, the step counts
    advance on device where the flag is clear, the scalars are computed on device, and the
    kernels skip the update where the flag is set. No host sync."""
    devs = {prep["plan"]["dstep"].device for prep in preps}
    flags = {d: opt._dflag[d] for d in devs}
    for f in flags.values():
        f.zero_()
    if opt.check_finite:
        opt._nonfinite(preps, flags)
    for prep in preps:
        group, plan = prep["group"], prep["plan"]
        flag = flags[plan["dstep"].device]
        plan["dstep"].add_((flag == 0).to(torch.int64))
        device_scalars(opt, plan, opt._hp(group, plan["ps"][0]), flag)
        for i, b in enumerate(plan["buckets"]):  # hp per bucket (ecc: parameter dtype)
            hpb = opt._hp(group, b["ps"][0])
            opt._launch(b["ent"], group, hpb, None, scal=plan["scal"][i])
    for d, f in flags.items():
        opt._dskip[d].add_(f.to(torch.int64))


def device_scalars(opt, plan, hp, flag) -> None:
    """``_plan.scalar_args`` for every bucket of the plan from its device step count, with
    torch float64 ops (the same formulas), rounded to fp32 into ``plan["scal"]``."""
    dev = plan["dstep"].device
    lr = hp["lr"]
    lr_t = torch.is_tensor(lr)
    b1, b2 = hp.get("b1", 0.0), hp.get("b2", 0.0)
    eps, wd, damp = hp.get("eps", 0.0), hp["wd"], hp.get("dampening", 0.0)
    key = (None if lr_t else lr, b1, b2, eps, wd, damp)
    if plan["ckey"] != key:
        if _plan.capturing():
            raise RuntimeError(
                "flashoptim: hyperparameters other than a tensor lr changed during CUDA"
                " graph capture; change them before the warm-up step, or use a tensor lr"
            )
        vals = [0.0 if lr_t else lr, b1, 1 - b1, b2, 1 - b2, eps, wd, 1 - damp]
        plan["consts"] = torch.tensor(vals, dtype=torch.float64, device=dev)
        plan["ckey"] = key
    c = plan["consts"]
    if lr_t:
        if lr.numel() != 1:
            raise ValueError("a tensor lr must hold one element")
        if lr.device != dev:
            raise ValueError("capturable=True needs a tensor lr on the parameters' device")
        lr64 = lr.detach().reshape(1).to(torch.float64)
    else:
        lr64 = c[0:1]
    s = plan["dstep"]
    nb = s.shape[0]
    if opt._kind == ADAM:
        pw = torch.pow(c[1:4:2][:, None], s.to(torch.float64)[None, :])  # [b1, b2] ** step
        bc = 1 - pw
        step_size = lr64 / bc[0]
        isb = torch.sqrt(bc[1]).reciprocal()
    else:
        step_size = lr64.expand(nb)
        isb = torch.ones(nb, dtype=torch.float64, device=dev)
    decay = 1 - lr64 * c[6]
    cols = [lr64.expand(nb)] + [c[j].expand(nb) for j in range(1, 7)]
    cols += [decay.expand(nb), step_size, isb, c[7].expand(nb)]
    f32 = torch.stack(cols, 1).to(torch.float32).view(torch.int32)
    first = (s == 1).to(torch.int64)
    mix = (s * GOLDEN) & M32
    mix = torch.where(mix >= 2**31, mix - 2**32, mix)  # uint32 bits as int32
    ints = torch.stack([first, mix, flag.to(torch.int64).expand(nb)], 1).to(torch.int32)
    plan["scal"].copy_(torch.cat([f32, ints], 1))
