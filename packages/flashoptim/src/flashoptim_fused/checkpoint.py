"""Checkpoints and master weights of the flashoptim optimizers: compact bit-exact state
dicts, torch.optim checkpoints (quantized on load), FSDP2 / DCP state dicts whose group
scales are sharded by rows like their parameter (reshardable bit for bit, ``grid.py``),
fp32 master weights in and out."""

from __future__ import annotations

from typing import Any

import torch

from . import grid
from ._cpu import _narrow_q
from ._plan import flat, local
from .reference import (
    dequantize_momentum_ref,
    dequantize_variance_ref,
    quantize_momentum_ref,
    quantize_variance_ref,
    split_ref,
    state_row,
)


def master_weight(p: torch.Tensor, optimizer=None) -> torch.Tensor:
    """fp32 master value of ``p`` (its local shard): ``p + correction * q``."""
    lp = local(p).detach()
    st = optimizer.state.get(p, {}) if optimizer is not None else {}
    if "correction" not in st or lp.dtype == torch.float32:
        return lp.to(torch.float32).clone()
    c = st["correction"]
    bits = 8 if c.dtype == torch.int8 else 16
    pb = lp.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    q, _ = _narrow_q(pb, lp.dtype == torch.bfloat16, bits)
    return (lp.reshape(-1).to(torch.float32) + c.reshape(-1).to(torch.float32) * q).view(lp.shape)


