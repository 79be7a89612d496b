"""The vLLM wing has one door: only vllm/_vllm.py imports or names the vllm package or reads
attributes of vLLM's objects (an item's fields: also vllm/_items.py), only vllm/_deployment.py
reads vLLM's configuration and the environment, every environment variable is named in
vllm/_env.py, and no module asks which kind of writer it holds."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shmstore

WING = Path(shmstore.__file__).parent / "vllm"
MODULES = sorted(WING.rglob("*.py"))  # the acceleration room (_accel/) too


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def names_vllm(path: Path) -> list[str]:
    """Where `path` imports vllm or names one of its modules in a string."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "vllm":
                found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("vllm.") and node.value != "vllm.plugins.shmstore":
                found.append(node.value)
    return found


def reads_config_or_environment(path: Path) -> list[str]:
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "vllm_config" or (node.value.id == "os" and
                                                   node.attr in ("environ", "getenv")):
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in ("env_seconds", "env_switch"):
            found.append(f"line {node.lineno}: {node.id}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(WING).as_posix())
def test_only_the_door_names_vllm(path: Path) -> None:
    if path.name == "_vllm.py":
        assert names_vllm(path), "the door names what it takes from vLLM"
        return
    assert not names_vllm(path), f"{path.name} names vLLM's API: go through _vllm.py"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(WING).as_posix())
def test_only_the_deployment_reads_vllms_configuration_and_the_environment(path: Path) -> None:
    found = reads_config_or_environment(path)
    if path.name == "_deployment.py":
        assert found
        return
    if path.name == "plugin.py":  # the on/off switch, read before vLLM is imported
        assert all("env_switch" in f for f in found), found
        return
    assert not found, f"{path.name} reads vLLM's configuration or the environment: {found}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(WING).as_posix())
def test_environment_variables_are_named_once_and_no_writer_kind_is_asked(path: Path) -> None:
    for node in ast.walk(tree(path)):
        if path.name != "_env.py" and isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            assert not [n for n in names if n.endswith("_ENV")], f"{path.name}: {names}"
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
            kinds = ast.unparse(node.args[1])
            assert "Writer" not in kinds, f"{path.name} line {node.lineno}: isinstance {kinds}"


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom vllm.x import y\ndef f(vllm_config):\n"
                   "    return vllm_config.parallel_config, os.environ, 'vllm.v1.engine'\n")
    assert names_vllm(bad) == ["vllm.x", "vllm.v1.engine"]
    assert [f.split(": ")[1] for f in reads_config_or_environment(bad)] == [
        "vllm_config.parallel_config", "os.environ"]


SHAPES = [  # (config fields, shape, readers, why it cannot be served)
    ({}, "local", 2, None),
    ({"api_servers": 2, "api_rank": 1}, "remote", 2, None),
    ({"api_servers": 2, "dp": 2}, "local", 4, None),
    ({"nodes": 2, "world_size": 4}, "relay", 2, None),
    ({"nodes": 2, "world_size": 4, "api_servers": 2}, "relay", 2, "several API servers"),
    ({"dp": 2, "dp_local": 1}, "local", 2, "other nodes"),
]


@pytest.mark.parametrize(("fields", "shape", "readers", "why"), SHAPES)
def test_a_deployment_is_read_once_into_its_shape(fields: dict, shape: str, readers: int,
                                                 why: str | None, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from shmstore.vllm._deployment import Deployment
    from tests.vllm.test_vllm_plugin import config

    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "door-test")
    d = Deployment.read(config("door-test", **fields))
    assert (d.shape, d.n_readers, d.name) == (shape, readers, "door-test")
    assert (d.unservable is None) if why is None else (why in (d.unservable or ""))
    assert d.keeps_shm() is (why is None)
    with pytest.raises(AttributeError):
        d.name = "other"  # type: ignore[misc]


def test_a_bad_environment_value_is_refused_when_the_deployment_is_read(monkeypatch) -> None:
    pytest.importorskip("vllm")
    from shmstore.errors import InvalidArgument
    from shmstore.vllm._deployment import Deployment
    from shmstore.vllm._env import SETTLE_ENV
    from tests.vllm.test_vllm_plugin import config

    monkeypatch.setenv(SETTLE_ENV, "soon")
    with pytest.raises(InvalidArgument, match=SETTLE_ENV):
        Deployment.read(config("x"))


