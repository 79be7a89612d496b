"""ObjectStore: objects keyed by content hash in one shared ring, read in place by N readers.

The writer (from `ObjectStore.create`) puts objects and hands out Handles; each reader (from
`ObjectStore.attach(name, reader=i)`) reads them with `get` (owned copy) or `view` (zero copy).

Delivery without locks: the writer records, in its own memory, each hand-out of an object
(`put` once, then once per `get_cached`, minus `release`), numbered by a store-wide hand-out
sequence. Each reader counts, in a word of the object's header that only it writes, how often it
finished reading the object. The writer may reclaim an object only when every reader has read it
as often as it was handed out to that reader.

Readers that die or leave: a reader slot has a generation, raised by every attach. The first
reader of a slot owes every hand-out; a replacement owes only hand-outs made after it attached
(what was sent to its dead predecessor is lost with it). A slot whose reader died (its pid is
gone; checked when a put is blocked and at least once a second) or closed owes nothing, so it
never pins objects; a slot nobody has attached to yet owes everything (readers are expected).
Read counters carry the generation of the reader that wrote them, so reads of a dead reader
never count for its replacement.

Store meta area (segment offset 64, after the segment header; little-endian)::

    offset  size  field
    0       8     max_object_size   u64, largest serialized object accepted
    8       4     policy            u32, POLICY_IDS
    12      4     reserved
    16      8     handout_seq       u64, number of the last hand-out (written by the writer)
    24      40    reserved
    64      64*n  reader table, one cache line per reader (written only by that reader):
                    0   8  pid             i64, 0 when no reader is attached
                    8   8  total_reads     u64, reads finished by this slot, ever
                    16  8  attached_ns     u64, when the reader attached
                    24  8  generation      u64, 0 before the first attach, +1 per attach
                    32  8  attach_handout  u64, hand-outs before this one are not owed to it
                    40  24 reserved

Object layout (the payload of one ring chunk)::

    offset  size  field
    0       16    key_digest      blake2b-128 of the key
    16      8     body_bytes      u64, serialized size (serde body)
    24      4     structure_crc   u32, CRC-32 of body_bytes and of the body's header, buffer table
                                  and msgpack structure (everything but raw array bytes)
    28      36    reserved
    64      8*n   read counters   u64 per reader: generation << 32 | reads by that generation,
                                  each written only by its reader (store-release)
    64+8n   pad   to a cache line
    header  ...   body            serde layout; arrays inside stay cache-line aligned
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from ._closeable import Closeable
from .errors import (
    CorruptObject,
    IncompatibleSegment,
    InvalidHandle,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    ObjectTooLarge,
    SegmentClosed,
    StaleHandle,
    StoreFull,
)
from .handle import KEY_DIGEST_BYTES, Handle
from .ring import RingWriter, ShmRingBuffer
from .segment import ALIGN_BYTES, SEGMENT_HEADER, align_up, check_reader_slot, pid_alive
from .serde import decode, encode

__all__ = ["ObjectStore", "StoreWriter", "StoreReader", "StoreStats", "MAX_READERS", "key_digest"]

STORE_META = struct.Struct("<QI4xQ40x")
READER_SLOT = struct.Struct("<qQQQQ24x")
OBJECT_HEADER = struct.Struct("<16sQI36x")
assert STORE_META.size == READER_SLOT.size == OBJECT_HEADER.size == ALIGN_BYTES
META_HANDOUT_SEQ = 16  # byte offset of handout_seq inside the store meta area
READER_TOTAL_READS = 8  # byte offsets inside a reader slot
READER_GENERATION = 24
READER_ATTACH_HANDOUT = 32
LIVENESS_CHECK_S = 1.0  # a reader's pid is checked at least this often while it owes reads
_COUNT_MASK = (1 << 32) - 1
_U64 = struct.Struct("<Q")
log = logging.getLogger("shmstore")
MAX_READERS = 1024  # a reader table of 64 KiB; tensor parallelism stays far below
POLICY_IDS = {"fifo": 1, "reinsert": 2}
REINSERT_BUDGET_FACTOR = 2  # a put may copy at most this many times its own size forward
_RETRY_SLEEP_S = (0.0002, 0.005)  # first and largest pause while a full put waits for readers


def key_digest(key: str | bytes) -> bytes:
    """Return the 16-byte digest a Handle carries for `key` (str and bytes keys never collide)."""
    if type(key) is str:
        data = b"s" + key.encode("utf-8", "surrogatepass")
    elif type(key) is bytes:
        data = b"b" + key
    else:
        raise InvalidKey(f"keys are str or bytes (e.g. an mm hash), got {type(key).__name__}; "
                         "hash other values with shmstore's mm_hash or hashlib first")
    if len(data) == 1:
        raise InvalidKey("keys must not be empty")
    return hashlib.blake2b(data, digest_size=KEY_DIGEST_BYTES).digest()


def _object_header_bytes(n_readers: int) -> int:
    return OBJECT_HEADER.size + align_up(8 * n_readers)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of one store, taken by the writer."""

    name: str
    capacity_bytes: int
    bytes_in_use: int
    objects: int
    puts: int
    hits: int
    evictions: int
    releases: int
    full_events: int
    max_object_size: int
    n_readers: int
    reader_lag: tuple[int, ...]  # hand-outs each reader owes on live objects
    reader_pids: tuple[int, ...]  # 0 where no reader is attached
    dead_readers: int = 0  # readers found dead (their pid gone) and no longer waited for
    policy: str = "fifo"
    reinsertions: int = 0  # objects copied forward instead of dropped (policy "reinsert")
    bytes_reinserted: int = 0  # ring bytes those copies wrote


