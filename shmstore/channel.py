"""Channel: a BroadcastQueue for the order plus an ObjectStore for the bytes.

`writer.send(obj)` sends small values inline in a queue slot and stores large ones in the store,
sending only their Handle; `reader.recv()` gives the same value back either way. Given a `key`
that is already cached, `send` hands the stored object out again instead of copying it.

The channel `name` owns two segments, `<name>.store` and `<name>.queue`; the writer unlinks both.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._closeable import Closeable
from .broadcast import BroadcastQueue, QueueReader, QueueWriter
from .errors import CorruptObject
from .handle import Handle
from .segment import validate_name
from .serde import encode
from .store import ObjectStore, StoreReader, StoreWriter

__all__ = ["Channel", "ChannelWriter", "ChannelReader"]

TAG_INLINE = 0
TAG_HANDLE = 1
DEFAULT_INLINE_THRESHOLD = 64 << 10  # above this a value is stored and only its Handle is sent
HANDLE_MESSAGE_BYTES = 256  # a Handle message with room to spare


class Channel:
    """Factory for the two sides; `create` gives the writer, `attach` a reader."""

    @staticmethod
    def create(
        name: str | None,
        n_readers: int,
        capacity: int = 256 << 20,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        *,
        n_slots: int = 64,
        max_object_size: int | None = None,
        mode: int = 0o600,
    ) -> ChannelWriter:
        """Create the store and the queue of a channel; the caller owns both.

        Args:
            name: base name of the two segments (None: a random `shmstore-...`; see `.name`).
            capacity: bytes of the store for values above `inline_threshold`.
            inline_threshold: largest serialized value sent inline in a queue slot.
            n_slots: queue slots; the writer blocks when a reader is this many messages behind.
        """
        if name is None:
            name = f"shmstore-{secrets.token_hex(6)}"
        validate_name(name)
        if isinstance(inline_threshold, bool) or not isinstance(inline_threshold, int) or not (
                0 <= inline_threshold <= 1 << 30):
            raise ValueError(f"inline_threshold must be an int in [0, 2**30], got {inline_threshold!r}")
        store = ObjectStore.create(f"{name}.store", capacity, n_readers, max_object_size, mode=mode)
        try:
            queue = BroadcastQueue.create(
                f"{name}.queue", n_readers, slot_bytes=max(inline_threshold, HANDLE_MESSAGE_BYTES),
                n_slots=n_slots, mode=mode)
        except BaseException:
            store.close()
            raise
        return ChannelWriter(name, store, queue, inline_threshold)

    @staticmethod
    def attach(name: str, reader: int) -> ChannelReader:
        """Attach as reader `reader`; messages sent from now on are received."""
        store = ObjectStore.attach(f"{name}.store", reader)
        try:
            queue = BroadcastQueue.attach(f"{name}.queue", reader)
        except BaseException:
            store.close()
            raise
        return ChannelReader(store, queue)


class _Pair(Closeable):
    _store: Any = None
    _queue: Any = None

    def close(self) -> None:
        """Close the queue, then the store; idempotent (the writer also unlinks both)."""
        if self._queue is not None:
            self._queue.close()
        if self._store is not None:
            self._store.close()



class ChannelWriter(_Pair):
    """The single sender. Values above inline_threshold go through the store."""

    def __init__(self, name: str, store: StoreWriter, queue: QueueWriter,
                 inline_threshold: int) -> None:
        self.name = name
        self._store = store
        self._queue = queue
        self.inline_threshold = inline_threshold
        self._anonymous = itertools.count()
        self.sent_inline = 0
        self.sent_by_handle = 0

    @property
    def store(self) -> StoreWriter:
        return self._store  # type: ignore[no-any-return]

    @property
    def queue(self) -> QueueWriter:
        return self._queue  # type: ignore[no-any-return]

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until every reader has attached to the queue."""
        self._queue.wait_for_readers(timeout)

    def send(self, obj: Any, key: str | bytes | None = None, timeout: float | None = None) -> None:
        """Send `obj` to every reader.

        Args:
            key: a content hash; when it is cached the stored object is handed out again and
                nothing is copied. Without a key a large value is stored under a fresh one.
            timeout: seconds to wait for space in the store and in the queue.
        """
        store: StoreWriter = self._store
        queue: QueueWriter = self._queue
        if key is not None and store.is_cached(key):
            handle = store.get_cached(key)
        else:
            enc = encode(obj)
            if enc.nbytes <= self.inline_threshold:
                queue._publish(enc, TAG_INLINE, timeout)
                self.sent_inline += 1
                return
            if key is None:
                key = f"#channel-{next(self._anonymous)}"
            handle = store.put(key, obj, timeout=timeout)
        try:
            queue._publish(encode(handle), TAG_HANDLE, timeout)
        except BaseException:
            store.release(handle)  # no reader will read this hand-out
            raise
        self.sent_by_handle += 1


class ChannelReader(_Pair):
    """One receiver. It never needs to know whether a value came inline or by handle."""

    def __init__(self, store: StoreReader, queue: QueueReader) -> None:
        self._store = store
        self._queue = queue

    def _next(self, timeout: float | None) -> tuple[Any, bool]:
        msg, tag = self._queue._receive(timeout)
        if tag == TAG_INLINE:
            return msg, False
        if tag != TAG_HANDLE or type(msg) is not Handle:
            raise CorruptObject(f"channel message with tag {tag} holds a {type(msg).__name__}, "
                                "not what that tag carries")
        return msg, True

    def recv(self, timeout: float | None = None) -> Any:
        """Return the next value as an owned copy."""
        msg, by_handle = self._next(timeout)
        return self._store.get(msg) if by_handle else msg

    @contextmanager
    def recv_view(self, timeout: float | None = None) -> Iterator[Any]:
        """Yield the next value; stored values are zero-copy views valid inside the block."""
        msg, by_handle = self._next(timeout)
        if not by_handle:
            yield msg
            return
        with self._store.view(msg) as obj:
            yield obj
