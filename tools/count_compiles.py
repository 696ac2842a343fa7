"""Estimate, on a CPU, how many distinct kernel compiles each GPU test triggers.

    python -O tools/count_compiles.py [--json OUT] [--dry] [--top N] PYTEST_ARGS...
    python -O tools/count_compiles.py --json /tmp/fs.json packages/flashsinkhorn/tests
    python tools/count_compiles.py --compare BEFORE.json AFTER.json

A cold GPU test run is compile-bound: every distinct (kernel, specialization) is a Triton or
Gluon compile of 0.3 to 30 s, every torch.compile graph an Inductor compile. This tool runs
the ``gpu``-marked tests of the given paths on the CPU and records, per test, each kernel
launch's compile key as triton 3.9 computes it (``triton/runtime/jit.py``: the binder of
``create_function_from_signature`` with ``native_specialize_impl``):

* every constexpr value;
* per integer argument: ``== 1`` (becomes a constexpr), ``% 16 == 0`` (the ``D``
  divisibility attribute), else plain ``i32``/``i64`` (unless ``do_not_specialize``);
* per tensor argument: its dtype and whether ``data_ptr() % 16 == 0`` (CPU and CUDA
  allocations are both aligned; a view at an odd offset is not, on either);
* the launch options (``num_warps``, ``num_stages``, ...; absent ones at their defaults, as
  the on-disk cache key has them, so ``num_warps=4`` and no ``num_warps`` are one compile).

Two launches with equal keys share one compile (in one process; across the xdist workers
of a run through the shared ``TRITON_CACHE_DIR``), so the count of distinct keys of a test
suite estimates its cold compiles, and a test's own count bounds what xdist can spread.

How the GPU tests run on a CPU (what the estimate covers):

* ``TRITON_INTERPRET=1``: ``@triton.jit`` kernels run under Triton's interpreter; the hook
  records the key and then runs the kernel (``--dry``: records only, the outputs stay
  unwritten; faster, and values then steer only data-dependent branches).
* "CUDA" tensors are CPU tensors that report ``device == cuda:0`` and ``is_cuda``: a
  ``TorchFunctionMode`` maps ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` onto the
  CPU, a ``TorchDispatchMode`` marks the results of every op on such a tensor (their
  storages), ``.cpu()`` copies. So the packages take their CUDA branches (sm_90 Gluon
  passes, one-pass kernels, autotuning); ``torch.cuda`` reports one sm_90 GPU (events,
  streams and graphs are stand-ins: a graph's replay does nothing), ``torch.autocast``
  for CUDA becomes the CPU autocast.
* Gluon kernels cannot run on a CPU: their launches are recorded and skipped (the outputs
  stay unwritten). ``triton.autotune``: each config of a new tuning key is recorded (each
  is a compile on the GPU) and the first one runs.
* ``torch.compile`` with Inductor: each forward and backward graph is recorded and runs
  eagerly (``backend="aot_eager"`` and other backends stay as they are, not counted).
* Run it with ``python -O``: assertions are stripped, so a test whose checks fail on the CPU
  (Gluon outputs unwritten, bf16 dots that the interpreter computes wrongly) still reaches
  its later launches. A test that raises anyway is listed with the launches it reached.

Package switches that differ between the interpreter and the GPU and decide which kernels
compile are set as on the GPU: flashoptim autotunes on CUDA unless
``FLASHOPTIM_NO_AUTOTUNE=1`` (the GPU runner does not set it); flashsinkhorn accepts
``precision="bf16"`` on the Triton backend. Block sizes that a package shrinks under the
interpreter keep their interpreter values (one variant each way: counts unchanged).
"""

from __future__ import annotations

import os
import sys

# The interpreter is chosen when triton is imported: before anything imports it.
os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("FLASHOPTIM_NO_AUTOTUNE", None)  # as tools/gpu_run.sh runs the tests

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

from fake_cuda import FakeCuda  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Option defaults of the CUDA backend (triton/backends/nvidia/compiler.py CUDAOptions) for
# the options a launch may pass: a launch without them compiles as one that passes these.
OPTION_DEFAULTS = {"num_warps": 4, "num_ctas": 1, "num_stages": 3, "maxnreg": None}
RUN_ONLY = ("grid", "warmup", "debug", "instrumentation_mode", "fpsan_homomorphic_casts")


# ---------------------------------------------------------------------------------------
# The compile key
# ---------------------------------------------------------------------------------------


