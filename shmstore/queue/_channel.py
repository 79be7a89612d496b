"""Channel: a BroadcastQueue for the order plus an ObjectStore for the bytes.

`writer.send(obj)` sends small values inline in a queue slot and stores large ones in the store,
sending only their Handle; `reader.recv()` gives the same value back either way. Given a `key`
that is already cached, `send` hands the stored object out again instead of copying it.

The channel `name` owns two segments, `<name>.store` and `<name>.queue`; the writer unlinks both.

Joining: a reader attaches the queue first (from then on every message is kept for it), then
the store owing only hand-outs after number J (`StoreReader.joined_handout`). Each handle message
carries its hand-out number; a reader skips handle messages numbered J or lower (sent while it
was attaching, and not owed to it), so its store and queue memberships start at the same point:
it is never owed an object it will not receive, nor given one that may be reclaimed under it.
`wait_for_readers()` returns only after both attaches completed, so every message sent after it
reaches every reader.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from .._proc import int_arg
from ..errors import CorruptObject, InvalidArgument, InvalidHandle, SegmentClosed, ShmStoreError
from ..handle import Handle, HandOut
from ..serde._codec import Encoded, encode
from ..shm._closeable import Closeable
from ..shm._segment import validate_name
from ..shm._wait import Deadline
from ..store._object_store import ObjectStore, StoredBody, StoreReader, StoreWriter
from ..store._writer import Reservation
from ._broadcast import BroadcastQueue, QueueReader, QueueWriter

__all__ = ["Channel", "ChannelWriter", "ChannelReader", "RawMessage", "TAG_INLINE", "TAG_HANDLE"]

TAG_INLINE = 0  # queue tag of a value sent inline
TAG_HANDLE = 1  # queue tag of a stored object's hand-out: HandOut.to_words()
DEFAULT_INLINE_THRESHOLD = 64 << 10  # above this a value is stored and only its Handle is sent
HANDLE_MESSAGE_BYTES = 256  # a Handle message with room to spare


@dataclass(frozen=True, slots=True)
class RawMessage:
    """A message as ChannelReader.recv_raw yields it: `stored` is None for an inline `value`,
    else the stored object's body, with its `handle` and hand-out number."""

    value: Any
    stored: StoredBody | None
    handle: Handle | None
    handout: int


