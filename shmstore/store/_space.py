"""How the store writer makes room: reclaiming, reinserting and dropping old objects.

StoreSpace is StoreWriter's base (store/writer.py has the picture and the exception-safety
rules). The oldest chunk goes when no attached reader owes a read on it and none is inside it
(pins); the policy may copy a hit object forward instead; a damaged object that blocks the
writer is dropped and counted; a chunk still being filled by an open reserve() is never taken.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..errors import StoreFull, WrongThread
from ..handle import Handle
from ..shm._wait import Deadline, wait_until
from ..shm.ring import Chunk, RingWriter
from ._layout import OBJECT_HEADER, ReaderLedger, StoreBase
from .policy import EvictionPolicy

__all__ = ["StoreSpace", "Entry", "one_thread"]

log = logging.getLogger("shmstore")

_Method = TypeVar("_Method", bound=Callable[..., Any])


def one_thread(method: _Method) -> _Method:
    """A short writer call that refuses to start while another thread is inside the writer
    (WrongThread); it does not hold the writer, so that its last statement stays its commit
    point (an exception injected after it must not report undone what was done)."""
    @functools.wraps(method)
    def call(self: StoreSpace, *args: Any, **kwargs: Any) -> Any:
        self._check_thread()
        return method(self, *args, **kwargs)
    return cast(_Method, call)


@dataclass(slots=True, eq=False)
class Entry:
    """The writer's record of one object."""

    key: str | bytes
    handle: Handle
    chunk: Chunk
    nbytes: int  # serialized body size
    crc: int  # structure CRC as written
    handouts: list[int] = field(default_factory=list)  # hand-out numbers not yet taken back
    uses: int = 0  # the policy's use count (hits since written, as the policy counts them)
    live: bool = True  # False once dropped (also mid-drop, if an exception cut it short)
    reserved: bool = False  # being filled by an open reserve(): neither live nor reclaimable
    origin: int = 0  # seq of the put that wrote these bytes (the header's origin_seq)
    ended: set[int] = field(default_factory=set)  # hand-outs whose users said they are over
    narrowed: dict[int, int] = field(default_factory=dict)  # hand-out -> mask of its readers