@dataclass(slots=True)
class _Entry:
    key: str | bytes
    handle: Handle
    handouts: list[int]  # hand-out numbers not yet released, oldest first
    nbytes: int  # serialized size
    hit: bool = False  # handed out again since it was (re)written


class EvictionPolicy:
    """Decides, for the oldest object every reader is done with, whether it stays.

    The store owns the bytes and the "reclaim until it fits" loop; a policy only answers `keep`.
    """

    name = "fifo"

    def keep(self, entry: _Entry, chunk_bytes: int, budget_bytes: int) -> bool:
        """FIFO: never; the oldest reclaimable object goes."""
        return False


class ReinsertPolicy(EvictionPolicy):
    """FIFO-reinsertion (CLOCK with one bit): an object hit since it was written is copied to
    the head instead of dropped, while the put's copy budget lasts."""

    name = "reinsert"

    def keep(self, entry: _Entry, chunk_bytes: int, budget_bytes: int) -> bool:
        return entry.hit and chunk_bytes <= budget_bytes


_POLICIES: dict[str, type[EvictionPolicy]] = {"fifo": EvictionPolicy, "reinsert": ReinsertPolicy}


class ObjectStore(Closeable):
    """What the writer and the readers of one store share; use `create` or `attach`."""

    _ring: ShmRingBuffer | None = None
    name = ""
    n_readers = 0
    capacity = 0
    max_object_size = 0
    epoch = 0

    def __init__(self, ring: ShmRingBuffer) -> None:
        self._ring = ring
        seg = ring.segment
        self.name = seg.name
        self.n_readers = seg.n_readers
        self.capacity = seg.capacity_bytes
        self.epoch = seg.epoch
        self._buf = seg.buf
        self._words = seg.words
        self._obj_header_bytes = _object_header_bytes(self.n_readers)
        self._table_offset = SEGMENT_HEADER.size + STORE_META.size

    @staticmethod
    def create(
        name: str | None,
        capacity: int,
        n_readers: int,
        max_object_size: int | None = None,
        *,
        policy: str = "fifo",
        mode: int = 0o600,
        prefault: bool = True,
    ) -> StoreWriter:
        """Create a store and return its writer (this process owns and later unlinks it).

        Args:
            name: the segment name in /dev/shm (None: a random `shmstore-...` name).
            capacity: bytes of the ring that holds the objects.
            n_readers: how many readers must read each object before it can be reclaimed.
            max_object_size: largest serialized object accepted (default: what fits the ring).
            policy: "fifo" reclaims the oldest object every reader is done with; "reinsert"
                copies it to the head instead when it was handed out again since it was
                written (at most REINSERT_BUDGET_FACTOR times the new object's size per put).
            mode: permission bits of the segment (0o600: this user only).
            prefault: map with MAP_POPULATE so puts take no page faults.
        """
        if isinstance(n_readers, bool) or not isinstance(n_readers, int) or not (
                0 <= n_readers <= MAX_READERS):
            raise ValueError(f"n_readers must be an int in [0, {MAX_READERS}], got {n_readers!r}")
        if policy not in POLICY_IDS:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICY_IDS)}")
        header_bytes = _object_header_bytes(n_readers)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 4 * ALIGN_BYTES:
            raise ValueError(f"capacity must be an int of at least {4 * ALIGN_BYTES} bytes, "
                             f"got {capacity!r}")
        largest = align_up(capacity) - ALIGN_BYTES - header_bytes  # one object filling the ring
        if max_object_size is None:
            max_object_size = largest
        elif (isinstance(max_object_size, bool) or not isinstance(max_object_size, int)
              or not 0 < max_object_size <= largest):
            raise ValueError(f"max_object_size must be an int in [1, {largest}] for a capacity of "
                             f"{capacity} bytes, got {max_object_size!r}")
        ring = ShmRingBuffer.create(
            name, capacity, meta_bytes=STORE_META.size + READER_SLOT.size * n_readers,
            n_readers=n_readers, mode=mode, prefault=prefault,
        )
        try:
            STORE_META.pack_into(ring.meta, 0, max_object_size, POLICY_IDS[policy], 0)
            return StoreWriter(ring, policy)
        except BaseException:
            ring.close()
            raise

    @staticmethod
    def attach(name: str, reader: int, *, prefault: bool = True) -> StoreReader:
        """Attach to the store `name` as reader number `reader` (0..n_readers-1)."""
        ring = ShmRingBuffer.attach(name, prefault=prefault)
        try:
            return StoreReader(ring, reader)
        except BaseException:
            ring.close()
            raise

    # -- shared helpers ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ring is None or self._ring.closed

    @property
    def ring(self) -> ShmRingBuffer:
        if self._ring is None or self._ring.closed:
            raise SegmentClosed(f"store {self.name!r} is closed; attach it again to use it")
        return self._ring

    def _read_max_object_size(self) -> int:
        meta = self.ring.meta
        if len(meta) < STORE_META.size + READER_SLOT.size * self.n_readers:
            raise IncompatibleSegment(
                f"store {self.name!r} has a {len(meta)}-byte meta area, too small for "
                f"{self.n_readers} readers: the segment is corrupt; recreate it", self.name)
        max_object_size, policy_id, _ = STORE_META.unpack_from(meta, 0)
        if policy_id not in POLICY_IDS.values() or not 0 < max_object_size <= self.capacity:
            raise IncompatibleSegment(
                f"store {self.name!r} has policy id {policy_id} and max_object_size "
                f"{max_object_size}: the segment is corrupt or from another version", self.name)
        return int(max_object_size)

    def _slot_offset(self, reader: int) -> int:
        return self._table_offset + READER_SLOT.size * reader

    def _slot_fields(self, reader: int) -> tuple[int, int, int]:
        """(pid, generation, attach_handout) of a reader slot, as its reader last wrote them."""
        slot = self._slot_offset(reader)
        words = self._words
        pid = words.load_acquire(slot)  # first: the reader stores it last
        if pid >= 1 << 63:
            pid -= 1 << 64
        return (pid, words.load_acquire(slot + READER_GENERATION),
                words.load_acquire(slot + READER_ATTACH_HANDOUT))

    def _counter_offset(self, address: int, reader: int) -> int:
        return address + ALIGN_BYTES + OBJECT_HEADER.size + 8 * reader

    def _check_handle(self, handle: Handle) -> None:
        if type(handle) is not Handle:
            raise InvalidHandle(f"expected a shmstore Handle, got {type(handle).__name__}")
        if handle.epoch != self.epoch:
            raise StaleHandle(
                f"handle {handle} belongs to another store or an earlier incarnation of "
                f"{self.name!r} (epoch {handle.epoch:#x}, this store {self.epoch:#x}); "
                "handles are valid only in the store that issued them")

    def close(self) -> None:
        """Detach this process; idempotent (the writer also unlinks the segment)."""
        if self._ring is not None:
            self._ring.close()


    def __repr__(self) -> str:
        state = "closed" if self.closed else f"capacity={self.capacity}"
        return f"<{type(self).__name__} {self.name!r} n_readers={self.n_readers} {state}>"


