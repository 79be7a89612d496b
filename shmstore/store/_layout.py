"""What the writer and the readers of an object store share: binary layouts and the base class.

Store meta area (segment offset 64, after the segment header; little-endian)::

    offset  size  field
    0       8     max_object_bytes  u64, largest serialized object accepted
    8       4     policy            u32, policy.POLICY_IDS
    12      4     reserved
    16      8     handout_seq       u64, number of the last hand-out (written by the writer)
    24      40    reserved
    64      128*n reader rows (shm/_readers.py head, then the store's words):
                    0   8   owner            shm/_readers.py
                    8   8   ready_ns         shm/_readers.py
                    16  8   attach_handout   hand-outs up to this number are not owed to this
                                             reader generation
                    24  8   total_reads      reads this row finished, ever
                    32  8   corrupt_reads    objects this row gave up on (failed validation)
                    40  8   pin_mask         bit i set: pins[i] holds a seq
                    48  8   done_through     0, or: this reader takes its hand-outs in order
                                             and is done with every one up to this number
                                             (read, or lost with a damaged message)
                    56  8   reserved
                    64  64  pins[8]          seqs of chunks this reader is inside of now

Object layout (the payload of one ring chunk)::

    offset  size  field
    0       16    key_digest      blake2b-128 of the key
    16      8     body_bytes      u64, serialized size (serde body)
    24      4     structure_crc   u32, CRC-32 of the body's header, buffer table and msgpack
                                  structure, continued over body_bytes (not the raw array bytes)
    28      4     reserved
    32      8     origin_seq      u64, seq of the put that wrote these bytes; a copy forward
                                  keeps it, so (key_digest, origin_seq) names the content across
                                  moves (what a relay caches remote copies under)
    40      24    reserved
    64      8*n   read counters   u64 per reader: generation << 32 | reads by that generation,
                                  each written only by its reader (store-release)
    64+8n   pad   to a cache line
    header  ...   body            serde layout; arrays inside stay cache-line aligned

Pins (why a chunk under read is never reused)::

    reader                                   writer (freeing chunk seq X)
    1. pin_mask |= bit; pins[i] = X           1. chunk seq word = 0     (tombstone)
       (exchange: full barrier)                  (exchange: full barrier)
    2. chunk seq word == X ?  else Stale      2. any attached reader with a pin == X ?
    3. read; count the read                      yes: keep the bytes, try again later
    4. pins[i] = 0; pin_mask &= ~bit             no:  reuse the bytes

Dekker's argument: of the two exchanges one comes first in the total order; if the reader's
came first the writer sees the pin, otherwise the reader sees the tombstone. So a reader that
passed step 2 reads bytes that stay put until step 4, even across clear(); and its counter
store (step 3) never lands in another object.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import IncompatibleSegment, InvalidHandle, StaleHandle
from ..handle import Handle
from ..shm._closeable import CallGuard, Closeable
from ..shm._ordering import Words
from ..shm._readers import ATTACHED, NEVER, ROW_HEAD_BYTES, Liveness, ReaderTable
from ..shm.ring import ShmRingBuffer
from ..shm.segment import ALIGN_BYTES, SEGMENT_HEADER, align_up
from .policy import POLICY_IDS

__all__ = ["STORE_META", "OBJECT_HEADER", "STORE_ROW", "StoreStats", "StoreBase", "ReaderLedger",
           "object_header_bytes", "counter_offset"]

STORE_META = struct.Struct("<QI4xQ40x")
STORE_ROW = struct.Struct("<QQQQQQQ8x8Q")
OBJECT_HEADER = struct.Struct("<16sQI4xQ24x")
assert STORE_META.size == OBJECT_HEADER.size == ALIGN_BYTES and STORE_ROW.size == 2 * ALIGN_BYTES
META_HANDOUT_SEQ = 16  # byte offsets inside the store meta area
ROW_ATTACH_HANDOUT = ROW_HEAD_BYTES  # byte offsets inside a reader row
ROW_TOTAL_READS = ROW_HEAD_BYTES + 8
ROW_CORRUPT_READS = ROW_HEAD_BYTES + 16
ROW_PIN_MASK = ROW_HEAD_BYTES + 24
ROW_DONE_THROUGH = ROW_HEAD_BYTES + 32
ROW_PINS = 64
MAX_PINS = 8  # views one reader may hold open at once (nested or in threads)
COUNT_MASK = (1 << 32) - 1
U64 = struct.Struct("<Q")


def object_header_bytes(n_readers: int) -> int:
    """Bytes before an object's body: the fixed header and one counter per reader."""
    return OBJECT_HEADER.size + align_up(8 * n_readers)


def counter_offset(address: int, reader: int) -> int:
    """Byte offset of `reader`'s read counter in the object at chunk `address`."""
    return address + ALIGN_BYTES + OBJECT_HEADER.size + 8 * reader


