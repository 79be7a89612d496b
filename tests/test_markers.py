"""The fast lane stays fast: every test module that starts vLLM, a server or a multi-node relay
carries the `serving` marker on the whole module, so `pytest -m "not serving"` leaves it out."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# what a module names when it starts one of them: the launcher scripts and the relay's workers
STARTS_SERVING = ('with_name("shmstore")', "vllm_engine_run", "vllm_requests_run", "relay_workers",
                  "Server(model")  # a `vllm serve` of tests/vllm/served.py


def module_marks(path: Path) -> set[str]:
    """The marker names in the module's `pytestmark` assignment."""
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                  for t in node.targets)):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def serving_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if p != Path(__file__).resolve() and any(s in p.read_text() for s in STARTS_SERVING))


def test_the_check_finds_the_modules_that_start_servers() -> None:
    names = {p.name for p in serving_modules()}
    assert {"test_vllm_engine.py", "test_vllm_serve_shapes.py", "test_vllm_start.py",
            "test_relay_mp.py"} <= names, names


@pytest.mark.parametrize("path", serving_modules(), ids=lambda p: p.name)
def test_a_module_that_starts_servers_is_marked_serving(path: Path) -> None:
    assert "serving" in module_marks(path), (
        f"{path.relative_to(TESTS)} starts vLLM, a server or a multi-node relay: add "
        "pytest.mark.serving to its module-level pytestmark")


# what a test names when it looks at all of /dev/shm, or removes every dead writer's segments
SEES_ALL_SHM = ("left_since(", "sweep_dead(", 'cli("gc")', '"SHMSTORE_SWEEP": "1"')


@pytest.mark.parametrize("path", sorted(p for p in TESTS.rglob("test_*.py")
                                        if p != Path(__file__).resolve()
                                        and any(s in p.read_text() for s in SEES_ALL_SHM)),
                         ids=lambda p: p.name)
def test_a_module_that_sees_all_of_dev_shm_marks_those_tests_alone(path: Path) -> None:
    """scripts/test.sh runs the tests on two processes: a test that looks at everything in
    /dev/shm (or removes every dead writer's segments) would see (or take) the other's, so it
    is marked `alone` and runs after them."""
    text = path.read_text()
    assert "mark.alone" in text, (
        f"{path.relative_to(TESTS)} looks at all of /dev/shm: mark those tests "
        "pytest.mark.alone")
