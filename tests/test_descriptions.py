"""Facts stated once: the policy list, the default policy, and the error hierarchy of the cache
layer. A drift between code and docs fails here, not in a user's hands."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import shmstore
import shmstore.errors
from shmstore.cache._caches import CACHE_KINDS, DEFAULT_KIND
from shmstore.cache._hitsim import SIM_KINDS
from shmstore.store._policy import DEFAULT_POLICY, POLICIES, POLICY_IDS, RING_POLICY

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(shmstore.__file__).parent
NAMES = "|".join(POLICIES)
# "`adaptive` (default)", "(default `shm-adaptive`)", "freq      the default:", "default freq"
STATED = [re.compile(rf"`?(?:shm-)?({NAMES})`?\s*\((?:the )?(?:caches' )?default\b"),
          re.compile(rf"\(default:?\s*`?(?:shm-)?({NAMES})`?"),
          re.compile(rf"\b({NAMES})\s+the (?:caches' )?default\b"),
          re.compile(rf"\bdefaults? to `?(?:shm-)?({NAMES})\b")]


def texts() -> list[tuple[str, str]]:
    """(where, line) of every line of the README, the docs and the package's sources."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(PACKAGE.rglob("*.py"))]
    return [(f"{p.relative_to(ROOT)}:{i}", line) for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1)]


def test_the_kinds_derive_from_the_one_policy_list() -> None:
    assert CACHE_KINDS == (*(f"shm-{p}" for p in POLICIES), "lru")
    assert SIM_KINDS == CACHE_KINDS and DEFAULT_KIND == f"shm-{DEFAULT_POLICY}"
    assert sorted(POLICY_IDS.values()) == sorted(POLICIES)
    assert all(cls.name == name for name, cls in POLICIES.items())
    assert {DEFAULT_POLICY, RING_POLICY} <= set(POLICIES)


def test_every_default_policy_the_docs_state_is_the_one_in_code() -> None:
    wrong = []
    for where, line in texts():
        for pattern in STATED:
            for found in pattern.finditer(line):
                meant = RING_POLICY if "ObjectStore" in line else DEFAULT_POLICY
                if found.group(1) != meant and "before" not in line:
                    wrong.append(f"{where}: {line.strip()}")
    assert not wrong, f"a default other than {DEFAULT_POLICY!r} (caches) / {RING_POLICY!r} " \
                      f"(ObjectStore): {wrong}"


def test_the_check_sees_a_wrong_default() -> None:
    stated = [p.search(line) for line in ("fifo | freq (default freq)", "`fifo` (default)")
              for p in STATED]
    assert {m.group(1) for m in stated if m} == {"freq", "fifo"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "cache").glob("*.py")), ids=lambda p: p.name)
def test_the_cache_layer_raises_through_the_hierarchy(path: Path) -> None:
    allowed = set(shmstore.errors.__all__) | {"ModuleNotFoundError", "NotImplementedError"}
    wrong = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name) and call.id[0].isupper() and call.id not in allowed:
                wrong.append(f"line {node.lineno}: {call.id}")
    assert not wrong, f"{path.name} raises outside shmstore.errors: {wrong}"


def _design_tree() -> dict[str, set[str]]:
    """The modules docs/design.md's tree names, by package ('' for the top level)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text[text.index("```text\nshmstore/\n") + len("```text\nshmstore/\n"):]
    named: dict[str, set[str]] = {}
    package: str | None = None
    for line in block[:block.index("```")].splitlines():
        start = re.match(r"  ([\w/]+?)/\s", line)
        if start:
            package = start.group(1)  # "  shm/  _segment.py ...": a subpackage's first line
            # ("  vllm/_accel/ ...": a subpackage's own subpackage)
        elif re.match(r"  \w+\.py\b", line):
            package = ""  # "  metrics.py ...": the top level
        elif not line.startswith(" " * 13):
            package = None  # tests/, bench/, ...: beside the package
        if package is not None:
            named.setdefault(package, set()).update(re.findall(r"\b(\w+\.(?:py|c))\b", line))
    return named


def test_the_design_pages_tree_names_every_module_and_nothing_else() -> None:
    named = _design_tree()
    packages = sorted(p.parent.relative_to(PACKAGE).as_posix()
                      for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert sorted(k for k in named if k) == packages
    for package in ["", *packages]:
        folder = PACKAGE / package
        on_disk = {p.name for p in folder.iterdir()
                   if p.suffix in (".py", ".c") and p.name not in ("__init__.py", "__main__.py")}
        assert named[package] == on_disk, (
            f"docs/design.md's tree of shmstore/{package}: missing "
            f"{sorted(on_disk - named[package])}, naming what is not there "
            f"{sorted(named[package] - on_disk)}")


LAYERS = "_native|shm|serde|store|queue|cache|relay|cli|vllm"
# vllm.x.y is vLLM's own unless x is one of the plugin's modules (private, or its entry point)
DOTTED = re.compile(r"(?<![\w./])(?:shmstore\.)?"
                    r"(?:(_native|shm|serde|store|queue|cache|relay|cli)\.([a-z_]\w*)"
                    r"|(vllm)\.(_\w+|plugin))\.(\w+)")
PATH = re.compile(rf"(?<![\w./])(?:shmstore/)?({LAYERS})/((?:\w+/)?\w+\.(?:py|c))\b")


def test_every_module_the_sources_and_docs_name_exists() -> None:
    """`store._policy.POLICIES` or `vllm/_records.py` in a docstring, comment or page names a
    module that is there (five docstrings named paths from before a rename)."""
    wrong = []
    for where, line in texts() + [(f"CONTRIBUTING.md:{i}", line) for i, line in enumerate(
            (ROOT / "CONTRIBUTING.md").read_text().splitlines(), 1)]:
        for found in DOTTED.finditer(line):
            package, module = found.group(1) or found.group(3), found.group(2) or found.group(4)
            if not ((PACKAGE / package / f"{module}.py").exists()
                    or (PACKAGE / package / module / "__init__.py").exists()):
                wrong.append(f"{where}: {package}.{module}")
        for package, file in PATH.findall(line):
            if not (PACKAGE / package / file).exists():
                wrong.append(f"{where}: {package}/{file}")
    assert not wrong, f"names of modules that are not there: {wrong}"


def test_the_reference_check_sees_a_stale_name() -> None:
    assert DOTTED.search("a name of store.policy.POLICIES").groups()[:2] == ("store", "policy")
    assert DOTTED.search("see shmstore.vllm._recrds.read").groups()[2:4] == ("vllm", "_recrds")
    assert DOTTED.search("vllm.multimodal.cache") is None  # vLLM's own
    assert PATH.findall("in shmstore/vllm/_recrds.py") == [("vllm", "_recrds.py")]
    assert PATH.findall("tests/vllm/test_x.py") == []  # the tests' tree is not the package's
