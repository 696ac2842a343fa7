"""``FlashOptimizer``: the base class of every flashoptim optimizer (state, the step,
capturable mode; checkpoints in ``checkpoint.py``). The per-optimizer modules
(``adamw.py``, ``sgd.py``, ``lion.py``) only name their kind, their state and their
hyperparameters.

On CUDA a step is one fused Triton launch per bucket of tensors (``_plan.py``,
``_step_kernel.py``); on CPU the same arithmetic runs in plain torch (``_cpu.py``).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import torch

from . import _capturable, _compile, _config, _plan, checkpoint, grid
from ._cpu import cpu_step, cpu_step_rows
from ._plan import local
from .reference import ADAM, ECC_BITS, ECC_DTYPE, mix32_ref

_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr


# A compiled step inside a CUDA graph capture: a capture would record the step on whatever
# tensors the graph hands it (CUDA graph trees pass static copies), where the step's offset
# tables are built on the real .grad pointers. mode="reduce-overhead" never gets here (the
# op's cudagraph_unsafe tag, _compile.py); a torch.cuda.graph of the user's around a
# compiled step does: refused; the package's own capture (capturable=True, eager step).
REDUCE_OVERHEAD_ERROR = (
    "flashoptim: a compiled step() is being captured in a CUDA graph: not supported (a"
    " graph's inputs may be copies of the gradients the step's tables point at). Capture"
    " the eager step instead: capturable=True, static"
    " .grad tensors, one eager step, then torch.cuda.graph around opt.step() (docs/"
    "flashoptim.md, 'Capturable mode and CUDA graphs': 2,050 tensors replay in 0.271 ms"
    " against 1.64 ms eager on an H200)"
)


class NonFiniteGradError(RuntimeError):
    """Raised by ``step()`` when a gradient holds inf/NaN and ``on_nonfinite='raise'``."""


class FlashOptimizer(checkpoint.CheckpointMixin, torch.optim.Optimizer):
    """Base class. Subclasses set ``_kind``, the torch-compatible state names and ``_hp``.

    Common options (also per param group):
        master_weight_bits: 24 (int8 correction, default), 32 (int16) or None (the bf16/fp16
            parameter is the only copy). fp32 parameters always update in fp32.
        quantize: companded 8-bit states (default) or fp32 states.
        stochastic_rounding: round the correction stochastically (default; small updates
            land in expectation) or to nearest (the published scheme).
        scale_dtype: torch.bfloat16 (default; absmax rounded up, range of fp32, 2 bytes
            per group of 32) or torch.float32.
    Optimizer-wide options:
        backend: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch".
        check_finite: check all gradients before the step (default True).
        on_nonfinite: "skip" (count it in ``skipped_steps``, states untouched) or "raise".
        seed: base seed of the stochastic rounding (each parameter derives its own).
        capturable: ``step()`` makes no host sync and no host decision on device data, so it
            can be captured in a ``torch.cuda.CUDAGraph`` after one eager warm-up step. The
            step counts live on device (one per bucket, incremented there), the step's
            scalars (bias corrections, step size, decay, first flag, rounding key) are
            computed on device in float64 and read by the kernel through a pointer, and a
            non-finite gradient skips the step on device (``skipped_steps_device`` counts
            it; the host int ``skipped_steps`` is not updated). ``lr`` may be a 0-dim tensor
            on the parameters' device (LR schedulers fill it in place; a float lr is baked
            into a captured graph). Needs the Triton path, ``on_nonfinite='skip'``, static
            parameters and gradient tensors (no ``zero_grad(set_to_none=True)`` between
            replays). ``state_dict()`` reads the device step counts (one sync).
    """

    _kind = ADAM
    _m_key = "exp_avg"
    _v_key: str | None = "exp_avg_sq"
    _decoupled = True
    # the param_groups order differs from the order the parameters were given in (FlashMuon's
    # split): load_master_weights then refuses a list
    _reordered = False

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        master_weight_bits: int | None = 24,
        quantize: bool = True,
        stochastic_rounding: bool = True,
        scale_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        check_finite: bool = True,
        on_nonfinite: str = "skip",
        seed: int = 0,
        capturable: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        amsgrad: bool = False,
    ):
        # torch.optim's keywords: foreach / fused name torch's kernels (every flashoptim step
        # is one fused multi-tensor launch per bucket: accepted, no effect); maximize flips
        # the gradient's sign inside the kernel; the rest have no meaning here
        if differentiable:
            raise ValueError(
                "differentiable=True is not supported: the step updates quantized states in"
                " place, outside autograd (use torch.optim for differentiable optimizers)"
            )
        if amsgrad:
            raise ValueError(
                "amsgrad=True is not supported: flashoptim keeps no max_exp_avg_sq state"
                " (use torch.optim.AdamW(amsgrad=True))"
            )
        del foreach, fused
        defaults = dict(defaults, maximize=bool(maximize))
        if master_weight_bits not in (None, 24, 32):
            raise ValueError(f"master_weight_bits must be 24, 32 or None; got {master_weight_bits}")
        if scale_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"scale_dtype must be torch.bfloat16 or torch.float32; got {scale_dtype}"
                " (fp16 scales underflow for small momenta)"
            )
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
        if on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise'; got {on_nonfinite!r}")
        if capturable and on_nonfinite == "raise":
            raise ValueError(
                "capturable=True cannot raise on non-finite gradients (that needs a host sync);"
                " use on_nonfinite='skip' and read skipped_steps_device"
            )
        if capturable and backend == "torch":
            raise ValueError("capturable=True needs the Triton kernels (backend 'auto'/'triton')")
        defaults = dict(
            defaults,
            master_weight_bits=master_weight_bits,
            quantize=quantize,
            stochastic_rounding=stochastic_rounding,
            scale_dtype=scale_dtype,
        )
        self.backend = backend
        self.check_finite = check_finite
        self.on_nonfinite = on_nonfinite
        self.seed = int(seed)
        self.skipped_steps = 0  # steps skipped for non-finite gradients (eager mode)
        self.capturable = bool(capturable)
        self._dskip: dict = {}  # capturable: device -> int64 [1] count of skipped steps
        self._dflag: dict = {}  # capturable: device -> int32 [1] non-finite flag of the step
        self._eflag: dict = {}  # eager: device -> int32 [1] epoch of the last bad step
        self._epoch = 0  # eager: the current checked step's mark (never reset by a skip)
        self._plans: dict = {}  # id(group) -> cached plan (tables reused across steps)
        self._release_enabled = False
        self._warned_skip = False
        self._handle = _compile.register(self)  # names it to a compiled graph's step op
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
        except ValueError as e:
            self.param_groups.pop()
            raise ValueError(f"param group {len(self.param_groups)}: {e}") from None
        if not hasattr(self, "_pindex"):
            self._pindex = {}
        gi = len(self.param_groups) - 1
        seen: dict = {}
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                # torch.optim warns and steps such a parameter twice per step; a fused step
                # would apply one update with two gradients' worth of state: refused
                self.param_groups.pop()
                raise ValueError(
                    f"param group {gi}: parameter {i} is parameter {seen[id(p)]} again (shape"
                    f" {tuple(p.shape)}); list each parameter once (tied weights appear once"
                    " in model.parameters())"
                )
            seen[id(p)] = i
        for i, p in enumerate(self.param_groups[-1]["params"]):
            self._pindex.setdefault(id(p), len(self._pindex))
            where = f"parameter {i} of param group {gi}"
            if p.is_complex():
                raise ValueError(f"flashoptim does not support complex parameters ({where})")
            if p.dtype not in _plan.P_CODE:
                raise ValueError(
                    f"{where}: parameter dtype must be fp32, bf16 or fp16; got {p.dtype}"
                )
            if not _plan.dense(local(p)):
                raise _plan.layout_error(local(p), where)
            if hasattr(p, "_local_tensor"):
                _plan.check_placements(p, where)
            if local(p).device.type != "cuda" and not _config.interpret():
                if self.backend == "triton" or self.capturable:
                    what = "backend='triton'" if self.backend == "triton" else "capturable=True"
                    raise ValueError(
                        f"{where} is on {local(p).device.type}: {what} runs the Triton kernels,"
                        " which need CUDA tensors, or TRITON_INTERPRET=1 in the environment"
                        " before triton is imported (Triton's CPU interpreter, for tests);"
                        " on CPU use backend='auto' or 'torch' (and capturable=False)"
                    )

    def _check_group(self, group) -> None:
        """Hyperparameters of a param group (constructor defaults and group dicts alike)."""
        lr = group["lr"]
        if torch.is_tensor(lr):
            if lr.numel() != 1 or not (lr.is_floating_point() or lr.dtype == torch.int64):
                raise ValueError(
                    "lr must be a float or a 1-element floating tensor (0-dim, float64 for a"
                    f" capturable step); got a tensor of shape {tuple(lr.shape)} and dtype"
                    f" {lr.dtype}"
                )
            if lr.device.type != "meta" and not float(lr) >= 0:
                raise ValueError(f"lr must be >= 0; got {float(lr)}")
        elif not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(f"lr must be a float >= 0 or a 1-element tensor; got {lr!r}")
        wd = group.get("weight_decay", 0.0)
        if not wd >= 0:
            raise ValueError(f"weight_decay must be >= 0; got {wd}")
        if group.get("amsgrad"):
            raise ValueError("amsgrad=True is not supported (no max_exp_avg_sq state)")

    # ------------------------------------------------------------------ state
    def _bits(self, group, p) -> int:
        if p.dtype == torch.float32:
            return 0
        return ECC_BITS[group["master_weight_bits"]]

    def _has_mom(self, group) -> bool:
        return True

    def _quantized(self, group, p) -> bool:
        """Whether ``p``'s states are 8-bit codes: the group's ``quantize`` and rows of at
        least one whole group (``grid.py``: a 1-D tensor can be cut anywhere by a shard, so
        it keeps fp32 states under every mesh alike)."""
        return bool(group["quantize"]) and grid.quantizable(p)

    def _state_keys(self, group) -> tuple[str | None, str | None]:
        """The state names of the group's momentum and variance (None: not kept)."""
        return (self._m_key if self._has_mom(group) else None), self._v_key

    def _init_state(self, p: torch.Tensor, group) -> dict:
        st = self.state[p]
        if "step" in st:
            return st
        lp = local(p)
        dev = lp.device
        st["step"] = 0
        # per-parameter seed from its position in the param groups (not the order in which
        # states are created: gradient release creates them in backward order)
        idx = self._pindex.get(id(p), 0)
        st["seed"] = mix32_ref(torch.tensor([(self.seed * 1000003 + idx) & 0xFFFFFFFF])).item()
        quant = self._quantized(group, p)
        m_key, v_key = self._state_keys(group)
        keys = []
        if m_key is not None:
            keys.append((m_key, torch.int8))
        if v_key is not None:
            keys.append((v_key, torch.uint8))
        for key, cdt in keys:
            # every per-element state has the parameter's strides (zeros_like keeps a dense
            # layout): the step runs over memory order, element i of each array the same
            # quantized: codes under <state>_codes (torch.optim's loaders must not take them
            # for moments), the scales of the grid's groups as (rows, groups per row): a
            # shard's rows of the unsharded scale array (grid.py)
            if quant:
                st[key + "_codes"] = torch.zeros_like(lp, dtype=cdt)
                shape = grid.scale_shape(lp)
                st[key + "_scale"] = torch.zeros(shape, dtype=group["scale_dtype"], device=dev)
            else:
                st[key] = torch.zeros_like(lp, dtype=torch.float32)
        bits = self._bits(group, p)
        if bits:
            st["correction"] = torch.zeros_like(lp, dtype=ECC_DTYPE[bits])
        return st

    def _state_view(self, st, group) -> dict:
        """A parameter's state under the kernel's array names (c, m, ms, v, vs)."""
        sd = {}
        m_key, v_key = self._state_keys(group)
        for key, a in ((m_key, "m"), (v_key, "v")):
            if key is not None and (key in st or key + "_codes" in st):
                sd[a] = st[key + "_codes"] if key + "_codes" in st else st[key]
                sd[a + "s"] = st.get(key + "_scale")
        if "correction" in st:
            sd["c"] = st["correction"]
        return sd

    def _hp(self, group, p) -> dict:
        raise NotImplementedError

    def _common_hp(self, group, p) -> dict:
        return dict(
            ecc=self._bits(group, p),
            quant=self._quantized(group, p),
            sr=bool(group["stochastic_rounding"]),
            scale_dtype=group["scale_dtype"],
            lr=group["lr"]
            if self.capturable and torch.is_tensor(group["lr"])
            else float(group["lr"]),
            wd=float(group["weight_decay"]),
            decoupled=self._decoupled,
            maximize=bool(group.get("maximize", False)),
        )

    # ------------------------------------------------------------------ step
    def _use_triton(self, t: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            return True
        return t.is_cuda

    def _grads_of(self, group) -> tuple[list, list, tuple | None]:
        """(parameters with a gradient, their gradients, the gradients' ``data_ptr()`` or
        None) of a group: one read of every ``.grad`` and one ``data_ptr()`` per step
        (C-level ``map``: with thousands of tensors these reads are the host's step time).
        The addresses double as the check that every parameter has a gradient (a None
        raises TypeError); None when some has none or a gradient has no plain storage."""
        params = group["params"]
        grads = list(map(_GRAD, params))
        try:
            return params, grads, tuple(map(_DATA_PTR, grads))
        except (TypeError, RuntimeError):
            pass
        if any(map(operator.is_, grads, repeat(None))):
            ps = [p for p, g in zip(params, grads) if g is not None]
            return ps, [g for g in grads if g is not None], None
        return params, grads, None

    def _nonfinite(self, preps, flags: dict | None = None, mark: int = 1) -> bool:
        """One check for the whole step: a Triton pre-pass per bucket writing one flag per
        device, then a single host sync; ``torch.isfinite`` for CPU-path tensors. With
        ``flags`` (the step kernels read them on device) only the pre-passes run, no sync.
        ``mark``: the value the pre-pass writes into a flag (the step's epoch, or 1).
        Sharded (DTensor) parameters: the decision is the maximum over all ranks of their
        meshes (a non-finite gradient element lies in one rank's shard; every rank skips)."""
        on_device = flags is not None
        flags = {} if flags is None else flags
        cpu_ps = []
        for prep in preps:
            for b in prep["buckets"]:
                ent = b["ent"]
                if ent is None:
                    cpu_ps += b["ps"]
                    continue
                dev = ent["tab"].device
                if dev not in flags:
                    flags[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
                _plan.launch_prepass(ent, flags[dev], mark)
        meshes = _meshes(preps)
        if on_device:
            for f in flags.values():
                _plan.all_ranks_max_(f, meshes)
            return False
        bad = any(not bool(torch.isfinite(local(p.grad)).all()) for p in cpu_ps)
        bad = bad or sum(f.to("cpu", non_blocking=False).item() for f in flags.values()) > 0
        if meshes:
            t = torch.tensor([int(bad)], dtype=torch.int32, device=_plan.mesh_device(meshes[0]))
            _plan.all_ranks_max_(t, meshes)
            bad = bool(t.item())
        return bad

    def _skip(self) -> None:
        """Account for a step not taken because of a non-finite gradient."""
        if self.on_nonfinite == "raise":
            raise NonFiniteGradError("non-finite gradient: step not taken")
        self.skipped_steps += 1
        if not self._warned_skip:
            self._warned_skip = True
            step = max((st.get("step", 0) for st in self.state.values()), default=0) + 1
            warnings.warn(
                f"flashoptim: a gradient holds inf/NaN: step {step} was skipped (parameters and"
                " states unchanged). Later skips are only counted in optimizer.skipped_steps;"
                " on_nonfinite='raise' raises instead",
                RuntimeWarning,
                stacklevel=3,
            )

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        if torch.compiler.is_compiling():  # one custom op in the graph (_compile.py)
            if closure is not None:
                raise ValueError("flashoptim: a compiled step() takes no closure")
            _compile.traced_step(self)
            return None
        return self._step(closure)

    def _step_from_graph(self, index: list, params: list, grads: list) -> None:
        """The compiled graph's step op: step the parameters at ``index`` with the gradients
        the graph computed (set as their ``.grad``); ``params`` may be copies the graph
        passes (functionalization), which then receive the updated values."""
        if _plan.capturing():
            raise RuntimeError(REDUCE_OVERHEAD_ERROR)
        allp = [p for g in self.param_groups for p in g["params"]]
        orig = [allp[i] for i in index]
        with torch.no_grad():
            for p, g in zip(orig, grads, strict=True):
                if p.grad is not g:
                    p.grad = g
            self._step(None)
            for q, p in zip(params, orig, strict=True):
                if q is not p and q.data_ptr() != p.data_ptr():
                    q.copy_(p)

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        preps = []
        for g in self.param_groups:
            ps, gs, ptrs = self._grads_of(g)
            if ps:
                preps.append(self._prepare(g, ps, grads=gs, gptrs=ptrs))
        if self.capturable:
            _capturable.step_on_device(self, preps)
            return loss
        if self.check_finite and self._checked_on_device(preps):
            self._step_checked_on_device(preps)
            return loss
        if self.check_finite and self._nonfinite(preps):
            self._skip()
            return loss
        for prep in preps:
            self._commit(prep)
        return loss

    @staticmethod
    def _checked_on_device(preps) -> bool:
        """Cached plans whose buckets all run the Triton kernel: the step kernels read the
        pre-pass's device flag themselves, so the host syncs once, after the launches."""
        return all(
            prep["plan"] is not None and all(b["ent"] is not None for b in prep["buckets"])
            for prep in preps
        )

    def _step_checked_on_device(self, preps) -> None:
        """Pre-pass (a persistent device flag per device, a new epoch per checked step: no
        memset), then every step kernel with that flag (each returns at once when it holds
        this epoch, so nothing is written), then one sync. On a non-finite gradient the host
        step counts ``_commit`` advanced are taken back."""
        if self._epoch >= 2**31 - 2:
            for f in self._eflag.values():
                f.zero_()
            self._epoch = 0
        self._epoch += 1
        flags: dict = {}
        for prep in preps:
            for b in prep["buckets"]:
                dev = b["ent"]["tab"].device
                if dev not in self._eflag:
                    self._eflag[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
                flags[dev] = self._eflag[dev]
        self._nonfinite(preps, flags, self._epoch)
        for prep in preps:
            self._commit(prep, skip=flags)
        if any(f.to("cpu", non_blocking=False).item() == self._epoch for f in flags.values()):
            for prep in preps:  # undo the step counts _commit advanced
                plan = prep["plan"]
                for st in plan["states"]:
                    st["step"] -= 1
                plan["step"] -= 1
            self._skip()

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Step one parameter (used by gradient release); honours check_finite."""
        if p.grad is None:
            return
        if self.capturable:
            raise ValueError("gradient release (step_param) is not supported with capturable=True")
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                prep = self._prepare(group, [p], cache=False)
                if self.check_finite and self._nonfinite([prep]):
                    self._skip()
                    return
                self._plans.pop(id(group), None)
                self._commit(prep)
                return
        raise ValueError("parameter is not managed by this optimizer")

    def _prepare(self, group, ps, cache: bool = True, grads: list | None = None, gptrs=None):
        """Buckets and offset tables for this step; no state changes (a skipped step must
        leave everything as it was). ``grads`` / ``gptrs``: ``[p.grad for p in ps]`` and
        their ``data_ptr()`` when the caller has read them already. A cached plan is reused
        when the parameters are the same objects and every gradient is at the same address
        (the host's per-step cost with thousands of tensors: one ``.grad`` read and one
        ``data_ptr`` per parameter), or rebased when only the gradient tensors changed."""
        plan = self._plans.get(id(group)) if cache else None
        if plan is not None and plan["n"] == len(ps) and all(map(operator.is_, plan["ps"], ps)):
            gs = list(map(_GRAD, ps)) if grads is None else grads
            if plan["dt"]:
                gs = list(map(local, gs))
                gptrs = None
            if gptrs is None:
                gptrs = tuple(map(_DATA_PTR, gs))
            if gptrs == plan["gptrs"]:
                return dict(group=group, plan=plan, buckets=plan["buckets"], cache=cache)
            if not self.capturable and _plan.rebase_grads(plan, gs, gptrs):
                plan["gptrs"] = gptrs
                return dict(group=group, plan=plan, buckets=plan["buckets"], cache=cache)
        if self.capturable:
            _capturable.drop_plan(self, group)
        buckets: dict = {}
        for p in ps:
            if p.grad.is_sparse:
                raise ValueError("flashoptim does not support sparse gradients")
            lp = local(p)
            if not lp.is_contiguous() or local(p.grad).stride() != lp.stride():
                self._match_layout(p, group)
            st = self._init_state(p, group)
            quant = self._quantized(group, p)
            rows = quant and grid.split(p)  # each row its own table entry (grid.py)
            key = (
                st["step"],
                p.dtype,
                p.grad.dtype,
                lp.device,
                self._use_triton(p),
                (grid.row_len(p) if rows else lp.numel()) % 16 == 0,
                quant,
                rows,
            )
            buckets.setdefault(key, []).append(p)
        out = []
        for key, bps in buckets.items():
            out += self._bucket_entries(group, key, bps)
        if self.capturable:
            return _capturable.device_plan(self, group, ps, out, cache)
        return dict(group=group, plan=None, buckets=out, cache=cache, ps=ps)

    def _match_layout(self, p, group) -> None:
        """A strided (channels_last, transposed) parameter: it must be dense, and its gradient
        gets the parameter's strides (autograd's gradients have them already; another layout
        is copied into one, in ``p.grad``, once)."""
        lp, lg = local(p), local(p.grad)
        if not _plan.dense(lp):
            i = next(i for i, q in enumerate(group["params"]) if q is p)
            raise _plan.layout_error(lp, f"parameter {i} of its param group")
        if lg.stride() != lp.stride():
            if hasattr(p.grad, "_local_tensor"):
                raise ValueError("a DTensor gradient must have its parameter's strides")
            p.grad = torch.empty_like(lp, dtype=lg.dtype).copy_(lg)

    def _bucket_entries(self, group, key: tuple, bps: list) -> list[dict]:
        """The launch units of one bucket (``key``: step count, dtypes, device, Triton or
        not, numel % 16 == 0): its parameters with their offset and work tables (None on the
        CPU path) and step count; one unit per bucket."""
        ent = None
        if key[4]:
            sts = [self._state_view(self.state[p], group) for p in bps]
            ent = _plan.build_table(bps, sts, [self.state[p]["seed"] for p in bps], rows=key[7])
        return [dict(ps=bps, ent=ent, step=key[0], rows=key[7])]

    def _step_bucket(self, group, b: dict, hp: dict, step: int, skip=None) -> None:
        """Step one unit of ``_bucket_entries``: its kernel launch (``skip``: the device
        non-finite flag it checks), or the CPU path per parameter."""
        if b["ent"] is not None:
            self._launch(b["ent"], group, hp, step, skip=skip)
            return
        run = cpu_step_rows if b.get("rows") else cpu_step
        for p in b["ps"]:
            st = self.state[p]
            sv = self._state_view(st, group)
            args = (self._kind, local(p), local(p.grad), sv, hp, step, st["seed"])
            run(*args, _plan.global_index_base(p))

    def _commit(self, prep, skip: dict | None = None) -> None:
        """Launch (or run on the CPU path) the step of every bucket of ``prep`` and advance
        the step counts; an uncached step whose buckets all run the kernel at one step count
        leaves a cached plan."""
        group = prep["group"]
        plan = prep["plan"]
        if plan is not None:  # fast path: one step count for all, cached tables
            step = plan["step"] + 1
            for b in plan["buckets"]:  # hp per bucket: ecc depends on the parameter dtype
                flag = None if skip is None else skip[b["ent"]["tab"].device]
                self._step_bucket(group, b, self._hp(group, b["ps"][0]), step, skip=flag)
            # the host counts after the launches: this loop (one dict update per parameter)
            # runs while the device steps, before the caller's sync
            plan["step"] = step
            for st in plan["states"]:
                st["step"] += 1
            return
        for b in prep["buckets"]:
            step = b["step"] + 1
            hp = self._hp(group, b["ps"][0])
            for p in b["ps"]:
                self.state[p]["step"] = step
            self._step_bucket(group, b, hp, step)
        bs = prep["buckets"]
        steps = {b["step"] for b in bs}
        if prep["cache"] and all(b["ent"] is not None for b in bs) and len(steps) == 1:
            ps = prep["ps"]
            _plan.index_buckets(ps, bs)
            self._plans[id(group)] = dict(
                n=len(ps),
                ps=list(ps),
                dt=any(hasattr(p, "_local_tensor") for p in ps),
                gptrs=tuple(local(p.grad).data_ptr() for p in ps),
                states=[self.state[p] for p in ps],
                step=steps.pop() + 1,
                buckets=bs,
            )

    def _launch(self, ent, group, hp, step, scal=None, skip=None) -> None:
        """The bucket's step kernel; ``scal`` (capturable): the device scalars, read by the
        kernel through its ``lr`` argument; ``skip``: the device non-finite flag."""
        if scal is None:
            scalars = _plan.scalar_args(self._kind, hp, step)
        else:  # the kernel reads them through ``lr``, a pointer; the rest are placeholders
            scalars = (scal,) + (0.0,) * 10 + (0, 0)
        flags = _plan.mode_flags(self._kind, ent, hp, self._has_mom(group))
        flags["SCALARS_ON_DEVICE"] = scal is not None
        _plan.launch_step(ent, scalars, flags, skip, self._epoch)

    # the per-step caches (plans with offset tables, device flags) are not part of the state:
    # a copy (copy.deepcopy, pickle) starts without them and rebuilds them on its first step
    _CACHES = ("_plans", "_dskip", "_dflag", "_eflag")

    def __getstate__(self) -> dict:
        if self.capturable and self._plans:
            self.sync_steps()  # the device step counts into state["step"]
        d = super().__getstate__()  # defaults, state, param_groups
        for k, v in self.__dict__.items():  # our options and counters, not torch's hooks
            if k not in d and not k.startswith("_optimizer_") and k not in self._CACHES:
                d[k] = v
        d.pop("_pindex", None)  # ids of the old parameters: rebuilt from param_groups
        d.pop("_handle", None)  # the copy gets its own
        return d

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for k in self._CACHES:
            if not isinstance(self.__dict__.get(k), dict):
                self.__dict__[k] = {}
        self._epoch = 0
        self._warned_skip = self.__dict__.get("_warned_skip", False)
        self._handle = _compile.register(self)
        self._pindex = {}
        for g in self.param_groups:
            for p in g["params"]:
                self._pindex.setdefault(id(p), len(self._pindex))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ capturable mode
    def sync_steps(self) -> None:
        """Capturable mode: bring every ``state[p]["step"]`` up to date from the device step
        counts (one host sync; not during a capture). ``state_dict()`` calls it."""
        _capturable.sync_steps(self)

    @property
    def skipped_steps_device(self) -> torch.Tensor | None:
        """Capturable mode: int64 [1] device count of steps skipped for non-finite gradients
        since construction or the last load_state_dict (``skipped_steps`` stays a host int
        that only eager mode updates). None before the first capturable step."""
        if not self._dskip:
            return None
        ts = list(self._dskip.values())
        return ts[0] if len(ts) == 1 else sum(t.to(ts[0].device) for t in ts)


def _meshes(preps) -> list:
    """The device meshes of the steps' DTensor parameters (cached on a plan)."""
    out: list = []
    for prep in preps:
        plan = prep["plan"]
        if plan is not None:
            if "meshes" not in plan:
                plan["meshes"] = _plan.meshes_of(plan["ps"]) if plan["dt"] else []
            ms = plan["meshes"]
        else:
            ms = _plan.meshes_of(p for b in prep["buckets"] for p in b["ps"])
        out += [m for m in ms if all(m is not x for x in out)]
    return out
