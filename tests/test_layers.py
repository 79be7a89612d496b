"""The package's layers: each imports only what its docstring allows, nothing imports upward,
no two modules import each other, and each package's module table names what is there."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import shmstore

PACKAGE = Path(shmstore.__file__).parent
BASE = ("errors", "handle", "_proc")  # the words every layer shares
ALLOWED = re.compile(r"^May import: (.+?)\.?$", re.M)


def _layers() -> list[str]:
    """The layer names in the order the package docstring lists them, lowest first."""
    doc = shmstore.__doc__ or ""
    table = doc[doc.index("Layers, lowest first"):]
    names = [re.split(r"\s{2,}", line.strip())[0] for line in table.splitlines()[1:]
             if line.startswith("    ") and line.strip()]
    assert names and names[0] == ", ".join(BASE), f"the table must start with {BASE}: {names}"
    return ["_proc", *names[1:]]  # "_proc" stands for the three base modules


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every shmstore module `path` imports, at the top or inside a function."""
    me = _module_name(path, package)
    here = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "shmstore":
                found.add(target)
                # `from .pkg import module` imports a module too
                for alias in node.names:
                    if (package.parent / (target.replace(".", "/") + f"/{alias.name}.py")).exists():
                        found.add(f"{target}.{alias.name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "shmstore"}
    found.discard(me)  # `from . import _compiled` in a package's __init__ names its own module
    return found


def _layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__", "lowlevel"):
        return "<surface>"
    return "_proc" if parts[1] in BASE else parts[1]


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _declared(layer: str) -> set[str]:
    """What a layer's docstring lets it import ("every other layer" for the top one)."""
    if layer == "_proc":
        return set()
    path = PACKAGE / layer / "__init__.py"
    if not path.exists():
        path = PACKAGE / f"{layer}.py"
    match = ALLOWED.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    assert match, f"{path.name} of layer {layer} has no 'May import: ...' line in its docstring"
    if match.group(1) == "every other layer":
        return set(_layers()) - {layer}
    return {"_proc" if name in BASE else name for name in re.split(r"[,\s]+", match.group(1).split(" (")[0])
            if name}


def test_every_module_belongs_to_a_listed_layer() -> None:
    layers = set(_layers())
    strays = sorted(m for m in _graph() if _layer_of(m) not in layers | {"<surface>"})
    assert not strays, f"modules outside every layer of shmstore/__init__'s table: {strays}"
    surface = sorted(m for m in _graph() if _layer_of(m) == "<surface>")
    assert surface == ["shmstore", "shmstore.__main__", "shmstore.lowlevel"], surface


@pytest.mark.parametrize("layer", _layers())
def test_a_layer_declares_only_layers_below_it(layer: str) -> None:
    order = _layers()
    above = sorted(d for d in _declared(layer) if order.index(d) >= order.index(layer))
    assert not above, f"{layer} declares layers at or above itself: {above}"


@pytest.mark.parametrize("layer", _layers())
def test_a_layer_imports_only_what_it_declares(layer: str) -> None:
    allowed = _declared(layer) | {layer, "_proc"}
    if layer == "_proc":
        allowed = {"_proc"}
    wrong = sorted(f"{m} -> {d}" for m, deps in _graph().items() if _layer_of(m) == layer
                   for d in deps if _layer_of(d) not in allowed)
    assert not wrong, f"{layer} imports what its docstring does not allow: {wrong}"


def test_no_two_modules_import_each_other() -> None:
    graph = {m: {d for d in deps if d in _graph() and _layer_of(d) != "<surface>"}
             for m, deps in _graph().items()}
    # a package imports its own modules when it re-exports them: that is not a cycle
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if node.startswith(dep + "."):
                continue  # a module's own package runs first; its __init__ is checked on its own
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The parser above is what every check rests on: it must see relative, nested and
    from-package imports."""
    mod = tmp_path / "shmstore" / "store" / "x.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("def f():\n    from ..vllm import _cache\n    from . import writer\n")
    (tmp_path / "shmstore" / "vllm").mkdir()
    (tmp_path / "shmstore" / "vllm" / "_cache.py").write_text("")
    found = _imports(mod, tmp_path / "shmstore")
    assert {"shmstore.vllm", "shmstore.vllm._cache", "shmstore.store"} <= found


def _table(package: Path) -> list[str]:
    """The modules a package's docstring table names (`    name.py   what it holds`)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return re.findall(r"^\s{4}(\w+\.(?:py|c))\b", doc, re.M)


@pytest.mark.parametrize("package", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_a_packages_module_table_names_each_of_its_modules_once(package: str) -> None:
    path = PACKAGE / package
    on_disk = sorted(p.name for p in path.iterdir()
                     if p.suffix in (".py", ".c") and p.name != "__init__.py")
    table = _table(path)
    assert len(table) == len(set(table)), f"shmstore/{package}: a module named twice: {table}"
    assert sorted(table) == on_disk, (
        f"shmstore/{package}/__init__.py's module table is stale: missing "
        f"{sorted(set(on_disk) - set(table))}, naming what is not there "
        f"{sorted(set(table) - set(on_disk))}")


def test_the_compiled_code_is_one_boundary_and_each_type_has_a_python_twin() -> None:
    """Every C source is in _native/, setup.py builds only those, and each compiled type's
    Python twin (named in _native/__init__.py) offers every method the compiled type does."""
    import importlib

    from shmstore import _native

    sources = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.c"))
    assert sources and all(s.startswith("_native/") for s in sources), sources
    setup = (PACKAGE.parent / "setup.py").read_text()
    assert sorted(re.findall(r'"shmstore/([^"]+\.c)"', setup)) == sources
    stub = (PACKAGE / "_native" / "_atomic.pyi").read_text()
    for compiled, twin in _native.TWINS.items():
        module, _, name = twin.rpartition(".")
        python = getattr(importlib.import_module(module), name)
        block = stub[stub.index(f"class {compiled}:"):].split("\nclass ")[0]
        methods = set(re.findall(r"def (\w+)\(", block)) - {"__init__"}
        assert methods, f"no methods read for {compiled} from _atomic.pyi"
        missing = sorted(m for m in methods if not callable(getattr(python, m, None)))
        assert not missing, f"{twin} lacks {missing}, which the compiled {compiled} has"
        if _native.ATOMIC is not None:
            built = {m for m in dir(getattr(_native.ATOMIC, compiled)) if not m.startswith("_")}
            assert built == methods, f"_atomic.pyi and the built {compiled} differ: {built}"
