"""FlashAdamW, FlashAdam, FlashSGD, FlashSGDW, FlashLion: torch.optim optimizers with weight
splitting (bf16 parameter + int8/int16 correction) and companded 8-bit states.

See ``_core.py`` for the storage formats and the arithmetic, ``docs/flashoptim.md`` for the
math. On CUDA every step is one fused Triton launch per bucket of tensors (same dtype and
hyperparameters); on CPU the same arithmetic runs in plain torch.
"""

from __future__ import annotations

import array
import math
import operator
import os
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import torch

from . import _core
from ._core import ADAM, GROUP, LION, SGD

BLOCK = int(os.environ.get("FLASHOPTIM_BLOCK", "1024"))
NUM_WARPS = int(os.environ.get("FLASHOPTIM_NUM_WARPS", "4"))
_P_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# C-level getters for the per-step passes over thousands of parameters (``map``, no
# Python frame per tensor)
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_GET_DEVICE = torch.Tensor.get_device
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
# v4 with on_nonfinite="skip": resolve the device non-finite flag lazily (a non-blocking copy
# read at the next step / skipped_steps / state_dict) instead of a host sync in every step.
# Opt-in (FLASHOPTIM_LAZY_SKIP=1 or ``opt._lazy_skip = True``) until the GPU has measured it.
_LAZY_SKIP = os.environ.get("FLASHOPTIM_LAZY_SKIP", "0") == "1"
# v4: the leaner tile math (fewer instructions per element, same bits as the default math
# with the explicit-fma LEAN_PIN bit; _core._tile_update_v3 LEAN). The default since the H200
# run of 2026-12-01 evening (537M AdamW at BLOCK 2048 / 4 warps: 1.736 vs 1.959 ms without
# the finiteness check, 1.980 vs 2.175 with it, bitwise equal; NOTES.md); FLASHOPTIM_LEAN=0
# or ``opt._lean = False`` selects the previous math.
_LEAN = os.environ.get("FLASHOPTIM_LEAN", "1") != "0"


def _lean_parts(lean: bool, override: int | None) -> int:
    """v4's PARTS bits (``_core.LEAN_*``; GPU only): ``opt._lean_parts`` if set, else
    FLASHOPTIM_LEAN_PARTS (read at every launch, e.g. ``0x1f``), else all parts when lean and
    none at LEAN 0. At LEAN 0 only ``LEAN_PIN`` (explicit fma, changes the default's bits)
    counts."""
    if override is None:
        env = os.environ.get("FLASHOPTIM_LEAN_PARTS", "")
        override = int(env, 0) if env else None
    parts = (_core.LEAN_ALL if lean else 0) if override is None else int(override)
    return parts & _core.LEAN_ALL if lean else parts & _core.LEAN_PIN


def _v2_autotune(dev: torch.device) -> bool:
    """Autotune v2 on CUDA unless FLASHOPTIM_NO_AUTOTUNE=1 (read at every launch)."""
    return (
        dev.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("FLASHOPTIM_NO_AUTOTUNE", "0") != "1"
    )


_SMS: dict = {}


def _use_asm(dev: torch.device) -> bool:
    """v3's inline PTX: on CUDA, never under the interpreter (it cannot run inline asm)."""
    return dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 1
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _capturing() -> bool:
    """Whether a CUDA graph capture is in progress on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# The Triton step kernel used unless ``kernel=`` or FLASHOPTIM_KERNEL says otherwise (v4 since
# 2026-12-01: H200, same process, 537M AdamW with the check 2.507 -> 2.155 ms, SGD 1.59 ->
# 1.50, 2,050 tensors 1.44 -> 1.39; packages/flashoptim/NOTES.md).
DEFAULT_KERNEL = "v4"


class NonFiniteGradError(RuntimeError):
    """Raised by ``step()`` when a gradient holds inf/NaN and ``on_nonfinite='raise'``."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameter or gradient), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _index_buckets(ps: list, buckets: list) -> None:
    """A plan's buckets get ``idx``: their parameters' positions in ``ps`` (for the
    gradient rebase); a single bucket holding every parameter in order needs none."""
    if len(buckets) == 1 and len(buckets[0]["ps"]) == len(ps):
        buckets[0]["idx"] = None
        return
    pos = {id(p): i for i, p in enumerate(ps)}
    for b in buckets:
        b["idx"] = [pos[id(p)] for p in b["ps"]]


def _global_index_base(p: torch.Tensor) -> int:
    """Flat index of the first local element in the full tensor (DTensor Shard(0) only)."""
    if not hasattr(p, "_local_tensor"):
        return 0
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        stride = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        return int(off[0]) * stride if p.dim() else 0
    except Exception:  # pragma: no cover - older torch / exotic placements
        return 0


