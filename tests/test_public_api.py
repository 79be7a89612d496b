"""The public surface is pinned, and the core import is light."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import shmstore

EXPECTED = {
    "ObjectStore", "StoreWriter", "StoreReader", "StoreStats", "Handle", "HandOut", "BroadcastQueue",
    "QueueWriter", "QueueReader", "Channel", "ChannelWriter", "ChannelReader", "CACHE_KINDS",
    "SenderCache", "ReceiverCache", "CacheStats", "mm_hash", "dumps", "loads", "Blank",
    "ShmStoreError", "InvalidArgument", "InvalidKey", "NotSerializable", "ObjectTooLarge",
    "StoreFull", "KeyExists", "KeyNotCached", "StaleHandle", "CorruptObject", "Timeout", "Closed",
    "WriterGone", "MessageTooLarge", "SegmentExists", "SegmentNotFound", "ShmSpaceError",
}
FACES = {  # each namespace a user may import from, and exactly what it offers
    "shmstore.lowlevel": {
        "Segment", "ShmRingBuffer", "RingWriter", "encode", "decode", "Encoded", "Verbatim",
        "WriterAPI", "WriterHost", "RemoteWriter", "Reservation", "EvictionPolicy", "FifoPolicy",
        "ReinsertPolicy", "FreqPolicy", "RecencyPolicy", "AdaptivePolicy", "RingReplay",
        "POLICIES", "DEFAULT_POLICY", "RING_POLICY", "make_policy"},
    "shmstore.relay": {
        "Publisher", "Relay", "CurveKeys", "PublisherSecurity", "RelaySecurity", "Timing",
        "NodeChannel", "PublisherStats", "NodeStats", "RelayStats",
        "generate_keys", "check_endpoint", "DEFAULT_WINDOW", "DEFAULT_PEER_TIMEOUT_S",
        "DEFAULT_HEARTBEAT_S"},
    "shmstore.vllm": {
        "register", "ENABLE_ENV", "POLICY_ENV", "SETTLE_ENV", "LEASE_ENV", "PUBLISH_ENV",
        "KEYS_ENV", "ALLOW_ENV", "INSECURE_ENV", "WAIT_ENV", "ACCELERATE_ENV"},
}


def test_all_is_pinned() -> None:
    assert set(shmstore.__all__) == EXPECTED
    for public in shmstore.__all__:
        assert hasattr(shmstore, public), public


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_is_pinned(face: str) -> None:
    module = importlib.import_module(face)
    assert set(module.__all__) == FACES[face]
    for public in module.__all__:
        assert hasattr(module, public), f"{face}.{public}"


def test_every_error_is_in_errors_and_the_top_level_ones_are_the_same_objects() -> None:
    import shmstore.errors

    classes = {n for n, v in vars(shmstore.errors).items()
               if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == "shmstore.errors"}
    assert classes == set(shmstore.errors.__all__)
    for public in EXPECTED & classes:
        assert getattr(shmstore, public) is getattr(shmstore.errors, public)


def test_importing_a_face_does_not_pull_vllm_or_torch() -> None:
    code = ("import sys, shmstore.lowlevel, shmstore.relay, shmstore.vllm; "
            "print([m for m in ('vllm', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


CREATES = ["ObjectStore", "BroadcastQueue", "Channel", "lowlevel.ShmRingBuffer",
           "lowlevel.Segment"]


@pytest.mark.parametrize("owner", CREATES)
def test_every_create_argument_after_the_name_is_keyword_only(owner: str) -> None:
    import inspect

    import shmstore.lowlevel

    cls = getattr(shmstore.lowlevel if owner.startswith("lowlevel.") else shmstore,
                  owner.removeprefix("lowlevel."))
    params = list(inspect.signature(cls.create).parameters.values())
    assert params[0].name == "name"
    assert all(p.kind is p.KEYWORD_ONLY for p in params[1:]), owner


def test_docs_and_examples_import_only_faces() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    deep = re.compile(r"(?:from|import) shmstore\.(?!errors\b|lowlevel\b|relay\b|vllm\b)[\w.]+")
    found = [f"{p.relative_to(root)}: {m.group(0)}"
             for p in [root / "README.md", *sorted((root / "docs").glob("*.md")),
                       *sorted((root / "examples").glob("*.py"))]
             for m in deep.finditer(p.read_text())]
    assert not found, found


def test_errors_share_one_base_and_stdlib_meanings() -> None:
    import shmstore.errors

    for public in shmstore.errors.__all__:
        obj = getattr(shmstore.errors, public)
        assert isinstance(obj, type) and issubclass(obj, shmstore.ShmStoreError), public
    assert issubclass(shmstore.InvalidArgument, ValueError)
    assert issubclass(shmstore.NotSerializable, TypeError)
    assert issubclass(shmstore.InvalidKey, TypeError) and issubclass(shmstore.InvalidKey, ValueError)
    assert issubclass(shmstore.StoreFull, MemoryError)
    assert issubclass(shmstore.ObjectTooLarge, ValueError)
    assert issubclass(shmstore.Timeout, TimeoutError)
    assert issubclass(shmstore.errors.WrongThread, RuntimeError)
    assert issubclass(shmstore.ShmSpaceError, OSError)
    assert issubclass(shmstore.SegmentNotFound, FileNotFoundError)
    assert issubclass(shmstore.Closed, EOFError)
    assert issubclass(shmstore.MessageTooLarge, ValueError)


def test_import_is_light_and_does_not_pull_torch() -> None:
    heavy = ("torch", "blake3", "matplotlib")
    code = f"import sys, shmstore; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


ENTRY_POINTS = {  # (group, name): the object it must load; what users' installs depend on
    ("vllm.general_plugins", "shmstore"): "shmstore.vllm.plugin:register",
    ("console_scripts", "shmstore"): "shmstore.cli:main",
}


def test_entry_points_are_declared_installed_and_load() -> None:
    """pyproject declares them, the installed metadata agrees (a stale install would hide a
    rename), and each loads the function it names."""
    import importlib.metadata
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    declared = {("console_scripts", k): v for k, v in project["project"]["scripts"].items()}
    for group, table in project["project"]["entry-points"].items():
        declared.update({(group, k): v for k, v in table.items()})
    assert {key: declared.get(key) for key in ENTRY_POINTS} == ENTRY_POINTS
    for (group, name), value in ENTRY_POINTS.items():
        found = [e for e in importlib.metadata.entry_points(group=group) if e.name == name]
        assert [e.value for e in found] == [value], f"reinstall (pip install -e .): {found}"
        assert callable(found[0].load())


def test_the_version_is_stated_once() -> None:
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert shmstore.__version__ == project["project"]["version"]
