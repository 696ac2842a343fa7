"""The package's structure (issue #36): every module imports on its own; the graph of
module-level imports between the package's modules has no cycle; no module imports a
package module inside a function (to dodge a cycle); no module uses another module's
private names. ``python tests/test_structure.py`` prints the import graph.
"""

import ast
import importlib
import pathlib
import pkgutil
import sys

import flashsinkhorn

ROOT = "flashsinkhorn"
SRC = pathlib.Path(flashsinkhorn.__file__).parent

# Private Triton helpers of _triton_tiles (jit tile functions, launch helpers) that the
# Triton kernel modules share. They get public names in one change with the kernel
# modules of #30 (whose rewrite of sampling.py imports them too); the Gluon side already
# has its shared helpers public (_gluon_ring.py). Nothing else may import private names.
KERNEL_HELPERS = {
    ("flashsinkhorn._triton_tiles", name)
    for name in (
        "_block_d",
        "_bucket",
        "_device",
        "_label_operands",
        "_label_tile",
        "_load_rows",
        "_lse_tile",
        "_next_pow2",
        "_online_lse_step",
        "_pick",
        "_prune",
        "_row_stationary_dot",
        "_tile_dot",
        "_tile_scores",
        "_triton_configs",
    )
} | {
    # the sm_90 modules of #30 (its branch moves these into the public _gluon_ring.py)
    ("flashsinkhorn._softmin_hopper", name)
    for name in ("_tma_load", "_turn_after", "_elem_bytes", "_tma_ready")
}


def modules():
    """Every module of the package, dotted names (the package's __init__s included)."""
    names = [ROOT]
    for info in pkgutil.walk_packages([str(SRC)], prefix=f"{ROOT}."):
        names.append(info.name)
    return sorted(names)


def _path(name):
    rel = name.split(".")[1:]
    p = SRC.joinpath(*rel)
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def _is_module(name):
    return name in set(modules())


def _resolve(node, current):
    """The package modules an import node names: ``[(module, imported names, alias map)]``."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.split(".")[0] == ROOT:
                out.append((a.name, [], {(a.asname or a.name): a.name}))
        return out
    mod = node.module or ""
    if node.level:  # relative import
        base = (
            current.split(".")[: -node.level]
            if not _path(current).name == "__init__.py"
            else (current.split(".")[: len(current.split(".")) - node.level + 1])
        )
        mod = ".".join(base + ([mod] if mod else []))
    if mod.split(".")[0] != ROOT:
        return out
    names, aliases = [], {}
    for a in node.names:
        sub = f"{mod}.{a.name}"
        if _is_module(sub):  # "from flashsinkhorn import solver": an edge to the submodule
            out.append((sub, [], {(a.asname or a.name): sub}))
        else:
            names.append(a.name)
    if names or not out:
        out.append((mod, names, aliases))
    return out


def scan(name):
    """``(module-level edges, function-level imports, private uses)`` of one module."""
    tree = ast.parse(_path(name).read_text())
    top, inner, private = set(), [], []
    bound = {}  # local names bound to package modules

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            func = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for mod, names, aliases in _resolve(child, name):
                    if func:
                        inner.append((mod, child.lineno))
                    else:
                        top.add(mod)
                    bound.update(aliases)
                    for n in names:
                        if n.startswith("_") and not n.startswith("__") and mod != name:
                            if (mod, n) not in KERNEL_HELPERS:
                                private.append((mod, n, child.lineno))
            visit(child, func)

    visit(tree, False)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            private.append((bound[node.value.id], node.attr, node.lineno))
    return top, inner, private


def graph():
    """Module-level import edges between the package's modules (importing ``a.b.c`` also
    runs the ``a.b`` package's __init__: an edge to it, except to the root package)."""
    g = {}
    for name in modules():
        edges = set()
        for mod in scan(name)[0]:
            parts = mod.split(".")
            for k in range(2, len(parts)):
                parent = ".".join(parts[:k])
                if parent != name and not name.startswith(parent + "."):
                    edges.add(parent)
            if mod != name:
                edges.add(mod)
        g[name] = sorted(e for e in edges if _is_module(e))
    return g


def cycles(g):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, []):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            strong(v)
    return out


def test_every_module_imports():
    for name in modules():
        importlib.import_module(name)


def test_import_graph_has_no_cycle():
    found = cycles(graph())
    assert not found, f"import cycles: {found}"


def test_no_package_import_inside_a_function():
    bad = [(name, mod, line) for name in modules() for mod, line in scan(name)[1]]
    assert not bad, f"imports of package modules inside functions: {bad}"


def test_no_use_of_another_modules_private_names():
    bad = [(name, *p) for name in modules() for p in scan(name)[2]]
    assert not bad, f"private names of other modules used: {bad}"


if __name__ == "__main__":
    for name, edges in graph().items():
        print(f"{name} -> {', '.join(e.removeprefix(ROOT + '.') for e in edges) or '-'}")
    print("cycles:", cycles(graph()) or "none")


MARK = "# fmt" + ": skip"  # (spelled apart: this file is scanned too)


def test_no_fmt_skip_in_the_package():
    """Constructors take keyword arguments and ruff owns the layout (the vendored shared
    benchmark harness, tools/harness.py's byte-identical copy, is the one exception)."""
    root = SRC.parent.parent  # packages/flashsinkhorn
    bad = [
        str(p.relative_to(root))
        for sub in ("src", "tests", "examples")
        for p in sorted((root / sub).rglob("*.py"))
        if p.name != "_harness.py" and MARK in p.read_text()
    ]
    assert not bad, f"{MARK} in {bad}"