class StoreWriter(ObjectStore):
    """The single writer: put, get_cached, release, clear, stats. Keeps the key index."""

    def __init__(self, ring: RingWriter, policy: str) -> None:
        super().__init__(ring)
        self._writer_ring = ring
        self.policy = policy
        self._policy = _POLICIES[policy]()
        self._reinsertions = self._bytes_reinserted = 0
        self.max_object_size = self._read_max_object_size()
        self._index: dict[str | bytes, _Entry] = {}
        self._by_seq: dict[int, _Entry] = {}
        self._puts = self._hits = self._evictions = self._releases = self._full_events = 0
        self._handout_seq = 0
        self._liveness: list[tuple[int, float, bool]] = [(0, 0.0, True)] * self.n_readers
        self._reported_dead: set[tuple[int, int]] = set()  # (reader, generation) logged dead

    # -- the API -----------------------------------------------------------------------------

    def put(self, key: str | bytes, obj: Any, timeout: float | None = None) -> Handle:
        """Store `obj` under `key` and hand it out once; return its Handle.

        One copy: each array/tensor is copied from its own memory straight into the ring.

        Args:
            timeout: seconds to wait for readers when the store is full (None or 0: do not wait).

        Raises:
            KeyExists: `key` is cached (use get_cached).
            ObjectTooLarge: the serialized object exceeds max_object_size.
            StoreFull: the oldest object is still owed to a reader (named in the message).
        """
        digest = key_digest(key)
        if key in self._index:
            raise KeyExists(f"key {key!r} is already in store {self.name!r}: hand it out again "
                            "with get_cached(key), or check is_cached(key) first", key)
        enc = encode(obj)
        if enc.nbytes > self.max_object_size:
            raise ObjectTooLarge(
                f"object for key {key!r} is {enc.nbytes} bytes serialized, above the "
                f"max_object_size of store {self.name!r} ({self.max_object_size} bytes): send it "
                "another way or create the store with a larger max_object_size",
                enc.nbytes, self.max_object_size)
        address, seq = self._allocate(self._obj_header_bytes + enc.nbytes, timeout)
        handle = Handle(address, seq, digest, self.epoch)
        entry = _Entry(key, handle, [], enc.nbytes)  # owed to nobody until fully written
        self._by_seq[seq] = entry
        start = address + ALIGN_BYTES
        buf = self._buf
        OBJECT_HEADER.pack_into(buf, start, digest, enc.nbytes,
                                zlib.crc32(_U64.pack(enc.nbytes), enc.structure_crc))
        counters = start + OBJECT_HEADER.size
        buf[counters:counters + 8 * self.n_readers] = bytes(8 * self.n_readers)
        body = start + self._obj_header_bytes
        enc.write_into(buf[body:body + enc.nbytes])
        self._hand_out(entry)
        self._index[key] = entry
        self._puts += 1
        return handle

    def is_cached(self, key: str | bytes) -> bool:
        """Say whether `key` is in the store; no side effect."""
        key_digest(key)
        return key in self._index

    def object_bytes(self, key: str | bytes) -> int:
        """Serialized size of the cached object of `key`; KeyNotCached if it is not cached."""
        entry = self._index.get(key)
        if entry is None:
            raise KeyNotCached(f"key {key!r} is not in store {self.name!r}", key)
        return entry.nbytes

    def get_cached(self, key: str | bytes) -> Handle:
        """Hand the object of `key` out once more (one more read owed by every reader).

        Raises:
            KeyNotCached: the key was never put or has been evicted (put it again).
        """
        entry = self._index.get(key)
        if entry is None:
            key_digest(key)
            raise KeyNotCached(f"key {key!r} is not in store {self.name!r} (never put, evicted "
                               "or cleared): put it again", key)
        self._hand_out(entry)
        entry.hit = True
        self._hits += 1
        return entry.handle

    def _hand_out(self, entry: _Entry) -> None:
        self._handout_seq += 1
        entry.handouts.append(self._handout_seq)
        self._words.store_release(SEGMENT_HEADER.size + META_HANDOUT_SEQ, self._handout_seq)

    def release(self, handle: Handle) -> None:
        """Take back one hand-out of `handle` that no reader will read (an aborted request).

        Raises:
            StaleHandle: the object is gone, or has no hand-out left to take back.
        """
        self._check_handle(handle)
        entry = self._by_seq.get(handle.seq)
        if entry is None or entry.handle != handle:
            raise StaleHandle(f"handle {handle} names no live object in store {self.name!r}; "
                              "it was reclaimed or cleared already")
        if not entry.handouts:
            raise StaleHandle(f"handle {handle} has no hand-out left to release in store "
                              f"{self.name!r}; release each hand-out at most once")
        entry.handouts.pop()
        self._releases += 1

    def clear(self) -> None:
        """Drop every object; every handle issued before now becomes stale."""
        self._evictions += len(self._wring().clear())
        self._index.clear()
        self._by_seq.clear()

    def stats(self) -> StoreStats:
        """Return counters and what each reader owes; O(objects x readers)."""
        ring = self._wring()
        states = self._reader_states(force=False)
        lag = [0] * self.n_readers
        for entry in self._by_seq.values():
            for r, state in enumerate(states):
                lag[r] += self._owed(entry, r, state)
        pids = [self._slot_fields(r)[0] for r in range(self.n_readers)]
        return StoreStats(
            name=self.name, capacity_bytes=self.capacity,
            bytes_in_use=ring.used_bytes,
            objects=len(self._by_seq), puts=self._puts, hits=self._hits,
            evictions=self._evictions, releases=self._releases, full_events=self._full_events,
            max_object_size=self.max_object_size, n_readers=self.n_readers,
            reader_lag=tuple(lag), reader_pids=tuple(pids), policy=self.policy,
            reinsertions=self._reinsertions, bytes_reinserted=self._bytes_reinserted,
            dead_readers=len(self._reported_dead),
        )

    def __len__(self) -> int:
        return len(self._index)

    def _wring(self) -> RingWriter:
        if self._writer_ring.closed:
            raise SegmentClosed(f"store {self.name!r} is closed; create it again to use it")
        return self._writer_ring

    # -- eviction ----------------------------------------------------------------------------

    def _reader_states(self, force: bool) -> list[tuple[int, int] | None]:
        """Per reader: (generation, attach_handout) while it owes reads, None when it owes
        nothing (it died or left). Pids are checked when `force` or once a LIVENESS_CHECK_S."""
        states: list[tuple[int, int] | None] = []
        now = time.monotonic()
        for r in range(self.n_readers):
            pid, generation, attach_handout = self._slot_fields(r)
            if generation == 0:  # nobody attached yet: owes everything, as readers are expected
                states.append((0, 0))
                continue
            if pid <= 0:  # its reader closed
                states.append(None)
                continue
            known_pid, checked, alive = self._liveness[r]
            if force or known_pid != pid or now - checked >= LIVENESS_CHECK_S:
                alive = pid_alive(pid)
                self._liveness[r] = (pid, now, alive)
            if not alive and (r, generation) not in self._reported_dead:
                self._reported_dead.add((r, generation))
                log.warning("store %r: reader %d (pid %d) died; no longer waiting for it",
                            self.name, r, pid)
            states.append((generation, attach_handout) if alive else None)
        return states

    def _owed(self, entry: _Entry, reader: int, state: tuple[int, int] | None) -> int:
        """Reads `reader` still owes on `entry`."""
        if state is None or not entry.handouts:
            return 0
        generation, attach_handout = state
        handed = entry.handouts
        owed = len(handed) if handed[0] > attach_handout else sum(h > attach_handout for h in handed)
        if not owed:
            return 0
        word = self._words.load_acquire(self._counter_offset(entry.handle.address, reader))
        reads = word & _COUNT_MASK if word >> 32 == generation else 0
        return max(0, owed - reads)

    def _owed_by(self, entry: _Entry, states: list[tuple[int, int] | None]) -> list[int]:
        """Readers that still owe reads of `entry`."""
        return [r for r, state in enumerate(states) if self._owed(entry, r, state)]

    def _reclaim_one(self, budget: list[int], states: list[tuple[int, int] | None]) -> bool:
        """Free (or, if the policy keeps it, move to the head) the oldest object; False if it
        is still owed to a reader. `budget` holds the copy bytes this put may still spend."""
        ring = self._wring()
        oldest = ring.oldest()
        if oldest is None:
            return False
        entry = self._by_seq[oldest[1]]
        if self._owed_by(entry, states):
            return False
        header = ring.header(oldest[0], oldest[1])
        if self._policy.keep(entry, header.chunk_bytes, budget[0]):
            budget[0] -= header.chunk_bytes
            self._move_to_head(entry, header.payload_bytes)
            return True
        ring.free(_always, nbytes=1)
        del self._by_seq[oldest[1]]
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
        self._evictions += 1
        return True

    def _move_to_head(self, entry: _Entry, payload_bytes: int) -> None:
        """Copy a fully read object from the tail to the head; its old handles become stale."""
        ring = self._wring()
        start = entry.handle.address + ALIGN_BYTES
        saved = bytes(self._buf[start:start + payload_bytes])  # the new chunk may overlap it
        ring.free(_always, nbytes=1)
        address, seq = ring.allocate(payload_bytes)
        start = address + ALIGN_BYTES
        self._buf[start:start + payload_bytes] = saved
        counters = start + OBJECT_HEADER.size
        self._buf[counters:counters + 8 * self.n_readers] = bytes(8 * self.n_readers)
        del self._by_seq[entry.handle.seq]
        entry.handle = Handle(address, seq, entry.handle.key_digest, self.epoch)
        entry.handouts = []
        entry.hit = False
        self._by_seq[seq] = entry
        self._reinsertions += 1
        self._bytes_reinserted += ring.chunk_bytes_for(payload_bytes)

    def _allocate(self, payload_bytes: int, timeout: float | None) -> tuple[int, int]:
        ring = self._wring()
        deadline = None if not timeout else time.monotonic() + timeout
        pause = _RETRY_SLEEP_S[0]
        counted = False
        budget = [REINSERT_BUDGET_FACTOR * ring.chunk_bytes_for(payload_bytes)]
        states = self._reader_states(force=False)
        while True:
            while not ring.fits(payload_bytes):
                if not self._reclaim_one(budget, states):
                    break
            else:
                return ring.allocate(payload_bytes)
            fresh = self._reader_states(force=True)  # blocked: is the reader we wait for alive?
            if fresh != states:
                states = fresh
                continue
            if not counted:
                self._full_events += 1
                counted = True
            if deadline is None or time.monotonic() >= deadline:
                raise self._full_error(payload_bytes, timeout)
            time.sleep(pause)
            pause = min(pause * 2, _RETRY_SLEEP_S[1])

    def _full_error(self, payload_bytes: int, timeout: float | None) -> StoreFull:
        ring = self._wring()
        oldest = ring.oldest()
        entry = self._by_seq[oldest[1]] if oldest is not None else None
        if entry is None:  # empty ring: only an object larger than the ring gets here
            return StoreFull(f"store {self.name!r} cannot hold {payload_bytes} bytes even when "
                             f"empty (capacity {self.capacity}); create a larger store",
                             payload_bytes, self.capacity)
        lagging = tuple(self._owed_by(entry, self._reader_states(force=True)))
        waited = f" after waiting {timeout} s" if timeout else ""
        return StoreFull(
            f"store {self.name!r} is full{waited}: {payload_bytes} bytes needed, "
            f"{ring.used_bytes} of {self.capacity} in use, and the oldest object "
            f"(key {entry.key!r}, handed out {len(entry.handouts)} times) is still owed to "
            f"reader(s) {list(lagging)}. Have them read it (or release() its handle), pass a "
            "timeout to put(), or create a larger store",
            payload_bytes, self.capacity, lagging)


def _always(seq: int, payload: memoryview) -> bool:
    return True


class StoreReader(ObjectStore):
    """One reader of a store: get (owned copy) and view (zero copy). Writes only its own counters."""

    reader = -1
    generation = 0

    def __init__(self, ring: ShmRingBuffer, reader: int) -> None:
        super().__init__(ring)
        what = f"store {self.name!r}"
        check_reader_slot(what, reader, self.n_readers, None)
        self.max_object_size = self._read_max_object_size()
        check_reader_slot(what, reader, self.n_readers, self._slot_fields(reader)[0])
        slot = self._slot_offset(reader)
        self.reader = reader
        self._reader_ring = ring
        self._slot = slot
        words = self._words
        self._reads = words.load_acquire(slot + READER_TOTAL_READS)
        previous = words.load_acquire(slot + READER_GENERATION)
        self.generation = previous + 1
        # The first reader of a slot owes every hand-out; a replacement only later ones.
        attach_handout = 0 if previous == 0 else words.load_acquire(
            SEGMENT_HEADER.size + META_HANDOUT_SEQ)
        READER_SLOT.pack_into(self._buf, slot, 0, self._reads, time.time_ns(), self.generation,
                              attach_handout)
        words.store_release(slot, os.getpid())  # last: the writer sees a complete slot

    @property
    def reads(self) -> int:
        """Reads this reader slot has finished, ever."""
        return self._reads

    def _locate(self, handle: Handle) -> tuple[memoryview, int]:
        """Validate `handle` against the chunk it names; return its body and structure CRC."""
        self._check_handle(handle)
        if self._buf is None:
            raise SegmentClosed(f"store {self.name!r} is closed; attach it again to use it")
        header = self._reader_ring.header(handle.address, handle.seq)
        start = handle.address + ALIGN_BYTES
        digest, body_bytes, crc = OBJECT_HEADER.unpack_from(self._buf, start)
        if digest != handle.key_digest:
            raise StaleHandle(f"handle {handle} does not match the key of the object at its "
                              f"address in store {self.name!r}; it is stale or forged")
        body = start + self._obj_header_bytes
        if body + body_bytes > start + header.payload_bytes:
            raise CorruptObject(f"object seq {handle.seq} in store {self.name!r} claims a "
                                f"{body_bytes}-byte body, more than its chunk holds")
        return self._buf[body:body + body_bytes], crc

    def _finish(self, handle: Handle) -> None:
        """Check the object was not overwritten while read, then count the read."""
        if _U64.unpack_from(self._buf, handle.address)[0] != handle.seq:  # the chunk's seq
            raise StaleHandle(f"object seq {handle.seq} in store {self.name!r} was overwritten "
                              "while it was read; what was read is not valid (a reader read a "
                              "handle more often than it was handed out, or the store was cleared)")
        counter = self._counter_offset(handle.address, self.reader)
        words = self._words
        word = words.load_acquire(counter)
        reads = word & _COUNT_MASK if word >> 32 == self.generation else 0
        words.store_release(counter, self.generation << 32 | (reads + 1))
        self._reads += 1
        words.store_release(self._slot + READER_TOTAL_READS, self._reads)

    def get(self, handle: Handle) -> Any:
        """Return an owned copy of the object and count one read.

        Raises:
            StaleHandle: the object was reclaimed, cleared, or the handle is from another store.
            CorruptObject: the bytes fail validation.
        """
        body, crc = self._locate(handle)
        obj = decode(body, copy=True, expected_crc=crc, crc_suffix=_U64.pack(len(body)))
        self._finish(handle)
        return obj

    @contextmanager
    def view(self, handle: Handle) -> Iterator[Any]:
        """Yield the object with arrays/tensors pointing into shared memory; count the read on exit.

        The arrays are valid only inside the block: once it exits the writer may reuse the bytes.
        Keep what you need with `.copy()` / `.clone()`, or use get().
        """
        body, crc = self._locate(handle)
        obj = decode(body, copy=False, expected_crc=crc, crc_suffix=_U64.pack(len(body)))
        try:
            yield obj
        except BaseException:
            del obj
            with suppress(StaleHandle):  # the block failed, but this reader is done with it
                self._finish(handle)
            raise
        del obj
        self._finish(handle)

    def close(self) -> None:
        """Give the reader slot back and detach; idempotent."""
        if self._ring is not None and not self._ring.closed and self.reader >= 0:
            slot = self._buf[self._slot:self._slot + 8]
            if int.from_bytes(slot, "little", signed=True) == os.getpid():
                slot[:] = bytes(8)
            slot.release()
        self._buf = None  # type: ignore[assignment]
        self._words = None  # type: ignore[assignment]
        super().close()