class ReaderLedger:
    """The writer's reading of the reader rows: what each reader still owes on an object (its
    counter against the hand-outs made after it attached) and which readers are inside a chunk
    (its pins). Readers write these words; the writer only loads them."""

    def __init__(self, words: Words, table: ReaderTable, liveness: Liveness) -> None:
        self._words = words
        self._table = table
        self._liveness = liveness
        self._n = table.n_readers

    def owed(self, handouts: list[int], address: int, force: bool,
             narrowed: dict[int, int] | None = None) -> list[int]:
        """Reads each reader still owes on the object at `address`, handed out as numbered;
        a hand-out in `narrowed` is owed only by the readers of its mask (bit r: reader r)."""
        n = self._n
        if not handouts:
            return [0] * n
        words = self._words
        table = self._table
        owed = [0] * n
        every = handouts
        for r in range(n):
            if narrowed:
                handouts = [h for h in every if h not in narrowed or narrowed[h] >> r & 1]
                if not handouts:
                    continue
            status, generation = self._liveness.status(r, force)
            if status == NEVER:
                owed[r] = len(handouts)
                continue
            if status != ATTACHED:
                continue
            row = table.row(r)
            after = words.load_acquire(row + ROW_ATTACH_HANDOUT)
            through = words.load_acquire(row + ROW_DONE_THROUGH)
            if through:  # an in-order reader: what comes after `through` is owed, once each
                owed[r] = sum(h > after and h > through for h in handouts)
                continue
            count = len(handouts) if handouts[0] > after else sum(h > after for h in handouts)
            if count:
                word = words.load_acquire(counter_offset(address, r))
                reads = word & COUNT_MASK if word >> 32 == generation else 0
                owed[r] = max(0, count - reads)
        return owed

    def pinned_by(self, seq: int) -> tuple[int, ...]:
        """Attached readers that are inside the chunk `seq` now."""
        words = self._words
        table = self._table
        inside = []
        for r in range(self._n):
            row = table.row(r)
            mask = words.load_acquire(row + ROW_PIN_MASK)
            if not mask:
                continue
            if self._liveness.status(r)[0] != ATTACHED:
                continue
            for i in range(MAX_PINS):
                if mask >> i & 1 and words.load_acquire(row + ROW_PINS + 8 * i) == seq:
                    inside.append(r)
                    break
        return tuple(inside)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of one store, taken by the writer."""

    name: str
    policy: str
    policy_rule: str  # the rule applied now: the policy's name, or the rival adaptive follows
    capacity_bytes: int
    max_object_bytes: int
    n_readers: int
    bytes_in_use: int
    objects: int
    puts: int
    hits: int
    evictions: int
    give_backs: int
    full_events: int
    reinsertions: int  # objects copied forward instead of dropped (every policy but fifo)
    bytes_reinserted: int  # ring bytes those copies wrote
    damaged_objects: int  # objects dropped because their header in shared memory was damaged
    withdrawn: int  # objects dropped by withdraw() while readers still owed reads
    dead_readers: int  # readers found dead (their pid gone) and no longer waited for
    reader_lag: tuple[int, ...]  # hand-outs each reader owes on live objects
    reader_pids: tuple[int, ...]  # 0 where no reader is attached
    corrupt_reads: tuple[int, ...]  # objects each reader gave up on because they failed checks


class StoreBase(Closeable):
    """What the writer and the readers of one store share; use ObjectStore.create / attach."""

    _ring: ShmRingBuffer | None = None
    _guard: CallGuard | None = None
    name = ""
    n_readers = 0
    capacity_bytes = 0
    max_object_bytes = 0
    policy = ""
    epoch = 0

    def __init__(self, ring: ShmRingBuffer) -> None:
        self._ring = ring
        seg = ring.segment
        self.name = seg.name
        self.n_readers = seg.n_readers
        self.capacity_bytes = seg.capacity_bytes
        self.epoch = seg.epoch
        self._total_bytes = seg.total_bytes
        self._buf = seg.buf
        self._words = seg.words
        self._header_bytes = object_header_bytes(self.n_readers)
        self._meta = SEGMENT_HEADER.size
        meta = ring.meta
        if len(meta) < STORE_META.size + STORE_ROW.size * self.n_readers:
            raise IncompatibleSegment(
                f"store {self.name!r} has a {len(meta)}-byte meta area, too small for "
                f"{self.n_readers} readers: the segment is corrupt; recreate it", self.name)
        max_object_bytes, policy_id, _ = STORE_META.unpack_from(meta, 0)
        if policy_id not in POLICY_IDS or not 0 < max_object_bytes <= self.capacity_bytes:
            raise IncompatibleSegment(
                f"store {self.name!r} has policy id {policy_id} and max_object_bytes "
                f"{max_object_bytes}: the segment is corrupt or from another version", self.name)
        self.max_object_bytes = int(max_object_bytes)
        self.policy = POLICY_IDS[policy_id]
        self._table = ReaderTable(self._words, self._meta + STORE_META.size, self.n_readers,
                                  STORE_ROW.size, f"store {self.name!r}", self.name, self.epoch)

    @property
    def closed(self) -> bool:
        return self._guard is None or self._guard.closing

    @property
    def segment_bytes(self) -> int:
        """Shared memory the store reserved: its header, reader rows and ring."""
        return self._total_bytes

    def _check_handle(self, handle: Handle) -> None:
        if type(handle) is not Handle:
            raise InvalidHandle(f"expected a shmstore Handle, got {type(handle).__name__}")
        if handle.epoch != self.epoch:
            raise StaleHandle(
                f"handle {handle} belongs to another store or an earlier incarnation of "
                f"{self.name!r} (epoch {handle.epoch:#x}, this store {self.epoch:#x}); "
                "handles are valid only in the store that issued them", handle, self.name)

    def close(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"capacity_bytes={self.capacity_bytes}"
        return f"<{type(self).__name__} {self.name!r} n_readers={self.n_readers} {state}>"
