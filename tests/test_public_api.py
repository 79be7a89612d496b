"""The public surface is pinned, and the core import is light."""

from __future__ import annotations

import subprocess
import sys

import shmstore

EXPECTED = {
    "ObjectStore", "StoreWriter", "StoreReader", "StoreStats", "Handle", "BroadcastQueue",
    "QueueWriter", "QueueReader", "Channel", "ChannelWriter", "ChannelReader", "CACHE_KINDS",
    "SenderCache", "ReceiverCache", "CacheStats", "mm_hash", "dumps", "loads", "Blank",
    "ShmStoreError", "InvalidArgument", "SegmentNotFound", "SegmentExists",
    "SegmentPermissionError", "IncompatibleSegment", "ShmSpaceError", "SegmentClosed",
    "WrongProcess", "WrongThread", "StoreFull", "ObjectTooLarge", "NotSerializable", "KeyExists",
    "KeyNotCached",
    "InvalidKey", "StaleHandle", "InvalidHandle", "CorruptObject", "ReaderIndexError",
    "ReaderSlotBusy", "Timeout", "Closed", "MessageTooLarge", "WriterGone",
    "ProtocolError",
}


def test_all_is_pinned() -> None:
    assert set(shmstore.__all__) == EXPECTED
    for public in shmstore.__all__:
        assert hasattr(shmstore, public), public


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
    assert issubclass(shmstore.WrongThread, RuntimeError)
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