def _fmt(v) -> str:
    """A readable, process-independent rendering of a specialization value."""
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_fmt(x) for x in v) + ")"
    fn = getattr(v, "fn", None)
    if fn is not None and hasattr(fn, "__qualname__"):  # a JIT function passed as constexpr
        return f"{fn.__module__}.{fn.__qualname__}"
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{v.__module__}.{v.__qualname__}"
    return repr(v)


class KeyMaker:
    """Triton's specialization of a launch: the binder jit.py builds from the signature."""

    def __init__(self):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        self._backend = BaseBackend
        self._jit = JITFunction
        self._create = create_function_from_signature
        self._binders = {}

    def binder(self, kernel):
        fn = kernel.fn
        b = self._binders.get(fn)
        if b is None:
            if hasattr(kernel, "params"):  # a real JITFunction (Gluon)
                sig, params = kernel.signature, kernel.params
            else:  # InterpretedFunction: the JITFunction the GPU would build
                jf = self._jit(fn, **kernel.kwargs)
                sig, params = jf.signature, jf.params
            b = (self._create(sig, params, self._backend), [p.name for p in params])
            self._binders[fn] = b
        return b

    def key(self, kernel, args, kwargs) -> str:
        binder, names = self.binder(kernel)
        kwargs = {k: v for k, v in kwargs.items() if k not in RUN_ONLY}
        _, spec, options = binder(*args, **kwargs)
        opts = dict(OPTION_DEFAULTS)
        opts.update(options)
        parts = [f"{n}={_fmt(s)}" for n, s in zip(names, spec)]
        parts += [f"{k}={_fmt(v)}" for k, v in sorted(opts.items())]
        return ";".join(parts)


# ---------------------------------------------------------------------------------------
# What was compiled, per test
# ---------------------------------------------------------------------------------------


class Record:
    def __init__(self):
        self.test = "<collection>"
        self.launches = defaultdict(Counter)  # test -> Counter((kind, fn, key))
        self.order = []  # tests in run order
        self.outcome = {}
        self.error = {}
        self.seconds = {}

    def add(self, kind: str, fn, key: str) -> None:
        name = fn if isinstance(fn, str) else f"{fn.__module__}.{fn.__qualname__}"
        self.launches[self.test][(kind, name, key)] += 1


REC = Record()
STATE = threading.local()


def _dry() -> bool:
    return getattr(STATE, "dry", False) or ARGS_DRY[0]


ARGS_DRY = [False]


@contextlib.contextmanager
def dry_launches():
    old = getattr(STATE, "dry", False)
    STATE.dry = True
    try:
        yield
    finally:
        STATE.dry = old


# ---------------------------------------------------------------------------------------
# Hooks on the launch paths
# ---------------------------------------------------------------------------------------


def install_hooks(fc: FakeCuda, keys: KeyMaker) -> None:
    import torch
    from triton.runtime import autotuner
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        REC.add("triton", self.fn, keys.key(self, args, kwargs))
        if warmup or _dry():
            return None
        with fc.off():
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run

    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        GluonJITFunction = None
    if GluonJITFunction is not None:

        def gluon_run(self, *args, grid, warmup, **kwargs):
            REC.add("gluon", self.fn, keys.key(self, args, kwargs))
            return None

        GluonJITFunction.run = gluon_run

    def bench(self, *args, config, **meta):
        # each config of a new tuning key compiles on the GPU; recorded, not run
        with dry_launches():
            self.fn.run(*args, **meta, **config.all_kwargs())
        return [float(self.configs.index(config))] * 3

    autotuner.Autotuner._bench = bench

    # torch.compile with Inductor: record each graph, run it eagerly
    from torch._dynamo.backends.common import aot_autograd

    real_compile = torch.compile

    def recorder(kind):
        def compiler(gm, example_inputs):
            meta = [
                (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                for t in example_inputs
            ]
            h = hashlib.sha256((gm.code + repr(meta)).encode()).hexdigest()[:16]
            REC.add("inductor", "torch.compile graph", f"{kind}:{h}")
            return gm.forward

        return compiler

    counting = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))

    def compile_(model=None, **kw):
        if kw.get("backend") in (None, "inductor"):
            kw["backend"] = counting
            kw.pop("mode", None)
            kw.pop("options", None)
        if model is None:
            return lambda m: _wrap(real_compile(m, **kw), fc)
        return _wrap(real_compile(model, **kw), fc)

    torch.compile = compile_