class CheckpointMixin:
    """``state_dict`` / ``load_state_dict`` / master weights of ``FlashOptimizer``."""

    def master_weights(self) -> dict[torch.Tensor, torch.Tensor]:
        """fp32 master weight of every parameter: {param: fp32 tensor (local shard)}."""
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                out[p] = master_weight(p, self)
        return out

    @torch.no_grad()
    def load_master_weights(self, masters) -> None:
        """Start from fp32 weights: set every parameter to the nearest narrow (bf16/fp16)
        value of its fp32 master and keep the rest in its correction.

        ``masters``: a dict {parameter: tensor}, or one tensor per parameter in
        ``param_groups`` order, each of the parameter's shape (for FSDP2, DTensors sharded
        like the parameters, or their local shards). A list is refused where the optimizer
        reordered the parameters it was given (FlashMuon's split into a Muon and an AdamW
        group): a list in the model's order would fit other parameters of equal shape. Call
        it after building the optimizer, typically with the weights the model had before
        ``model.to(torch.bfloat16)``::

            masters = [p.detach().clone() for p in model.parameters()]
            model.to(torch.bfloat16)
            opt = FlashAdamW(model.parameters(), lr=1e-3)
            opt.load_master_weights(masters)

        Why it matters: a model cast to bf16 has every master weight exactly on a bf16 value
        (correction 0), so an update smaller than half a bf16 ulp leaves the visible weight
        unchanged, for every weight at once; early in training (warm-up, updates of about the
        learning rate against an ulp of 1.2e-4 at |w| = 0.02) whole steps are lost. An fp32
        master sits at a random place inside its bf16 interval and the visible weights follow
        the updates on average, as with torch's fp32 master weights (docs/flashoptim.md,
        "Parity at 400 steps"). fp32 parameters are set to their master; with
        ``master_weight_bits=None`` only the narrow value is kept."""
        params = [p for group in self.param_groups for p in group["params"]]
        if not isinstance(masters, dict) and self._reordered:
            raise ValueError(
                "load_master_weights: this optimizer's param_groups order is not the order its"
                " parameters were given in (FlashMuon splits them into a Muon and an AdamW"
                " group), so a list cannot be matched safely; pass a dict {parameter: fp32"
                " tensor}, e.g. dict(zip(model.parameters(), masters))"
            )
        if isinstance(masters, dict):
            missing = sum(1 for p in params if p not in masters)
            if missing:
                raise ValueError(f"load_master_weights: no tensor for {missing} parameters")
            masters = [masters[p] for p in params]
        masters = list(masters)
        if len(masters) != len(params):
            raise ValueError(
                f"load_master_weights: got {len(masters)} tensors for {len(params)} parameters"
            )
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                t, lp = masters[i], local(p)
                lt = local(t) if hasattr(t, "_local_tensor") else t
                if not torch.is_tensor(lt) or not lt.is_floating_point():
                    raise TypeError(f"load_master_weights: masters[{i}] must be a float tensor")
                if lt.shape != lp.shape:
                    raise ValueError(
                        f"load_master_weights: masters[{i}] has shape {tuple(lt.shape)}, the"
                        f" parameter (local shard) has {tuple(lp.shape)}"
                    )
                lt = lt.to(device=lp.device, dtype=torch.float32)
                bits = self._bits(group, p)
                if not bits:
                    lp.copy_(lt.to(lp.dtype))
                else:
                    st = self._init_state(p, group)
                    narrow, code = split_ref(lt.reshape(-1), lp.dtype, bits)
                    lp.copy_(narrow.view_as(lp))
                    st["correction"].copy_(code.view_as(st["correction"]))
                i += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict, or a plain torch.optim one (quantized on load).

        torch's loader would cast floating states to the parameter dtype (fp32 scales and
        states to bf16), so the states are mapped to parameters here, unchanged. The
        ``register_load_state_dict_pre_hook`` / ``_post_hook`` hooks run as in torch.optim.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        saved = state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(groups)} param groups; optimizer has {len(self.param_groups)}"
            )
        id_map = {}
        for gi, (g_new, g_old) in enumerate(zip(self.param_groups, groups)):
            if len(g_new["params"]) != len(g_old["params"]):
                raise ValueError(
                    f"state dict param group {gi} has {len(g_old['params'])} parameters; the"
                    f" optimizer's has {len(g_new['params'])}"
                )
            if g_old.get("amsgrad"):
                raise ValueError(
                    f"state dict param group {gi} has amsgrad=True: flashoptim keeps no"
                    " max_exp_avg_sq, so loading it would silently drop that state"
                )
            for i, (p, pid) in enumerate(zip(g_new["params"], g_old["params"])):
                id_map[pid] = (p, g_new, f"parameter {i} of param group {gi}", g_new)
            foreign = sorted(k for k in g_old if k in _KIND_KEYS and k not in g_new)
            if foreign:
                raise ValueError(
                    f"state dict param group {gi} has {', '.join(map(repr, foreign))}, which"
                    f" {type(self).__name__} does not take: a state dict of another optimizer"
                    " kind (its states would be dropped)"
                )
            merged = dict(g_new, **{k: v for k, v in g_old.items() if k != "params"})
            try:
                self._check_group(merged)
            except ValueError as e:
                raise ValueError(f"state dict param group {gi}: {e}") from None
            for pid in g_old["params"]:
                if pid in id_map:
                    id_map[pid] = id_map[pid][:3] + (merged,)
        for pid, st_old in saved.items():
            if pid not in id_map:
                raise ValueError(f"state dict has state for parameter id {pid!r}, not in any group")
            p, _, where, merged = id_map[pid]
            if "max_exp_avg_sq" in st_old:
                raise ValueError(f"{where}: max_exp_avg_sq (amsgrad) cannot be loaded")
            self._check_state_kind(st_old, merged, where)
            self._check_state_shapes(p, st_old, where)
        for g_new, g_old in zip(self.param_groups, groups):
            for k, v in g_old.items():
                if k != "params":
                    g_new[k] = v
        self.state.clear()
        extra = state_dict.get("flashoptim", {})
        self.skipped_steps = extra.get("skipped_steps", 0)
        for t in self._dskip.values():  # the saved total is in the host count now
            t.zero_()
        self._plans.clear()
        for pid, st_old in saved.items():
            p, group = id_map[pid][:2]
            self._load_param_state(p, group, st_old)

    def _check_state_kind(self, st_old, group, where) -> None:
        """A parameter's saved state holds exactly this optimizer's states: none of another
        kind (an SGD momentum_buffer into FlashAdamW would be dropped), none missing (a
        Lion-shaped {exp_avg} into FlashAdamW would restart its variance at zero)."""
        keys = [k for k in self._state_keys(group) if k is not None]
        known = {"step", "seed", "correction"}
        for k in keys + [self._m_key]:
            known.update((k, k + "_codes", k + "_scale", k + "_scale_per_element"))
        present = {k for k, v in st_old.items() if v is not None}
        extra = sorted(present - known)
        if extra:
            raise ValueError(
                f"{where}: state {', '.join(map(repr, extra))} is not a state of"
                f" {type(self).__name__} (it keeps {', '.join(keys) or 'no state'}, step): a"
                " state dict of another optimizer kind?"
            )
        if present - {"step", "seed", "correction"}:
            missing = [k for k in keys if not present & {k, k + "_codes"}]
            if missing:
                raise ValueError(
                    f"{where}: the state dict has no {', '.join(map(repr, missing))} for this"
                    f" parameter, which {type(self).__name__} keeps: a state dict of another"
                    " optimizer kind? (loading it would restart that state at zero)"
                )

    def _check_state_shapes(self, p, st_old, where) -> None:
        """Every per-element state has the parameter's (local) number of elements."""
        n = local(p).numel()
        for k, v in st_old.items():
            if not torch.is_tensor(v) or k == "step" or k.endswith("_scale"):
                continue
            if local(v).numel() != n:
                raise ValueError(
                    f"{where}: state {k!r} has shape {tuple(v.shape)}, the parameter has"
                    f" {tuple(p.shape)} (a state dict of another model?)"
                )

    def _load_param_state(self, p, group, st_old) -> None:
        lp = local(p)
        st = self._init_state(p, group)
        step = st_old.get("step")
        if step is None:
            # torch.optim.SGD (and Muon, Lion-shaped dicts) keep no step count; a momentum
            # there means steps were taken: 0 would make the next step the first, which
            # restarts SGD's momentum from the gradient (the count changes nothing else)
            has_state = any(torch.is_tensor(v) for k, v in st_old.items() if k != "seed")
            step = 1 if has_state else 0
        st["step"] = int(step.item()) if torch.is_tensor(step) else int(step)
        if "seed" in st_old:
            st["seed"] = int(st_old["seed"])
        m_key, v_key = self._state_keys(group)
        for key in [m_key, v_key]:
            if key is None or not (key in st or key + "_codes" in st):
                continue
            val = self._saved_values(p, st_old, key, is_var=key == v_key)
            if val is None:
                continue
            codes, scales, values = val
            if key in st:  # fp32 states
                lay = torch.empty_like(st[key])
                flat(lay).copy_(values() if codes is not None else flat(scales))
                st[key].copy_(lay)
                continue
            dst, dst_s = st[key + "_codes"], st[key + "_scale"]
            # the saved groups are this grid's: (rows, groups per row) scales of our shape,
            # or 0.2.0's flat grid of 32 on rows of a multiple of 32 (the same groups)
            flat_grid = state_row(lp, True) is None  # rows of a multiple of 32
            same_grid = scales is not None and (
                scales.shape == dst_s.shape
                or (scales.dim() == 1 and scales.numel() == dst_s.numel() and flat_grid)
            )
            if codes is not None and same_grid:
                flat(dst).copy_(flat(codes))  # bit for bit
                dst_s.copy_(scales.reshape(dst_s.shape))
                continue
            # a torch.optim moment, or codes on another grid (older checkpoints): quantized
            # on this parameter's grid, in its memory order
            x = values() if codes is not None else flat(scales).to(torch.float64)
            quant = quantize_variance_ref if key == v_key else quantize_momentum_ref
            c2, s2 = quant(x, group["scale_dtype"], row=state_row(lp, True))
            flat(dst).copy_(c2)
            dst_s.copy_(s2.reshape(dst_s.shape))
        if "correction" in st and "correction" in st_old:
            st["correction"].copy_(local(st_old["correction"]))

    def _saved_values(self, p, st_old, key, is_var: bool):
        """A saved state of ``p`` as (codes, scales, values): our codes with their group
        scales (``scales`` None for a per-element export) and a function decoding them
        (float64, flat in memory order); or (None, fp32 moment, None) for a torch.optim
        state; None when the dict has none."""
        lp = local(p)
        dev = lp.device
        if key + "_codes" in st_old or (
            key in st_old and torch.is_tensor(st_old[key]) and not st_old[key].is_floating_point()
        ):  # codes (0.2.0 and later name them <state>_codes; earlier dicts <state>)
            codes = local(st_old.get(key + "_codes", st_old.get(key))).to(dev).reshape(lp.shape)
            per_el = st_old.get(key + "_scale_per_element")  # 0.2.0's sharded export
            if per_el is not None:
                e = local(per_el).to(dev).reshape(-1).to(torch.float64)
                c = flat(codes).to(torch.float64)
                if is_var:
                    return codes, None, lambda: (c / 255 * e) ** 2
                return codes, None, lambda: (c / 127) / (2 - (c / 127).abs()) * e
            sc = local(st_old[key + "_scale"]).to(dev)
            # the grid the scales were saved on: this one (2-D: rows, groups per row), or
            # 0.2.0's flat grid of 32 over the (local) tensor (1-D)
            row = state_row(lp, True) if sc.dim() == 2 else None
            dq = dequantize_variance_ref if is_var else dequantize_momentum_ref
            return codes, sc, lambda: dq(flat(codes), sc.reshape(-1), row)
        if key in st_old and torch.is_tensor(st_old[key]):
            v = local(st_old[key]).to(dev)
            lay = torch.empty_like(lp, dtype=torch.float64)
            lay.copy_(v.reshape(lay.shape))
            return None, flat(lay), None
        return None

    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout, under the names the live state has (8-bit codes are
        ``<state>_codes``, their scales ``<state>_scale``: loaders that take the names from
        the live state, torch.distributed.checkpoint's flattened dicts and torchtitan's,
        find every tensor). For DTensor (FSDP2) parameters every state is a DTensor with
        the parameter's placements: per-element states of the parameter's shape, the group
        scales of shape (rows, groups per row) (``grid.py``), sharded by rows as the
        parameter is, so torch.distributed.checkpoint saves and reshards them bit for bit."""
        skipped = self.skipped_steps
        if self.capturable:
            self.sync_steps()
            if self._dskip:
                skipped += int(self.skipped_steps_device.item())
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in list(sd["state"].items()):
            p = params[idx]
            if not hasattr(p, "_local_tensor"):
                continue
            sd["state"][idx] = {
                k: (_as_dtensor(v, p, k.endswith("_scale")) if torch.is_tensor(v) else v)
                for k, v in st.items()
            }
        sd["flashoptim"] = {"skipped_steps": skipped, "grid": "rows"}
        return sd

    def torch_state_dict(self) -> dict[str, Any]:
        """The way back to torch.optim: a state dict in its layout with dequantized fp32
        moments (``exp_avg``, ``exp_avg_sq`` / ``momentum_buffer``, each of its parameter's
        shape) and torch's group keys, for ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` over fp32
        copies of the parameters made from ``master_weights()``::

            masters = opt.master_weights()
            fp32 = [masters[p].clone().requires_grad_() for p in model.parameters()]
            torch_opt = torch.optim.AdamW(fp32)
            torch_opt.load_state_dict(opt.torch_state_dict())

        ``load_state_dict`` takes such a dict back (quantizing it). Not for DTensor (FSDP2)
        parameters: use ``state_dict()`` with torch.distributed.checkpoint there."""
        if self.capturable:
            self.sync_steps()
        state, groups, idx = {}, [], 0
        for group in self.param_groups:
            m_key, v_key = self._state_keys(group)
            ids = []
            for p in group["params"]:
                if hasattr(p, "_local_tensor"):
                    raise ValueError("torch_state_dict() does not export DTensor (FSDP2) states")
                st = self.state.get(p)
                if st and "step" in st:
                    out = {"step": torch.tensor(float(st["step"]))}
                    for key, dq in (
                        (m_key, dequantize_momentum_ref),
                        (v_key, dequantize_variance_ref),
                    ):
                        if key is None or not (key in st or key + "_codes" in st):
                            continue
                        if key in st:
                            out[key] = st[key].to(torch.float32, copy=True)
                            continue
                        codes = st[key + "_codes"]
                        lay = torch.empty_like(codes, dtype=torch.float32)
                        row = state_row(p, True)
                        flat(lay).copy_(dq(flat(codes), st[key + "_scale"].reshape(-1), row))
                        out[key] = lay
                    state[idx] = out
                ids.append(idx)
                idx += 1
            g = {k: v for k, v in group.items() if k not in _OURS and k != "params"}
            g.update(self._torch_group_keys(group))
            g["params"] = ids
            groups.append(g)
        return {"state": state, "param_groups": groups}

    def _torch_group_keys(self, group) -> dict:
        keys = dict(foreach=None, maximize=bool(group.get("maximize", False)))
        keys.update(capturable=False, differentiable=False, fused=None)
        if self._v_key is not None:  # Adam / AdamW
            keys.update(amsgrad=False, decoupled_weight_decay=self._decoupled)
        return keys


# group keys that name an optimizer kind's hyperparameters: one of them in a saved group
# that this optimizer's groups lack means a state dict of another kind
_KIND_KEYS = frozenset(
    {"betas", "eps", "momentum", "dampening", "nesterov", "ns_coefficients", "ns_steps"}
    | {"adjust_lr_fn", "use_muon"}
)
# our group keys that torch.optim does not have
_OURS = ("master_weight_bits", "quantize", "stochastic_rounding", "scale_dtype")


def _as_dtensor(t: torch.Tensor, p, scales: bool):
    """A state tensor of the DTensor parameter ``p`` as a DTensor with ``p``'s placements:
    per-element states of ``p``'s shape, group scales (``scales``) of shape (rows, groups per
    row); both sharded by rows as ``p`` (Shard(0) or Replicate, ``_plan.check_placements``)."""
    from torch.distributed.tensor import DTensor

    lp = local(p)
    if scales:
        rows, gpr = grid.scale_shape(lp)
        shape = (p.shape[0] if p.dim() else 1, gpr)
        return DTensor.from_local(
            t.reshape(rows, gpr),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=(gpr, 1),
        )
    return DTensor.from_local(
        t.reshape(lp.shape),
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )
