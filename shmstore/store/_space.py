"""Where the store writer's next object goes: reclaiming, copying forward and dropping old
objects (store/_writer.py has the picture and the exception-safety rules).

The oldest chunk goes when no attached reader owes a read on it and none is inside it (pins);
the policy may copy a hit object forward instead; a damaged object that blocks the writer is
dropped and counted; a chunk still being filled by an open reserve() is never taken. Space
owns its counters and the put's copy budget; the writer holds the guard of every call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import StoreFull
from ..handle import Handle
from ..shm._ring import Chunk, RingWriter
from ..shm._wait import Deadline, deadline_of, wait_until
from ._index import Entry, Index
from ._layout import OBJECT_HEADER
from ._ledger import ReaderLedger, Row
from ._policy import EvictionPolicy

__all__ = ["Space", "Scrape"]

log = logging.getLogger("shmstore")


class Space:
    """The ring of one writer, its policy and the readers' ledger, and what they decide."""

    def __init__(self, ring: RingWriter, policy: EvictionPolicy, ledger: ReaderLedger,
                 index: Index, *, name: str, header_bytes: int, epoch: int,
                 check: Callable[[], None]) -> None:
        self.ring = ring
        self.policy = policy
        self.ledger = ledger
        self.index = index
        self.name = name
        self._header_bytes = header_bytes
        self.epoch = epoch
        self._check = check  # raises once the writer is closing (a wait ends)
        self.budget = 0  # ring bytes the put making room may still copy forward
        self.wanted = 0  # payload bytes the put that is making room needs
        self.evictions = self.full_events = self.reinsertions = self.bytes_reinserted = 0
        self.damaged = self.withdrawn = 0
        self.scrape = Scrape(self)

    def clear(self, keep_handed_out: bool) -> None:
        """Forget every key (StoreWriter.clear says what stays readable)."""
        ring = self.ring
        for chunk in ring:
            entry = chunk.owner
            if entry is None or not entry.live:
                continue
            if keep_handed_out and any(self.owed(entry, force=False)):
                entry.uses = 0  # out of the index: never copied forward
                continue
            self.drop(entry)
            self.evictions += 1
        self.index.by_key.clear()
        self.policy.clear()
        for chunk in ring:
            owner = chunk.owner
            if not chunk.tombstoned and not (owner and (owner.reserved or owner.live)):
                ring.tombstone(chunk)
        while ((oldest := ring.oldest()) is not None and oldest.tombstoned
               and not self.ledger.pinned_by(oldest.seq)):
            ring.pop_oldest(oldest)

    def lag(self) -> tuple[list[int], int]:
        """(hand-outs each reader owes on live objects, live objects); Scrape says what it
        costs."""
        return self.scrape.lag()

    def recount(self) -> tuple[list[int], int]:
        """lag() by a walk of every live object in the ring: O(objects x readers)."""
        lag = [0] * self.ledger.n_readers
        objects = 0
        for chunk in self.ring:
            entry = chunk.owner
            if entry is None or not entry.live:
                continue
            objects += 1
            for r, owed in enumerate(self.owed(entry, force=False)):
                lag[r] += owed
        return lag, objects

    def withdraw(self, entry: Entry) -> None:
        """Drop `entry` now although readers still owe reads on it (counted)."""
        self.withdrawn += 1
        self.evict(entry)

    def make_room(self, payload_bytes: int, wait: Deadline | float | None) -> Chunk:
        """A chunk for `payload_bytes`, waiting up to `wait` (checked_wait) for readers."""
        ring = self.ring
        self.budget = self.policy.copy_budget(ring.chunk_bytes_for(payload_bytes))
        self.wanted = payload_bytes
        counted = force = False
        while True:
            blockers: tuple[int, ...] = ()
            while (chunk := ring.allocate_if_free(payload_bytes)) is None:
                if ring.oldest() is None:
                    raise StoreFull(f"store {self.name!r} cannot hold {payload_bytes} bytes even "
                                    f"when empty (capacity {self.ring.capacity_bytes} bytes); create "
                                    "a larger store", payload_bytes, self.ring.capacity_bytes)
                blockers = self._reclaim_oldest(force)
                if blockers:
                    break
            else:
                return chunk
            if not force:  # blocked: are the readers we wait for alive, is the object intact?
                force = True
                continue
            if not counted:
                self.full_events += 1
                counted = True
            deadline = wait = deadline_of(wait)  # made once, when it first has to wait
            if deadline.expired() or not wait_until(self.oldest_free, deadline,
                                                    check=self._check):
                raise self._full_error(payload_bytes, deadline, blockers)
            force = False

    def oldest_free(self) -> bool:
        """Whether the oldest chunk could be reclaimed now (for waiting)."""
        oldest = self.ring.oldest()
        if oldest is None:
            return True
        entry = oldest.owner
        if entry is not None and entry.reserved:
            return False  # being filled in a reserve() block
        if (entry is not None and entry.live and any(self.owed(entry, force=False))
                and not self.over(entry)):
            return False
        return not self.ledger.pinned_by(oldest.seq) if oldest.tombstoned else True

    def _reclaim_oldest(self, force: bool) -> tuple[int, ...]:
        """Free (or, if the policy keeps it, move to the head) the oldest chunk; return the
        readers that block it, () when it went."""
        ring = self.ring
        chunk = ring.oldest()
        assert chunk is not None  # the caller checked
        entry = chunk.owner
        if entry is not None and entry.reserved:
            raise StoreFull(f"store {self.name!r} needs the space of an object still being "
                            f"filled in a reserve() block (key {entry.key!r}); leave that block "
                            "first, or create a larger store", 0, self.ring.capacity_bytes, ())
        if entry is not None and entry.live:
            owed = self.owed(entry, force)
            if any(owed) and self.over(entry):
                # every hand-out of it is over (end_handouts): nobody will read the rest
                self.withdrawn += 1
                self.evict(entry)
            elif any(owed):
                if not (force and self.damaged_in_shm(entry)):
                    return tuple(r for r, n in enumerate(owed) if n)
                log.warning("store %r: object seq %d (key %r) is damaged in shared memory and "
                            "cannot be read; dropping it", self.name, chunk.seq, entry.key)
                self.damaged += 1
                self.drop(entry)
            elif (self.index.names(entry)
                  and self.policy.keep(entry.uses, chunk.chunk_bytes, self.budget)):
                return self._reinsert(entry)
            else:
                self.evict(entry)
        if not chunk.tombstoned:
            ring.tombstone(chunk)
        pinned = self.ledger.pinned_by(chunk.seq)
        if pinned:
            return pinned
        ring.pop_oldest(chunk)
        return ()

    @staticmethod
    def over(entry: Entry) -> bool:
        """Whether every hand-out of `entry` was said to be over (StoreWriter.end_handouts)."""
        return bool(entry.ended) and entry.ended.issuperset(entry.handouts)

    def drop(self, entry: Entry) -> None:
        self.index.drop(entry)

    def evict(self, entry: Entry) -> None:
        """Drop `entry` (counted; told to the policy while its key still names it)."""
        indexed = self.index.names(entry)
        self.drop(entry)
        self.evictions += 1
        if indexed:
            self.policy.evicted(entry.key, len(self.index.by_key))

    def _reinsert(self, entry: Entry) -> tuple[int, ...]:
        """Copy a fully read object from the tail to the head; its old handles become stale."""
        ring = self.ring
        old = entry.chunk
        entry.live = False  # until committed at the new place
        saved = bytes(ring.payload(old))  # the new chunk may overlap the old one
        ring.tombstone(old)
        pinned = self.ledger.pinned_by(old.seq)
        if pinned:  # a reader is inside it beyond its hand-outs: drop it instead
            self.evict(entry)
            return pinned
        ring.pop_oldest(old)
        self.index.forget(old.seq, entry)
        if not ring.fits(len(saved)) or (ring.fits(self.wanted) and not self.oldest_free()):
            # no room for the copy; or the put fits in the space it leaves while the next
            # object is still owed: copied forward, it would take that space and the put fail
            self.evict(entry)
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
        entry.uses = self.policy.kept(entry.uses)
        new.owner = entry
        self.index.by_seq[new.seq] = entry
        entry.live = True
        self.budget -= new.chunk_bytes
        self.reinsertions += 1
        self.bytes_reinserted += new.chunk_bytes
        return ()

    def owed(self, entry: Entry, force: bool) -> list[int]:
        """Reads each reader still owes on `entry`."""
        return self.ledger.owed(entry.handouts, entry.chunk.address, force, entry.narrowed)

    def damaged_in_shm(self, entry: Entry) -> bool:
        """Whether the chunk or object header in shared memory differs from what was written."""
        ring = self.ring
        if not ring.header_intact(entry.chunk):
            return True
        digest, nbytes, crc, _ = OBJECT_HEADER.unpack_from(ring.payload(entry.chunk), 0)
        return (digest, nbytes, crc) != (entry.handle.key_digest, entry.nbytes, entry.crc)

    def _full_error(self, payload_bytes: int, deadline: Deadline,
                    blockers: tuple[int, ...]) -> StoreFull:
        oldest = self.ring.oldest()
        entry = oldest.owner if oldest is not None else None
        waited = f" after waiting {deadline.timeout_s} s" if deadline.timeout_s else ""
        what = (f"the oldest object (key {entry.key!r}, handed out {len(entry.handouts)} times) "
                "is still owed to" if entry is not None and entry.live
                else "the oldest object is still being read by")
        return StoreFull(
            f"store {self.name!r} is full{waited}: {payload_bytes} bytes needed, "
            f"{self.ring.used_bytes} of {self.ring.capacity_bytes} in use, and {what} "
            f"reader(s) {list(blockers)}. Have them read it (or give_back() its handle), pass a "
            "timeout to put(), or create a larger store",
            payload_bytes, self.ring.capacity_bytes, blockers)


def _held_here(lock: Any) -> bool:
    """Whether this thread holds the RLock `lock` (threading.Condition asks the same)."""
    return bool(lock._is_owned())


class Scrape:
    """What each reader owes, kept between calls of stats(): the owed reads of every object
    that owes any, per reader and in total, and each reader's row as last seen (its stamp).

    What a reader owes on an object changes only when the writer changes the object's
    hand-outs (it marks the entry: Index.changed) or when the reader's row changes (it read,
    discarded or finished through something, attached again, or died: every read bumps its
    reads-ever word after the object's counter). So a call looks again only at the marked
    entries, for every reader, and at the owing objects of each reader whose row changed, for
    that reader: O(readers + changes since the last call). A reader that stopped, died or
    never attached costs nothing however much it owes; one that reads while it lags costs
    what it owes, once per call in which it read. The first call (and a call after one an
    exception cut short) walks every live object once.

    The writer's thread (a signal handler's stats()) or another thread may call it while the
    writer works: the marks are taken under the index's lock, each object's owed reads are
    worked out before any total changes, an object that changed meanwhile is marked again, and
    a call that finds another in progress in its own thread (a signal handler), or finds its
    thread inside a change of the writer's (the index's lock held: a mark made, its change
    not yet), walks every object without touching what is kept or taking a mark."""

    def __init__(self, space: Space) -> None:
        self._space = space
        self._lock = threading.RLock()
        self._busy = False
        self._valid = False  # False: the next call walks every live object
        n = space.ledger.n_readers
        self._owed: dict[int, tuple[Entry, list[int]]] = {}  # seq -> (entry, owed by reader)
        self._owing: list[set[int]] = [set() for _ in range(n)]  # seqs reader r owes on
        self._lag = [0] * n
        self._stamps: list[Row | None] = [None] * n

    def lag(self) -> tuple[list[int], int]:
        with self._lock:
            # a handler inside a call in this thread, or inside a change of the writer's (the
            # index's lock held here: an entry marked, its change not made): the walk, which
            # takes no mark
            if self._busy or _held_here(self._space.index.lock):
                return self._space.recount()
            self._busy = True
            try:
                return self._look()
            except BaseException:
                self._valid = False  # cut short: what is kept may be half done
                raise
            finally:
                self._busy = False

    def _look(self) -> tuple[list[int], int]:
        space = self._space
        index = space.index
        with index.lock:
            changed, index.changed = index.changed, {}
            if index.last is not None:  # a change that may still be under way: every time
                changed.setdefault(*index.last)
            rebuilt = not self._valid
            if rebuilt:  # every live entry, as changed (a hand-out after this is marked)
                changed = dict(index.by_seq)
                self._owed.clear()
                index.kept.clear()
                for owing in self._owing:
                    owing.clear()
                self._lag = [0] * len(self._lag)
                self._stamps = [None] * len(self._stamps)
        rows = space.ledger.rows(force=False)
        self._valid = True
        # a snapshot: a give-back marks without the lock (Index.changing), maybe in the dict
        # just taken; what it marks is `last` then, looked at in this call and the next
        for seq, entry in list(changed.items()):
            self._update(seq, entry, rows, None)
        if rebuilt:  # every reader's debts were just worked out from these rows
            self._stamps = list(rows)
        for r, row in enumerate(rows):
            if row != self._stamps[r]:
                for seq in list(self._owing[r]):
                    self._update(seq, self._owed[seq][0], rows, r)
                self._stamps[r] = row
        return list(self._lag), len(index.by_seq)

    def _update(self, seq: int, entry: Entry, rows: list[Row], only: int | None) -> None:
        """Work out what `entry` owes now (reader `only`'s alone, else every reader's); an
        entry gone from `seq` owes nothing there."""
        if self._space.index.by_seq.get(seq) is not entry or not entry.live:
            self._set(seq, entry, [0] * len(rows))
            return
        try:
            owed = self._space.ledger.owed(entry.handouts, entry.chunk.address, False,
                                           entry.narrowed, rows, only)
        except (RuntimeError, IndexError):  # the writer's thread changes it now: it marked it
            with self._space.index.lock:
                self._space.index.changed[seq] = entry
            return
        if only is not None:
            kept = self._owed.get(seq)
            whole = list(kept[1]) if kept is not None else [0] * len(rows)
            whole[only] = owed[only]
            owed = whole
        self._set(seq, entry, owed)

    def _set(self, seq: int, entry: Entry, owed: list[int]) -> None:
        """Keep `owed` as what `entry` at `seq` owes (nothing kept when it owes nothing)."""
        index = self._space.index
        if any(owed):
            with index.lock:  # kept only while it lives there: its drop then marks it
                if index.by_seq.get(seq) is not entry or not entry.live:
                    owed = [0] * len(owed)  # dropped since it was looked at
                else:
                    index.kept.add(seq)
        kept = self._owed.pop(seq, None)
        old = kept[1] if kept is not None else [0] * len(owed)
        for r, count in enumerate(owed):
            if count != old[r]:
                self._lag[r] += count - old[r]
                if count:
                    self._owing[r].add(seq)
                else:
                    self._owing[r].discard(seq)
        if any(owed):
            self._owed[seq] = (entry, owed)
        else:
            index.kept.discard(seq)