def _wrap(compiled, fc: FakeCuda):
    """A compiled callable run with the modes popped; its results on "CUDA" inputs are
    "CUDA" tensors."""
    import functools

    if isinstance(compiled, type) or not callable(compiled):
        return compiled
    if hasattr(compiled, "forward") and hasattr(compiled, "_orig_mod"):  # a compiled module
        real_call = compiled.__call__

        def call_module(*a, **k):
            return _call(real_call, a, k, fc)

        compiled.forward_with_fakes = call_module
        return _ModuleProxy(compiled, call_module)

    @functools.wraps(compiled)
    def call(*a, **k):
        return _call(compiled, a, k, fc)

    return call


class _ModuleProxy:
    def __init__(self, mod, call):
        object.__setattr__(self, "_mod", mod)
        object.__setattr__(self, "_call", call)

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def __setattr__(self, name, value):
        setattr(self._mod, name, value)


def _call(fn, a, k, fc):
    if not fc.on:
        return fn(*a, **k)
    inputs = fc.tensors((a, k))
    fake = any(fc.is_fake(t) for t in inputs)
    with fc.suspended():
        out = fn(*a, **k)
    if fake:
        fc.mark(out)
    return out


# ---------------------------------------------------------------------------------------
# pytest plugin and report
# ---------------------------------------------------------------------------------------


class Plugin:
    def __init__(self, fc: FakeCuda):
        self.fc = fc

    def pytest_runtest_protocol(self, item, nextitem):
        REC.test = item.nodeid
        REC.order.append(item.nodeid)
        REC.launches[item.nodeid]  # present even without launches
        t0 = time.perf_counter()
        self._cm = self.fc.active()
        self._cm.__enter__()
        self._t0 = t0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            REC.outcome[report.nodeid] = report.outcome
            if report.failed:
                crash = getattr(report.longrepr, "reprcrash", None)
                where = f"{Path(crash.path).name}:{crash.lineno}: " if crash else ""
                msg = crash.message if crash else str(report.longrepr)
                REC.error[report.nodeid] = (where + msg.strip().splitlines()[0])[:240]
        if report.when == "teardown":
            if getattr(self, "_cm", None) is not None:
                self._cm.__exit__(None, None, None)
                self._cm = None
            REC.seconds[report.nodeid] = time.perf_counter() - self._t0
            REC.test = "<between tests>"


def summarize(data: dict) -> dict:
    """Per-test and per-suite counts from the recorded launches."""
    seen = set()
    tests = []
    per_fn = Counter()
    kinds = Counter()
    for t in data["order"]:
        keys = {tuple(k) for k in data["launches"][t]}
        new = keys - seen
        seen |= keys
        tests.append(
            dict(
                test=t,
                outcome=data["outcome"].get(t, "?"),
                launches=sum(c for _, c in data["launches"][t].items()),
                distinct=len(keys),
                new=len(new),
                seconds=round(data["seconds"].get(t, 0.0), 2),
            )
        )
    for kind, fn, _ in seen:
        per_fn[(kind, fn)] += 1
        kinds[kind] += 1
    return dict(tests=tests, unique=len(seen), kinds=dict(kinds), per_fn=per_fn)


def load(paths: str) -> dict:
    """One or several (comma-separated) --json files as one run, in the given order."""
    out = dict(order=[], launches={}, outcome={}, error={}, seconds={})
    for path in paths.split(","):
        raw = json.loads(Path(path).read_text())
        out["order"] += raw["order"]
        for k in ("outcome", "error", "seconds"):
            out[k].update(raw[k])
        for t, v in raw["launches"].items():
            out["launches"][t] = Counter({tuple(k.split("\x1f")): c for k, c in v.items()})
    return out


def report(data: dict, top: int) -> str:
    s = summarize(data)
    lines = [
        f"GPU tests: {len(s['tests'])}; distinct compile keys: {s['unique']} "
        + " ".join(f"{k}={v}" for k, v in sorted(s["kinds"].items())),
        "",
        "distinct keys per kernel:",
    ]
    for (kind, fn), n in s["per_fn"].most_common():
        lines.append(f"  {n:5d}  {kind:8s} {fn}")
    lines += ["", f"tests by distinct keys (top {top}): distinct / new / outcome"]
    for t in sorted(s["tests"], key=lambda r: -r["distinct"])[:top]:
        lines.append(f"  {t['distinct']:5d} {t['new']:5d}  {t['outcome']:7s} {t['test']}")
    failed = [t for t in s["tests"] if t["outcome"] == "failed"]
    if failed:
        lines += ["", f"raised on the CPU ({len(failed)}; counted up to the exception):"]
        for t in failed:
            lines.append(f"  {t['test']}: {data['error'].get(t['test'], '')}")
    return "\n".join(lines)


