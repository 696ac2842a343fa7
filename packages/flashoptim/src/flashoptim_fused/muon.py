"""FlashMuon: Muon for the matrices, AdamW for the rest, with weight splitting and a
momentum held as a low-rank part plus int8 residual codes.

Muon (Keller Jordan 2024; ``torch.optim.Muon``) steps a matrix by the orthogonalised
Nesterov momentum: ``m = mu m + (1 - mu) g``, ``u = mu m + (1 - mu) g`` (or ``m``),
``O = NS(u)`` (5 quintic Newton-Schulz iterations in bf16 on the Frobenius-normalised
``u``, on its wide orientation), ``theta = theta (1 - lr wd) - lr ratio(shape) O``. The
parameters Muon should not take (embeddings, output heads, norms, biases) take AdamW in the
same optimizer. The momentum of a matrix of both sides >= 32 is ``P R^T`` (bf16 factors of
rank ``reference.MUON_RANK``) plus int8 codes of the residual rounded to nearest
(``_muon_lowrank``). A step per workspace wave of matrices (``_bucket_entries``):

1. the stored low-rank parts ``bf16(P R^T)`` into the workspace, then
   ``_muon_kernel._momentum_kernel``: one launch over the wave, the momentum EMA, ``u`` in
   bf16 into the wave's workspace (codes stored here only without a low-rank part);
2. the factors' power iteration from ``u`` and the gradient, the new low-rank parts into
   the workspace; ``newton_schulz`` on each matrix of the workspace (the symmetric Gram
   kernel and cuBLAS on CUDA; matrices of one shape batched), its result written back into
   the workspace; DTensor (FSDP2) matrices after every wave of the group, each on one owner
   rank (``_muon_shard``);
3. ``_muon_kernel._update_kernel``: one launch over the wave, decay, the scaled update and
   the split into bf16 + int8 correction; the momentum again, minus the new low-rank part,
   into its codes.

The workspace (6 bytes per element of the wave with low-rank parts, else 2) lives only
during the step; waves hold at most ``WAVE_ELEMS`` elements (or one larger matrix), so the
step's transient memory stays that of one wave plus its Newton-Schulz temporaries.
"""

from __future__ import annotations

import math

import torch

from . import _muon_kernel, _muon_lowrank, _muon_shard
from ._cpu import muon_momentum_cpu, muon_requantize_cpu, muon_update_cpu
from ._gram_kernel import gram
from ._plan import build_table, flat, global_index_base, local
from .optimizer import FlashOptimizer
from .reference import (
    GOLDEN,
    M32,
    MUON_RANK,
    NS_COEFFICIENTS,
    dequantize_momentum_ref,
    quantize_momentum_ref,
    state_row,
)

# elements per workspace wave: 2**25 (64 MiB of bf16) groups small matrices into one launch
# and one batched Newton-Schulz per shape; a larger matrix is a wave of its own
WAVE_ELEMS = 2**25
# names (the module owning the weight) that mark a 2-D parameter as an embedding or an
# output head, which Muon's default split leaves to AdamW
HEAD_NAMES = frozenset({"wte", "wpe", "tok", "pos", "head", "lm_head", "output", "classifier"})
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# the low-rank factors of a Muon momentum (``_muon_lowrank``): P (local rows x k), R (cols x k)
LOWRANK_P, LOWRANK_R = "momentum_buffer_lowrank_p", "momentum_buffer_lowrank_r"
_CODES, _SCALE = "momentum_buffer_codes", "momentum_buffer_scale"


def default_use_muon(name: str | None, p: torch.Tensor) -> bool:
    """The default split of ``FlashMuon``: Muon for a 2-D parameter unless its name says it
    is an embedding or an output head (the owning module's name contains ``embed`` or is one
    of ``HEAD_NAMES``: ``tok_embeddings.weight``, ``transformer.wte.weight``,
    ``lm_head.weight``); AdamW for everything else (biases, norms, convolutions). Without
    names (plain ``model.parameters()``) every 2-D parameter takes Muon: pass
    ``model.named_parameters()`` or param groups with ``use_muon``."""
    if p.ndim != 2:
        return False
    if name is None:
        return True
    parts = name.lower().split(".")
    owner = parts[-2] if len(parts) > 1 else parts[0]
    return "embed" not in owner and owner not in HEAD_NAMES


def matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The (rows, columns) matrix Muon orthogonalises for ``p`` (its full shape): dim 0 by
    the product of the others."""
    return int(p.shape[0]), math.prod(p.shape[1:])


def lr_ratio(shape: tuple[int, int], adjust_lr_fn: str | None) -> float:
    """The shape-dependent scale of the update of an (A, B) matrix, as torch.optim.Muon's:
    ``"original"`` / None (Keller Jordan) ``sqrt(max(1, A / B))``; ``"match_rms_adamw"``
    (Moonlight, Liu et al. 2025) ``0.2 sqrt(max(A, B))``: the update's RMS becomes 0.2, an
    AdamW update's, so AdamW's learning rate and weight decay carry over."""
    a, b = shape
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return math.sqrt(max(1.0, a / b))


def _addmm(inp, m1, m2, beta, alpha, out=None):
    if inp.ndim == 2:
        return torch.addmm(inp, m1, m2, beta=beta, alpha=alpha, out=out)
    return torch.baddbmm(inp, m1, m2, beta=beta, alpha=alpha, out=out)


def gram_torch(y, alpha=1.0, z=None, beta=0.0):
    """``alpha y y^T + beta z`` by torch's matmuls, as torch.optim.Muon computes both Gram
    products (``X @ X.mT``; with ``z``, ``y`` is the symmetric ``A`` and the product is
    ``addmm(A, A, A)``: bitwise its operations)."""
    if z is None:
        return y @ y.mT if alpha == 1.0 else alpha * (y @ y.mT)
    return _addmm(z, y, y, beta=beta, alpha=alpha)


def default_gram(x: torch.Tensor):
    """The Gram product ``newton_schulz`` uses for ``x``: the symmetric Triton kernel on CUDA
    (half the tiles of a matmul), torch's matmuls elsewhere."""
    return gram if x.is_cuda else gram_torch


