"""ObjectStore: objects keyed by content hash in one shared ring, read in place by N readers.

The writer (`ObjectStore.create`, a StoreWriter, store/_writer.py) puts objects and hands out
Handles; each reader (`ObjectStore.attach(name, reader=i)`, a StoreReader) reads them with `get`
(owned copy) or `view` (zero copy). Layouts, and why a chunk under read is never reused:
store/_layout.py. Delivery accounting and exception safety: store/_writer.py. Reader rows and
liveness: shm/_readers.py.

A reader that finds an object damaged (its structure fails its CRC, or its sizes do not fit)
raises CorruptObject and gives the object up: it counts as read, so the writer is never blocked
by bytes nobody can decode, and the row's corrupt_reads counter says it happened.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .._proc import int_arg
from ..errors import CorruptObject, InvalidArgument, StaleHandle
from ..handle import Handle
from ..serde._codec import decode
from ..shm._closeable import CallGuard
from ..shm._header import peek_epoch
from ..shm._readers import MAX_READERS
from ..shm._ring import RingWriter, ShmRingBuffer
from ..shm._segment import ALIGN_BYTES, MAX_CAPACITY_BYTES, align_up
from ._base import StoreBase, StoreStats
from ._layout import (
    COUNT_MASK,
    MAX_PINS,
    META_HANDOUT_SEQ,
    OBJECT_HEADER,
    ROW_ATTACH_HANDOUT,
    ROW_CORRUPT_READS,
    ROW_DONE_THROUGH,
    ROW_PIN_MASK,
    ROW_PINS,
    ROW_TOTAL_READS,
    STORE_META,
    STORE_ROW,
    U64,
    counter_offset,
    object_header_bytes,
)
from ._policy import RING_POLICY, make_policy
from ._writer import StoreWriter

__all__ = ["ObjectStore", "StoreWriter", "StoreReader", "StoreStats", "StoredBody", "MAX_READERS"]


@dataclass(frozen=True, slots=True)
class StoredBody:
    """One object's serialized body as StoreReader.body yields it.

    `object_id` (key digest + origin seq, 24 bytes) names these bytes in this store's epoch:
    a copy forward keeps it, a new put of the same key gets a new one.
    """

    object_id: bytes
    data: memoryview


class ObjectStore:
    """Makes the two sides of a store: `create` gives the writer, `attach` a reader."""

    @staticmethod
    def create(
        name: str | None,
        *,
        capacity_bytes: int,
        n_readers: int,
        max_object_bytes: int | None = None,
        policy: str = RING_POLICY,
        mode: int = 0o600,
        prefault: bool = True,
    ) -> StoreWriter:
        """Create a store and return its writer (this process owns and later unlinks it).

        Args:
            name: the segment name in /dev/shm (None: a random `shmstore-...` name).
            capacity_bytes: bytes of the ring that holds the objects.
            n_readers: how many readers must read each object before it can be reclaimed.
            max_object_bytes: largest serialized object accepted (default: what fits the ring).
            policy: a name of store._policy.POLICIES: "fifo" (RING_POLICY, the default),
                "reinsert", "freq", "recency" or "adaptive" (DEFAULT_POLICY: what caches run).
            mode: permission bits of the segment (0o600: this user only).
            prefault: map with MAP_POPULATE so puts take no page faults.

        Raises:
            InvalidArgument: a value out of range (the message gives the range).
            SegmentExists, ShmSpaceError: see Segment.create.
        """
        n_readers = int_arg(n_readers, "n_readers", 0, MAX_READERS)
        eviction = make_policy(policy)
        header_bytes = object_header_bytes(n_readers)
        capacity_bytes = int_arg(capacity_bytes, "capacity_bytes", 4 * ALIGN_BYTES + header_bytes,
                                 MAX_CAPACITY_BYTES)
        largest = align_up(capacity_bytes) - ALIGN_BYTES - header_bytes  # one object filling it
        if max_object_bytes is None:
            max_object_bytes = largest
        max_object_bytes = int_arg(max_object_bytes, "max_object_bytes", 1, largest)
        ring = ShmRingBuffer.create(
            name, capacity_bytes=capacity_bytes, meta_bytes=STORE_META.size + STORE_ROW.size * n_readers,
            n_readers=n_readers, mode=mode, prefault=prefault,
        )
        try:
            STORE_META.pack_into(ring.meta, 0, max_object_bytes, eviction.id, 0)
            return StoreWriter(ring, eviction)
        except BaseException:
            ring.close()
            raise

    @staticmethod
    def segment_bytes(capacity_bytes: int, n_readers: int) -> int:
        """Bytes of /dev/shm a store made with `capacity_bytes` and `n_readers` reserves: its
        ring and the segment's header, meta area and reader rows."""
        meta_bytes = STORE_META.size + STORE_ROW.size * n_readers
        return ShmRingBuffer.segment_bytes(capacity_bytes, meta_bytes)

    @staticmethod
    def ring_bytes_for(object_bytes: int, n_readers: int) -> int:
        """Ring bytes one object of `object_bytes` (serialized) takes with `n_readers`: chunk
        header, object header, read counters, body, rounded to cache lines."""
        return RingWriter.chunk_bytes_for(object_header_bytes(n_readers) + object_bytes)

    @staticmethod
    def attach(name: str, reader: int, *, from_start: bool = True,
               prefault: bool = True) -> StoreReader:
        """Attach to the store `name` as reader number `reader` (0..n_readers-1).

        Args:
            from_start: the first reader of an index owes every object handed out since the
                store was created (the writer keeps them for it). False: only objects handed out
                after this attach (a Channel's readers, which get handles from a queue they join
                now). A replacement of an earlier reader of the index always owes only later
                hand-outs.
        """
        ring = ShmRingBuffer.attach(name, prefault=prefault)
        try:
            return StoreReader(ring, reader, from_start)
        except BaseException:
            ring.close()
            raise


