"""StoreWriter: the single writer of an object store (store/_object_store.py has the picture).

Delivery without locks: the writer records, in its own memory, each hand-out of an object (put
once, then once per get_cached, minus give_back), numbered by a store-wide hand-out sequence.
Each reader counts, in a word of the object's header only it writes, how often it finished
reading it. The writer reclaims an object only once every reader that owes reads (shm/_readers.py:
NEVER rows owe everything, GONE rows nothing, a replacement what was handed out after it
attached) has read it as often as it was handed out to it, and no reader is inside it (pins).

Exception safety: an exception may surface between any two statements (a signal handler that
raises, a KeyboardInterrupt); each prefix of an operation is a state the next one accepts: a
chunk no object owns is freed on the next reclaim; an entry marked not live is dropped by the
next lookup; a hand-out whose HandOut never reached the caller is taken back (one mechanism,
`hands_out`: store/_guards.py). The writer never re-reads what it wrote to shared memory:
damaged shared bytes can mislead readers (who fail loudly), not the writer; a damaged object
that blocks the writer is dropped and counted (damaged_objects).
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import (
    CorruptObject,
    KeyExists,
    KeyNotCached,
    ObjectTooLarge,
    StaleHandle,
    Timeout,
    WrongThread,
)
from ..handle import Handle, HandOut, check_key, key_digest
from ..serde._codec import Encoded, blank_key, encode
from ..serde._decode import peek
from ..shm._closeable import CallGuard
from ..shm._readers import Liveness
from ..shm._ring import RingWriter
from ..shm._wait import Deadline, checked_wait, wait_until
from ._api import HandleVerbs, must_be_cached
from ._base import StoreBase, StoreStats
from ._guards import Done, hands_out, one_thread
from ._handouts import HandOuts, object_id
from ._index import Entry, Index
from ._layout import META_HANDOUT_SEQ, OBJECT_HEADER, ROW_CORRUPT_READS, U64
from ._ledger import ReaderLedger
from ._policy import EvictionPolicy
from ._space import Space
from ._wire import MAX_PEEK_BYTES, check_field

__all__ = ["StoreWriter", "Reservation"]

class BodySize(Protocol):
    """What _begin needs of a body: an Encoded's, or a lent chunk's (store/_lender.py)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def structure_crc(self) -> int: ...


class Reservation:
    """What `StoreWriter.reserve` yields: the writable arrays/tensors, then the hand-out."""

    def __init__(self, views: list[tuple[tuple[Any, ...], Any]]) -> None:
        self.arrays: dict[Any, Any] = {blank_key(path): view for path, view in views}
        self.handout: HandOut | None = None  # set when the block ends without an exception

    @property
    def handle(self) -> Handle | None:
        """The stored object's handle once the block ended without an exception."""
        return None if self.handout is None else self.handout.handle

    def _seal(self) -> None:
        for view in self.arrays.values():
            if isinstance(view, np.ndarray):
                view.flags.writeable = False  # the object is published (or abandoned)