def newton_schulz(
    x: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    out: torch.Tensor | None = None,
    gram_fn=None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Muon's orthogonalisation of ``x`` (A, B) or a batch (k, A, B), bf16: the operations of
    ``torch.optim.Muon`` (wide orientation, ``X / max(||X||_F, eps)``, then ``steps`` times
    ``S = X X^T``, ``X = a X + (b S + c S S) X``), batched. The two Gram products ``S`` and
    ``b S + c S S`` (both symmetric) come from ``gram_fn(y, alpha, z, beta)`` (default
    ``default_gram(x)``: the symmetric kernel on CUDA, torch's matmuls elsewhere, bitwise
    torch.optim.Muon's there), ``a X + (.) X`` from torch's addmm / baddbmm. ``out`` (``x``
    itself allowed): where the result goes. ``dtype``: of the iteration (torch's bf16; fp32
    for a closer orthogonalisation). float64 reference: ``reference.newton_schulz_ref``."""
    gram_fn = default_gram(x) if gram_fn is None else gram_fn
    a, b, c = coefficients
    tall = x.shape[-2] > x.shape[-1]
    X = x.mT if tall else x
    dst = None if out is None else (out.mT if tall else out)
    X = X.to(dtype)
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    direct = dst is not None and (dst.is_contiguous() or dst.mT.is_contiguous())
    for i in range(steps):
        s = gram_fn(X)
        s2 = gram_fn(s, c, s, b)
        last = i == steps - 1 and direct
        X = _addmm(X, s2, X, beta=a, alpha=1.0, out=dst if last else None)
    if dst is None:
        return X.mT if tall else X
    if not (steps and direct):
        dst.copy_(X)
    return out


def _logical(u: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """The workspace region ``u`` (flat, in ``lp``'s memory order, as the passes write it)
    viewed as the tensor ``lp``: its shape with its strides."""
    return u.view(lp.shape) if lp.is_contiguous() else u.as_strided(lp.shape, lp.stride())


def _orthogonalize_one(p, u: torch.Tensor, coefficients, steps: int, eps: float) -> None:
    """One matrix on its own: a parameter stored in another memory order (a transpose,
    channels_last), or a DTensor of a placement other than row shards (``_muon_shard``
    takes those): its ``u`` (the local part) is all-gathered, the full matrix orthogonalised
    on every rank and this rank's part of ``O`` written back."""
    lp = local(p)
    x = _logical(u, lp)
    if hasattr(p, "_local_tensor"):
        from torch.distributed.tensor import DTensor, Replicate

        mesh = p.device_mesh
        full = DTensor.from_local(
            x, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()
        o = newton_schulz(full.reshape(matrix_shape(p)), coefficients, steps, eps)
        rep = DTensor.from_local(o.view(p.shape), mesh, [Replicate()] * mesh.ndim, run_check=False)
        x.copy_(rep.redistribute(mesh, p.placements).to_local())
        return
    o = newton_schulz(x.reshape(matrix_shape(p)), coefficients, steps, eps)
    x.copy_(o.view(p.shape))


class FlashMuon(FlashOptimizer):
    """Muon (torch.optim.Muon semantics and defaults) for matrices, AdamW for the other
    parameters, in one optimizer: bf16 weights + int8 correction (stochastic rounding), the
    Muon momentum as a rank-4 part (bf16 factors) plus companded int8 residual codes with
    group scales (6.0625 + 8 (A + B) / (A B) bytes per parameter of an A x B matrix with its
    bf16 gradient, 6.08 at 512 x 2048; torch.optim.Muon with fp32 parameters: 12), the
    AdamW states as ``FlashAdamW``'s.

    Which parameters take Muon: a param group's ``use_muon`` (True / False); a group without
    it is split by ``default_use_muon`` (2-D and not named like an embedding or a head; pass
    ``model.named_parameters()`` for names) into a Muon group and an AdamW group, in that
    order. A Muon group takes ``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps`` (of the normalisation), ``ns_steps``, ``adjust_lr_fn``
    (None / "original": ``sqrt(max(1, A / B))``; "match_rms_adamw": ``0.2 sqrt(max(A, B))``).
    An AdamW group takes ``lr``, ``betas``, ``eps``, ``weight_decay``; split off a group
    without ``use_muon`` they come from ``adamw_lr`` (None: ``lr``), ``adamw_betas``,
    ``adamw_eps``, ``adamw_weight_decay`` (None: ``weight_decay``), of the group or the
    constructor. Parameters with more than 2 dimensions take Muon only with
    ``use_muon=True`` (orthogonalised as (shape[0], rest)).

    Storage and step options: ``FlashOptimizer`` (``master_weight_bits``, ``quantize``,
    ``stochastic_rounding``, ``scale_dtype``, ``backend``, ``check_finite``,
    ``on_nonfinite``, ``seed``; ``stochastic_rounding`` applies to the correction: the
    momentum's codes round to nearest); ``capturable`` is not supported. Under FSDP2 each
    row-sharded matrix is orthogonalised once, on an owner rank (``_muon_shard``).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        **kw,
    ):
        if kw.get("capturable"):
            raise ValueError("FlashMuon does not support capturable=True")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            use_muon=None,
            adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
        )
        super().__init__(params, defaults, **kw)
        # waves of a step that hold DTensor matrices: finished by _orthogonalize_sharded
        self._pending: list = []

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a group; one without ``use_muon`` is split into a Muon and an AdamW group
        (``default_use_muon``), each added if it has parameters."""
        group = dict(param_group)
        params = group["params"]
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        use = group.get("use_muon", self.defaults["use_muon"])
        if use is None:
            named = [it if isinstance(it, tuple) else (None, it) for it in items]
            flags = [default_use_muon(n, p) for n, p in named]
            muon = [it for it, f in zip(items, flags) if f]
            adam = [it for it, f in zip(items, flags) if not f]
            if any(flags[i] and not flags[i - 1] for i in range(1, len(flags))):
                self._reordered = True  # an AdamW parameter came before a Muon one
            halves = [(muon, True), (adam, False)] if items else [(items, True)]
            for part, flag in halves:
                if part or not items:
                    self._add_group(dict(group, params=part, use_muon=flag), explicit=False)
            return
        self._add_group(dict(group, params=items, use_muon=bool(use)), explicit=True)

    def _add_group(self, group: dict, explicit: bool) -> None:
        d = self.defaults
        if not group["use_muon"]:  # AdamW: its own lr (schedulers scale it), betas, eps, wd

            def pick(key, akey):
                if explicit and key in group:
                    return group[key]
                alt = group.get(akey, d[akey])
                return alt if alt is not None else group.get(key, d[key])

            group.update(
                lr=pick("lr", "adamw_lr"),
                weight_decay=pick("weight_decay", "adamw_weight_decay"),
                eps=pick("eps", "adamw_eps"),
                betas=tuple(
                    group["betas"]
                    if explicit and "betas" in group
                    else pick("betas", "adamw_betas")
                ),
            )
        _validate(group, d)
        super().add_param_group(group)
        g = self.param_groups[-1]
        if g["use_muon"]:
            for p in g["params"]:
                if p.ndim < 2:
                    raise ValueError(
                        f"use_muon=True needs parameters of 2 or more dimensions; got shape"
                        f" {tuple(p.shape)} (leave biases and norms to AdamW: use_muon=False)"
                    )

    # ------------------------------------------------------------------ state
    def _lowrank(self, group, p) -> bool:
        """Whether ``p``'s momentum keeps a low-rank part: a quantized Muon matrix of both
        sides >= 32 (``_muon_lowrank.uses_lowrank``), whole or sharded by rows."""
        if not (group["use_muon"] and group["quantize"]):
            return False
        if hasattr(p, "_local_tensor") and _muon_shard.shard_group(p) is None:
            return False
        return _muon_lowrank.uses_lowrank(matrix_shape(p))

    def _init_state(self, p, group) -> dict:
        fresh = "step" not in self.state[p]
        st = super()._init_state(p, group)
        if fresh and self._lowrank(group, p):
            rows = int(local(p).shape[0])
            P, R = _muon_lowrank.init_factors(rows, matrix_shape(p)[1], st["seed"], local(p).device)
            st[LOWRANK_P], st[LOWRANK_R] = P, R
        return st

    def _state_keys(self, group):
        if group["use_muon"]:
            return "momentum_buffer", None  # torch.optim.Muon's name
        return "exp_avg", "exp_avg_sq"

    def _hp(self, group, p):
        if group["use_muon"]:
            return dict(
                self._common_hp(group, p),
                mu=float(group["momentum"]),
                nesterov=bool(group["nesterov"]),
            )
        b1, b2 = group["betas"]
        return dict(self._common_hp(group, p), b1=float(b1), b2=float(b2), eps=float(group["eps"]))

    def _torch_group_keys(self, group) -> dict:
        """``torch_state_dict()``: a Muon group as torch.optim.Muon's, an AdamW group as
        torch.optim.AdamW's (split the dict by ``use_muon`` for the two torch optimizers)."""
        if group["use_muon"]:
            return {}
        return super()._torch_group_keys(group)

    # ------------------------------------------------------------------ checkpoints
    # The factors are not per-element states: the base class's checks, sharded export and
    # torch export see the residual codes only; these add the factors (an export to torch
    # holds the whole momentum, a load without factors splits the whole momentum again).
    def _check_state_kind(self, st_old, group, where) -> None:
        super()._check_state_kind(_without_factors(st_old), group, where)

    def _check_state_shapes(self, p, st_old, where) -> None:
        super()._check_state_shapes(p, _without_factors(st_old), where)
        if LOWRANK_P in st_old:
            want = ((int(local(p).shape[0]), MUON_RANK), (matrix_shape(p)[1], MUON_RANK))
            got = tuple(tuple(local(st_old[k]).shape) for k in (LOWRANK_P, LOWRANK_R))
            if got != want:
                raise ValueError(f"{where}: low-rank factors of shapes {got}; expected {want}")

    def _load_param_state(self, p, group, st_old) -> None:
        super()._load_param_state(p, group, _without_factors(st_old))
        st = self.state[p]
        if LOWRANK_P not in st:
            return
        if LOWRANK_P in st_old:
            st[LOWRANK_P].copy_(local(st_old[LOWRANK_P]))
            st[LOWRANK_R].copy_(local(st_old[LOWRANK_R]))
            return
        # a checkpoint without factors (torch.optim.Muon's, or ours before issue #31): the
        # whole momentum, split into factors and residual codes here
        lp = local(p)
        row = state_row(lp, True)
        old = st_old.get("momentum_buffer")
        whole = torch.empty_like(lp, dtype=torch.float64)  # the parameter's layout
        if torch.is_tensor(old) and old.is_floating_point():  # torch.optim.Muon's
            whole.copy_(local(old).reshape(lp.shape))
        else:  # our codes of the whole momentum
            codes, scales = flat(st[_CODES]), st[_SCALE]
            flat(whole).copy_(dequantize_momentum_ref(codes, scales, row))
        m = whole.reshape(int(lp.shape[0]), matrix_shape(p)[1]).float()
        P, R = _muon_lowrank.factors_of(m, st["seed"], reduce=_muon_shard.row_sum(p))
        st[LOWRANK_P].copy_(P)
        st[LOWRANK_R].copy_(R)
        whole -= _muon_lowrank.lowrank(P, R).double().view(lp.shape)
        codes, scales = quantize_momentum_ref(flat(whole), group["scale_dtype"], None, row)
        flat(st[_CODES]).copy_(codes)
        st[_SCALE].copy_(scales.view_as(st[_SCALE]))

    def state_dict(self) -> dict:
        """``FlashOptimizer.state_dict`` plus each low-rank momentum's factors (under FSDP2:
        P sharded by rows as its matrix, R replicated)."""
        hidden = {}
        for p, st in self.state.items():
            if LOWRANK_P in st:
                hidden[p] = (st.pop(LOWRANK_P), st.pop(LOWRANK_R))
        try:
            sd = super().state_dict()
        finally:
            for p, (P, R) in hidden.items():
                self.state[p][LOWRANK_P], self.state[p][LOWRANK_R] = P, R
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, p in enumerate(params):
            if p not in hidden or idx not in sd["state"]:
                continue
            P, R = hidden[p]
            if hasattr(p, "_local_tensor"):
                from torch.distributed.tensor import DTensor, Replicate

                mesh = p.device_mesh
                P = DTensor.from_local(
                    P,
                    mesh,
                    p.placements,
                    run_check=False,
                    shape=(p.shape[0], MUON_RANK),
                    stride=(MUON_RANK, 1),
                )
                R = DTensor.from_local(R, mesh, [Replicate()] * mesh.ndim, run_check=False)
            sd["state"][idx][LOWRANK_P], sd["state"][idx][LOWRANK_R] = P, R
        return sd

    def torch_state_dict(self) -> dict:
        """``FlashOptimizer.torch_state_dict``, each Muon momentum whole (``P R^T`` plus the
        decoded residual), as torch.optim.Muon keeps it."""
        sd = super().torch_state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, p in enumerate(params):
            st = self.state.get(p, {})
            if LOWRANK_P in st and idx in sd["state"]:
                low = _muon_lowrank.lowrank(st[LOWRANK_P], st[LOWRANK_R]).float()
                sd["state"][idx]["momentum_buffer"] += low.view(p.shape)
        return sd

    # ------------------------------------------------------------------ waves
    def _bucket_entries(self, group, key, bps):
        """Muon groups: the bucket's matrices sorted by shape (stable: same-shape matrices
        keep their order and lie side by side in the workspace) and cut into waves of at
        most ``WAVE_ELEMS`` elements (one larger matrix is a wave of its own)."""
        if not group["use_muon"]:
            return super()._bucket_entries(group, key, bps)
        waves, cur, size = [], [], 0
        low = [LOWRANK_P in self.state[p] for p in bps]
        order = sorted(range(len(bps)), key=lambda i: (low[i], matrix_shape(bps[i])))
        for i in order:  # full shapes: the same waves on every rank
            p = bps[i]
            if cur and (size + p.numel() > WAVE_ELEMS or low[i] != low[cur[-1]]):
                waves.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += p.numel()
        if cur:
            waves.append(cur)
        return [self._wave(group, key, [bps[i] for i in w], low[w[0]]) for w in waves]

    def _wave(self, group, key, ps: list, lowrank: bool = False) -> dict:
        """One wave: its parameters, workspace layout (each matrix's local elements at a
        multiple of 16), the runs of same-shape matrices orthogonalised as one batch, and
        (Triton) the tables, column 5 the workspace offsets, column 6 the ratios.
        ``lowrank``: its momenta keep a low-rank part (all or none of a wave's)."""
        offs, runs, o = [], [], 0
        for i, p in enumerate(ps):
            n = local(p).numel()
            alone = hasattr(p, "_local_tensor") or not local(p).is_contiguous()
            shape = matrix_shape(p)
            last = runs[-1] if runs else None
            if last and not alone and not last["alone"] and last["shape"] == shape:
                last["k"] += 1
            else:
                runs.append(dict(i=i, k=1, shape=shape, alone=alone, stride=-(-n // 16) * 16))
            offs.append(o)
            o += -(-n // 16) * 16
        ent = None
        if key[4]:
            sts = [self._state_view(self.state[p], group) for p in ps]
            ent = build_table(ps, sts, [self.state[p]["seed"] for p in ps], rows=key[7])
            # per table entry (a matrix, or one of its rows: grid.split) its workspace offset
            ws_off = torch.tensor(offs, dtype=torch.int64)[ent["owner"]] + ent["row0"]
            ent["tab"][:, 5] = ws_off.to(ent["tab"].device)
        wave = dict(ps=ps, ent=ent, step=key[0], offs=offs, ws_numel=o, runs=runs, lowrank=lowrank)
        wave.update(adjust=None, ratios=None)
        self._refresh_ratios(group, wave)
        return wave

    def _refresh_ratios(self, group, wave) -> None:
        """The wave's per-matrix lr scales for the group's ``adjust_lr_fn`` (fp32 values; on
        the Triton path their bits in column 6 of the table)."""
        fn = group["adjust_lr_fn"]
        if wave["ratios"] is not None and wave["adjust"] == fn:
            return
        r = torch.tensor([lr_ratio(matrix_shape(p), fn) for p in wave["ps"]], dtype=torch.float32)
        wave.update(adjust=fn, ratios=r.tolist())
        if wave["ent"] is not None:
            tab = wave["ent"]["tab"]
            bits = r.view(torch.int32).to(torch.int64)[wave["ent"]["owner"]]
            tab[:, 6] = bits.to(tab.device)

    # ------------------------------------------------------------------ the step
    def _step_bucket(self, group, b, hp, step, skip=None) -> None:
        """A Muon wave: pass 1 (the momentum, ``u`` into the workspace), the low-rank
        factors' update from ``u`` (``_muon_lowrank``), the orthogonalisation of every matrix
        in the workspace, pass 2 (weights; a low-rank momentum's residual codes). The
        workspace holds ``u`` / ``O`` and, for low-rank momenta, the old and the new
        low-rank parts (bf16, the same offsets). With ``skip`` (the device non-finite flag)
        both passes return at once on a bad step; the rest then runs on an unwritten
        workspace and nothing reads it, except the factors: a skipped step's new factors
        are dropped (``_lowrank_step`` writes them only after the flag says the step ran)."""
        if not group["use_muon"]:
            return super()._step_bucket(group, b, hp, step, skip)
        self._refresh_ratios(group, b)
        ps, ent = b["ps"], b["ent"]
        n = max(b["ws_numel"], 1)
        low = b["lowrank"]
        ws = torch.empty((3 if low else 1) * n, dtype=torch.bfloat16, device=local(ps[0]).device)
        lo, ln = (ws[n : 2 * n], ws[2 * n :]) if low else (None, None)
        regions = [ws[:n], lo, ln]
        views = [
            [None if r is None else r[o : o + local(p).numel()] for r in regions]
            for p, o in zip(ps, b["offs"])
        ]  # (u, old, new) of each matrix
        if low:
            for p, v in zip(ps, views):
                st = self.state[p]
                _logical(v[1], local(p)).copy_(
                    _muon_lowrank.lowrank(st[LOWRANK_P], st[LOWRANK_R]).view(local(p).shape)
                )
        mix = (step * GOLDEN) & M32  # the step's key of the rounding stream
        if ent is not None:
            _muon_kernel.launch_momentum(ent, ws[:n], lo, hp, skip, self._epoch)
        else:
            for p, v in zip(ps, views):
                sv = self._state_view(self.state[p], group)
                muon_momentum_cpu(local(p.grad), sv, hp, v[0], v[1])
        coeffs, steps, eps = group["ns_coefficients"], int(group["ns_steps"]), group["eps"]
        sharded = []
        for run in b["runs"]:
            i, k, (rows, cols) = run["i"], run["k"], run["shape"]
            if run["alone"] and hasattr(ps[i], "_local_tensor"):
                sharded.append(i)  # after every wave of the group: _orthogonalize_sharded
                continue
            if low:
                self._lowrank_step(group, hp, ps[i : i + k], views[i : i + k], skip)
            if run["alone"]:
                _orthogonalize_one(ps[i], views[i][0], coeffs, steps, eps)
            else:
                if k == 1:
                    x = views[i][0].view(rows, cols)
                else:
                    x = ws.as_strided((k, rows, cols), (run["stride"], cols, 1), b["offs"][i])
                newton_schulz(x, coeffs, steps, eps, out=x)
        pass2 = (group, b, ws[:n], views, lo, ln, hp, step, mix, skip)
        if sharded:
            self._pending.append((group, pass2, [(ps[i], views[i]) for i in sharded]))
        else:
            self._update(*pass2)

    def _lowrank_step(self, group, hp, ps, views, skip, reduce=None) -> None:
        """The low-rank factors of matrices, from their ``u`` in the workspace and their
        gradients (views: no copies), before the orthogonalisation overwrites ``u``; their
        new low-rank parts into the workspace. ``reduce``: the sum over the ranks of a row
        shard (``_muon_shard``). On a step the device flag ``skip`` skips, the factors stay
        (no host sync: selected on the device)."""
        keep = None
        if skip is not None:  # the step's epoch in the device flag: it was skipped
            keep = skip.reshape(()) == self._epoch
        sign = -1.0 if hp.get("maximize") else 1.0
        for p, v in zip(ps, views):
            lp, st = local(p), self.state[p]
            shape = (int(lp.shape[0]), matrix_shape(p)[1])
            u = _logical(v[0], lp).reshape(shape)
            g = local(p.grad).reshape(shape)
            P, R = _muon_lowrank.update_factors(
                u, g, st[LOWRANK_R], hp["mu"], hp["nesterov"], reduce, sign
            )
            _logical(v[2], lp).copy_(_muon_lowrank.lowrank(P, R).view(lp.shape))
            if keep is not None:
                P = torch.where(keep, st[LOWRANK_P], P)
                R = torch.where(keep, st[LOWRANK_R], R)
            st[LOWRANK_P].copy_(P)
            st[LOWRANK_R].copy_(R)

    def _update(self, group, b, ws, views, lo, ln, hp, step, mix, skip) -> None:
        """Pass 2 of a wave: the weights from ``O`` in the workspace ``ws``; with ``lo`` /
        ``ln`` (the old and new low-rank parts) the momentum's residual codes."""
        ps, ent = b["ps"], b["ent"]
        if ent is not None:
            _muon_kernel.launch_update(ent, ws, lo, ln, hp, mix, skip, self._epoch)
            return
        for p, v, r in zip(ps, views, b["ratios"]):
            st = self.state[p]
            c = st.get("correction")
            idx = global_index_base(p)
            muon_update_cpu(local(p), c, v[0], hp, r, step, st["seed"], idx)
            if lo is not None:
                sv = self._state_view(st, group)
                muon_requantize_cpu(local(p.grad), sv, hp, v[1], v[2])

    def _commit(self, prep, skip: dict | None = None) -> None:
        super()._commit(prep, skip)
        self._orthogonalize_sharded()

    def _orthogonalize_sharded(self) -> None:
        """The DTensor matrices of a group's step, after pass 1 of every wave: each ranks'
        buckets and waves differ (a bucket's key holds the local numel), so the collectives
        run here, once per step, over all of them in the group's parameter order (the same on
        every rank): the low-rank factors (two sums over the row shards per matrix), then row
        shards through ``_muon_shard`` (each matrix orthogonalised once, on its owner rank),
        any other placement gathered whole on every rank; then pass 2 of those waves. Their
        workspaces live until then: 2 (6 with a low-rank part) bytes per local element."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        group = pending[0][0]
        coeffs, steps, eps = group["ns_coefficients"], int(group["ns_steps"]), group["eps"]
        items = sorted(
            ((p, v, pass2) for _, pass2, its in pending for p, v in its),
            key=lambda it: self._pindex[id(it[0])],
        )
        for p, v, pass2 in items:
            if pass2[4] is not None:  # a low-rank momentum
                reduce = _muon_shard.row_sum(p)
                self._lowrank_step(group, pass2[6], [p], [v], pass2[9], reduce)
        rest = _muon_shard.orthogonalize(
            [(p, _logical(v[0], local(p))) for p, v, _ in items],
            lambda u: newton_schulz(u, coeffs, steps, eps),
        )
        for p, x in rest:  # (x has p's local shape: _logical keeps it)
            _orthogonalize_one(p, x, coeffs, steps, eps)
        for _, pass2, _ in pending:
            self._update(*pass2)


def _without_factors(st: dict) -> dict:
    return {k: v for k, v in st.items() if k not in (LOWRANK_P, LOWRANK_R)}


def _validate(group: dict, d: dict) -> None:
    """Clear errors for a group's hyperparameters (after defaults are filled in)."""

    def get(k):
        return group.get(k, d[k])

    if not torch.is_tensor(get("lr")) and get("lr") < 0:  # (tensor lr: the base class's check)
        raise ValueError(f"lr must be >= 0; got {get('lr')}")
    if get("weight_decay") < 0:
        raise ValueError(f"weight_decay must be >= 0; got {get('weight_decay')}")
    if group["use_muon"]:
        if get("momentum") < 0:
            raise ValueError(f"momentum must be >= 0; got {get('momentum')}")
        steps = get("ns_steps")
        if not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100); got {steps!r}")
        if len(tuple(get("ns_coefficients"))) != 3:
            raise ValueError(f"ns_coefficients must be 3 floats; got {get('ns_coefficients')}")
        if get("eps") < 0:
            raise ValueError(f"eps must be >= 0; got {get('eps')}")
        if get("adjust_lr_fn") not in ADJUST_LR_FNS:
            raise ValueError(
                f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw'; got"
                f" {get('adjust_lr_fn')!r}"
            )
    else:
        b1, b2 = group["betas"]
        if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
            raise ValueError(f"betas must be in [0, 1); got {group['betas']}")
        if group["eps"] < 0:
            raise ValueError(f"eps must be >= 0; got {group['eps']}")
