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