class StoreWriter(HandleVerbs, StoreBase):
    """The single writer: put, get_cached, give_back, clear, stats. Keeps the key index.

    Only the process that created the store may call it. Handles it returns stay valid until
    every reader has read them as often as they were handed out and the space is needed, or
    until clear().

    A facade over parts that each own their state (as trio's channel endpoints share one
    state object): the Index of entries, the Space that makes room (ring, policy, the
    readers' ledger and its counters) and the HandOuts (the hand-out sequence). The facade
    holds the guard of every call: one thread at a time, a close that waits for calls.
    """

    _busy_thread: int = 0

    def __init__(self, ring: RingWriter, policy: EvictionPolicy) -> None:
        self._busy = threading.RLock()  # held by the thread inside a call (_guard_enter)
        super().__init__(ring)
        self._writer_ring = ring
        self._policy = policy
        self._header_pad = bytes(self._header_bytes - OBJECT_HEADER.size)  # the read counts' room
        policy.start(ring.capacity_bytes)
        self._guard = CallGuard(f"store {self.name!r} (writer)", os.getpid())
        self._liveness = Liveness(self._table)
        self._index = Index()
        self._space = Space(ring, policy, ReaderLedger(self._words, self._table, self._liveness),
                            self._index, name=self.name, header_bytes=self._header_bytes,
                            epoch=self.epoch, check=self._guard_check)
        self._handouts = HandOuts(self._index, self._space, self._words,
                                  self._meta + META_HANDOUT_SEQ, name=self.name,
                                  n_readers=self.n_readers, check_handle=self._check_handle)
        self._puts = self._hits = 0

    # -- the guard ---------------------------------------------------------------------------

    def _guard_enter(self) -> None:
        """Start a writer call: one thread at a time (WrongThread for a second one, rather
        than a corrupted index), re-entrant for the same thread (a signal handler)."""
        assert self._guard is not None  # set in __init__; never None on a writer
        if not self._busy.acquire(blocking=False):
            self._refuse_thread()
        try:
            self._busy_thread = threading.get_ident()
            self._guard.enter()
        except BaseException:
            self._busy.release()
            raise

    def _check_thread(self) -> None:
        """WrongThread if another thread is inside a writer call now."""
        if not self._busy.acquire(blocking=False):
            self._refuse_thread()
        self._busy.release()

    def _refuse_thread(self) -> None:
        me = threading.get_ident()
        raise WrongThread(
            f"store {self.name!r}: thread {me} called the writer while thread "
            f"{self._busy_thread} is inside a call of it; the writer is for one thread at "
            "a time: hold one lock around every call (stats() may be called from any "
            "thread)", self._busy_thread, me)

    def _guard_leave(self) -> None:
        assert self._guard is not None
        try:
            self._guard.leave()
        finally:
            self._busy.release()

    def _guard_check(self) -> None:
        assert self._guard is not None
        self._guard.check()

    @contextmanager
    def _call(self) -> Iterator[None]:
        """One writer call that holds the writer (see _guard_enter)."""
        self._guard_enter()
        try:
            yield
        finally:
            self._guard_leave()

    # -- the API -----------------------------------------------------------------------------

    def hand_out_new(self, key: str | bytes, obj: Any, timeout: float | None = 0) -> HandOut:
        """Store `obj` under `key` and hand it out once; return the HandOut. `obj` may also be
        a value already encoded with serde.encode (no second walk over it).

        One copy: each array/tensor is copied from its own memory straight into the ring.

        Args:
            timeout: how long to wait for readers when the store is full: 0 (the default) does
                not wait, None waits without limit, t waits up to t seconds.

        Raises:
            KeyExists: `key` is cached (use get_cached or hand_out_cached).
            ObjectTooLarge: the serialized object exceeds max_object_bytes.
            NotSerializable: `obj` holds something the serializer cannot carry (with its path).
            StoreFull: the oldest object is still owed to a reader (named in the message).
        """
        check_key(key)
        return self._hand_out_new(key, obj if isinstance(obj, Encoded) else encode(obj),
                                  timeout)

    def store(self, key: str | bytes, obj: Any) -> Handle:
        """Store `obj` under `key`, owed by no reader (WriterAPI.store): handed out and given
        back at once, so the object is cached and pins nothing."""
        handout = self.hand_out_new(key, obj)
        self.give_back(handout.handle, handout.number)
        return handout.handle

    @hands_out
    def _hand_out_new(self, done: Done, key: str | bytes, enc: Encoded,
                      timeout: float | None) -> HandOut:
        return self._put(key, enc, checked_wait(timeout), done)

    @contextmanager
    def reserve(self, key: str | bytes, template: Any,
                timeout: float | None = 0) -> Iterator[Reservation]:
        """Make room for `template` and let the caller write its arrays in place; store it on
        exit (`.handout`, `.handle`), or not at all if the block raises.

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
        entry: Entry | None = None
        reservation: Reservation | None = None
        try:
            with self._call():  # the whole block: close() waits before it unmaps the views
                entry = self._begin(key, enc, checked_wait(timeout))
                entry.reserved = True  # from here the user writes into it: not reclaimable
                payload = self._writer_ring.payload(entry.chunk)[self._header_bytes:]
                enc.write_into(payload)
                reservation = Reservation(enc.blank_views(payload))
                yield reservation
                reservation._seal()
            # last: nothing of reserve runs after the hand-out is made (see hands_out)
            self._publish(entry, reservation)
        except BaseException:
            if reservation is not None:
                reservation._seal()
            if entry is not None:
                entry.reserved = False  # an orphan now (unless published): freed in turn
            raise

    @hands_out
    def get_cached(self, done: Done, key: str | bytes) -> Handle:
        """HandleVerbs.get_cached, made inside the writer's guard: from the hand-out to the
        return nothing runs outside it (an exception anywhere takes the hand-out back).

        Raises:
            KeyNotCached: the key was never put or has been evicted (put it again).
        """
        return must_be_cached(self, key, self._hit(check_key(key), done)).handle

    def hand_out_cached(self, keys: Iterable[str | bytes], field: str | None = None
                        ) -> list[HandOut | None]:
        """get_cached for each of `keys` that is cached, in one call: its HandOut, or None for
        a key that is not cached. Every key is checked before anything is handed out, and a
        call cut short by an exception hands out nothing.

        `field`: also read the bytes under `field` of each object's top-level map into
        HandOut.record (a small record stored beside the arrays: the structure is read and
        its CRC checked, no array is touched). The record is None when the object has no
        such field or it is over MAX_PEEK_BYTES. An object whose structure is damaged is not
        handed out (None, as if not cached): its readers would give it up.

        Raises:
            InvalidKey: a key that is not a non-empty str or bytes (nothing was handed out).
            InvalidArgument: `field` is not a str of 1 to 64 characters.
        """
        keys = list(keys)
        for key in keys:
            check_key(key)
        if field is not None:
            check_field(field)
        return self._hand_outs(keys, field)

    @hands_out
    def _hand_outs(self, done: Done, keys: list[str | bytes], field: str | None
                   ) -> list[HandOut | None]:
        if field is None:
            return [self._hit(key, done) for key in keys]
        return [self._peeked_hit(key, done, field) for key in keys]

    def _peeked_hit(self, key: str | bytes, done: Done, field: str) -> HandOut | None:
        entry = self._index.lookup(key)
        if entry is None or self._space.damaged_in_shm(entry):
            return None
        body = self._writer_ring.payload(entry.chunk)[
            self._header_bytes:self._header_bytes + entry.nbytes]
        try:
            record = peek(body, field, expected_crc=entry.crc,
                          crc_suffix=U64.pack(entry.nbytes), max_bytes=MAX_PEEK_BYTES)
        except CorruptObject:
            return None
        return self._hit_entry(entry, done, record)

    def _hit(self, key: str | bytes, done: Done) -> HandOut | None:
        entry = self._index.lookup(key)
        return None if entry is None else self._hit_entry(entry, done)

    def _hit_entry(self, entry: Entry, done: Done, record: bytes | None = None) -> HandOut:
        handout = self._handouts.make(entry, done, record)
        self._policy.requested(entry.key, entry.chunk.chunk_bytes)
        entry.uses = self._policy.hit(entry.uses)
        self._hits += 1
        return handout

    @one_thread
    def cached(self, keys: Iterable[str | bytes]) -> list[bool]:
        """is_cached for each of `keys`; no side effect."""
        self._guard_check()
        return [self._index.lookup(key) is not None for key in keys]

    @one_thread
    def is_cached(self, key: str | bytes) -> bool:
        """Say whether `key` is in the store; no side effect."""
        self._guard_check()
        return self._index.lookup(key) is not None

    @one_thread
    def handle_of(self, key: str | bytes) -> Handle | None:
        """The handle of the cached object of `key` without handing it out (None if it is not
        cached); for checking a handle that arrived from elsewhere. No side effect."""
        self._guard_check()
        entry = self._index.lookup(key)
        return None if entry is None else entry.handle

    @one_thread
    def object_id(self, key: str | bytes) -> bytes | None:
        """The id of the cached object of `key` (key digest + origin seq, 24 bytes, as
        StoredBody.object_id and HandOut.object_id), None if it is not cached: the key a relay
        node stores these bytes under. No side effect."""
        self._guard_check()
        entry = self._index.lookup(key)
        return None if entry is None else object_id(entry)

    @one_thread
    def issued(self, key: str | bytes, handout: HandOut) -> bool:
        """Whether `handout` (arrived from elsewhere: a client, another process) is one this
        store made of the object it caches under `key` now: the same handle and object id,
        and a number it has handed out. No side effect."""
        self._guard_check()
        entry = self._index.lookup(key)
        return (entry is not None and handout.handle == entry.handle
                and handout.object_id == object_id(entry)
                and type(handout.number) is int and 0 < handout.number <= self._handouts.seq)

    @one_thread
    def object_bytes(self, key: str | bytes) -> int:
        """Serialized size of the cached object of `key`; KeyNotCached if it is not cached."""
        self._guard_check()
        entry = self._index.lookup(key)
        if entry is None:
            raise KeyNotCached(f"key {key!r} is not in store {self.name!r}", key)
        return entry.nbytes

    # -- hand-outs (store/_handouts.py) -------------------------------------------------------

    @property
    def handout_seq(self) -> int:
        """The number of the last hand-out this store made (every HandOut has its own)."""
        return self._handouts.seq

    @one_thread
    def give_back(self, handle: Handle, number: int | None = None, *, wait: bool = True) -> None:
        """Take back one hand-out of `handle` that no reader will read (an aborted request):
        hand-out `number` if given (needed once hand-outs are narrowed), else the last one.
        wait=False (for callers that also drive a RemoteWriter, which then posts the call): a
        handle gone meanwhile is not an error.

        Raises:
            StaleHandle: the object is gone, or has no such hand-out left to take back.
        """
        self._guard_check()
        if not wait:
            with contextlib.suppress(StaleHandle):
                self._handouts.give_back(handle, number)
            return
        self._handouts.give_back(handle, number)

    @one_thread
    def narrow(self, handle: Handle, number: int, readers: Iterable[int], *,
               wait: bool = True) -> None:
        """Owe hand-out `number` of `handle` only by `readers` (reader indexes): for a
        hand-out whose handle goes to some readers only, decided after it was made (the
        engine a request goes to). A reader left out never pins the object for it. wait=False
        as in give_back.

        Raises:
            StaleHandle: the object is gone, or has no hand-out `number`.
            ReaderIndexError: a reader index outside the store's readers.
        """
        self._guard_check()
        if not wait:
            with contextlib.suppress(StaleHandle):
                self._handouts.narrow(handle, number, readers)
            return
        self._handouts.narrow(handle, number, readers)

    @one_thread
    def end_handouts(self, groups: Iterable[tuple[Handle, Iterable[int]]]) -> list[bool]:
        """Say that the hand-outs of each (handle, numbers) are over: whoever they were made
        for will not read them any more (read or not). Once every hand-out of an object is
        over, the store withdraws it when it needs the space even if readers still owe reads
        on it (as withdraw() would; a late read fails loudly). Numbers an object does not have
        are ignored, as are objects that are gone.

        Returns:
            for each group, whether its object is still live and owed reads by some reader
            (the hand-outs just ended may be among the unread ones).
        """
        self._guard_check()
        return self._handouts.end_handouts(groups)

    @one_thread
    def unread(self, handle: Handle) -> tuple[int, ...]:
        """Reads each reader still owes on the object of `handle` (all zero once every hand-out
        has been read or given back). No side effect.

        Raises:
            StaleHandle: the object is gone (reclaimed, withdrawn or cleared).
        """
        self._guard_check()
        return self._handouts.unread(handle)

    def withdraw(self, handle: Handle) -> bool:
        """Drop the object of `handle` now, even though readers still owe reads on it: for
        hand-outs that will never be read (their requests ended) but that a reader may still
        hold. Every handle of it becomes stale (a late read raises StaleHandle); its space is
        reused once the ring reaches it and no reader is inside it. Return False (and do
        nothing) if the object is gone already.
        """
        with self._call():
            return self._handouts.withdraw(handle)

    @hands_out
    def hand_out(self, done: Done, handle: Handle) -> HandOut:
        """Hand the object of `handle` out once more (one more read owed by every reader), as
        get_cached does by key; also for an object clear(keep_handed_out=True) kept for its
        readers. Not counted as a hit.

        Raises:
            StaleHandle: the object is gone (reclaimed, withdrawn or cleared).
        """
        return self._handouts.hand_out(handle, done)

    @hands_out
    def hand_out_again(self, done: Done, handle: Handle) -> HandOut:
        """Replace one hand-out of `handle` by one made now (the next hand-out number), for a
        writer that publishes its hand-outs in order (ChannelWriter.publish) and kept this one
        a while before sending it (against eviction). Neither a hit nor a give-back.

        Raises:
            StaleHandle: as give_back.
        """
        return self._handouts.hand_out_again(handle)

    def clear(self, *, keep_handed_out: bool = False) -> None:
        """Forget every key: the store is empty to lookups and puts from now on.

        Without `keep_handed_out`, every object goes and every handle issued before now becomes
        stale. With it, an object some reader still owes reads on stays readable under its
        handles until those reads are done (or it is given back or withdrawn), then goes like
        any other; a put of its key meanwhile stores a new object. Either way a reader already
        inside an object (get or view in progress) finishes with the bytes it started with:
        their space is reused only after it leaves.
        """
        with self._call():
            self._space.clear(keep_handed_out)

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
        """Return counters and what each reader owes. Safe from another thread (a metrics
        scrape) while this writer's own thread puts. O(readers + what changed since the last
        call), whatever the readers owe (store/_space.py Scrape): the objects whose hand-outs
        changed, and the owing objects of each reader that read since; a reader that stopped,
        died or never attached costs nothing. The first call walks every live object."""
        self._guard_check()
        lag, objects = self._space.lag()
        table = self._table
        words = self._words
        space = self._space
        return StoreStats(
            name=self.name, policy=self.policy, policy_rule=self._policy.rule,
            capacity_bytes=self.capacity_bytes,
            max_object_bytes=self.max_object_bytes, n_readers=self.n_readers,
            bytes_in_use=self._writer_ring.used_bytes, objects=objects, puts=self._puts,
            hits=self._hits, evictions=space.evictions, give_backs=self._handouts.give_backs,
            full_events=space.full_events, reinsertions=space.reinsertions,
            bytes_reinserted=space.bytes_reinserted, damaged_objects=space.damaged,
            withdrawn=space.withdrawn,
            dead_readers=self._liveness.dead_readers, reader_lag=tuple(lag),
            reader_pids=tuple(table.owner(r)[0] for r in range(self.n_readers)),
            corrupt_reads=tuple(words.load_acquire(table.row(r) + ROW_CORRUPT_READS)
                                for r in range(self.n_readers)),
        )

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        """Unlink the store now and unmap it once calls in flight in other threads have ended
        (a blocked put raises SegmentClosed); idempotent."""
        if self._guard is not None:
            self._writer_ring.segment.unlink()
            self._guard.close(self._writer_ring.close)

    # -- put and hand-outs -------------------------------------------------------------------

    def _put(self, key: str | bytes, enc: Encoded, wait: Deadline | float | None,
             done: Done) -> HandOut:
        entry = self._begin(key, enc, wait)
        enc.write_into(self._writer_ring.payload(entry.chunk)[self._header_bytes:])
        return self._commit(entry, done)

    def _begin(self, key: str | bytes, enc: BodySize,
               wait: Deadline | float | None) -> Entry:
        """Room for `enc` and its header written; the entry is not live yet."""
        digest = key_digest(key)  # checks the key
        if self._index.lookup(key, checked=True) is not None:
            raise KeyExists(f"key {key!r} is already in store {self.name!r}: hand it out again "
                            "with get_cached(key), or check is_cached(key) first", key)
        if enc.nbytes > self.max_object_bytes:
            raise ObjectTooLarge(
                f"object for key {key!r} is {enc.nbytes} bytes serialized, "
                f"{enc.nbytes - self.max_object_bytes} bytes above the max_object_bytes of store "
                f"{self.name!r} ({self.max_object_bytes}): send it another way or create the "
                "store with a larger max_object_bytes", enc.nbytes, self.max_object_bytes)
        chunk = self._space.make_room(self._header_bytes + enc.nbytes, wait)
        # From here until chunk.owner is set the chunk is an orphan: if we stop, it is freed.
        payload = self._writer_ring.payload(chunk)
        crc = zlib.crc32(U64.pack(enc.nbytes), enc.structure_crc)
        OBJECT_HEADER.pack_into(payload, 0, digest, enc.nbytes, crc, chunk.seq)
        payload[OBJECT_HEADER.size:self._header_bytes] = self._header_pad
        entry = Entry(key, Handle(chunk.address, chunk.seq, digest, self.epoch), chunk,
                       enc.nbytes, crc, live=False, origin=chunk.seq)
        chunk.owner = entry  # not live: if we stop before _commit, the chunk is an orphan
        return entry

    def _commit(self, entry: Entry, done: Done) -> HandOut:
        """Publish a reserved entry: index it and hand it out once."""
        if self._index.lookup(entry.key, checked=True) is not None:  # put inside a reserve block
            raise KeyExists(f"key {entry.key!r} was put into store {self.name!r} while it was "
                            "reserved; the reservation is dropped", entry.key)
        self._index.by_seq[entry.chunk.seq] = entry
        self._index.by_key[entry.key] = entry
        entry.reserved = False
        self._policy.requested(entry.key, entry.chunk.chunk_bytes)
        entry.uses = self._policy.admitted(entry.key)
        entry.live = True
        self._puts += 1
        return self._handouts.make(entry, done)

    @hands_out
    def _publish(self, done: Done, entry: Entry, reservation: Reservation | None = None
                 ) -> HandOut:
        """Commit a reserved entry whose body is written (reserve, Lender.commit); the hand-out
        goes into `reservation` here, inside the call, so that it never exists unowned."""
        handout = self._commit(entry, done)
        if reservation is not None:
            reservation.handout = handout
        return handout


if TYPE_CHECKING:  # mypy checks that StoreWriter meets the one writer interface
    from ._api import WriterAPI

    _MEETS_WRITER_API: type[WriterAPI] = StoreWriter