@pytest.mark.parametrize(("env", "on", "warned"), [
    ({}, True, []),
    ({"SHMSTORE_VLLM_ACCELERATE": "0"}, False, []),
    ({"SHMSTORE_VLLM_ACCELERATE": "off", "SHMSTORE_VLLM_LAZY_IMAGES": "1"}, False,
     ["SHMSTORE_VLLM_LAZY_IMAGES"]),
    ({"SHMSTORE_VLLM_LAZY_IMAGES": "0"}, False, ["SHMSTORE_VLLM_LAZY_IMAGES"]),
    ({"SHMSTORE_VLLM_SHARE_UPDATES": "0", "SHMSTORE_VLLM_LAZY_IMAGES": "yes"}, False,
     ["SHMSTORE_VLLM_LAZY_IMAGES", "SHMSTORE_VLLM_SHARE_UPDATES"]),
    ({"SHMSTORE_VLLM_SHARE_UPDATES": "1"}, True, ["SHMSTORE_VLLM_SHARE_UPDATES"]),
])
def test_one_switch_turns_the_acceleration_on_or_off(env: dict, on: bool, warned: list,
                                                     monkeypatch, caplog) -> None:
    """SHMSTORE_VLLM_ACCELERATE, and the two switches it replaced: still obeyed (a 0 turns
    the whole acceleration off), each named in a warning that says what replaces it."""
    pytest.importorskip("vllm")
    from shmstore.vllm._accel import Acceleration
    from shmstore.vllm._deployment import Deployment
    from tests.vllm.test_vllm_plugin import config

    for name in ("SHMSTORE_VLLM_ACCELERATE", "SHMSTORE_VLLM_LAZY_IMAGES",
                 "SHMSTORE_VLLM_SHARE_UPDATES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("WARNING", logger="vllm.plugins.shmstore"):
        d = Deployment.read(config("x"))
    assert d.accelerate is on
    said = [r.getMessage() for r in caplog.records if "is replaced by" in r.getMessage()]
    assert [m.split()[1] for m in said] == warned
    assert all("SHMSTORE_VLLM_ACCELERATE" in m for m in said)
    if not on:  # off: no fingerprint, so no record is written or read, and no lazy image
        import threading

        accel = Acceleration(d.accelerate, d.processor_identity, d.vocab_size, threading.Lock())
        assert accel.fingerprint({"size": 336}) is None and not accel.lazy_images
        assert accel.record(["any"], None) is None


def test_a_bad_acceleration_switch_is_refused(monkeypatch) -> None:
    pytest.importorskip("vllm")
    from shmstore.errors import InvalidArgument
    from shmstore.vllm._deployment import Deployment
    from tests.vllm.test_vllm_plugin import config

    monkeypatch.setenv("SHMSTORE_VLLM_LAZY_IMAGES", "maybe")
    with pytest.raises(InvalidArgument, match="SHMSTORE_VLLM_LAZY_IMAGES"):
        Deployment.read(config("x"))


def _declared_shapes() -> tuple[set[str], set[str]]:
    """The attribute names of _vllm.py's SHAPES and ITEM_SHAPES, read without importing vLLM."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree(WING / "_vllm.py")):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                node.target.id in ("SHAPES", "ITEM_SHAPES") and node.value is not None:
            found[node.target.id] = {a for attrs in ast.literal_eval(node.value).values()
                                     for a in attrs}
    return found["SHAPES"], found["ITEM_SHAPES"]


def reads_attributes(path: Path, names: set[str]) -> list[str]:
    """Where `path` reads or sets one of `names` as an attribute (x.name, getattr(x, "name"))."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "getattr", "setattr", "hasattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append(f"line {node.lineno}: {node.func.id} {node.args[1].value!r}")  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(WING).as_posix())
def test_only_the_door_reads_vllms_objects_and_only_items_their_fields(path: Path) -> None:
    """Every attribute the plugin reads on a vLLM object is listed in the door (SHAPES) and
    read there; an item's fields (ITEM_SHAPES) are read there or in _items.py only."""
    shapes, item_shapes = _declared_shapes()
    if path.name == "_vllm.py":
        return
    allowed = item_shapes if path.name == "_items.py" else set()
    found = reads_attributes(path, (shapes | item_shapes) - allowed)
    assert not found, (f"{path.name} reads attributes of vLLM's objects: {found}; read them "
                       "through an accessor of _vllm.py and list them in its SHAPES")


def test_this_vllm_has_every_attribute_the_door_lists(monkeypatch) -> None:
    pytest.importorskip("vllm")
    from shmstore.vllm import _vllm

    assert _vllm.missing_shapes() == []
    assert len(_vllm.SHAPES) >= 8 and len(_vllm.ITEM_SHAPES) == 4
    monkeypatch.setitem(_vllm.SHAPES, ("vllm.v1.core.sched.output", "NewRequestData"),
                        ("req_id", "renamed_in_a_later_vllm"))
    assert _vllm.missing_shapes() == ["NewRequestData.renamed_in_a_later_vllm"]


