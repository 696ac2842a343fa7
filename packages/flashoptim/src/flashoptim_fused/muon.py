"""FlashMuon: Muon for the matrices, AdamW for the rest, with weight splitting and a
companded 8-bit momentum.

Muon (Keller Jordan 2024; ``torch.optim.Muon``) steps a matrix by the orthogonalised
Nesterov momentum: ``m = mu m + (1 - mu) g``, ``u = mu m + (1 - mu) g`` (or ``m``),
``O = NS(u)`` (5 quintic Newton-Schulz iterations in bf16 on the Frobenius-normalised
``u``, on its wide orientation), ``theta = theta (1 - lr wd) - lr ratio(shape) O``. The
parameters Muon should not take (embeddings, output heads, norms, biases) take AdamW in the
same optimizer. A step per workspace wave of matrices (``_bucket_entries``):

1. ``_muon_kernel._momentum_kernel``: one launch over the wave, the momentum EMA and its
   int8 codes in place, ``u`` in bf16 into the wave's workspace;
2. ``newton_schulz`` on each matrix of the workspace (torch bf16 matmuls, the tensor cores;
   matrices of one shape batched), its result written back into the workspace; a DTensor
   (FSDP2) matrix is all-gathered for it and each rank keeps its rows;
3. ``_muon_kernel._update_kernel``: one launch over the wave, decay, the scaled update and
   the split into bf16 + int8 correction.

The workspace (2 bytes per element of the wave) lives only during the step; waves hold at
most ``WAVE_ELEMS`` elements (or one larger matrix), so the step's transient memory stays
that of one wave plus its Newton-Schulz temporaries.
"""

from __future__ import annotations

import math

import torch

from . import _muon_kernel, _muon_shard
from ._cpu import muon_momentum_cpu, muon_update_cpu
from ._gram_kernel import gram
from ._plan import build_table, global_index_base, local
from .optimizer import FlashOptimizer
from .reference import GOLDEN, M32, NS_COEFFICIENTS

