"""The public surface is pinned, and the core import is light."""

from __future__ import annotations

import subprocess
import sys

import shmstore

EXPECTED = {
    "BadMagic", "CorruptObject", "Handle", "IncompatibleSegment", "InvalidHandle", "InvalidKey",
    "InvalidName", "KeyExists", "KeyNotCached", "ObjectStore", "ObjectTooLarge", "ReaderIndexError",
    "ReaderSlotBusy", "RingWriter", "Segment", "SegmentClosed", "SegmentExists", "SegmentNotFound",
    "SegmentPermissionError", "SegmentTooSmall", "ShmRingBuffer", "ShmSpaceError", "ShmStoreError",
    "StaleHandle", "StoreFull", "StoreReader", "StoreStats", "StoreWriter", "Timeout",
    "VersionMismatch", "WrongSegmentKind", "decode", "dumps", "encode", "loads",
    "BroadcastQueue", "QueueReader", "QueueWriter", "Channel", "ChannelReader", "ChannelWriter",
    "Closed", "MessageTooLarge", "CACHE_KINDS", "CacheStats", "ReceiverCache", "SenderCache",
    "make_cache", "mm_hash", "WriterGone",
}


def test_all_is_pinned() -> None:
    assert set(shmstore.__all__) == EXPECTED
    for public in shmstore.__all__:
        assert hasattr(shmstore, public), public


def test_errors_share_one_base_and_stdlib_meanings() -> None:
    for public in shmstore.__all__:
        obj = getattr(shmstore, public)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, shmstore.ShmStoreError), public
    assert issubclass(shmstore.StoreFull, MemoryError)
    assert issubclass(shmstore.ObjectTooLarge, ValueError)
    assert issubclass(shmstore.Timeout, TimeoutError)
    assert issubclass(shmstore.ShmSpaceError, OSError)
    assert issubclass(shmstore.SegmentNotFound, FileNotFoundError)
    assert issubclass(shmstore.Closed, EOFError)
    assert issubclass(shmstore.MessageTooLarge, ValueError)


def test_import_is_light_and_does_not_pull_torch() -> None:
    heavy = ("torch", "blake3", "matplotlib")
    code = f"import sys, shmstore; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
