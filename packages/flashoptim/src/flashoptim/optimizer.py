"""``FlashOptimizer``: the base class of every flashoptim optimizer (state, the step,
capturable mode; checkpoints in ``checkpoint.py``). The per-optimizer modules
(``adamw.py``, ``sgd.py``, ``lion.py``) only name their kind, their state and their
hyperparameters.

On CUDA a step is one fused Triton launch per bucket of tensors (``_plan.py``,
``_step_kernel.py``); on CPU the same arithmetic runs in plain torch (``_cpu.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import torch

from . import _capturable, _plan, checkpoint
from ._cpu import cpu_step
from ._plan import local
from .reference import ADAM, ECC_BITS, ECC_DTYPE, GROUP, mix32_ref

_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr


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
    ):
        if defaults.get("lr", 0.0) < 0:
            raise ValueError(f"lr must be >= 0; got {defaults['lr']}")
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
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if not hasattr(self, "_pindex"):
            self._pindex = {}
        for p in self.param_groups[-1]["params"]:
            self._pindex.setdefault(id(p), len(self._pindex))
            if p.is_complex():
                raise ValueError("flashoptim does not support complex parameters")
            if p.dtype not in _plan.P_CODE:
                raise ValueError(f"parameter dtype must be fp32, bf16 or fp16; got {p.dtype}")

    # ------------------------------------------------------------------ state
    def _bits(self, group, p) -> int:
        if p.dtype == torch.float32:
            return 0
        return ECC_BITS[group["master_weight_bits"]]

    def _has_mom(self, group) -> bool:
        return True

    def _init_state(self, p: torch.Tensor, group) -> dict:
        st = self.state[p]
        if "step" in st:
            return st
        lp = local(p)
        n = lp.numel()
        ng = (n + GROUP - 1) // GROUP
        dev = lp.device
        st["step"] = 0
        # per-parameter seed from its position in the param groups (not the order in which
        # states are created: gradient release creates them in backward order)
        idx = self._pindex.get(id(p), 0)
        st["seed"] = mix32_ref(torch.tensor([(self.seed * 1000003 + idx) & 0xFFFFFFFF])).item()
        quant = group["quantize"]
        keys = []
        if self._has_mom(group):
            keys.append((self._m_key, torch.int8))
        if self._v_key is not None:
            keys.append((self._v_key, torch.uint8))
        for key, cdt in keys:
            if quant:
                st[key] = torch.zeros(lp.shape, dtype=cdt, device=dev)
                st[key + "_scale"] = torch.zeros(ng, dtype=group["scale_dtype"], device=dev)
            else:
                st[key] = torch.zeros(lp.shape, dtype=torch.float32, device=dev)
        bits = self._bits(group, p)
        if bits:
            st["correction"] = torch.zeros(lp.shape, dtype=ECC_DTYPE[bits], device=dev)
        return st

    def _state_view(self, st, group) -> dict:
        """A parameter's state under the kernel's array names (c, m, ms, v, vs)."""
        sd = {}
        if self._m_key in st:
            sd["m"] = st[self._m_key]
            sd["ms"] = st.get(self._m_key + "_scale")
        if self._v_key is not None:
            sd["v"] = st[self._v_key]
            sd["vs"] = st.get(self._v_key + "_scale")
        if "correction" in st:
            sd["c"] = st["correction"]
        return sd

    def _hp(self, group, p) -> dict:
        raise NotImplementedError

    def _common_hp(self, group, p) -> dict:
        return dict(
            ecc=self._bits(group, p),
            quant=bool(group["quantize"]),
            sr=bool(group["stochastic_rounding"]),
            scale_dtype=group["scale_dtype"],
            lr=group["lr"]
            if self.capturable and torch.is_tensor(group["lr"])
            else float(group["lr"]),
            wd=float(group["weight_decay"]),
            decoupled=self._decoupled,
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
        ``mark``: the value the pre-pass writes into a flag (the step's epoch, or 1)."""
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
        if on_device:
            return False
        for p in cpu_ps:
            g = local(p.grad)
            if not bool(torch.isfinite(g).all()):
                return True
        return sum(f.to("cpu", non_blocking=False).item() for f in flags.values()) > 0

    def _skip(self) -> None:
        """Account for a step not taken because of a non-finite gradient."""
        if self.on_nonfinite == "raise":
            raise NonFiniteGradError("non-finite gradient: step not taken")
        self.skipped_steps += 1

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
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
            st = self._init_state(p, group)
            lp = local(p)
            key = (
                st["step"],
                p.dtype,
                p.grad.dtype,
                lp.device,
                self._use_triton(p),
                lp.numel() % 16 == 0,
            )
            buckets.setdefault(key, []).append(p)
        out = []
        for key, bps in buckets.items():
            ent = None
            if key[4]:
                sts = [self._state_view(self.state[p], group) for p in bps]
                ent = _plan.build_table(bps, sts, [self.state[p]["seed"] for p in bps])
            out.append(dict(ps=bps, ent=ent, step=key[0]))
        if self.capturable:
            return _capturable.device_plan(self, group, ps, out, cache)
        return dict(group=group, plan=None, buckets=out, cache=cache, ps=ps)

    def _commit(self, prep, skip: dict | None = None) -> None:
        """Launch (or run on the CPU path) the step of every bucket of ``prep`` and advance
        the step counts; an uncached step whose buckets all run the kernel at one step count
        leaves a cached plan."""
        group = prep["group"]
        plan = prep["plan"]
        if plan is not None:  # fast path: one step count for all, cached tables
            step = plan["step"] + 1
            for b in plan["buckets"]:  # hp per bucket: ecc depends on the parameter dtype
                ent = b["ent"]
                flag = None if skip is None else skip[ent["tab"].device]
                self._launch(ent, group, self._hp(group, b["ps"][0]), step, skip=flag)
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
            if b["ent"] is not None:
                self._launch(b["ent"], group, hp, step)
                continue
            for p in b["ps"]:
                st = self.state[p]
                sv = self._state_view(st, group)
                cpu_step(
                    self._kind,
                    local(p),
                    local(p.grad),
                    sv,
                    hp,
                    step,
                    st["seed"],
                    _plan.global_index_base(p),
                )
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
