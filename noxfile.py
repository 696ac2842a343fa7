"""Sessions for the whole monorepo: lint, tests, build, demo, gpu.

The README's two commands are `nox -s demo` (the CPU demo) and
`nox -s lint tests build` (what CI runs through .ci/run).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "ci" / "constraints.txt")

# package folder -> import name
PACKAGES = {
    "flashsinkhorn": "flashsinkhorn",
    "mhc-proj": "mhc_proj",
    "flashoptim": "flashoptim_fused",  # distribution flashoptim-fused
}
# Extra demo modules run after each package's own `python -m <pkg>.demo`, if they exist.
EXTRA_DEMOS = {"flashsinkhorn": ["flashsinkhorn.second_order.demo"]}

# Triton kernels run on CPU tensors under the interpreter; this must be set before the
# interpreter imports triton, hence in the session environment, not in the tests.
CPU_ENV = {
    "TRITON_INTERPRET": "1",
    "FLASHSINKHORN_NO_AUTOTUNE": "1",
    "FLASHOPTIM_NO_AUTOTUNE": "1",
    "OMP_NUM_THREADS": "2",
    "PYTHONUNBUFFERED": "1",
}

nox.options.sessions = ["lint", "tests", "build"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True


@contextlib.contextmanager
def _venv_removed_after(session: nox.Session) -> Iterator[None]:
    """Delete the session's venv (and its tmp/) when the session ends, pass or fail.

    Every venv holds its own torch + triton (1-2.4 GB each); the nine of one CI run took
    15 GB and the CI machine ran out of disk on the ninth (2026-12-02). One at a time
    keeps the peak at one venv. A failing session is re-run to debug it anyway.
    """
    try:
        yield
    finally:
        location = Path(session.virtualenv.location).resolve()
        if (ROOT / ".nox").resolve() in location.parents:
            session.log(f"removing {location} (disk)")
            shutil.rmtree(location, ignore_errors=True)


def _has_nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def _install(session: nox.Session, *args: str, cuda: bool = True) -> None:
    # mhc-proj builds CUDA only for the visible GPUs by default (none on a CPU machine: the
    # CPU module alone). CI must compile the CUDA module where nvcc exists, so it names one
    # architecture (166 s of nvcc on 2 cores) unless the caller chose others; cuda=False
    # (the demo) keeps the package's default.
    if cuda:
        session.env.setdefault("CUDAARCHS", "90")
    session.install("-c", CONSTRAINTS, *args)


def _pytest(session: nox.Session, package: str, env: dict[str, str]) -> None:
    session.run(
        "python",
        "-m",
        "pytest",
        "-c",
        str(ROOT / "pyproject.toml"),
        "--rootdir",
        str(ROOT),
        "-p",
        "no:cacheprovider",
        "-q",
        str(ROOT / "packages" / package / "tests"),
        *session.posargs,
        env=env,
    )


def _smoke_bench(session: nox.Session, package: str, env: dict[str, str]) -> None:
    # outside the session's venv, which is deleted when the session ends
    out = ROOT / ".nox" / "smoke-bench" / f"bench-{package}-smoke.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    module = f"{PACKAGES[package]}.bench"
    session.run("python", "-m", module, "--smoke", "--json", str(out), env=env)
    session.log(f"smoke benchmark JSON written to {out}")


def _doc_blocks(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """Every ```python block of the package's README and docs pages, run as written."""
    session.run("python", str(ROOT / "tools" / "run_doc_blocks.py"), *args, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole tree, and the tests of tools/ (the
    benchmark report and the shared harness, whose vendored copies must be identical)."""
    with _venv_removed_after(session):
        _install(
            session, "ruff==0.17.6", "pytest", "torch"
        )  # ruff pinned: formatting must not drift
        session.run("ruff", "check", str(ROOT))
        session.run("ruff", "format", "--check", str(ROOT))
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tools"))


# "mhc-proj-cpu-only" builds mhc-proj with its CUDA switch off: the CPU module alone must
# build and pass, and its tests check that no CUDA module was built.
TEST_VARIANTS = ["flashsinkhorn", "mhc-proj", "mhc-proj-cpu-only", "flashoptim"]


@nox.session
@nox.parametrize("variant", TEST_VARIANTS)
def tests(session: nox.Session, variant: str) -> None:
    """One fresh venv per package: install it with its [test] extra, run its CPU suite
    (Triton under the interpreter), its --smoke benchmark and its docs' python blocks."""
    with _venv_removed_after(session):
        env = dict(CPU_ENV)
        package = variant.removesuffix("-cpu-only")
        source = f"{ROOT / 'packages' / package}[test]"
        if variant == "mhc-proj-cpu-only":
            env["MHC_PROJ_EXPECT_CUDA"] = "0"
            _install(session, "--config-settings=cmake.define.MHC_PROJ_CUDA=OFF", source)
            _pytest(session, package, env)
            return
        if package == "mhc-proj":
            env["MHC_PROJ_EXPECT_CUDA"] = "1" if _has_nvcc() else "0"
        _install(session, source)
        _pytest(session, package, env)
        _smoke_bench(session, package, env)
        _doc_blocks(session, package, env=env)


@nox.session
@nox.parametrize("package", list(PACKAGES))
def build(session: nox.Session, package: str) -> None:
    """sdist + wheel, then the wheel installed alone in a fresh venv and imported."""
    with _venv_removed_after(session):
        session.install("build")
        session.env.setdefault("CUDAARCHS", "90")  # as in _install
        dist = Path(session.create_tmp()).resolve() / "dist"
        shutil.rmtree(dist, ignore_errors=True)
        session.run(
            "python", "-m", "build", "--outdir", str(dist), str(ROOT / "packages" / package)
        )
        wheels = sorted(dist.glob("*.whl"))
        sdists = sorted(dist.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            session.error(f"expected one wheel and one sdist in {dist}, got {wheels + sdists}")
        venv = Path(session.create_tmp()).resolve() / "clean-venv"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "venv", str(venv))
        py = str(venv / "bin" / "python")
        session.run(
            py, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, str(wheels[0]), external=True
        )
        import_name = PACKAGES[package]
        # Import from a neutral folder so the source tree cannot shadow the installed wheel.
        session.chdir(str(venv))
        session.run(
            py,
            "-c",
            f"import {import_name} as m; print(m.__name__, m.__version__, m.__file__)",
            external=True,
            env=CPU_ENV,
        )


@nox.session
def demo(session: nox.Session) -> None:
    """The first thing to run: a short CPU job through all three packages. mhc-proj builds
    as pip builds it for a user: its CUDA module only for a visible GPU (on a machine
    without one, the CPU module alone: seconds, not the minutes of nvcc)."""
    with _venv_removed_after(session):
        _install(session, *(str(ROOT / "packages" / p) for p in PACKAGES), cuda=False)
        for package, import_name in PACKAGES.items():
            session.log(f"--- {package} ---")
            session.run("python", "-m", f"{import_name}.demo", env=CPU_ENV)
            for module in EXTRA_DEMOS.get(package, []):
                session.run("python", "-c", _RUN_IF_PRESENT.format(module=module), env=CPU_ENV)
        _doc_blocks(session, "--all-packages", env=CPU_ENV)  # the root README and shared pages


# Runs a demo module only if the package ships it (later issues add more demos).
_RUN_IF_PRESENT = """
import importlib.util, runpy
try:
    found = importlib.util.find_spec("{module}") is not None
except ModuleNotFoundError:
    found = False
if found:
    runpy.run_module("{module}", run_name="__main__")
else:
    print("({module} is not part of this build)")
"""


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a CUDA host: build, GPU tests and benchmarks of every package (tools/gpu_run.sh)."""
    out = session.posargs[0] if session.posargs else str(ROOT / "results" / "gpu")
    if not _has_nvcc():
        session.warn("no CUDA compiler found; the GPU runner may fail")
    session.run("bash", str(ROOT / "tools" / "gpu_run.sh"), out, external=True)
