"""The broadcast queue's binary layout and what its writer and readers share.

BroadcastQueue (_broadcast.py): one writer, N readers; every reader gets every message, in order.

A ring of fixed-size slots in one Segment. Message number m (1, 2, 3, ...) goes to slot
(m - 1) % n_slots. The writer may fill slot m only when every attached reader has consumed
message m - n_slots; each reader publishes only its own "last consumed" counter.

Queue meta area (segment offset 64; little-endian)::

    offset  size  field
    0       4     n_slots          u32
    4       4     slot_bytes       u32, payload bytes per slot
    8       8     write_seq        u64, last message published (written by the writer)
    16      8     closed           u64, 1 once the writer closed the queue; 2: closed because
                                   the writer it forwards for died (a relay: WriterGone)
    24      8     writer_sleeping  u64, 1 while the writer waits for space on its doorbell
    32      32    reserved
    64      64*n  reader rows (shm/_readers.py head, then the queue's words):
                    0   8  owner      shm/_readers.py
                    8   8  ready_ns   shm/_readers.py
                    16  8  read_seq   u64, last message consumed (or skipped)
                    24  8  sleeping   u64, 1 while the reader waits on its doorbell
                    32  8  skipped    u64, damaged messages this row skipped, ever
                    40  24 reserved

Slot layout (data area; slot i at data_offset + i * (64 + slot_bytes rounded to 64))::

    0       8     seq       u64, the message number held (stored last, with release order)
    8       8     nbytes    u64, serialized size
    16      4     tag       u32, the sender's tag (0 unless put(tag=...); a Channel uses 1, 2)
    20      4     crc       u32, CRC-32 of nbytes, tag and the payload
    24      40    reserved
    64      ...   payload   serde body

Ordering: the writer fills the payload, then stores `seq` with release order, then write_seq
with a full-barrier exchange; a reader loads `seq` with acquire order, copies the message out,
then publishes `read_seq` with a full-barrier exchange.

Two paths, one layout: each step above (the writer's copy, CRC, publish and wake; a reader's
check, consume and doorbell sleep) is one call of a Slots (queue/_slots.py), given the offsets
below by name as `handoff_layout()`: the compiled one (_native/_atomic.c) where it was built,
else its Python twin, chosen once at import. Either side may take either path: the bytes in the
segment are the same. Sleeping: shm/_wait.py (spin, then a
per-reader doorbell; the writer has its own for waiting on slow readers).

Attach (shm/_readers.py protocol): prepare sets read_seq to the current write_seq W; after the row
is visible, settle re-reads write_seq W' and starts there. A message the writer was publishing
while it could not yet see the row overwrote at most slot W'+1-n_slots, which this reader never
reads. A reader receives every message published after attach returns.

Damage: a reader never waits on bytes that cannot change. If write_seq says message s was
published but its slot holds neither s nor the slot's previous message (or the next message is
visibly published), the slot is damaged: the reader skips it and raises CorruptObject once;
the same for a message whose size or CRC is wrong. The next get() goes on with message s + 1.
"""

from __future__ import annotations

import struct

from ..errors import IncompatibleSegment
from ..shm._closeable import CallGuard, Closeable
from ..shm._readers import ROW_HEAD_BYTES, ReaderTable
from ..shm._segment import ALIGN_BYTES, SEGMENT_HEADER, Segment, align_up
from ..shm._tracker import unlink_if_same
from ..shm._wait import sem_path
from . import _slots

__all__ = ["QueueBase", "CLOSED_UPSTREAM_GONE", "QUEUE_META", "QUEUE_ROW", "SLOT_HEADER",
           "SLOT_FIELDS", "bell_name", "remove_semaphores"]

QUEUE_META = struct.Struct("<IIQQQ32x")
QUEUE_ROW = struct.Struct("<QQQQQ24x")
SLOT_HEADER = struct.Struct("<QQII40x")
SLOT_FIELDS = struct.Struct("<QII")  # nbytes, tag and crc, at slot offset SLOT_NBYTES
SLOT_NBYTES, SLOT_TAG, SLOT_CRC = 8, 16, 20  # where SLOT_FIELDS puts each field in a slot
assert QUEUE_META.size == QUEUE_ROW.size == SLOT_HEADER.size == ALIGN_BYTES
META_WRITE_SEQ = 8
META_CLOSED = 16
CLOSED_UPSTREAM_GONE = 2  # META_CLOSED value: readers get WriterGone, not Closed
META_WRITER_SLEEPING = 24
ROW_READ_SEQ = ROW_HEAD_BYTES
ROW_SLEEPING = ROW_HEAD_BYTES + 8
ROW_SKIPPED = ROW_HEAD_BYTES + 16
MAX_SLOT_BYTES = 1 << 30  # a u32 field; large values go through a Channel's store instead
MAX_SLOTS = 1 << 20
MAX_TAG = (1 << 32) - 1
DEFAULT_SPIN_S = 0.002  # spin this long before sleeping: keeps latency at a few microseconds
#                         under load and the CPU idle when idle
WRITER_CHECK_S = 0.2  # how often a waiting reader checks that the writer is alive