class StoreSpace(StoreBase):
    """The writer's space keeping; StoreWriter adds the API."""

    _writer_ring: RingWriter
    _policy: EvictionPolicy
    _ledger: ReaderLedger
    _index: dict[str | bytes, Entry]
    _by_seq: dict[int, Entry]
    _budget: int
    _wanted: int  # payload bytes the put that is making room needs
    _evictions: int
    _full_events: int
    _reinsertions: int
    _bytes_reinserted: int
    _damaged: int
    _withdrawn: int
    _busy: threading.RLock
    _busy_thread: int = 0

    # -- guard shortcuts ---------------------------------------------------------------------

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

    # -- reclaiming space --------------------------------------------------------------------

    def _make_room(self, payload_bytes: int, deadline: Deadline) -> Chunk:
        ring = self._writer_ring
        self._budget = self._policy.copy_budget(ring.chunk_bytes_for(payload_bytes))
        self._wanted = payload_bytes
        counted = force = False
        while True:
            blockers: tuple[int, ...] = ()
            while not ring.fits(payload_bytes):
                if ring.oldest() is None:
                    raise StoreFull(f"store {self.name!r} cannot hold {payload_bytes} bytes even "
                                    f"when empty (capacity {self.capacity_bytes} bytes); create "
                                    "a larger store", payload_bytes, self.capacity_bytes)
                blockers = self._reclaim_oldest(force)
                if blockers:
                    break
            else:
                return ring.allocate(payload_bytes)
            if not force:  # blocked: are the readers we wait for alive, is the object intact?
                force = True
                continue
            if not counted:
                self._full_events += 1
                counted = True
            if deadline.expired() or not wait_until(self._oldest_free, deadline,
                                                    check=self._guard_check):
                raise self._full_error(payload_bytes, deadline, blockers)
            force = False

    def _oldest_free(self) -> bool:
        """Whether the oldest chunk could be reclaimed now (for waiting)."""
        oldest = self._writer_ring.oldest()
        if oldest is None:
            return True
        entry = oldest.owner
        if entry is not None and entry.reserved:
            return False  # being filled in a reserve() block
        if (entry is not None and entry.live and any(self._owed(entry, force=False))
                and not self._over(entry)):
            return False
        return not self._ledger.pinned_by(oldest.seq) if oldest.tombstoned else True

    def _reclaim_oldest(self, force: bool) -> tuple[int, ...]:
        """Free (or, if the policy keeps it, move to the head) the oldest chunk; return the
        readers that block it, () when it went."""
        ring = self._writer_ring
        chunk = ring.oldest()
        assert chunk is not None  # the caller checked
        entry = chunk.owner
        if entry is not None and entry.reserved:
            raise StoreFull(f"store {self.name!r} needs the space of an object still being "
                            f"filled in a reserve() block (key {entry.key!r}); leave that block "
                            "first, or create a larger store", 0, self.capacity_bytes, ())
        if entry is not None and entry.live:
            owed = self._owed(entry, force)
            if any(owed) and self._over(entry):
                # every hand-out of it is over (end_handouts): nobody will read the rest
                self._withdrawn += 1
                self._evict(entry)
            elif any(owed):
                if not (force and self._damaged_in_shm(entry)):
                    return tuple(r for r, n in enumerate(owed) if n)
                log.warning("store %r: object seq %d (key %r) is damaged in shared memory and "
                            "cannot be read; dropping it", self.name, chunk.seq, entry.key)
                self._damaged += 1
                self._drop(entry)
            elif (self._indexed(entry)
                  and self._policy.keep(entry.uses, chunk.chunk_bytes, self._budget)):
                return self._reinsert(entry)
            else:
                self._evict(entry)
        if not chunk.tombstoned:
            ring.tombstone(chunk)
        pinned = self._ledger.pinned_by(chunk.seq)
        if pinned:
            return pinned
        ring.pop_oldest(chunk)
        return ()

    @staticmethod
    def _over(entry: Entry) -> bool:
        """Whether every hand-out of `entry` was said to be over (StoreWriter.end_handouts)."""
        return bool(entry.ended) and entry.ended.issuperset(entry.handouts)

    def _indexed(self, entry: Entry) -> bool:
        """Whether `entry` is what its key names (not an object clear kept for its readers)."""
        return self._index.get(entry.key) is entry

    def _drop(self, entry: Entry) -> None:
        entry.live = False  # first: lookups now ignore it, whatever happens next
        if self._indexed(entry):
            del self._index[entry.key]
        if self._by_seq.get(entry.chunk.seq) is entry:
            del self._by_seq[entry.chunk.seq]

    def _evict(self, entry: Entry) -> None:
        """Drop `entry` (counted; told to the policy while its key still names it)."""
        indexed = self._indexed(entry)
        self._drop(entry)
        self._evictions += 1
        if indexed:
            self._policy.evicted(entry.key, len(self._index))

    def _reinsert(self, entry: Entry) -> tuple[int, ...]:
        """Copy a fully read object from the tail to the head; its old handles become stale."""
        ring = self._writer_ring
        old = entry.chunk
        entry.live = False  # until committed at the new place
        saved = bytes(ring.payload(old))  # the new chunk may overlap the old one
        ring.tombstone(old)
        pinned = self._ledger.pinned_by(old.seq)
        if pinned:  # a reader is inside it beyond its hand-outs: drop it instead
            self._evict(entry)
            return pinned
        ring.pop_oldest(old)
        if self._by_seq.get(old.seq) is entry:
            del self._by_seq[old.seq]
        if not ring.fits(len(saved)) or (ring.fits(self._wanted) and not self._oldest_free()):
            # no room for the copy; or the put fits in the space it leaves while the next
            # object is still owed: copied forward, it would take that space and the put fail
            self._evict(entry)
            return ()
        new = ring.allocate(len(saved))
        payload = ring.payload(new)
        payload[:] = saved
        payload[OBJECT_HEADER.size:self._header_bytes] = bytes(self._header_bytes - OBJECT_HEADER.size)
        entry.chunk = new
        entry.handle = Handle(new.address, new.seq, entry.handle.key_digest, self.epoch)
        entry.handouts = []
        entry.ended.clear()
        entry.narrowed.clear()
        entry.uses = self._policy.kept(entry.uses)
        new.owner = entry
        self._by_seq[new.seq] = entry
        entry.live = True
        self._budget -= new.chunk_bytes
        self._reinsertions += 1
        self._bytes_reinserted += new.chunk_bytes
        return ()

    def _owed(self, entry: Entry, force: bool) -> list[int]:
        """Reads each reader still owes on `entry`."""
        return self._ledger.owed(entry.handouts, entry.chunk.address, force, entry.narrowed)

    def _damaged_in_shm(self, entry: Entry) -> bool:
        """Whether the chunk or object header in shared memory differs from what was written."""
        ring = self._writer_ring
        if not ring.header_intact(entry.chunk):
            return True
        digest, nbytes, crc, _ = OBJECT_HEADER.unpack_from(ring.payload(entry.chunk), 0)
        return (digest, nbytes, crc) != (entry.handle.key_digest, entry.nbytes, entry.crc)

    def _full_error(self, payload_bytes: int, deadline: Deadline,
                    blockers: tuple[int, ...]) -> StoreFull:
        oldest = self._writer_ring.oldest()
        entry = oldest.owner if oldest is not None else None
        waited = f" after waiting {deadline.timeout_s} s" if deadline.timeout_s else ""
        what = (f"the oldest object (key {entry.key!r}, handed out {len(entry.handouts)} times) "
                "is still owed to" if entry is not None and entry.live
                else "the oldest object is still being read by")
        return StoreFull(
            f"store {self.name!r} is full{waited}: {payload_bytes} bytes needed, "
            f"{self._writer_ring.used_bytes} of {self.capacity_bytes} in use, and {what} "
            f"reader(s) {list(blockers)}. Have them read it (or give_back() its handle), pass a "
            "timeout to put(), or create a larger store",
            payload_bytes, self.capacity_bytes, blockers)