# elements per workspace wave: 2**25 (64 MiB of bf16) groups small matrices into one launch
# and one batched Newton-Schulz per shape; a larger matrix is a wave of its own
WAVE_ELEMS = 2**25
# names (the module owning the weight) that mark a 2-D parameter as an embedding or an
# output head, which Muon's default split leaves to AdamW
HEAD_NAMES = frozenset({"wte", "wpe", "tok", "pos", "head", "lm_head", "output", "classifier"})
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


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
    Muon momentum companded into int8 with group scales (6.06 bytes per matrix parameter
    with its bf16 gradient; torch.optim.Muon with fp32 parameters: 12), the AdamW states as
    ``FlashAdamW``'s.

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
    ``on_nonfinite``, ``seed``); ``capturable`` is not supported. Under FSDP2 each matrix
    is all-gathered (bf16) for its orthogonalisation and every rank keeps its rows.
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

    # ------------------------------------------------------------------ waves
    def _bucket_entries(self, group, key, bps):
        """Muon groups: the bucket's matrices sorted by shape (stable: same-shape matrices
        keep their order and lie side by side in the workspace) and cut into waves of at
        most ``WAVE_ELEMS`` elements (one larger matrix is a wave of its own)."""
        if not group["use_muon"]:
            return super()._bucket_entries(group, key, bps)
        waves, cur, size = [], [], 0
        for p in sorted(bps, key=matrix_shape):  # full shapes: the same waves on every rank
            if cur and size + p.numel() > WAVE_ELEMS:
                waves.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += p.numel()
        if cur:
            waves.append(cur)
        return [self._wave(group, key, w) for w in waves]

    def _wave(self, group, key, ps: list) -> dict:
        """One wave: its parameters, workspace layout (each matrix's local elements at a
        multiple of 16), the runs of same-shape matrices orthogonalised as one batch, and
        (Triton) the tables, column 5 the workspace offsets, column 6 the ratios."""
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
        wave = dict(ps=ps, ent=ent, step=key[0], offs=offs, ws_numel=o, runs=runs)
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
        """A Muon wave: pass 1 (momentum, ``u`` into the workspace), the orthogonalisation
        of every matrix in the workspace, pass 2 (weights). With ``skip`` (the device
        non-finite flag) both passes return at once on a bad step; the orthogonalisation
        then runs on an unwritten workspace whose result nothing reads."""
        if not group["use_muon"]:
            return super()._step_bucket(group, b, hp, step, skip)
        self._refresh_ratios(group, b)
        ps, ent = b["ps"], b["ent"]
        ws = torch.empty(max(b["ws_numel"], 1), dtype=torch.bfloat16, device=local(ps[0]).device)
        views = [ws[o : o + local(p).numel()] for p, o in zip(ps, b["offs"])]
        mix = (step * GOLDEN) & M32  # the step's key of the rounding stream
        if ent is not None:
            _muon_kernel.launch_momentum(ent, ws, hp, mix, skip, self._epoch)
        else:
            for p, u in zip(ps, views):
                st = self.state[p]
                sv = self._state_view(st, group)
                ib = global_index_base(p)
                muon_momentum_cpu(local(p.grad), sv, hp, u, step, st["seed"], ib)
        coeffs, steps, eps = group["ns_coefficients"], int(group["ns_steps"]), group["eps"]
        sharded = []
        for run in b["runs"]:
            i, k, (rows, cols) = run["i"], run["k"], run["shape"]
            if run["alone"] and hasattr(ps[i], "_local_tensor"):
                sharded.append(i)  # after every wave of the group: _orthogonalize_sharded
            elif run["alone"]:
                _orthogonalize_one(ps[i], views[i], coeffs, steps, eps)
            else:
                if k == 1:
                    x = views[i].view(rows, cols)
                else:
                    x = ws.as_strided((k, rows, cols), (run["stride"], cols, 1), b["offs"][i])
                newton_schulz(x, coeffs, steps, eps, out=x)
        pass2 = (b, ws, views, hp, step, mix, skip)
        if sharded:
            self._pending.append((group, pass2, [(ps[i], views[i]) for i in sharded]))
        else:
            self._update(*pass2)

    def _update(self, b, ws, views, hp, step, mix, skip) -> None:
        """Pass 2 of a wave: the weights from ``O`` in the workspace ``ws``."""
        ps, ent = b["ps"], b["ent"]
        if ent is not None:
            _muon_kernel.launch_update(ent, ws, hp, mix, skip, self._epoch)
            return
        for p, o, r in zip(ps, views, b["ratios"]):
            st = self.state[p]
            c = st.get("correction")
            idx = global_index_base(p)
            muon_update_cpu(local(p), c, o, hp, r, step, st["seed"], idx)

    def _commit(self, prep, skip: dict | None = None) -> None:
        super()._commit(prep, skip)
        self._orthogonalize_sharded()

    def _orthogonalize_sharded(self) -> None:
        """The DTensor matrices of a group's step, after pass 1 of every wave: each ranks'
        buckets and waves differ (a bucket's key holds the local numel), so the collectives
        run here, once per step, over all of them in the group's parameter order (the same on
        every rank): row shards through ``_muon_shard`` (each matrix orthogonalised once, on
        its owner rank), any other placement gathered whole on every rank; then pass 2 of
        those waves. Their workspaces live until then: 2 bytes per local element."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        group = pending[0][0]
        coeffs, steps, eps = group["ns_coefficients"], int(group["ns_steps"]), group["eps"]
        items = sorted(
            ((p, _logical(u, local(p))) for _, _, its in pending for p, u in its),
            key=lambda it: self._pindex[id(it[0])],
        )
        rest = _muon_shard.orthogonalize(items, lambda u: newton_schulz(u, coeffs, steps, eps))
        for p, x in rest:  # (x has p's local shape: _logical keeps it)
            _orthogonalize_one(p, x, coeffs, steps, eps)
        for _, pass2, _ in pending:
            self._update(*pass2)


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