def test_the_shape_checks_see_what_they_look_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(req, inputs):\n    return req.req_id, getattr(inputs, 'cache', None)\n")
    assert [f.split(": ")[1] for f in reads_attributes(bad, {"req_id", "cache"})] == [
        ".req_id", "getattr 'cache'"]
    shapes, items = _declared_shapes()
    assert {"request_id", "scheduled_new_reqs", "mm_data_items"} <= shapes and "slices" in items


def test_the_processor_hook_hands_vllm_a_copy_whose_cache_is_the_view() -> None:
    """with_cache: vLLM's ProcessorInputs copied with another cache; the original unchanged
    (the request's scope travels in the copy only)."""
    pytest.importorskip("vllm")
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from shmstore.vllm._vllm import with_cache

    inputs = ProcessorInputs([1, 2], {}, hf_processor_mm_kwargs={"size": 336}, cache="sender")
    out = with_cache(inputs, "view")
    assert (out.cache, inputs.cache) == ("view", "sender")
    assert out.prompt is inputs.prompt and out.hf_processor_mm_kwargs is inputs.hf_processor_mm_kwargs


def test_another_vllm_version_makes_the_plugin_stand_aside(monkeypatch) -> None:
    """A vLLM the plugin does not know (0.34, an older one) is refused at start in one line
    that names the version and what is supported; TRY_VERSION lets an operator try it, and
    the door's checks still run then."""
    pytest.importorskip("vllm")
    from shmstore.vllm import _deployment

    monkeypatch.delenv("SHMSTORE_VLLM_TRY_VERSION", raising=False)
    assert _deployment.vllm_refusal() is None  # the version this suite runs
    monkeypatch.setattr(_deployment, "installed_vllm", lambda: "0.34.0")
    said = _deployment.vllm_refusal()
    assert said is not None and "vLLM 0.34.0 is not a version it knows" in said
    assert "(it serves 0.32.x, 0.33.x)" in said and "SHMSTORE_VLLM_TRY_VERSION=1" in said
    monkeypatch.setattr(_deployment, "PENDING_VLLM", {"0.34": "its new budget is not kept"})
    said = _deployment.vllm_refusal()  # a release known and not served yet says why
    assert said is not None and "vLLM 0.34.0 is known but not served yet: its new budget" in said
    monkeypatch.setenv("SHMSTORE_VLLM_TRY_VERSION", "1")
    assert _deployment.vllm_refusal() is None  # tried on purpose: the door's checks pass
    monkeypatch.delenv("SHMSTORE_VLLM_TRY_VERSION")
    for served in ("0.32.7", "0.33.0"):
        monkeypatch.setattr(_deployment, "installed_vllm", lambda v=served: v)
        assert _deployment.vllm_refusal() is None


def test_a_vllm_without_a_name_the_door_uses_makes_the_plugin_stand_aside(monkeypatch) -> None:
    pytest.importorskip("vllm")
    from vllm.multimodal.processing.processor import BaseMultiModalProcessor

    from shmstore.vllm import _deployment

    monkeypatch.delattr(BaseMultiModalProcessor, "_get_cache_missing_items")
    said = _deployment.vllm_refusal()
    assert said is not None and "BaseMultiModalProcessor._get_cache_missing_items" in said


def test_register_stands_aside_in_one_line_and_leaves_vllms_cache() -> None:
    """In a fresh process, as vLLM calls the entry point: the plugin binds nothing."""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"
        "from shmstore.vllm import _deployment, plugin\n"
        "_deployment.installed_vllm = lambda: '0.31.2'\n"
        "plugin.register()\n"
        "from vllm.multimodal.cache import factories\n"
        "assert not getattr(factories._get_cache_type, '_shmstore_hook', False)\n"
        "assert not plugin._registered\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "shmstore" in line]
    assert len(lines) == 1 and "stands aside" in lines[0] and "vLLM 0.31.2" in lines[0], lines


def test_the_vllm_under_test_is_the_one_asked_for() -> None:
    """scripts/check-vllm-next.sh runs these tests against another vLLM release: they must see
    that release, not the CPU build installed in .venv."""
    import os

    wanted = os.environ.get("SHMSTORE_TEST_VLLM_VERSION")
    if not wanted:
        pytest.skip("no other vLLM release asked for (scripts/check-vllm-next.sh sets one)")
    import vllm

    from shmstore.vllm import _deployment

    assert vllm.__version__ == _deployment.installed_vllm() == wanted


def test_the_shm_type_has_no_engine_cache_that_could_report_drift(monkeypatch) -> None:
    """vLLM (0.33) invalidates a sender's item only for a drift its engine's own receiver cache
    reports; with the `shm` type there is none, so invalidation is never reached."""
    pytest.importorskip("vllm")
    from vllm.multimodal.cache import factories

    monkeypatch.setattr(factories, "_get_cache_type", lambda vllm_config: "shm")
    assert factories.engine_receiver_cache_from_config(None) is None
