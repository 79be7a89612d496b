"""StoreWriter: the single writer of an object store (see store/object_store.py for the whole picture).

Delivery without locks: the writer records, in its own memory, each hand-out of an object (put
once, then once per get_cached, minus give_back), numbered by a store-wide hand-out sequence.
Each reader counts, in a word of the object's header that only it writes, how often it finished
reading the object. The writer reclaims an object only when every reader that owes reads (see
shm/_readers.py: NEVER rows owe everything, GONE rows nothing, a replacement only what was handed out
after it attached) has read it as often as it was handed out to it, and no reader is inside it
(pins, store/_layout.py).

Exception safety: an exception may surface between any two statements (a signal handler that
raises, a KeyboardInterrupt). Every writer operation is written so that each prefix of it is a
state the next operation accepts: a chunk the ring holds but no object owns is freed on the next
reclaim; an entry marked not live is dropped from the index by the next lookup; a hand-out whose
handle never reached the caller is taken back. The writer never re-reads from shared memory what
it wrote (chunk sizes, seqs, key digests live in its own records), so damaged shared bytes can
mislead readers (who fail loudly) but not the writer; a damaged object that blocks the writer is
dropped and counted (damaged_objects).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    KeyExists,
    KeyNotCached,
    ObjectTooLarge,
    Timeout,
)
from ..handle import Handle, check_key, key_digest
from ..serde.codec import Encoded, blank_key, encode
from ..shm._closeable import CallGuard
from ..shm._readers import Liveness
from ..shm._wait import Deadline, wait_until
from ..shm.ring import RingWriter
from ..shm.segment import ALIGN_BYTES
from ._handouts import HandOuts
from ._layout import (
    OBJECT_HEADER,
    ROW_CORRUPT_READS,
    U64,
    ReaderLedger,
    StoreStats,
)
from ._space import Entry, one_thread
from .policy import EvictionPolicy

__all__ = ["StoreWriter", "Reservation"]

STATS_TRIES = 100  # stats() from another thread reads again if a put tore its snapshot


class Reservation:
    """What `StoreWriter.reserve` yields: the writable arrays/tensors, then the handle."""

    def __init__(self, views: list[tuple[tuple[Any, ...], Any]]) -> None:
        self.arrays: dict[Any, Any] = {blank_key(path): view for path, view in views}
        self.handle: Handle | None = None  # set when the block ends without an exception

    def _seal(self) -> None:
        for view in self.arrays.values():
            if isinstance(view, np.ndarray):
                view.flags.writeable = False  # the object is published (or abandoned)


class StoreWriter(HandOuts):
    """The single writer: put, get_cached, give_back, clear, stats. Keeps the key index.

    Only the process that created the store may call it. Handles it returns stay valid until
    every reader has read them as often as they were handed out and the space is needed, or
    until clear().
    """

    def __init__(self, ring: RingWriter, policy: EvictionPolicy) -> None:
        self._busy = threading.RLock()  # held by the thread inside a call (_guard_enter)
        super().__init__(ring)
        self._writer_ring = ring
        self._policy = policy
        policy.start(ring.capacity_bytes)
        self._guard = CallGuard(f"store {self.name!r} (writer)", os.getpid())
        self._liveness = Liveness(self._table)
        self._ledger = ReaderLedger(self._words, self._table, self._liveness)
        self._index: dict[str | bytes, Entry] = {}
        self._by_seq: dict[int, Entry] = {}
        self._handout_seq = 0
        self._budget = self._wanted = 0
        self._puts = self._hits = self._evictions = self._give_backs = self._full_events = 0
        self._reinsertions = self._bytes_reinserted = self._damaged = self._withdrawn = 0

    # -- the API -----------------------------------------------------------------------------

    def put(self, key: str | bytes, obj: Any, timeout: float | None = 0) -> Handle:
        """Store `obj` under `key` and hand it out once; return its Handle.

        One copy: each array/tensor is copied from its own memory straight into the ring.

        Args:
            timeout: how long to wait for readers when the store is full: 0 (the default) does
                not wait, None waits without limit, t waits up to t seconds.

        Raises:
            KeyExists: `key` is cached (use get_cached).
            ObjectTooLarge: the serialized object exceeds max_object_bytes.
            NotSerializable: `obj` holds something the serializer cannot carry (with its path).
            StoreFull: the oldest object is still owed to a reader (named in the message).
        """
        check_key(key)
        return self.put_encoded(key, encode(obj), timeout)

    def put_encoded(self, key: str | bytes, enc: Encoded, timeout: float | None = 0) -> Handle:
        """put() of a value already encoded with serde.encode (no second walk over it)."""
        done: list[tuple[Entry, int]] = []
        try:
            self._guard_enter()
            try:
                return self._put(key, enc, Deadline(timeout), done)
            finally:
                self._guard_leave()
        except BaseException:
            self._undo(done)
            raise

    @contextmanager
    def reserve(self, key: str | bytes, template: Any,
                timeout: float | None = 0) -> Iterator[Reservation]:
        """Make room for `template` and let the caller write its arrays in place; store it on
        exit (`.handle`), or not at all if the block raises.

        `template` is any value put() accepts in which arrays/tensors still to be computed are
        `Blank(shape, dtype)` (torch: `Blank(shape, dtype, torch=True)`). Inside the block,
        `r.arrays[name]` (a top-level dict key; a path tuple for nested ones) is a writable
        array/tensor in shared memory, undefined until written (like np.empty): fill it (numpy
        `out=`, `np.copyto`, torch in-place ops) and nothing else is copied. After the block
        numpy views are read-only; do not keep torch views (the bytes are published, or given
        back).

        Raises:
            KeyExists, ObjectTooLarge, NotSerializable, StoreFull: as put(); StoreFull also if
                the ring must reclaim a chunk still being filled by an open reserve().
        """
        check_key(key)
        enc = encode(template, root="template", blanks=True)
        done: list[tuple[Entry, int]] = []
        entry: Entry | None = None
        try:
            self._guard_enter()
            try:
                entry = self._begin(key, enc, Deadline(timeout))
                entry.reserved = True  # from here the user writes into it: not reclaimable
                payload = self._writer_ring.payload(entry.chunk)[self._header_bytes:]
                enc.write_into(payload)
                reservation = Reservation(enc.blank_views(payload))
                try:
                    yield reservation
                    reservation.handle = self._commit(entry, done)
                finally:
                    reservation._seal()
            finally:
                self._guard_leave()
        except BaseException:
            self._undo(done)
            if entry is not None:
                entry.reserved = False  # an orphan now: freed when the ring reaches it
            raise

    def lend(self, key: str | bytes, sized: Any) -> Entry:
        """Make room for an object of `sized.nbytes` (serialized, with `sized.structure_crc`)
        whose body another process writes at body_offset(); publish it with commit_loan, or
        set `.reserved = False` on the returned record to give the room back (store/host.py).

        Raises:
            KeyExists, ObjectTooLarge, StoreFull: as put() with timeout 0.
        """
        check_key(key)
        self._guard_enter()
        try:
            entry = self._begin(key, sized, Deadline(0))
            entry.reserved = True  # another process writes into it: not reclaimable
            return entry
        finally:
            self._guard_leave()

    def body_offset(self, entry: Entry) -> int:
        """Byte offset in the segment where the body of lent `entry` goes."""
        return entry.chunk.address + ALIGN_BYTES + self._header_bytes

    def commit_loan(self, entry: Entry) -> Handle:
        """Publish lent `entry` once its body is written: index it and hand it out once.

        Raises:
            KeyExists: the key was put meanwhile (the room is given back).
        """
        done: list[tuple[Entry, int]] = []
        try:
            self._guard_enter()
            try:
                return self._commit(entry, done)
            finally:
                self._guard_leave()
        except BaseException:
            self._undo(done)
            entry.reserved = False
            raise

    def get_cached(self, key: str | bytes) -> Handle:
        """Hand the object of `key` out once more (one more read owed by every reader).

        Raises:
            KeyNotCached: the key was never put or has been evicted (put it again).
        """
        found = self.hand_out_cached((key,))[0]
        if found is None:
            raise KeyNotCached(f"key {key!r} is not in store {self.name!r} (never put, "
                               "evicted or cleared): put it again", key)
        return found[0]

    def hand_out_cached(self, keys: Iterable[str | bytes]) -> list[tuple[Handle, int] | None]:
        """get_cached for each of `keys` that is cached, in one call: (its handle, the
        hand-out's number), or None for a key that is not cached. Every key is checked before
        anything is handed out, and a call cut short by an exception hands out nothing.

        Raises:
            InvalidKey: a key that is not a non-empty str or bytes (nothing was handed out).
        """
        keys = list(keys)
        for key in keys:
            check_key(key)
        done: list[tuple[Entry, int]] = []
        try:
            self._guard_enter()
            try:
                return [self._hit(key, done) for key in keys]
            finally:
                self._guard_leave()
        except BaseException:
            self._undo(done)
            raise

    def _hit(self, key: str | bytes, done: list[tuple[Entry, int]]) -> tuple[Handle, int] | None:
        entry = self._lookup(key)
        if entry is None:
            return None
        self._hand_out(entry, done)
        self._policy.requested(entry.key, entry.chunk.chunk_bytes)
        entry.uses = self._policy.hit(entry.uses)
        self._hits += 1
        return entry.handle, self._handout_seq

    @one_thread
    def cached(self, keys: Iterable[str | bytes]) -> list[bool]:
        """is_cached for each of `keys`; no side effect."""
        self._guard_check()
        return [self._lookup(key) is not None for key in keys]

    @one_thread
    def is_cached(self, key: str | bytes) -> bool:
        """Say whether `key` is in the store; no side effect."""
        self._guard_check()
        return self._lookup(key) is not None

    @one_thread
    def handle_of(self, key: str | bytes) -> Handle | None:
        """The handle of the cached object of `key` without handing it out (None if it is not
        cached); for checking a handle that arrived from elsewhere. No side effect."""
        self._guard_check()
        entry = self._lookup(key)
        return None if entry is None else entry.handle

    @one_thread
    def object_id(self, key: str | bytes) -> bytes | None:
        """The id of the cached object of `key` (key digest + origin seq, 24 bytes, as
        StoredBody.object_id), None if it is not cached: the key a relay node stores these
        bytes under. No side effect."""
        self._guard_check()
        entry = self._lookup(key)
        return None if entry is None else entry.handle.key_digest + U64.pack(entry.origin)

    @one_thread
    def object_bytes(self, key: str | bytes) -> int:
        """Serialized size of the cached object of `key`; KeyNotCached if it is not cached."""
        self._guard_check()
        entry = self._lookup(key)
        if entry is None:
            raise KeyNotCached(f"key {key!r} is not in store {self.name!r}", key)
        return entry.nbytes

    def clear(self, *, keep_handed_out: bool = False) -> None:
        """Forget every key: the store is empty to lookups and puts from now on.

        Without `keep_handed_out`, every object goes and every handle issued before now becomes
        stale. With it, an object some reader still owes reads on stays readable under its
        handles until those reads are done (or it is given back or withdrawn), then goes like
        any other; a put of its key meanwhile stores a new object. Either way a reader already
        inside an object (get or view in progress) finishes with the bytes it started with:
        their space is reused only after it leaves.
        """
        self._guard_enter()
        try:
            ring = self._writer_ring
            for chunk in ring:
                entry = chunk.owner
                if entry is None or not entry.live:
                    continue
                if keep_handed_out and any(self._owed(entry, force=False)):
                    entry.uses = 0  # out of the index: never copied forward
                    continue
                self._drop(entry)
                self._evictions += 1
            self._index.clear()
            self._policy.clear()
            for chunk in ring:
                owner = chunk.owner
                if not chunk.tombstoned and not (owner and (owner.reserved or owner.live)):
                    ring.tombstone(chunk)
            while ((oldest := ring.oldest()) is not None and oldest.tombstoned
                   and not self._ledger.pinned_by(oldest.seq)):
                ring.pop_oldest(oldest)
        finally:
            self._guard_leave()

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until every reader index is attached.

        Raises:
            Timeout: naming the readers that did not attach in time.
        """
        table = self._table
        self._guard_enter()
        try:
            if not wait_until(lambda: all(table.ready(r) for r in range(self.n_readers)),
                              Deadline(timeout), check=self._guard_check):
                missing = tuple(r for r in range(self.n_readers) if not table.ready(r))
                raise Timeout(f"store {self.name!r}: reader(s) {list(missing)} did not attach "
                              f"within {timeout} s; start them, or check the name they use",
                              timeout, missing)
            self._liveness.observe()
        finally:
            self._guard_leave()

    def stats(self) -> StoreStats:
        """Return counters and what each reader owes; O(objects x readers). Safe from another
        thread (a metrics scrape) while this writer's own thread puts."""
        self._guard_check()
        for _ in range(STATS_TRIES - 1):  # from another thread, a call in flight may change
            try:                             # what is read: read again
                lag, objects = self._lag()
                break
            except (RuntimeError, IndexError):
                continue
        else:
            lag, objects = self._lag()
        table = self._table
        words = self._words
        return StoreStats(
            name=self.name, policy=self.policy, policy_rule=self._policy.rule,
            capacity_bytes=self.capacity_bytes,
            max_object_bytes=self.max_object_bytes, n_readers=self.n_readers,
            bytes_in_use=self._writer_ring.used_bytes, objects=objects, puts=self._puts,
            hits=self._hits, evictions=self._evictions, give_backs=self._give_backs,
            full_events=self._full_events, reinsertions=self._reinsertions,
            bytes_reinserted=self._bytes_reinserted, damaged_objects=self._damaged,
            withdrawn=self._withdrawn,
            dead_readers=self._liveness.dead_readers, reader_lag=tuple(lag),
            reader_pids=tuple(table.owner(r)[0] for r in range(self.n_readers)),
            corrupt_reads=tuple(words.load_acquire(table.row(r) + ROW_CORRUPT_READS)
                                for r in range(self.n_readers)),
        )

    def _lag(self) -> tuple[list[int], int]:
        """(hand-outs each reader owes on live objects, live objects)."""
        lag = [0] * self.n_readers
        objects = 0
        for chunk in self._writer_ring:
            entry = chunk.owner
            if entry is None or not entry.live:
                continue
            objects += 1
            for r, owed in enumerate(self._owed(entry, force=False)):
                lag[r] += owed
        return lag, objects

    def __len__(self) -> int:
        return sum(1 for e in self._index.values() if e.live)

    def close(self) -> None:
        """Unlink the store now and unmap it once calls in flight in other threads have ended
        (a blocked put raises SegmentClosed); idempotent."""
        if self._guard is not None:
            self._writer_ring.segment.unlink()
            self._guard.close(self._writer_ring.close)

    # -- put and hand-outs -------------------------------------------------------------------

    def _lookup(self, key: str | bytes) -> Entry | None:
        check_key(key)
        entry = self._index.get(key)
        if entry is not None and not entry.live:
            del self._index[key]  # left by a drop an exception cut short
            return None
        return entry

    def _put(self, key: str | bytes, enc: Encoded, deadline: Deadline,
             done: list[tuple[Entry, int]]) -> Handle:
        entry = self._begin(key, enc, deadline)
        enc.write_into(self._writer_ring.payload(entry.chunk)[self._header_bytes:])
        return self._commit(entry, done)

    def _begin(self, key: str | bytes, enc: Encoded, deadline: Deadline) -> Entry:
        """Room for `enc` and its header written; the entry is not live yet."""
        digest = key_digest(key)
        if self._lookup(key) is not None:
            raise KeyExists(f"key {key!r} is already in store {self.name!r}: hand it out again "
                            "with get_cached(key), or check is_cached(key) first", key)
        if enc.nbytes > self.max_object_bytes:
            raise ObjectTooLarge(
                f"object for key {key!r} is {enc.nbytes} bytes serialized, "
                f"{enc.nbytes - self.max_object_bytes} bytes above the max_object_bytes of store "
                f"{self.name!r} ({self.max_object_bytes}): send it another way or create the "
                "store with a larger max_object_bytes", enc.nbytes, self.max_object_bytes)
        chunk = self._make_room(self._header_bytes + enc.nbytes, deadline)
        # From here until chunk.owner is set the chunk is an orphan: if we stop, it is freed.
        payload = self._writer_ring.payload(chunk)
        crc = zlib.crc32(U64.pack(enc.nbytes), enc.structure_crc)
        OBJECT_HEADER.pack_into(payload, 0, digest, enc.nbytes, crc, chunk.seq)
        payload[OBJECT_HEADER.size:self._header_bytes] = bytes(self._header_bytes - OBJECT_HEADER.size)
        entry = Entry(key, Handle(chunk.address, chunk.seq, digest, self.epoch), chunk,
                       enc.nbytes, crc, live=False, origin=chunk.seq)
        chunk.owner = entry  # not live: if we stop before _commit, the chunk is an orphan
        return entry

    def _commit(self, entry: Entry, done: list[tuple[Entry, int]]) -> Handle:
        """Publish a reserved entry: index it and hand it out once."""
        if self._lookup(entry.key) is not None:  # put meanwhile (inside a reserve block)
            raise KeyExists(f"key {entry.key!r} was put into store {self.name!r} while it was "
                            "reserved; the reservation is dropped", entry.key)
        self._by_seq[entry.chunk.seq] = entry
        self._index[entry.key] = entry
        entry.reserved = False
        self._policy.requested(entry.key, entry.chunk.chunk_bytes)
        entry.uses = self._policy.admitted(entry.key)
        entry.live = True
        self._puts += 1
        self._hand_out(entry, done)
        return entry.handle


if TYPE_CHECKING:  # mypy checks that StoreWriter meets the one writer interface
    from ._api import WriterAPI

    _MEETS_WRITER_API: type[WriterAPI] = StoreWriter