def compare(a: dict, b: dict) -> str:
    sa, sb = summarize(a), summarize(b)
    lines = [
        f"tests {len(sa['tests'])} -> {len(sb['tests'])}; distinct keys {sa['unique']} -> "
        f"{sb['unique']}; largest test {max((t['distinct'] for t in sa['tests']), default=0)}"
        f" -> {max((t['distinct'] for t in sb['tests']), default=0)}",
        "per kernel (before -> after):",
    ]
    fns = set(sa["per_fn"]) | set(sb["per_fn"])
    for k in sorted(fns, key=lambda k: -sa["per_fn"].get(k, 0)):
        na, nb = sa["per_fn"].get(k, 0), sb["per_fn"].get(k, 0)
        lines.append(f"  {na:5d} -> {nb:5d}  {k[0]:8s} {k[1]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the launches per test here")
    ap.add_argument("--dry", action="store_true", help="record launches without running them")
    ap.add_argument("--top", type=int, default=25, help="tests listed in the report")
    ap.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="compare two runs (each a --json file, or several joined by commas)",
    )
    ap.add_argument("--report", metavar="JSON[,JSON...]", help="the report of --json files")
    args, pytest_args = ap.parse_known_args(argv)
    if args.compare:
        print(compare(load(args.compare[0]), load(args.compare[1])))
        return 0
    if args.report:
        print(report(load(args.report), args.top))
        return 0
    if sys.flags.optimize == 0:
        print("note: run with python -O (assertions stripped; see the docstring)", file=sys.stderr)
    ARGS_DRY[0] = args.dry

    import pytest
    import torch

    _no_checks(torch)
    fc = FakeCuda(torch)
    fc.install()
    install_hooks(fc, KeyMaker())
    _package_switches()
    rc = pytest.main(
        [
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(ROOT),
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-m",
            "gpu",
            "-q",
            "--assert=plain",  # pytest's rewritten asserts would run under python -O
            *pytest_args,
        ],
        plugins=[Plugin(fc)],
    )
    data = dict(
        order=REC.order,
        launches={
            t: {"\x1f".join(k): c for k, c in v.items()}
            for t, v in REC.launches.items()
            if t in REC.order
        },
        outcome=REC.outcome,
        error=REC.error,
        seconds=REC.seconds,
        args=pytest_args,
        dry=args.dry,
    )
    out = args.json or str(Path(tempfile.gettempdir()) / "count_compiles.json")
    Path(out).write_text(json.dumps(data, indent=0))
    print(report(load(out), args.top))
    return 0 if rc in (0, 1) else int(rc)


def _no_checks(torch) -> None:
    """The tests' value checks as no-ops (with python -O's stripped asserts), and no
    hypothesis shrinking: a check that fails on the CPU (unwritten Gluon outputs, --dry)
    neither ends the test before its later launches nor makes hypothesis run extra examples
    that the GPU run would not."""
    import numpy.testing

    def nothing(*a, **k):
        return None

    torch.testing.assert_close = nothing
    for name in ("assert_allclose", "assert_array_equal", "assert_array_almost_equal"):
        setattr(numpy.testing, name, nothing)
    with contextlib.suppress(ImportError):
        from hypothesis import Phase, settings

        settings.register_profile(
            "count_compiles", phases=[Phase.explicit, Phase.reuse, Phase.generate]
        )
        settings.load_profile("count_compiles")


def _package_switches() -> None:
    """The few switches that differ between the interpreter and the GPU and decide which
    kernels compile (imported lazily: a package may be absent from sys.path)."""
    with contextlib.suppress(ImportError):
        from flashoptim_fused import _config as fo_config

        def autotune(device) -> bool:
            return device.type == "cuda" and os.environ.get("FLASHOPTIM_NO_AUTOTUNE") != "1"

        fo_config.autotune = autotune
    with contextlib.suppress(ImportError):
        import importlib
        import pkgutil

        import flashsinkhorn
        from flashsinkhorn import primitives

        real = primitives.check_precision

        def check_precision(precision, backend):
            if precision not in primitives.PRECISIONS:
                real(precision, backend)

        for info in pkgutil.walk_packages(flashsinkhorn.__path__, "flashsinkhorn."):
            if info.name.endswith(("bench", "demo")):
                continue
            with contextlib.suppress(Exception):
                mod = importlib.import_module(info.name)
                if getattr(mod, "check_precision", None) is real:
                    mod.check_precision = check_precision


if __name__ == "__main__":
    sys.exit(main())
