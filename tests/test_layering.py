"""The package's layering (jax_dg/__init__.py's docstring): every import, at module level or
inside a function, goes to the module's own layer or one it may use, no import cycle exists,
the product's helpers and layers never import the pure-JAX reference (the test oracle), and
torch is imported only by the run-time half and the backends (and the torch interop)."""

from __future__ import annotations

import ast
import pathlib

import jax_dg

# The imported package's sources: the repository's, or an installed wheel's (scripts/test_versions.sh).
ROOT = pathlib.Path(jax_dg.__file__).resolve().parent

# The ops layer's folders: the op records, what users build operands with, the tools around.
OPS_FOLDERS = ("ops", "operands", "tools")
# layer -> layers its modules may import
MAY_IMPORT = {
    "contracts": set(),
    "numerics": {"contracts", "numerics"},
    "backends": {"contracts", "backends"},
    "reference": {"contracts", "numerics", "reference"},
    "core": {"contracts", "numerics", "backends", "core"},
    # the run-time half: what runs inside a DeepGEMM call; nothing of jax_dg imports it (the
    # bridge's C++ handler does, at its first call)
    "runtime": {"contracts", "numerics", "backends", "core", "runtime"},
    "ops": {"contracts", "numerics", "backends", "reference", "core", "ops"},
    "public": {"contracts", "numerics", "backends", "reference", "core", "ops", "public"},
    "nn": {"contracts", "numerics", "core", "ops", "nn"},   # never the oracle, never the package root
}
# The product's own code: the user helpers and the composed layers. They never import
# jax_dg.reference (what they compute is tested against it, so it must not be it). The ops'
# declarations do import it: an Op record's `reference=` is the oracle and the "xla" backend.
PRODUCT_FOLDERS = ("operands", "tools", "nn")
PRODUCT_MODULES = {"jax_dg.ops.linear"}
LEAVES = {"jax_dg.backends.deep_gemm"}   # import nothing of jax_dg


def layer(module: str) -> str:
    if module in ("jax_dg", "jax_dg.__main__"):
        return "public"
    if module == "jax_dg.contracts":
        return "contracts"
    if module == "jax_dg.numerics":
        return "numerics"
    if module == "jax_dg.nn" or module.startswith("jax_dg.nn."):
        return "nn"
    if any(module == f"jax_dg.{f}" or module.startswith(f"jax_dg.{f}.") for f in OPS_FOLDERS):
        return "ops"
    for name in ("backends", "reference", "core", "runtime"):
        if module == f"jax_dg.{name}" or module.startswith(f"jax_dg.{name}."):
            return name
    raise AssertionError(f"{module} is in no layer: add it to the table in jax_dg/__init__.py")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """jax_dg modules a file imports, anywhere in it (`from jax_dg.x import y` counts as
    jax_dg.x.y when that is a module, else jax_dg.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jax_dg"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jax_dg":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in g.items():
        for dst in sorted(targets):
            if dst == "jax_dg" or (src.startswith(dst + ".") and dst in (
                    "jax_dg.backends", "jax_dg.reference", "jax_dg.core", "jax_dg.ops",
                    "jax_dg.runtime")):
                continue  # the package itself (a parent package import is no dependency)
            if src in LEAVES:
                bad.append(f"{src} -> {dst}: {src} must import nothing of jax_dg")
            elif layer(dst) not in MAY_IMPORT[layer(src)]:
                bad.append(f"{src} ({layer(src)}) -> {dst} ({layer(dst)})")
    return bad


def product(g: dict[str, set[str]]) -> set[str]:
    """The product's own modules: everything in its folders, and the composed layers."""
    return {m for m in g if any(m.startswith(f"jax_dg.{f}.") for f in PRODUCT_FOLDERS)} | \
        (PRODUCT_MODULES & set(g))


def reference_imports(g: dict[str, set[str]]) -> list[str]:
    """Imports of jax_dg.reference (the package or a module of it) by product modules."""
    return [f"{src} -> {dst}" for src in sorted(product(g)) for dst in sorted(g[src])
            if dst == "jax_dg.reference" or dst.startswith("jax_dg.reference.")]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_import_goes_downward():
    assert violations(graph()) == []


def test_the_product_never_imports_the_oracle():
    g = graph()
    assert PRODUCT_MODULES <= set(g), PRODUCT_MODULES - set(g)   # a rename must not slip out
    assert len(product(g)) >= 9
    assert reference_imports(g) == []


def test_the_layout_shows_the_layers():
    # the package root holds the public face and the two plain-data/maths leaves; every other
    # module lives in the folder of its layer
    root = sorted(p.stem for p in ROOT.glob("*.py"))
    assert root == ["__init__", "__main__", "contracts", "numerics"]
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("_"))
    assert folders == ["backends", "core", "nn", "operands", "ops", "reference", "runtime", "tools"]


# The modules that may import torch: the run-time half, the torch emulation, DeepGEMM's native
# calls (built against torch on first use), the torch interop (its purpose), and `info`, which
# reports torch's version.
TORCH_MODULES = ("jax_dg.runtime", "jax_dg.backends.torch_emu", "jax_dg.backends.deep_gemm_native",
                 "jax_dg.tools.interop", "jax_dg.__main__")


def torch_importers() -> set[str]:
    out = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "torch" for n in names):
                out.add(name)
    return out


def test_torch_is_imported_only_by_the_run_time_half_and_the_backends():
    found = torch_importers()
    assert {m for m in found if not m.startswith(TORCH_MODULES)} == set()
    assert "jax_dg.runtime.run" in found and "jax_dg.backends.torch_emu.device" in found


def test_no_import_cycle():
    g = graph()
    # the package __init__ imports everything; submodules importing `jax_dg` itself would close
    # a loop through it, so none may
    assert not [src for src, t in g.items() if "jax_dg" in t and src != "jax_dg.__main__"]
    assert cycles({k: v - {"jax_dg"} for k, v in g.items()}) == []


def test_the_checks_catch_what_they_are_for():
    g = {"jax_dg.contracts": {"jax_dg.core.op"}, "jax_dg.core.op": {"jax_dg.contracts"},
         "jax_dg.reference.mqa": {"jax_dg.backends.torch_emu"},
         "jax_dg.backends.deep_gemm": {"jax_dg.contracts"}}
    assert len(violations(g)) == 3
    assert cycles(g) == [["jax_dg.contracts", "jax_dg.core.op"]]
    # numerics sits just above contracts: it imports no reference, core or op ...
    assert len(violations({"jax_dg.numerics": {"jax_dg.reference.quant", "jax_dg.core.checks"},
                           "jax_dg.reference.quant": {"jax_dg.numerics", "jax_dg.contracts"}})) == 2
    # ... and the product's helpers and layers reach no reference module, while an op may
    g = {"jax_dg.operands.paged": {"jax_dg.reference.paged_mqa", "jax_dg.numerics"},
         "jax_dg.ops.linear": {"jax_dg.reference"}, "jax_dg.operands.quant": {"jax_dg.numerics"},
         "jax_dg.ops.gemm": {"jax_dg.reference.gemm"}}
    assert reference_imports(g) == ["jax_dg.operands.paged -> jax_dg.reference.paged_mqa",
                                    "jax_dg.ops.linear -> jax_dg.reference"]