class Channel:
    """Factory for the two sides; `create` gives the writer, `attach` a reader."""

    @staticmethod
    def create(
        name: str | None,
        *,
        n_readers: int,
        capacity_bytes: int = 256 << 20,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        n_slots: int = 64,
        max_object_bytes: int | None = None,
        policy: str = "fifo",
        mode: int = 0o600,
    ) -> ChannelWriter:
        """Create the store and the queue of a channel; the caller owns both.

        Args:
            name: base name of the two segments (None: a random `shmstore-...`; see `.name`).
            capacity_bytes: bytes of the store for values above `inline_threshold`.
            inline_threshold: largest serialized value sent inline in a queue slot.
            n_slots: queue slots; the writer blocks when a reader is this many messages behind.
        """
        if name is None:
            name = f"shmstore-{secrets.token_hex(6)}"
        validate_name(name)
        inline_threshold = int_arg(inline_threshold, "inline_threshold", 0, 1 << 30)
        store = ObjectStore.create(f"{name}.store", capacity_bytes=capacity_bytes,
                                   n_readers=n_readers, max_object_bytes=max_object_bytes,
                                   policy=policy, mode=mode)
        try:
            queue = BroadcastQueue.create(
                f"{name}.queue", n_readers=n_readers,
                slot_bytes=max(inline_threshold, HANDLE_MESSAGE_BYTES), n_slots=n_slots, mode=mode)
        except BaseException:
            store.close()
            raise
        return ChannelWriter(name, store, queue, inline_threshold)

    @staticmethod
    def attach(name: str, reader: int) -> ChannelReader:
        """Attach as reader `reader`; every message sent after this returns is received."""
        queue = BroadcastQueue.attach(f"{name}.queue", reader)
        try:
            store = ObjectStore.attach(f"{name}.store", queue.reader, from_start=False)
        except BaseException:
            queue.close()
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

    @property
    def closed(self) -> bool:
        return bool(self._queue is None or self._queue.closed)


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

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until every reader has attached (queue and store)."""
        deadline = Deadline(timeout)
        self._queue.wait_for_readers(deadline.remaining())
        self._store.wait_for_readers(deadline.remaining())

    def send(self, obj: Any, key: str | bytes | None = None, timeout: float | None = None) -> None:
        """Send `obj` to every reader.

        Args:
            key: a content hash; when it is cached the stored object is handed out again and
                nothing is copied. Without a key a large value is stored under a fresh one.
            timeout: seconds to wait, in all, for space in the store and in the queue (None:
                without limit, 0: not at all).

        Raises:
            StoreFull, Timeout: no space in time. NotSerializable, ObjectTooLarge.
        """
        found = None if key is None else self._store.hand_out_cached([key])[0]
        if found is not None:
            self._publish(found, Deadline(timeout))
        else:
            self.send_encoded(encode(obj), key, timeout)

    def send_encoded(self, enc: Encoded, key: str | bytes | None = None,
                     timeout: float | None = None) -> None:
        """send() of a value already encoded (serde.encode, or a serde.Verbatim body); `key`,
        if given, is one not cached (else KeyExists, for a value above the inline threshold)."""
        deadline = Deadline(timeout)
        if enc.nbytes <= self.inline_threshold:
            self._queue.publish(enc, deadline, tag=TAG_INLINE)
            self.sent_inline += 1
            return
        if key is None:
            key = f"#channel-{next(self._anonymous)}"
        self._publish(self._store.hand_out_new(key, enc, deadline.remaining()), deadline)

    @contextmanager
    def reserve(self, template: Any, key: str | bytes | None = None,
                timeout: float | None = None) -> Iterator[Reservation]:
        """send() with the arrays written in place: `template` holds `Blank`s, the block fills
        `r.arrays[...]` (see StoreWriter.reserve), and on a clean exit the value is stored and
        sent; if the block raises, nothing is stored or sent. Always goes through the store."""
        deadline = Deadline(timeout)
        store: StoreWriter = self._store
        if key is None:
            key = f"#channel-{next(self._anonymous)}"
        with store.reserve(key, template, deadline.remaining()) as reservation:
            yield reservation
        assert reservation.handout is not None  # set by a clean exit
        self._publish(reservation.handout, deadline)

    def publish(self, handout: HandOut, timeout: float | None = None) -> None:
        """Send a hand-out just made on `store` (hand_out_new, hand_out_cached, hand_out) to
        every reader, as send() does; for a writer that uses the store directly too. Call it
        before the next hand-out (readers that take messages in order rely on the numbers
        rising). If it raises (no queue space in time: Timeout), the hand-out is given back.

        Raises:
            InvalidArgument: `handout` is not a HandOut (a bare Handle does not say which
                hand-out it is).
        """
        if type(handout) is not HandOut:
            raise InvalidArgument(f"publish() sends one hand-out: pass the HandOut the store "
                                  f"returned (hand_out_new, hand_out_cached, hand_out), not "
                                  f"{type(handout).__name__}", "handout", None)
        self._publish(handout, Deadline(timeout))

    def _publish(self, handout: HandOut, deadline: Deadline) -> None:
        try:
            self._queue.publish(encode(handout.to_words()), deadline, tag=TAG_HANDLE)
        except BaseException:
            with suppress(ShmStoreError):  # closed meanwhile: nothing to give back to
                self._store.give_back(handout.handle, handout.number)  # no reader reads it
            raise
        self.sent_by_handle += 1

    def end(self, *, upstream_gone: bool = False) -> None:
        """Close the queue: readers get Closed after the last message (WriterGone with
        `upstream_gone`, for a relay whose writer died). The store stays open (handles already
        received stay readable) until close()."""
        self._queue.close(upstream_gone=upstream_gone)


class ChannelReader(_Pair):
    """One receiver. It never needs to know whether a value came inline or by handle."""

    def __init__(self, store: StoreReader, queue: QueueReader) -> None:
        self._store = store
        self._queue = queue
        self.reader = queue.reader

    @property
    def max_inline_bytes(self) -> int:
        """Largest inline message the channel's queue carries."""
        return int(self._queue.slot_bytes)

    @property
    def max_object_bytes(self) -> int:
        """Largest serialized object the channel's store takes."""
        return int(self._store.max_object_bytes)

    @property
    def store_epoch(self) -> int:
        """The random epoch of the channel's store (new per writer): names its objects' ids."""
        return int(self._store.epoch)

    def _next(self, deadline: Deadline) -> tuple[Any, int]:
        """The next value (inline), or handle, with its hand-out number (0 for inline)."""
        store: StoreReader = self._store
        while True:
            tag, msg = self._queue.receive(deadline)
            if tag == TAG_INLINE:
                return msg, 0
            try:
                handout = HandOut.from_words(msg if tag == TAG_HANDLE else None)
            except InvalidHandle:  # another tag, or words that are not a hand-out's
                raise CorruptObject(f"channel message with tag {tag} holds {type(msg).__name__} "
                                    "that is not what that tag carries") from None
            if handout.number > store.joined_handout:
                return handout.handle, handout.number
            # handed out before this reader joined the store: not owed to it, not read

    def recv(self, timeout: float | None = None) -> Any:
        """Return the next value as an owned copy."""
        msg, handout = self._next(Deadline(timeout))
        if not handout:
            return msg
        try:
            return self._store.get(msg)
        finally:
            self._done(handout)

    @contextmanager
    def recv_view(self, timeout: float | None = None) -> Iterator[Any]:
        """Yield the next value; stored values are zero-copy views valid inside the block."""
        msg, handout = self._next(Deadline(timeout))
        if not handout:
            yield msg
            return
        try:
            with self._store.view(msg) as obj:
                yield obj
        finally:
            self._done(handout)

    @contextmanager
    def recv_raw(self, timeout: float | None = None, *, keep: bool = False
                 ) -> Iterator[RawMessage]:
        """Yield the next message undecoded, for forwarding it (a relay): an inline value as
        it is, a stored one as its serialized body (`StoreReader.body`), valid in the block.

        With `keep`, a stored object stays owed to this reader after the block: `body(handle)`
        reads it again until `release_through(raw.handout)` gives it (and those before) up.
        """
        msg, handout = self._next(Deadline(timeout))
        if not handout:
            yield RawMessage(msg, None, None, 0)
            return
        try:
            with self._store.body(msg, count=not keep) as stored:
                yield RawMessage(None, stored, msg, handout)
        except BaseException:
            self._done(handout)
            raise
        if not keep:
            self._done(handout)

    def recv_handle(self, timeout: float | None = None) -> Handle:
        """Return the next stored message's Handle without reading it: the object stays owed
        to this reader until `get(handle)` or `discard(handle)`, in any order. For a reader that
        matches objects to requests arriving another way; never mix with recv, recv_view or
        recv_raw on one reader (those release in order).

        Raises:
            CorruptObject: the next message is a value sent inline (this reader only takes
                stored ones: send with a store-only writer, e.g. `publish`).
        """
        msg, handout = self._next(Deadline(timeout))
        if not handout:
            raise CorruptObject(f"channel {self._queue.name!r} sent a value inline to a reader "
                                "that takes only stored objects (recv_handle); send it "
                                "through the store (ChannelWriter.publish)")
        return msg  # type: ignore[no-any-return]

    def get(self, handle: Handle) -> Any:
        """An owned copy of an object received with recv_handle (StoreReader.get)."""
        return self._store.get(handle)

    def discard(self, handle: Handle) -> None:
        """Give up an object received with recv_handle unread (StoreReader.discard)."""
        self._store.discard(handle)

    def body(self, handle: Handle) -> AbstractContextManager[StoredBody]:
        """Read a kept object's body again (see recv_raw): a context manager yielding a
        StoredBody, valid inside the block."""
        store: StoreReader = self._store
        return store.body(handle, count=False)

    def release_through(self, handout: int) -> None:
        """Give up kept objects handed out up to number `handout` (see recv_raw)."""
        self._done(handout)

    def _done(self, handout: int) -> None:
        """Hand-outs up to this one are done: read, or lost with a damaged message."""
        with suppress(SegmentClosed):
            self._store.finished_through(handout)