class FlashOptimizer(torch.optim.Optimizer):
    """Base class. Subclasses set ``_kind`` and the torch-compatible state names.

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
        kernel: Triton step kernel, default ``DEFAULT_KERNEL`` = "v4" (or the environment
            variable FLASHOPTIM_KERNEL): v3's element math over chunks of 8,192 elements with
            an L2 prefetch of the coming tiles (a tuning choice) and a per-step epoch in one
            persistent non-finite flag (no flag memset per step); H200 2026-12-01, same
            process: 537M params 2.16 ms with the finiteness check against v3's 2.51. "v3"
            (v2's unit table and persistent grid with cheaper element math: approximate
            reciprocals, floor-and-convert by one rounded add, a finiteness pre-pass whose
            device flag the step kernels read), "v2" (aligned int32 indexing over a unit
            table, persistent grid, autotuned on CUDA) or "v1". They compute the same codes,
            scales and rounding (bitwise under the interpreter; on the GPU v3/v4's
            approximate reciprocal can move a tie by one code, as the GPU already may against
            the CPU path). FLASHOPTIM_NO_AUTOTUNE=1 runs v2/v3/v4 with their single default
            config.
        capturable: ``step()`` makes no host sync and no host decision on device data, so it
            can be captured in a ``torch.cuda.CUDAGraph`` after one eager warm-up step. The
            step counts live on device (one per bucket, incremented there), the step's
            scalars (bias corrections, step size, decay, first flag, rounding key) are
            computed on device in float64 and read by the kernels through a pointer, and a
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
        kernel: str | None = None,
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
        kernel = kernel or os.environ.get("FLASHOPTIM_KERNEL") or DEFAULT_KERNEL
        if kernel not in ("v1", "v2", "v3", "v4"):
            raise ValueError(f"kernel must be 'v1', 'v2', 'v3' or 'v4'; got {kernel!r}")
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
        self.kernel = kernel
        self.check_finite = check_finite
        self.on_nonfinite = on_nonfinite
        self.seed = int(seed)
        self.skipped_steps = 0
        self.capturable = bool(capturable)
        self._dskip: dict = {}  # capturable: device -> int64 [1] count of skipped steps
        self._dflag: dict = {}  # capturable: device -> int32 [1] non-finite flag of the step
        self._eflag: dict = {}  # v4 eager: device -> int32 [1] epoch of the last bad step
        self._epoch = 0  # v4 eager: the current checked step's mark (never reset by a skip)
        self._lazy_skip = _LAZY_SKIP
        self._lean = _LEAN
        self._lean_parts = None  # None: FLASHOPTIM_LEAN_PARTS or the default (_lean_parts)
        self._pending = None  # lazy skip: (event, host flag values, mark, plans) of a step
        self._plans: dict = {}
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
            if p.dtype not in _P_CODE:
                raise ValueError(f"parameter dtype must be fp32, bf16 or fp16; got {p.dtype}")

    # ------------------------------------------------------------------ state
    def _bits(self, group, p) -> int:
        if p.dtype == torch.float32:
            return 0
        return _core._ECC_BITS[group["master_weight_bits"]]

    def _has_mom(self, group) -> bool:
        return True

    def _init_state(self, p: torch.Tensor, group) -> dict:
        st = self.state[p]
        if "step" in st:
            return st
        lp = _local(p)
        n = lp.numel()
        ng = (n + GROUP - 1) // GROUP
        dev = lp.device
        st["step"] = 0
        # per-parameter seed from its position in the param groups (not the order in which
        # states are created: gradient release creates them in backward order)
        idx = self._pindex.get(id(p), 0)
        st["seed"] = _core._mix32_t(torch.tensor([(self.seed * 1000003 + idx) & 0xFFFFFFFF])).item()
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
            st["correction"] = torch.zeros(lp.shape, dtype=_core._ECC_DTYPE[bits], device=dev)
        return st

    def _hp(self, group, p) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ step
    def _use_triton(self, t: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            return True
        return t.is_cuda

    def _grads(self, group):
        return [p for p in group["params"] if p.grad is not None]

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

    def _found_nonfinite_torch(self, params) -> bool:
        bad = False
        for p in params:
            g = _local(p.grad)
            if g.is_sparse:
                raise ValueError("flashoptim does not support sparse gradients")
            bad = bad or not bool(torch.isfinite(g).all())
        return bad

    def _nonfinite(self, preps, flags: dict | None = None, mark: int = 1) -> bool:
        """One check for the whole step: a Triton pre-pass per bucket writing one flag per
        device, then a single host sync; torch.isfinite for CPU-path tensors. With ``flags``
        (capturable: zeroed persistent device flags) only the pre-passes run, no sync.
        ``mark``: the value a v4 pre-pass writes into the flag (its epoch; 1 elsewhere)."""
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
                nb = ent["work"].shape[0]
                if nb and ent["use_v2"] and self.kernel == "v4":
                    w = _core.V4_PREPASS_WAVES
                    nsub = nb * (_core.V4_UNIT // _core.V4_PREPASS_SUB)
                    nprog = min(nsub, _num_sms(dev) * w) if dev.type == "cuda" else min(nsub, 3)
                    _core._nonfinite_kernel_v4[(nprog,)](
                        ent["work"],
                        nb,
                        ent["tab"],
                        ent["bases"][1],
                        flags[dev],
                        mark,
                        ALIGNED=ent["aligned"],
                        N16=ent["n16"],
                        G_DTYPE=_P_CODE[ent["bases"][1].dtype],
                        UNIT=_core.V4_UNIT,
                        SUB=_core.V4_PREPASS_SUB,
                        BLOCK=1024,
                        num_warps=4,
                    )
                elif nb and ent["use_v2"] and self.kernel == "v3":
                    w = _core.V3_PREPASS_WAVES  # persistent: programs per SM
                    nprog = min(nb, _num_sms(dev) * w) if dev.type == "cuda" else min(nb, 3)
                    _core._nonfinite_kernel_v3[(nprog,)](
                        ent["work"],
                        nb,
                        ent["tab"],
                        ent["bases"][1],
                        flags[dev],
                        ALIGNED=ent["aligned"],
                        N16=ent["n16"],
                        G_DTYPE=_P_CODE[ent["bases"][1].dtype],
                        UNIT=_core.V2_UNIT,
                        BLOCK=1024,
                        num_warps=4,
                    )
                elif nb and ent["use_v2"]:
                    _core._nonfinite_kernel_v2[(nb,)](
                        ent["work"],
                        nb,
                        ent["tab"],
                        ent["bases"][1],
                        flags[dev],
                        ALIGNED=ent["aligned"],
                        N16=ent["n16"],
                        UNIT=_core.V2_UNIT,
                        BLOCK=1024,
                        num_warps=4,
                    )
                elif nb:
                    _core._nonfinite_kernel[(nb,)](
                        ent["work"],
                        ent["tab"],
                        ent["bases"][1],
                        flags[dev],
                        ALIGNED=ent["aligned"],
                        N16=ent["n16"],
                        BLOCK=BLOCK,
                        GROUP_SIZE=GROUP,
                        num_warps=NUM_WARPS,
                    )
        if on_device:
            return False
        if cpu_ps and self._found_nonfinite_torch(cpu_ps):
            return True
        if not flags:
            return False
        total = sum(f.to("cpu", non_blocking=False).item() for f in flags.values())
        return total > 0

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # lazy skip: a pending flag of the previous step is read after this step's host
        # work and pre-pass launch (its copy lands meanwhile); ``_prepare`` reads it first
        # when a plan must be rebuilt (that reads the step counts)
        preps = []
        for g in self.param_groups:
            ps, gs, ptrs = self._grads_of(g)
            if ps:
                preps.append(self._prepare(g, ps, grads=gs, gptrs=ptrs))
        if self.capturable:
            self._step_on_device(preps)
            return loss
        if self.check_finite and self._deferred_check(preps):
            return self._step_checked_on_device(preps, loss)
        self._resolve_pending()
        if self.check_finite and self._nonfinite(preps):
            if self.on_nonfinite == "raise":
                raise NonFiniteGradError("non-finite gradient: step not taken")
            self.skipped_steps += 1
            return loss
        for prep in preps:
            self._commit(prep)
        return loss

    def _deferred_check(self, preps) -> bool:
        """v3 with cached plans whose buckets all run the v3 kernel: the step kernels read
        the pre-pass's device flag themselves, so the host syncs once after the launches."""
        return self.kernel in ("v3", "v4") and all(
            prep["plan"] is not None
            and all(b["ent"] is not None and b["ent"]["use_v2"] for b in prep["buckets"])
            for prep in preps
        )

    def _step_checked_on_device(self, preps, loss):
        """Pre-pass (device flag), then every step kernel with that flag (each returns at
        once when it is set, so nothing is written), then one sync. On a non-finite
        gradient the host step counts advanced by ``_commit`` are taken back."""
        flags: dict = {}
        mark = 1
        if self.kernel == "v4":  # persistent flags, a new epoch per checked step: no memset
            if self._epoch >= 2**31 - 2:
                for f in self._eflag.values():
                    f.zero_()
                self._epoch = 0
            self._epoch += 1
            mark = self._epoch
            for prep in preps:
                for b in prep["buckets"]:
                    dev = b["ent"]["tab"].device
                    if dev not in self._eflag:
                        self._eflag[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
                    flags[dev] = self._eflag[dev]
        self._nonfinite(preps, flags, mark)
        self._resolve_pending()  # lazy skip: the previous step's counts, before this step's
        for prep in preps:
            self._commit(prep, skip=flags)
        if not flags:
            return loss
        plans = [prep["plan"] for prep in preps]
        if (
            self.kernel == "v4"
            and self._lazy_skip
            and self.on_nonfinite == "skip"
            and len(flags) == 1
        ):
            (f,) = flags.values()
            if f.is_cuda:  # the flag's value reaches pinned host memory with the stream
                host = torch.empty(1, dtype=torch.int32, pin_memory=True)
                host.copy_(f, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            else:
                host, ev = f.clone(), None
            self._pending = (ev, host, mark, plans)
            return loss
        vals = [f.to("cpu", non_blocking=False).item() for f in flags.values()]
        bad = any(v == mark for v in vals) if self.kernel == "v4" else sum(vals) > 0
        if bad:
            self._take_back(plans)
            if self.on_nonfinite == "raise":
                raise NonFiniteGradError("non-finite gradient: step not taken")
            self.skipped_steps += 1
        return loss

    @staticmethod
    def _take_back(plans) -> None:
        """A skipped step: undo the step counts ``_commit`` advanced on the host."""
        for plan in plans:
            for st in plan["states"]:
                st["step"] -= 1
            plan["step"] -= 1

    def _resolve_pending(self) -> None:
        """Lazy skip (v4): read the previous step's flag (its copy was enqueued after that
        step's kernels; by the next step it has long landed) and, if that step was skipped,
        take back its step counts and count it. Called by every step before its step
        kernels' launch (after its pre-pass launch on cached plans, before a plan rebuild
        otherwise), by ``skipped_steps``, ``state_dict`` and ``load_state_dict``."""
        pend = self.__dict__.get("_pending")
        if pend is None:
            return
        self._pending = None
        ev, host, mark, plans = pend
        if ev is not None:
            ev.synchronize()
        if int(host[0]) == mark:
            self._take_back(plans)
            self.__dict__["_skipped_steps"] = self.__dict__.get("_skipped_steps", 0) + 1

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (host count; eager mode)."""
        self._resolve_pending()
        return self.__dict__.get("_skipped_steps", 0)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._resolve_pending()
        self.__dict__["_skipped_steps"] = int(value)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Step one parameter (used by gradient release); honours check_finite."""
        if p.grad is None:
            return
        if self.capturable:
            raise ValueError("gradient release (step_param) is not supported with capturable=True")
        self._resolve_pending()
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                prep = self._prepare(group, [p], cache=False)
                if self.check_finite and self._nonfinite([prep]):
                    if self.on_nonfinite == "raise":
                        raise NonFiniteGradError("non-finite gradient: step not taken")
                    self.skipped_steps += 1
                    return
                self._plans.pop(id(group), None)
                self._commit(prep)
                return
        raise ValueError("parameter is not managed by this optimizer")

    def _prepare(
        self, group, ps, cache: bool = True, grads: list | None = None, gptrs=None
    ) -> dict:
        """Buckets and offset tables for this step; no state changes (a skipped step must
        leave everything as it was). ``grads`` / ``gptrs``: ``[p.grad for p in ps]`` and
        their ``data_ptr()`` when the caller has read them already. A cached plan is reused
        when the parameters are the same objects and every gradient is at the same address
        (the host's per-step cost with thousands of tensors: one ``.grad`` read and one
        ``data_ptr`` per parameter)."""
        plan = self._plans.get(id(group)) if cache else None
        if plan is not None and plan["n"] == len(ps) and all(map(operator.is_, plan["ps"], ps)):
            gs = list(map(_GRAD, ps)) if grads is None else grads
            if plan["dt"]:
                gs = list(map(_local, gs))
                gptrs = None
            if gptrs is None:
                gptrs = tuple(map(_DATA_PTR, gs))
            if gptrs == plan["gptrs"]:
                return dict(group=group, plan=plan, buckets=plan["buckets"], cache=cache)
            if not self.capturable and self._rebase_grads(plan, gs, gptrs):
                plan["gptrs"] = gptrs
                return dict(group=group, plan=plan, buckets=plan["buckets"], cache=cache)
        self._resolve_pending()  # lazy skip: the step counts below must be resolved
        if self.capturable:
            if _capturing():
                raise RuntimeError(
                    "flashoptim: the offset tables would need rebuilding during CUDA graph"
                    " capture (parameters with gradients or gradient tensors changed since the"
                    " warm-up step); run an eager step first and keep .grad tensors static"
                )
            old = self._plans.pop(id(group), None)
            if old is not None:
                self._flush_steps(old)
        buckets: dict = {}
        for p in ps:
            if p.grad.is_sparse:
                raise ValueError("flashoptim does not support sparse gradients")
            st = self._init_state(p, group)
            lp = _local(p)
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
            ent = self._build_table(group, bps) if key[4] else None
            out.append(dict(ps=bps, ent=ent, step=key[0]))
        if self.capturable:
            return self._device_plan(group, ps, out, cache)
        return dict(group=group, plan=None, buckets=out, cache=cache, ps=ps)

    # ------------------------------------------------------------------ capturable mode
    def _device_plan(self, group, ps, out, cache) -> dict:
        """Capturable mode: the plan of a group with one device step count per bucket and
        the buffer of the buckets' device scalars (built eagerly, reused by every step)."""
        if any(b["ent"] is None for b in out):
            raise ValueError("capturable=True needs the Triton path for every parameter")
        devs = {b["ent"]["tab"].device for b in out}
        if len(devs) != 1:
            raise ValueError("capturable=True needs all parameters of a group on one device")
        dev = devs.pop()
        if dev not in self._dflag:
            self._dflag[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
            self._dskip[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
        _index_buckets(ps, out)
        plan = dict(
            n=len(ps),
            ps=list(ps),
            dt=any(hasattr(p, "_local_tensor") for p in ps),
            gptrs=tuple(_local(p.grad).data_ptr() for p in ps),
            states=[self.state[p] for p in ps],
            step=None,
            buckets=out,
            dstep=torch.tensor([b["step"] for b in out], dtype=torch.int64, device=dev),
            scal=torch.zeros(len(out), 14, dtype=torch.int32, device=dev),
            consts=None,
            ckey=None,
        )
        if cache:
            self._plans[id(group)] = plan
        return dict(group=group, plan=plan, buckets=out, cache=cache, ps=ps)

    def _flush_steps(self, plan) -> None:
        """Copy a plan's device step counts into the host ``state["step"]`` (one sync)."""
        if plan.get("dstep") is None:
            return
        for b, v in zip(plan["buckets"], plan["dstep"].tolist(), strict=True):
            b["step"] = int(v)
            for p in b["ps"]:
                self.state[p]["step"] = int(v)

    def sync_steps(self) -> None:
        """Capturable mode: bring every ``state[p]["step"]`` up to date from the device step
        counts (one host sync; not during a capture). ``state_dict()`` calls it."""
        if _capturing():
            raise RuntimeError("sync_steps() syncs with the host: not allowed during capture")
        for plan in self._plans.values():
            self._flush_steps(plan)

    @property
    def skipped_steps_device(self) -> torch.Tensor | None:
        """Capturable mode: int64 [1] device count of steps skipped for non-finite gradients
        since construction or the last load_state_dict (``skipped_steps`` stays a host int
        that only eager mode updates). None before the first capturable step."""
        if not self._dskip:
            return None
        ts = list(self._dskip.values())
        return ts[0] if len(ts) == 1 else sum(t.to(ts[0].device) for t in ts)

    def _step_on_device(self, preps) -> None:
        """Capturable step: the finiteness pre-pass writes device flags, the step counts
        advance on device where the flag is clear, the scalars are computed on device, and
        the kernels skip the update where the flag is set. No host sync."""
        devs = {prep["plan"]["dstep"].device for prep in preps}
        flags = {d: self._dflag[d] for d in devs}
        for f in flags.values():
            f.zero_()
        if self.check_finite:
            self._nonfinite(preps, flags)
        for prep in preps:
            group, plan = prep["group"], prep["plan"]
            flag = flags[plan["dstep"].device]
            plan["dstep"].add_((flag == 0).to(torch.int64))
            self._device_scalars(plan, self._hp(group, plan["ps"][0]), flag)
            for i, b in enumerate(plan["buckets"]):  # hp per bucket (ecc: parameter dtype)
                hpb = self._hp(group, b["ps"][0])
                self._run_kernel(b["ent"], group, hpb, None, scal=plan["scal"][i])
        for d, f in flags.items():
            self._dskip[d].add_(f.to(torch.int64))

    def _device_scalars(self, plan, hp, flag) -> None:
        """``_scalar_args`` for every bucket of the plan from its device step count, with
        torch float64 ops (same formulas), rounded to fp32 into ``plan["scal"]``."""
        dev = plan["dstep"].device
        lr = hp["lr"]
        lr_t = torch.is_tensor(lr)
        b1, b2 = hp.get("b1", 0.0), hp.get("b2", 0.0)
        eps, wd, damp = hp.get("eps", 0.0), hp["wd"], hp.get("dampening", 0.0)
        key = (None if lr_t else lr, b1, b2, eps, wd, damp)
        if plan["ckey"] != key:
            if _capturing():
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
        if self._kind == ADAM:
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
        mix = (s * _core._GOLDEN) & _core._M32
        mix = torch.where(mix >= 2**31, mix - 2**32, mix)  # uint32 bits as int32
        ints = torch.stack([first, mix, flag.to(torch.int64).expand(nb)], 1).to(torch.int32)
        plan["scal"].copy_(torch.cat([f32, ints], 1))

    def _commit(self, prep, skip: dict | None = None) -> None:
        group = prep["group"]
        plan = prep["plan"]
        if plan is not None:  # fast path: one step count for all, cached tables
            step = plan["step"] + 1
            for b in plan["buckets"]:  # hp per bucket: ecc depends on the parameter dtype
                ent = b["ent"]
                flag = None if skip is None else skip[ent["tab"].device]
                self._run_kernel(ent, group, self._hp(group, b["ps"][0]), step, skip=flag)
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
                self._run_kernel(b["ent"], group, hp, step)
            else:
                for p in b["ps"]:
                    st = self.state[p]
                    _core.cpu_step(
                        self._kind,
                        _local(p),
                        _local(p.grad),
                        self._state_view(st, group),
                        hp,
                        step,
                        st["seed"],
                        _global_index_base(p),
                    )
        bs = prep["buckets"]
        steps = {b["step"] for b in bs}
        if prep["cache"] and all(b["ent"] is not None for b in bs) and len(steps) == 1:
            ps = prep["ps"]
            _index_buckets(ps, bs)
            self._plans[id(group)] = dict(
                n=len(ps),
                ps=list(ps),
                dt=any(hasattr(p, "_local_tensor") for p in ps),
                gptrs=tuple(_local(p.grad).data_ptr() for p in ps),
                states=[self.state[p] for p in ps],
                step=steps.pop() + 1,
                buckets=bs,
            )

    def _rebase_grads(self, plan, gs, gptrs) -> bool:
        """New gradient tensors, same parameters (FSDP2 and ``zero_grad(set_to_none=True)``
        hand out fresh ``.grad`` storage every step): rewrite only the gradient column of each
        bucket's offset table instead of rebuilding the plan. ``gs``: the (local) gradients
        of ``plan["ps"]``, ``gptrs`` their addresses. False: rebuild (a gradient changed
        dtype, device or layout). Checks and offsets run over whole lists (C-level ``map``,
        one torch op per bucket), not per parameter in Python."""
        updates = []
        for b in plan["buckets"]:
            ent = b["ent"]
            idx = b["idx"]
            if idx is None:  # the plan's only bucket: every parameter, in order
                bgs, bptrs = gs, gptrs
            else:
                pick = operator.itemgetter(*idx)
                bgs, bptrs = (
                    (list(pick(gs)), pick(gptrs))
                    if len(idx) > 1
                    else ([gs[idx[0]]], (gptrs[idx[0]],))
                )
            old = ent["bases"][1]
            if (
                set(map(_DTYPE, bgs)) != {old.dtype}
                or set(map(_GET_DEVICE, bgs)) != {old.get_device()}
                or not all(map(_IS_CONTIGUOUS, bgs))
            ):
                return False
            base = bgs[0]
            es = base.element_size()
            ptr = torch.frombuffer(array.array("q", bptrs), dtype=torch.int64)
            d = ptr - bptrs[0]
            if bool((d % es).any()):
                return False
            offs = d // es
            aligned = bool(((offs % 16 == 0) & (ptr % 16 == 0)).all())
            updates.append((ent, base, offs, aligned))
        for ent, base, col, aligned in updates:
            if ent["tab"].is_cuda:
                # pinned + non_blocking: no host sync; the caching host allocator keeps the
                # buffer alive until the copy has run on the stream
                col = col.pin_memory()
            ent["tab"][:, 1].copy_(col, non_blocking=True)
            ent["bases"][1] = base
            ent["aligned"] = ent["aligned_other"] and aligned
        return True

    def _state_view(self, st, group) -> dict:
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

    def _build_table(self, group, ps):
        """Offset tables of one bucket: every array of tensor i sits at base_j + tab[i, j]."""
        p0 = _local(ps[0])
        sts = [self._state_view(self.state[p], group) for p in ps]
        cols = [
            [_local(p) for p in ps],
            [_local(p.grad) for p in ps],
            [s.get("c") for s in sts],
            [s.get("m") for s in sts],
            [s.get("ms") for s in sts],
            [s.get("v") for s in sts],
            [s.get("vs") for s in sts],
        ]
        bases = [col[0] if col[0] is not None else p0 for col in cols]
        rows, aligned, aligned_other = [], True, True
        for i, p in enumerate(ps):
            row = []
            for j, col in enumerate(cols):
                t = col[i]
                if t is None:
                    row.append(0)
                    continue
                if not t.is_contiguous():
                    raise ValueError("flashoptim needs contiguous parameters and gradients")
                if t.device != p0.device:
                    raise ValueError("all tensors of a step must be on one device")
                es = t.element_size()
                d = t.data_ptr() - bases[j].data_ptr()
                if d % es:
                    raise ValueError("tensor storage is not aligned to its element size")
                o = d // es
                ok = o % 16 == 0 and t.data_ptr() % 16 == 0
                aligned = aligned and ok
                if j != 1:  # every column but the gradients' (see _rebase_grads)
                    aligned_other = aligned_other and ok
                row.append(o)
            st = self.state[p]
            row += [cols[0][i].numel(), st["seed"], _global_index_base(p)]
            rows.append(row)
        tab = torch.tensor(rows, dtype=torch.int64, device=p0.device)
        unit = _core.V2_UNIT
        # v3: v2's unit table and indexing (int32 offsets), cheaper element math
        if self.kernel == "v4":  # v4: chunks of V4_UNIT elements in the same table format
            unit = _core.V4_UNIT
        use_v2 = self.kernel in ("v2", "v3", "v4") and max(r[7] for r in rows) <= 2**31 - 2 * unit
        # only the chosen kernel's work table is kept: both would cost 0.012 bytes/param
        size = unit if use_v2 else BLOCK
        nw = [(r[7] + size - 1) // size for r in rows]
        tid = torch.repeat_interleave(torch.arange(len(ps)), torch.tensor(nw))
        first = torch.repeat_interleave(torch.tensor([0] + nw[:-1]).cumsum(0), torch.tensor(nw))
        local = torch.arange(len(tid)) - first  # v2: unit index; v1: block start element
        work = torch.stack([tid, local if use_v2 else local * BLOCK], 1)
        written = [t for j in (0, 2, 3, 4, 5, 6) for t in cols[j] if t is not None]
        return dict(
            use_v2=use_v2,
            work=work.to(torch.int32).contiguous().to(p0.device),  # v2 units or v1 blocks
            written=written,
            tab=tab,
            bases=bases,
            aligned=aligned,
            aligned_other=aligned_other,
            skip=torch.zeros(1, dtype=torch.int32, device=p0.device),
            dtype=p0.dtype,
            n16=all(r[7] % 16 == 0 for r in rows),
            ib8=all(r[9] % 8 == 0 for r in rows),  # rounding-stream bases (LEAN 2)
        )

    def _run_kernel(self, ent, group, hp, step, scal=None, skip=None) -> None:
        """Launch the bucket's step kernel; ``scal`` (capturable): the device scalars;
        ``skip`` (v3): the device non-finite flag the kernel checks before any write."""
        nblocks = ent["work"].shape[0]
        if nblocks == 0:
            return
        if scal is None:
            scalars = self._scalar_args(hp, step)
        else:  # the kernel reads them through ``lr``, a pointer; the rest are placeholders
            scalars = (scal,) + (0.0,) * 10 + (0, 0)
        flags = self._flags(ent, group, hp)
        flags["SCALARS_ON_DEVICE"] = scal is not None
        if ent["use_v2"] and self.kernel in ("v3", "v4"):
            self._run_kernel_v3(ent, scalars, flags, skip, v4=self.kernel == "v4")
            return
        if ent["use_v2"]:
            self._run_kernel_v2(ent, scalars, flags)
            return
        _core._step_kernel[(nblocks,)](
            ent["work"],
            ent["tab"],
            *ent["bases"],
            *scalars,
            ent["skip"],
            **flags,
            CHECK_SKIP=False,
            ALIGNED=ent["aligned"],
            N16=ent["n16"],
            BLOCK=BLOCK,
            GROUP_SIZE=GROUP,
            num_warps=NUM_WARPS,
        )

    def _scalar_args(self, hp, step) -> tuple:
        """The step's run-time scalars, in the order both step kernels take them."""
        lr, wd = hp["lr"], hp["wd"]
        b1, b2 = hp.get("b1", 0.0), hp.get("b2", 0.0)
        bc1 = 1 - b1**step if self._kind == ADAM else 1.0
        bc2 = 1 - b2**step if self._kind == ADAM else 1.0
        return (
            lr,
            b1,
            1 - b1,
            b2,
            1 - b2,
            hp.get("eps", 0.0),
            wd,
            1 - lr * wd,
            lr / bc1,
            1 / math.sqrt(bc2),
            1 - hp.get("dampening", 0.0),
            1 if step == 1 else 0,
            (step * _core._GOLDEN) & _core._M32,
        )

    def _flags(self, ent, group, hp) -> dict:
        """The constexpr mode flags both step kernels take."""
        return dict(
            KIND=self._kind,
            ECC=hp["ecc"],
            QUANT=hp["quant"],
            SR=hp["sr"],
            P_DTYPE=_P_CODE[ent["dtype"]],
            DECOUPLED=hp["decoupled"],
            NESTEROV=hp.get("nesterov", False),
            HAS_MOM=self._has_mom(group),
            SCALE_F32=hp["scale_dtype"] == torch.float32,
        )

    def _run_kernel_v2(self, ent, scalars, flags) -> None:
        args = (ent["work"], ent["work"].shape[0], ent["tab"], *ent["bases"], *scalars)
        meta = dict(
            **flags,
            ALIGNED=ent["aligned"],
            N16=ent["n16"],
            UNIT=_core.V2_UNIT,
            GROUP_SIZE=GROUP,
        )
        self._launch_units(ent, args, meta, _core._step_kernel_v2_tuned, _core._step_kernel_v2)

    def _run_kernel_v3(self, ent, scalars, flags, skip, v4=False) -> None:
        """v3: v2's launch (unit table, persistent grid, autotuning) with the cheaper tile,
        inline PTX on the GPU, and the device skip flag when given. ``v4``: the same over the
        chunk table, with L2 prefetch (GPU) and the epoch-marked skip flag (one more
        argument: the step's epoch)."""
        args = (ent["work"], ent["work"].shape[0], ent["tab"], *ent["bases"], *scalars)
        args += (ent["skip"] if skip is None else skip,)
        if v4:
            args += (self._epoch if skip is not None else 0,)
        meta = dict(
            **flags,
            ALIGNED=ent["aligned"],
            N16=ent["n16"],
            CHECK_SKIP=skip is not None,
            ASM=_use_asm(ent["tab"].device),
            UNIT=_core.V4_UNIT if v4 else _core.V2_UNIT,
            GROUP_SIZE=GROUP,
        )
        if v4:
            meta["LEAN"] = (2 if ent["ib8"] else 1) if self._lean else 0
            # inline-PTX parts: none under the interpreter (one kernel variant there)
            meta["PARTS"] = _lean_parts(self._lean, self._lean_parts) if meta["ASM"] else 0
            kernels = (_core._step_kernel_v4_tuned, _core._step_kernel_v4)
            self._launch_units(ent, args, meta, *kernels, _core.V4_DEFAULT, _core.V4_DEFAULT_WARPS)
        else:
            kernels = (_core._step_kernel_v3_tuned, _core._step_kernel_v3)
            self._launch_units(ent, args, meta, *kernels)

    @staticmethod
    def _launch_units(ent, args, meta, tuned, plain, default=None, warps=None) -> None:
        """The unit-table kernels' launch (v2, v3 and v4): persistent grid of WAVES programs per
        SM (0: one per unit); autotuned on CUDA, with every written tensor of the bucket
        restored after the tuning runs; else the single default config."""
        nunits = ent["work"].shape[0]
        dev = ent["tab"].device
        if _v2_autotune(dev):
            nsm = _num_sms(dev)

            def grid(m):
                w = m["WAVES"]
                return (min(nunits, nsm * w) if w else nunits,)

            _core._TUNE["tensors"] = ent["written"]
            try:
                tuned[grid](*args, **meta)
            finally:
                if _core._TUNE["snap"] is not None:  # tuning raised: undo its runs
                    _core._tune_pre_hook({}, reset_only=True)
                _core._TUNE["tensors"] = ()
            return
        default = _core.V2_DEFAULT if default is None else default
        warps = _core.V2_DEFAULT_WARPS if warps is None else warps
        w = default["WAVES"]
        if dev.type != "cuda":
            nprog = min(nunits, 3)
        else:
            nprog = min(nunits, _num_sms(dev) * w) if w else nunits
        plain[(nprog,)](*args, **meta, **default, num_warps=warps)

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
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints
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

        ``masters``: one tensor per parameter, in ``param_groups`` order, each of the
        parameter's shape (for FSDP2, DTensors sharded like the parameters, or their local
        shards). Call it after building the optimizer, typically with the weights the model had
        before ``model.to(torch.bfloat16)``::

            masters = [p.detach().clone() for p in model.parameters()]
            model.to(torch.bfloat16)
            opt = FlashAdamW(model.parameters(), lr=1e-3)
            opt.load_master_weights(masters)

        Why it matters: a model cast to bf16 has every master weight exactly on a bf16 value
        (correction 0), so an update smaller than half a bf16 ulp leaves the visible weight
        unchanged, for every weight at once; early in training (warm-up, updates of about the
        learning rate against an ulp of 1.2e-4 at |w| = 0.02) whole steps are lost. An fp32
        master sits at a random place inside its bf16 interval and the visible weights follow
        the updates on average, as with torch's fp32 master weights (packages/flashoptim
        NOTES.md, "Parity at 400 steps"). fp32 parameters are set to their master; with
        ``master_weight_bits=None`` only the narrow value is kept."""
        params = [p for group in self.param_groups for p in group["params"]]
        masters = list(masters)
        if len(masters) != len(params):
            raise ValueError(
                f"load_master_weights: got {len(masters)} tensors for {len(params)} parameters"
            )
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                t, lp = masters[i], _local(p)
                lt = _local(t) if hasattr(t, "_local_tensor") else t
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
                    narrow, code = _core.split_ref(lt.reshape(-1), lp.dtype, bits)
                    lp.copy_(narrow.view_as(lp))
                    st["correction"].copy_(code.view_as(st["correction"]))
                i += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict, or a plain torch.optim one (quantized on load).

        torch's loader would cast floating states to the parameter dtype (fp32 scales and
        states to bf16), so the states are mapped to parameters here, unchanged.
        """
        self._resolve_pending()
        groups = state_dict["param_groups"]
        saved = state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(groups)} param groups; optimizer has {len(self.param_groups)}"
            )
        id_map = {}
        for g_new, g_old in zip(self.param_groups, groups):
            if len(g_new["params"]) != len(g_old["params"]):
                raise ValueError("state dict param group sizes do not match the optimizer")
            for p, pid in zip(g_new["params"], g_old["params"]):
                id_map[pid] = (p, g_new)
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
            p, group = id_map[pid]
            self._load_param_state(p, group, st_old)

    def _load_param_state(self, p, group, st_old) -> None:
        lp = _local(p)
        st = self._init_state(p, group)
        step = st_old.get("step", 0)
        st["step"] = int(step.item()) if torch.is_tensor(step) else int(step)
        if "seed" in st_old:
            st["seed"] = int(st_old["seed"])
        for key in [self._m_key, self._v_key]:
            if key is None or key not in st_old or key not in st:
                continue
            v = _local(st_old[key]).to(lp.device)
            per_el = st_old.get(key + "_scale_per_element")
            if per_el is not None and group["quantize"]:  # sharded (DCP) export
                self._load_per_element(st, key, v, _local(per_el).to(lp.device), group)
                continue
            if group["quantize"] and v.is_floating_point():  # torch.optim checkpoint
                v = v.to(torch.float64).reshape(-1)
                if key == self._v_key:
                    codes, s = _core.quantize_variance_ref(v, group["scale_dtype"])
                else:
                    codes, s = _core.quantize_momentum_ref(v, group["scale_dtype"])
                st[key].copy_(codes.view_as(st[key]))
                st[key + "_scale"].copy_(s)
            else:
                st[key].copy_(v.view_as(st[key]))
                if key + "_scale" in st_old:
                    st[key + "_scale"].copy_(_local(st_old[key + "_scale"]))
        if "correction" in st and "correction" in st_old:
            st["correction"].copy_(_local(st_old["correction"]))

    def _load_per_element(self, st, key, codes, per_el, group) -> None:
        """Codes + per-element scales (a sharded export). If this shard's groups of 32 line
        up with the saved ones (every group sees one scale), the codes and scales are copied
        unchanged (bit-exact, any world size); otherwise decode and quantize again."""
        c = codes.reshape(-1)
        e = per_el.reshape(-1).to(torch.float64)
        n = c.numel()
        eg = _core._pad(e).view(-1, GROUP)
        valid = _core._pad(torch.ones(n, dtype=torch.bool, device=e.device)).view(-1, GROUP)
        aligned = bool(((eg == eg[:, :1]) | ~valid).all())
        if aligned:
            st[key].copy_(codes.view_as(st[key]))
            st[key + "_scale"].copy_(eg[:, 0])
            return
        cf = c.to(torch.float64)
        if key == self._v_key:
            sv = cf / 255 * e
            codes2, s2 = _core.quantize_variance_ref(sv * sv, group["scale_dtype"])
        else:
            y = cf / 127
            codes2, s2 = _core.quantize_momentum_ref(y / (2 - y.abs()) * e, group["scale_dtype"])
        st[key].copy_(codes2.view_as(st[key]))
        st[key + "_scale"].copy_(s2)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout. For DTensor (FSDP2) parameters every per-element state is a
        DTensor with the parameter's placements, and each group scale is repeated per element
        (``<state>_scale_per_element``), so torch.distributed.checkpoint can save, load and
        reshard it; plain parameters keep the compact layout."""
        skipped = self.skipped_steps  # (resolves a lazy skip first)
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
            from torch.distributed.tensor import DTensor

            lp = _local(p)

            def wrap(t, p=p, lp=lp):
                return DTensor.from_local(
                    t.reshape(lp.shape),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )

            new = {}
            for k, v in st.items():
                if not torch.is_tensor(v):
                    new[k] = v
                elif k.endswith("_scale"):
                    per_el = v.repeat_interleave(GROUP)[: lp.numel()]
                    new[k + "_per_element"] = wrap(per_el)
                else:
                    new[k] = wrap(v)
            sd["state"][idx] = new
        sd["flashoptim"] = {"skipped_steps": skipped}
        return sd


def master_weight(p: torch.Tensor, optimizer: FlashOptimizer | None = None) -> torch.Tensor:
    """fp32 master value of ``p`` (its local shard): ``p + correction * q``."""
    lp = _local(p).detach()
    st = optimizer.state.get(p, {}) if optimizer is not None else {}
    if "correction" not in st or lp.dtype == torch.float32:
        return lp.to(torch.float32).clone()
    c = st["correction"]
    bits = 8 if c.dtype == torch.int8 else 16
    pb = lp.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    q, _ = _core._narrow_q(pb, lp.dtype == torch.bfloat16, bits)
    return (lp.reshape(-1).to(torch.float32) + c.reshape(-1).to(torch.float32) * q).view(lp.shape)


class FlashAdamW(FlashOptimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW semantics) with weight splitting and
    companded 8-bit states. ~7.1 bytes/param with bf16 params and grads (5.1 with release)."""

    _kind = ADAM
    _decoupled = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kw,
    ):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1); got {betas}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0; got {eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **kw)

    def _hp(self, group, p):
        hp = self._common_hp(group, p)
        b1, b2 = group["betas"]
        hp.update(b1=float(b1), b2=float(b2), eps=float(group["eps"]), decoupled=self._decoupled)
        return hp


