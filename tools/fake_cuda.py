"""CPU tensors that pass for CUDA tensors, for tools/count_compiles.py.

A ``TorchFunctionMode`` maps ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` onto the
CPU and marks the results' storages; a ``TorchDispatchMode`` marks every fresh result of an
op on a marked tensor (backward included); ``Tensor.device`` / ``is_cuda`` report
``cuda:0`` for marked storages; ``.cpu()`` copies. ``torch.cuda`` reports one sm_90 GPU
(events, streams and graphs are stand-ins that do nothing), ``torch.autocast("cuda")`` is
the CPU autocast, and ``torch.empty`` returns zeros (a kernel that is recorded but not run
leaves finite values).
"""

from __future__ import annotations

import contextlib
import time
import weakref


class FakeCuda:
    """CPU tensors that report CUDA: see the module docstring."""

    def __init__(self, torch):
        self.torch = torch
        self.fake = weakref.WeakSet()  # storages of "CUDA" tensors
        self.on = False
        self.cuda = torch.device("cuda", 0)

    # -- marking ------------------------------------------------------------------------
    def storage(self, t):
        try:
            return t.untyped_storage()
        except Exception:
            return None

    def is_fake(self, t) -> bool:
        if not isinstance(t, self.torch.Tensor):
            return False
        s = self.storage(t)
        return s is not None and s in self.fake

    def mark(self, out) -> None:
        for t in self.tensors(out):
            s = self.storage(t)
            if s is not None:
                self.fake.add(s)

    def unmark(self, out) -> None:
        for t in self.tensors(out):
            s = self.storage(t)
            if s is not None:
                self.fake.discard(s)

    def tensors(self, obj):
        from torch.utils._pytree import tree_leaves

        return [t for t in tree_leaves(obj) if isinstance(t, self.torch.Tensor)]

    def is_cuda_device(self, d) -> bool:
        if isinstance(d, str):
            return d.startswith("cuda")
        if isinstance(d, self.torch.device):
            return d.type == "cuda"
        return False

    def is_cpu_device(self, d) -> bool:
        if isinstance(d, str):
            return d == "cpu" or d.startswith("cpu:")
        if isinstance(d, self.torch.device):
            return d.type == "cpu"
        return False

    @contextlib.contextmanager
    def off(self):
        old, self.on = self.on, False
        try:
            yield
        finally:
            self.on = old

    # -- install ------------------------------------------------------------------------
    def install(self):
        torch = self.torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        fc = self
        real_device = torch._C.TensorBase.device

        def device(t):
            d = real_device.__get__(t)
            if fc.on and d.type == "cpu" and fc.is_fake(t):
                return fc.cuda
            return d

        torch.Tensor.device = property(device)
        torch.Tensor.is_cuda = property(lambda t: device(t).type == "cuda")
        torch.Tensor.is_cpu = property(lambda t: device(t).type == "cpu")
        torch.Tensor.get_device = lambda t: 0 if device(t).type == "cuda" else -1
        torch.Tensor.pin_memory = lambda t, *a, **k: t
        torch.Tensor.is_pinned = lambda t, *a, **k: False

        empties = {
            torch.empty,
            torch.empty_like,
            torch.empty_strided,
            torch.Tensor.new_empty,
            torch.Tensor.new_empty_strided,
        }

        class Remap(TorchFunctionMode):
            """device="cuda" onto the CPU; .cuda() / .to(cuda) copy and mark; .cpu() copies."""

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if not fc.on:
                    return func(*args, **kwargs)
                if func is torch.Tensor.cuda:
                    t = args[0]
                    if fc.is_fake(t):
                        return t
                    out = t.clone()
                    fc.mark(out)
                    return out
                if func is torch.Tensor.cpu:
                    t = args[0]
                    if not fc.is_fake(t):
                        return t
                    out = t.clone()
                    fc.unmark(out)
                    return out
                if func is torch.Tensor.to:
                    return fc.to(func, args, kwargs)
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
                d = kwargs.get("device")
                if d is not None and fc.is_cuda_device(d):
                    kwargs["device"] = "cpu"
                    if kwargs.get("pin_memory"):
                        kwargs["pin_memory"] = False
                    out = func(*args, **kwargs)
                    fc.mark(out)
                else:
                    out = func(*args, **kwargs)
                if func in empties and isinstance(out, torch.Tensor):
                    # a kernel not run here (Gluon, --dry) leaves zeros, not garbage: finite
                    # values keep the packages' finiteness checks from ending a test early
                    with torch.no_grad():
                        out.zero_()
                return out

        class Propagate(TorchDispatchMode):
            """Every fresh result of an op on a "CUDA" tensor is one (in-place and out=
            results keep their device, as on the GPU)."""

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if not fc.on or "out" in kwargs:
                    return out
                if func.overloadpacket.__name__.endswith("_"):
                    return out
                ins = fc.tensors((args, kwargs))
                if any(fc.is_fake(t) for t in ins):
                    own = {id(fc.storage(t)) for t in ins}
                    for t in fc.tensors(out):
                        s = fc.storage(t)
                        if s is not None and id(s) not in own:
                            fc.fake.add(s)
                return out

        self.modes = [Remap(), Propagate()]
        self.install_cuda_module()

    def to(self, func, args, kwargs):
        """Tensor.to with a CUDA or CPU target: a copy as on the GPU."""
        t, rest = args[0], list(args[1:])
        target = kwargs.pop("device", None)
        if rest and (isinstance(rest[0], (str, self.torch.device))):
            target = rest.pop(0)
        elif rest and isinstance(rest[0], self.torch.Tensor):
            other = rest.pop(0)
            target = self.cuda if self.is_fake(other) else "cpu"
            rest.insert(0, other.dtype)
        if target is None:
            return func(t, *rest, **kwargs)
        if self.is_cuda_device(target):
            if self.is_fake(t):
                return func(t, *rest, **kwargs)
            kwargs["copy"] = True
            out = func(t, *rest, **kwargs)
            self.mark(out)
            return out
        if self.is_cpu_device(target) and self.is_fake(t):
            kwargs["copy"] = True
            out = func(t, *rest, **kwargs)
            self.unmark(out)
            return out
        return func(t, *rest, **kwargs)

    @contextlib.contextmanager
    def active(self):
        for m in self.modes:
            m.__enter__()
        self.on = True
        try:
            yield
        finally:
            self.on = False
            for m in reversed(self.modes):
                m.__exit__(None, None, None)

    @contextlib.contextmanager
    def suspended(self):
        """Modes popped (torch.compile traces without them)."""
        from torch.overrides import _pop_mode_temporarily as pop_function
        from torch.utils._python_dispatch import _pop_mode_temporarily as pop_dispatch

        with self.off(), pop_dispatch(), pop_function():
            yield

    def install_cuda_module(self):
        torch = self.torch
        cuda = torch.cuda

        class Props:
            name = "sm_90 (count_compiles)"
            major, minor = 9, 0
            multi_processor_count = 132
            total_memory = 80 * 2**30
            L2_cache_size = 50 * 2**20
            warp_size = 32
            max_shared_memory_per_block_optin = 232448

        class Event:
            def __init__(self, *a, **k):
                self.t = 0.0

            def record(self, *a, **k):
                self.t = time.perf_counter()

            def synchronize(self):
                pass

            def query(self):
                return True

            def wait(self, *a, **k):
                pass

            def elapsed_time(self, other):
                return max((other.t - self.t) * 1e3, 1e-3)

        class Stream:
            def __init__(self, *a, **k):
                self.device = torch.device("cuda", 0)

            def wait_stream(self, *a, **k):
                pass

            def wait_event(self, *a, **k):
                pass

            def synchronize(self):
                pass

            def record_event(self, event=None):
                return event or Event()

            def query(self):
                return True

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        class Graph:
            def __init__(self, *a, **k):
                pass

            def replay(self):
                pass

            def reset(self):
                pass

            def capture_begin(self, *a, **k):
                pass

            def capture_end(self):
                pass

            def pool(self):
                return None

        @contextlib.contextmanager
        def graph(*a, **k):
            yield

        @contextlib.contextmanager
        def nullctx(*a, **k):
            yield

        stream = Stream()
        fixed = dict(
            is_available=lambda: True,
            device_count=lambda: 1,
            current_device=lambda: 0,
            set_device=lambda *a: None,
            get_device_capability=lambda *a: (9, 0),
            get_device_name=lambda *a: Props.name,
            get_device_properties=lambda *a: Props(),
            synchronize=lambda *a: None,
            is_bf16_supported=lambda *a, **k: True,
            mem_get_info=lambda *a: (Props.total_memory, Props.total_memory),
            memory_allocated=lambda *a: 0,
            max_memory_allocated=lambda *a: 0,
            memory_reserved=lambda *a: 0,
            max_memory_reserved=lambda *a: 0,
            reset_peak_memory_stats=lambda *a: None,
            reset_max_memory_allocated=lambda *a: None,
            empty_cache=lambda: None,
            manual_seed=lambda s: torch.manual_seed(s),
            manual_seed_all=lambda s: torch.manual_seed(s),
            Event=Event,
            Stream=Stream,
            current_stream=lambda *a: stream,
            default_stream=lambda *a: stream,
            stream=lambda *a: nullctx(),
            device=nullctx,
            graph=graph,
            CUDAGraph=Graph,
            is_current_stream_capturing=lambda: False,
            get_rng_state=lambda *a: torch.get_rng_state(),
            set_rng_state=lambda *a: None,
            get_rng_state_all=lambda: [torch.get_rng_state()],
            set_rng_state_all=lambda *a: None,
            _lazy_init=lambda: None,
            is_initialized=lambda: True,
        )
        for k, v in fixed.items():
            setattr(cuda, k, v)
        # what torch's own modules call directly (dynamo's CUDA device interface)
        for k, v in dict(_cuda_getDevice=lambda: 0).items():
            if not hasattr(torch._C, k):
                setattr(torch._C, k, v)
        cuda.graphs.is_current_stream_capturing = lambda: False

        real_gen = torch.Generator

        class Generator(real_gen):
            def __new__(cls, device="cpu"):
                return real_gen.__new__(cls, "cpu")

        torch.Generator = Generator

        # autocast for CUDA: the CPU autocast (bf16 / fp16 matmuls as on the GPU)
        real_autocast = torch.amp.autocast_mode.autocast

        class autocast(real_autocast):
            def __init__(self, device_type="cuda", *a, **k):
                super().__init__("cpu" if device_type == "cuda" else device_type, *a, **k)

        torch.autocast = torch.amp.autocast = autocast
        real_enabled, real_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

        def is_autocast_enabled(device_type=None):
            if device_type is None or device_type == "cuda":
                return real_enabled("cpu")
            return real_enabled(device_type)

        torch.is_autocast_enabled = is_autocast_enabled
        torch.get_autocast_dtype = lambda d: real_dtype("cpu" if d == "cuda" else d)
        torch.get_autocast_gpu_dtype = lambda: real_dtype("cpu")