BELL_MARK = "@"  # in every doorbell's name; no segment name may hold it (shm/_header.py)


def bell_name(name: str, who: str) -> str:
    """The semaphore name of queue `name`'s doorbell `who` (w, r0, r1, ...). Its file,
    /dev/shm/sem.NAME@WHO, can never be a segment's: a segment name has no BELL_MARK."""
    return f"/{name}{BELL_MARK}{who}"


def remove_semaphores(name: str, n_readers: int) -> int:
    """Unlink the doorbells of queue `name` (after its writer died); return how many went.
    Through the one locked unlink (shm/_tracker.py): another user's file, or one a live
    process holds, is never touched."""
    removed = 0
    for who in [f"r{r}" for r in range(n_readers)] + ["w"]:
        if unlink_if_same(sem_path(bell_name(name, who))) is not None:
            removed += 1
    return removed


class QueueBase(Closeable):
    """What both sides of a queue share (BroadcastQueue.create / attach make them)."""

    _seg: Segment | None = None
    _guard: CallGuard | None = None
    name = ""
    n_readers = 0
    n_slots = 0
    slot_bytes = 0

    def __init__(self, segment: Segment) -> None:
        self._seg = segment
        self.name = segment.name
        self.n_readers = segment.n_readers
        self._buf = segment.buf
        self._words = segment.words
        self._meta = SEGMENT_HEADER.size
        n_slots, slot_bytes = struct.unpack_from("<II", segment.buf, self._meta)
        stride = ALIGN_BYTES + align_up(slot_bytes)
        table = self._meta + QUEUE_META.size
        if (n_slots == 0 or segment.data_offset < table + QUEUE_ROW.size * self.n_readers
                or n_slots * stride != segment.capacity_bytes):
            raise IncompatibleSegment(
                f"queue {self.name!r} has an inconsistent header ({n_slots} slots of {slot_bytes} "
                f"bytes in {segment.capacity_bytes}): it is corrupt; recreate it", self.name)
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self._stride = stride
        self._data = segment.data_offset
        self._table = ReaderTable(self._words, table, self.n_readers, QUEUE_ROW.size,
                                  f"queue {self.name!r}", self.name, segment.epoch)

    def handoff_layout(self) -> dict[str, int]:
        """The offsets the hand-off follows, by name (_native/_atomic.c's HANDOFF_LAYOUT)."""
        return {"write_seq": self._meta + META_WRITE_SEQ, "closed": self._meta + META_CLOSED,
                "writer_sleeping": self._meta + META_WRITER_SLEEPING,
                "table": self._table.row(0), "row_bytes": QUEUE_ROW.size,
                "row_read_seq": ROW_READ_SEQ, "row_sleeping": ROW_SLEEPING, "data": self._data,
                "stride": self._stride, "n_slots": self.n_slots, "slot_bytes": self.slot_bytes,
                "slot_nbytes": SLOT_NBYTES, "slot_tag": SLOT_TAG, "slot_crc": SLOT_CRC,
                "body": ALIGN_BYTES}

    def open_slots(self, row: int, post: tuple[str, ...], wait: str | None) -> _slots.Slots:
        """This side's hand-off (queue/_slots.py SLOTS: compiled, or its Python twin)."""
        slots: _slots.Slots = _slots.SLOTS(self._words, self._buf, self.handoff_layout(), row,
                                           post, wait)
        return slots

    def slot(self, seq: int) -> int:
        """Offset of the slot that holds message `seq`."""
        return self._data + ((seq - 1) % self.n_slots) * self._stride

    @property
    def closed(self) -> bool:
        return self._guard is None or self._guard.closing

    def close(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} n_readers={self.n_readers} "
                f"{self.n_slots}x{self.slot_bytes} B{' closed' if self.closed else ''}>")