class FlashAdam(FlashAdamW):
    """Adam (L2 weight decay added to the gradient, torch.optim.Adam semantics)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)


class FlashSGD(FlashOptimizer):
    """SGD with momentum, dampening, nesterov and coupled weight decay (torch.optim.SGD)."""

    _kind = SGD
    _m_key = "momentum_buffer"
    _v_key = None
    _decoupled = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **kw,
    ):
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0; got {momentum}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires a momentum and zero dampening")
        d = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, d, **kw)

    def _has_mom(self, group) -> bool:
        return group["momentum"] != 0

    def _hp(self, group, p):
        hp = self._common_hp(group, p)
        hp.update(
            b1=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
            decoupled=self._decoupled,
        )
        return hp


class FlashSGDW(FlashSGD):
    """SGD with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the update."""

    _decoupled = True


class FlashLion(FlashOptimizer):
    """Lion (Chen et al. 2023): ``p -= lr * sign(b1 m + (1-b1) g)``; ``m = b2 m + (1-b2) g``;
    decoupled weight decay ``p *= 1 - lr * wd``."""

    _kind = LION
    _m_key = "exp_avg"
    _v_key = None

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **kw):
        if not 0.0 <= betas[0] <= 1.0 or not 0.0 <= betas[1] <= 1.0:
            raise ValueError(f"betas must be in [0, 1]; got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), **kw)

    def _hp(self, group, p):
        hp = self._common_hp(group, p)
        b1, b2 = group["betas"]
        hp.update(b1=float(b1), b2=float(b2), decoupled=True)
        return hp