class StoreReader(StoreBase):
    """One reader of a store: get (owned copy), view (zero copy), discard.

    Writes only its own row and its own counter in each object. May be used from several
    threads of the process that attached it (not from a forked child: WrongProcess).
    """

    reader = -1
    generation = 0
    joined_handout = 0  # hand-outs up to this number were made before this reader joined

    def __init__(self, ring: ShmRingBuffer, reader: Any, from_start: bool) -> None:
        super().__init__(ring)
        self._reader_ring = ring
        self._lock = threading.RLock()  # pins and counters of this reader, across threads
        self._pins_free = list(range(MAX_PINS - 1, -1, -1))
        self._pin_bits = 0
        words = self._words
        handout_word = self._meta + META_HANDOUT_SEQ
        owe_all = [False]

        def prepare(row: int, generation: int) -> None:
            owe_all[0] = from_start and generation == 1
            after = 0 if owe_all[0] else words.load_acquire(handout_word)
            words.store_release(row + ROW_ATTACH_HANDOUT, after)
            for i in range(MAX_PINS):  # a dead predecessor's pins
                words.store_release(row + ROW_PINS + 8 * i, 0)
            words.store_release(row + ROW_PIN_MASK, 0)
            words.store_release(row + ROW_DONE_THROUGH, 0)

        def settle(row: int, generation: int) -> None:
            # Hand-outs made before our row was visible may have been judged "not owed" and
            # reclaimed: owe (and accept) only those after the number read now.
            if not owe_all[0]:
                self.joined_handout = words.load_acquire(handout_word)
                words.store_release(row + ROW_ATTACH_HANDOUT, self.joined_handout)

        self.reader, self.generation = self._table.attach(reader, self, prepare, settle)
        self._row = self._table.row(self.reader)
        self._mask_word = self._row + ROW_PIN_MASK
        self._pin_words = [self._row + ROW_PINS + 8 * i for i in range(MAX_PINS)]
        self._reads = words.load_acquire(self._row + ROW_TOTAL_READS)
        self._corrupt_reads = words.load_acquire(self._row + ROW_CORRUPT_READS)
        self._guard = CallGuard(f"store {self.name!r} reader {self.reader}", os.getpid())

    def _epoch_mismatch(self, handle: Handle) -> str:
        now = peek_epoch(self.name)
        if now is not None and now != self.epoch and handle.epoch == now:
            # the handle is good: this reader's attachment is what is stale
            return (f"this reader is attached to an earlier incarnation of store {self.name!r} "
                    f"(epoch {self.epoch:#x}): its writer made the store anew (epoch {now:#x}), "
                    f"and handle {handle} is from the new one. Close this reader and attach "
                    "again to read it")
        return super()._epoch_mismatch(handle)

    @property
    def reads(self) -> int:
        """Reads this reader index has finished, ever."""
        return self._reads

    @property
    def corrupt_reads(self) -> int:
        """Objects this reader index gave up on because they failed validation, ever."""
        return self._corrupt_reads

    def get(self, handle: Handle, *, count: bool = True, pin_memory: bool = False,
            origin: int | None = None) -> Any:
        """Return an owned copy of the object and count one read (unless `count` is False: a
        reader reading a hand-out it has read before, whose read is counted already). With
        `pin_memory`, torch tensors are copied into page-locked memory, from which a CUDA
        device copy needs no staging copy (CUDA only). With `origin`, the object must be the
        bytes the put of that seq wrote (StoredBody.object_id's last word).

        Raises:
            InvalidArgument: pin_memory without CUDA.
            StaleHandle: the object was reclaimed, cleared, or the handle is from another store,
                or its bytes are not those of `origin` (no read is counted).
            CorruptObject: the bytes fail validation (the object is given up: counted as read).
            SegmentClosed: this reader was closed (before or during the call).
        """
        if pin_memory:
            _check_pinnable()
        guard = self._guard_enter()
        try:
            pin = self._pin(handle)
            done = None
            try:
                located = self._locate(handle)
                if origin is not None and located[3] != origin:
                    raise StaleHandle(f"handle {handle} names the bytes of put {origin}, but the "
                                      f"object at its address in store {self.name!r} holds those "
                                      f"of put {located[3]}: stale or damaged", handle, self.name)
                obj = self._decode(handle, copy=True, located=located, pin_memory=pin_memory)
                if self._words.load_acquire(handle.address) not in (handle.seq, 0):
                    # Reused under the pin: impossible unless the pin words were damaged.
                    raise StaleHandle(f"object seq {handle.seq} in store {self.name!r} was "
                                      "overwritten while it was copied (this reader's pin words "
                                      "are damaged); ask the writer to send it again",
                                      handle, self.name)
                done = handle if count else None
                return obj
            finally:
                self._unpin(pin, done)
        finally:
            guard.leave()

    def view(self, handle: Handle) -> AbstractContextManager[Any]:
        """Yield the object with arrays/tensors pointing into shared memory; count the read on
        exit.

        The bytes cannot change while the block runs (not even through clear()); once it exits
        the writer may reuse them. Keep what you need with `.copy()` / `.clone()`, or use get().
        An array kept past the block (a name still bound to it, a slice stored elsewhere) is
        not detected: it later shows whatever the writer puts there, the one way this library
        returns other bytes without an error. Each view or get counts one read of one
        hand-out: reading a hand-out twice counts two, so the writer may reclaim the object
        while a later hand-out of it is still owed, and that read then fails StaleHandle.
        """
        return self._pinned(handle, lambda: self._decode(handle, copy=False))

    def body(self, handle: Handle, *, count: bool = True) -> AbstractContextManager[StoredBody]:
        """Yield the object's serialized body (checked: it decodes) as a read-only view into
        shared memory, with the object's identity; count the read on exit unless `count` is
        False (a reader that gives hand-outs up with finished_through). For forwarding an
        object without decoding it (a relay); the view is valid inside the block only."""
        def read() -> StoredBody:
            located = self._locate(handle)
            body, body_bytes, _, origin = located
            data = self._buf[body:body + body_bytes].toreadonly()
            self._decode(handle, copy=False, located=located)
            return StoredBody(handle.key_digest + U64.pack(origin), data)

        return self._pinned(handle, read, count)

    @contextmanager
    def _pinned(self, handle: Handle, read: Callable[[], Any], count: bool = True
                ) -> Iterator[Any]:
        """Pin the chunk, yield `read()`, then count the read (if `count`) and unpin."""
        guard = self._guard_enter()
        try:
            pin = self._pin(handle)
            done = None
            try:
                obj = read()
                try:
                    yield obj
                finally:
                    del obj
                    done = handle if count else None
            finally:
                self._unpin(pin, done)
        finally:
            guard.leave()

    @property
    def handout_seq(self) -> int:
        """The number of the last hand-out the writer made: a handle that names a later one
        was not made by this store's writer."""
        return self._words.load_acquire(self._meta + META_HANDOUT_SEQ)

    def discard(self, handle: Handle) -> None:
        """Count one read of `handle` without reading it (a hand-out this reader will skip).

        Raises:
            StaleHandle: the object is gone already (nothing to give up), or the handle names
                another key than the object at its address (a read owed to that object is
                not taken).
        """
        guard = self._guard_enter()
        try:
            pin = self._pin(handle)
            done = None
            try:
                self._reader_ring.header(handle.address, handle.seq)
                start = handle.address + ALIGN_BYTES
                if bytes(self._buf[start:start + len(handle.key_digest)]) != handle.key_digest:
                    raise StaleHandle(f"handle {handle} does not match the key of the object "
                                      f"at its address in store {self.name!r}; it is stale or "
                                      "forged: nothing discarded", handle, self.name)
                done = handle
            finally:
                self._unpin(pin, done)
        finally:
            guard.leave()

    def finished_through(self, handout: int) -> None:
        """Say that this reader takes its hand-outs in order and is done with every hand-out
        numbered up to `handout` (read, discarded, or lost with a damaged message that carried
        its handle): the writer stops waiting for those. A Channel reader calls this after each
        stored value; only a reader that really reads in order may."""
        handout = int_arg(handout, "handout", 0, (1 << 64) - 1)
        guard = self._guard_enter()
        try:
            word = self._row + ROW_DONE_THROUGH
            if handout > self._words.load_acquire(word):
                self._words.store_release(word, handout)
        finally:
            guard.leave()

    def close(self) -> None:
        """Give the reader index back and detach; idempotent. Calls in flight in other
        threads finish first; blocked ones raise SegmentClosed."""
        if self._guard is not None:
            self._guard.close(self._release)

    # -- internals ---------------------------------------------------------------------------

    def _guard_enter(self) -> CallGuard:
        guard = self._guard
        assert guard is not None  # set at the end of __init__
        guard.enter()
        return guard

    def _release(self) -> None:
        assert self._guard is not None
        if not self._guard.forked:
            self._table.detach(self.reader, self.generation, self)
        self._reader_ring.close()

    def _pin(self, handle: Handle) -> int:
        """Announce that this reader is inside chunk `handle.seq` (see store/_layout.py)."""
        self._check_handle(handle)
        words = self._words
        with self._lock:
            if not self._pins_free:
                raise InvalidArgument(
                    f"reader {self.reader} of store {self.name!r} already has {MAX_PINS} views "
                    "open; leave one before opening another", "handle", handle)
            index = self._pins_free.pop()
            self._pin_bits |= 1 << index
            words.store_release(self._mask_word, self._pin_bits)
        words.exchange(self._pin_words[index], handle.seq)
        return index

    def _unpin(self, index: int, done: Handle | None) -> None:
        """Count one read of `done` (if given), then leave the pinned chunk: in this order."""
        words = self._words
        with self._lock:
            if done is not None:
                self._count_read(done, corrupt=False)
            words.store_release(self._pin_words[index], 0)
            self._pin_bits &= ~(1 << index)
            words.store_release(self._mask_word, self._pin_bits)
            self._pins_free.append(index)

    def _locate(self, handle: Handle) -> tuple[int, int, int, int]:
        """Check the pinned object's headers against `handle`: (body start, body bytes,
        structure crc, origin seq); give it up if its chunk header is damaged."""
        ring = self._reader_ring
        try:
            header = ring.header(handle.address, handle.seq)
        except StaleHandle as exc:
            raise StaleHandle(str(exc), handle, self.name) from None
        except CorruptObject as exc:
            if ring.valid_address(handle.address):  # a damaged chunk header: give it up
                with self._lock:
                    self._count_read(handle, corrupt=True)
            raise CorruptObject(str(exc), self.name) from None
        start = handle.address + ALIGN_BYTES
        digest, body_bytes, crc, origin = OBJECT_HEADER.unpack_from(self._buf, start)
        if digest != handle.key_digest:
            raise StaleHandle(f"handle {handle} does not match the key of the object at its "
                              f"address in store {self.name!r}; it is stale or forged",
                              handle, self.name)
        problem = ""
        if start + self._header_bytes + body_bytes > start + header.payload_bytes:
            problem = f"claims a {body_bytes}-byte body, more than its chunk holds"
        elif not 0 < origin <= handle.seq:  # a copy forward only moves to a later seq
            problem = f"names origin seq {origin}, not in 1..{handle.seq}"
        if problem:
            with self._lock:
                self._count_read(handle, corrupt=True)
            raise CorruptObject(f"object seq {handle.seq} in store {self.name!r} is damaged "
                                f"and was given up: it {problem}", self.name)
        return start + self._header_bytes, body_bytes, crc, origin

    def _decode(self, handle: Handle, copy: bool,
                located: tuple[int, int, int, int] | None = None,
                pin_memory: bool = False) -> Any:
        """Validate the pinned object and decode it; give it up if it is damaged."""
        body, body_bytes, crc, _ = located or self._locate(handle)
        try:
            return decode(self._buf[body:body + body_bytes], copy=copy, expected_crc=crc,
                          crc_suffix=U64.pack(body_bytes), pin_memory=pin_memory)
        except CorruptObject as exc:
            with self._lock:
                self._count_read(handle, corrupt=True)
            raise CorruptObject(f"object seq {handle.seq} in store {self.name!r} is damaged "
                                f"and was given up: {exc}", self.name) from None

    def _count_read(self, handle: Handle, corrupt: bool) -> None:
        """Count one read of the pinned object, unless clear() dropped it meanwhile (hold _lock)."""
        words = self._words
        if words.load_acquire(handle.address) != handle.seq:
            return  # tombstoned while we read it: the bytes were ours, but nothing is owed now
        counter = counter_offset(handle.address, self.reader)
        generation = self.generation
        word = words.load_acquire(counter)
        reads = word & COUNT_MASK if word >> 32 == generation else 0
        words.store_release(counter, generation << 32 | ((reads + 1) & COUNT_MASK))
        self._reads += 1
        words.store_release(self._row + ROW_TOTAL_READS, self._reads)
        if corrupt:
            self._corrupt_reads += 1
            words.store_release(self._row + ROW_CORRUPT_READS, self._corrupt_reads)


def _check_pinnable() -> None:
    """InvalidArgument unless torch with CUDA is here (page-locked memory needs it)."""
    try:
        import torch

        available = bool(torch.cuda.is_available())
    except ImportError:
        available = False
    if not available:
        raise InvalidArgument("pin_memory=True needs torch with a CUDA device; pass "
                              "pin_memory=False (the default) on a machine without one",
                              "pin_memory", True)
