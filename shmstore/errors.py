"""The exception types of shmstore: one hierarchy under `ShmStoreError`.

Every class also derives from the stdlib exception with the same meaning, so callers can catch
either. Messages say what failed, with numbers and units, and what to do; the same values are
attributes of the exception (None where a value is unknown).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ShmStoreError",
    "InvalidArgument",
    "InvalidName",
    "SegmentNotFound",
    "SegmentExists",
    "SegmentPermissionError",
    "IncompatibleSegment",
    "SegmentTooSmall",
    "BadMagic",
    "VersionMismatch",
    "WrongSegmentKind",
    "ShmSpaceError",
    "SegmentClosed",
    "WrongProcess",
    "WrongThread",
    "StoreFull",
    "ObjectTooLarge",
    "NotSerializable",
    "KeyExists",
    "KeyNotCached",
    "InvalidKey",
    "StaleHandle",
    "InvalidHandle",
    "CorruptObject",
    "ReaderIndexError",
    "ReaderSlotBusy",
    "Timeout",
    "Closed",
    "MessageTooLarge",
    "WriterGone",
    "ProtocolError",
]


class ShmStoreError(Exception):
    """Base class of every error shmstore raises on purpose."""


class InvalidArgument(ShmStoreError, ValueError):
    """An argument outside what the call accepts (the message names it and its range)."""

    def __init__(self, message: str, argument: str, value: Any) -> None:
        super().__init__(message)
        self.argument = argument
        self.value = value


class InvalidName(ShmStoreError, ValueError):
    """A segment name that POSIX shared memory cannot hold or that could escape /dev/shm."""


class SegmentNotFound(ShmStoreError, FileNotFoundError):
    """No shared-memory object of that name exists."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class SegmentExists(ShmStoreError, FileExistsError):
    """A create found the name taken (by a live writer, or left behind by a dead one)."""

    def __init__(self, message: str, name: str, writer_pid: int | None, writer_alive: bool) -> None:
        super().__init__(message)
        self.name = name
        self.writer_pid = writer_pid
        self.writer_alive = writer_alive


class IncompatibleSegment(ShmStoreError, ValueError):
    """The name exists but is not a shmstore segment this version can use."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class SegmentTooSmall(IncompatibleSegment):
    """The object is smaller than its own header says (or than any header)."""


class BadMagic(IncompatibleSegment):
    """The object does not start with shmstore's magic bytes."""


class VersionMismatch(IncompatibleSegment):
    """The segment was written by another layout version of shmstore."""


class WrongSegmentKind(IncompatibleSegment):
    """The segment is a shmstore segment of another kind (e.g. a queue, not a store)."""


class ShmSpaceError(ShmStoreError, OSError):
    """Shared memory could not be reserved: /dev/shm is too small or full."""

    def __init__(self, message: str, requested_bytes: int, free_bytes: int | None) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes


class SegmentClosed(ShmStoreError, ValueError):
    """An operation on an object whose close() was called (before or during the call)."""


class WrongProcess(ShmStoreError, RuntimeError):
    """An object used in a process that did not create or attach it (a forked child)."""

    def __init__(self, message: str, owner_pid: int, pid: int) -> None:
        super().__init__(message)
        self.owner_pid = owner_pid
        self.pid = pid


class WrongThread(ShmStoreError, RuntimeError):
    """A writer called from a second thread while another thread is inside a call of it."""

    def __init__(self, message: str, owner_thread: int, thread: int) -> None:
        super().__init__(message)
        self.owner_thread = owner_thread
        self.thread = thread


class StoreFull(ShmStoreError, MemoryError):
    """No contiguous space is left and nothing old enough may be reclaimed."""

    def __init__(
        self,
        message: str,
        requested_bytes: int,
        capacity_bytes: int,
        lagging_readers: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.capacity_bytes = capacity_bytes
        self.lagging_readers = lagging_readers


class ObjectTooLarge(ShmStoreError, ValueError):
    """An object's serialized size exceeds the store's max_object_bytes."""

    def __init__(self, message: str, object_bytes: int, max_object_bytes: int) -> None:
        super().__init__(message)
        self.object_bytes = object_bytes
        self.max_object_bytes = max_object_bytes


class NotSerializable(ShmStoreError, TypeError, ValueError):
    """A value the serializer cannot carry (a type, an int beyond 64 bits, too deep, bad str).

    `path` says where inside the value, e.g. `obj['pixel_values'][2]`.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class KeyExists(ShmStoreError, ValueError):
    """put() of a key that is already cached; use get_cached() to hand it out again."""

    def __init__(self, message: str, key: str | bytes) -> None:
        super().__init__(message)
        self.key = key


class KeyNotCached(ShmStoreError, KeyError):
    """get_cached() of a key that is not (or no longer) in the store."""

    def __init__(self, message: str, key: str | bytes) -> None:
        super().__init__(message)
        self.key = key

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class InvalidKey(ShmStoreError, TypeError, ValueError):
    """A key that is neither str nor bytes (TypeError), or is empty (ValueError)."""


class StaleHandle(ShmStoreError, LookupError):
    """A handle whose object was reclaimed, cleared, or belongs to another store."""

    def __init__(self, message: str, handle: Any = None, name: str | None = None) -> None:
        super().__init__(message)
        self.handle = handle
        self.name = name


class InvalidHandle(ShmStoreError, ValueError):
    """A value that is not a well-formed Handle (wrong types, out-of-range fields, bad bytes)."""


class CorruptObject(ShmStoreError, ValueError):
    """Bytes read from shared memory (or a message) fail validation.

    `name` is the segment, when known. A reader that raises this has already given the object
    up (counted as read), so the writer is not blocked by it.
    """

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class ReaderIndexError(ShmStoreError, IndexError):
    """A reader index outside 0..n_readers-1."""

    def __init__(self, message: str, reader: Any, n_readers: int) -> None:
        super().__init__(message)
        self.reader = reader
        self.n_readers = n_readers


class ReaderSlotBusy(ShmStoreError, RuntimeError):
    """A reader index is held by another live process, or already attached in this one."""

    def __init__(self, message: str, reader: int, pid: int) -> None:
        super().__init__(message)
        self.reader = reader
        self.pid = pid


class Timeout(ShmStoreError, TimeoutError):
    """A blocking call ran out of time; `lagging_readers` names whom a writer waited for."""

    def __init__(self, message: str, timeout_s: float | None,
                 lagging_readers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s
        self.lagging_readers = lagging_readers


class SegmentPermissionError(ShmStoreError, PermissionError):
    """The segment exists but this process may not open it (another user, or mode too strict)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class Closed(ShmStoreError, EOFError):
    """The writer closed the queue: no message will come any more."""


class MessageTooLarge(ShmStoreError, ValueError):
    """A message does not fit one queue slot (send large values through a Channel)."""

    def __init__(self, message: str, message_bytes: int, slot_bytes: int) -> None:
        super().__init__(message)
        self.message_bytes = message_bytes
        self.slot_bytes = slot_bytes


class WriterGone(ShmStoreError, ConnectionError):
    """The writer process died: no message will come any more (unlike Closed, not on purpose)."""

    def __init__(self, message: str, name: str, writer_pid: int) -> None:
        super().__init__(message)
        self.name = name
        self.writer_pid = writer_pid


class ProtocolError(ShmStoreError, ValueError):
    """A message from the network breaks the relay protocol (or comes from another version);
    it is dropped, never acted on."""
