"""BroadcastQueue: one writer, N readers; every reader gets every message, in order.

A ring of fixed-size slots in one Segment. Message number m (1, 2, 3, ...) goes to slot
(m - 1) % n_slots. The writer may fill slot m only when every attached reader has consumed
message m - n_slots; each reader publishes only its own "last consumed" counter.

Queue meta area (segment offset 64; little-endian)::

    offset  size  field
    0       4     n_slots          u32
    4       4     slot_bytes       u32, payload bytes per slot
    8       8     write_seq        u64, last message published (written by the writer)
    16      8     closed           u64, 1 once the writer closed the queue
    24      8     writer_sleeping  u64, 1 while the writer waits for space on its semaphore
    32      32    reserved
    64      64*n  reader table, one cache line per reader (written only by that reader):
                    0   8  pid        i64, 0 when the slot is free
                    8   8  read_seq   u64, last message consumed
                    16  8  sleeping   u64, 1 while the reader waits on its semaphore
                    24  40 reserved

Slot layout (data area; slot i at data_offset + i * (64 + slot_bytes rounded to 64))::

    0       8     seq       u64, the message number held (stored last, with release order)
    8       8     nbytes    u64, serialized size
    16      4     tag       u32, 0 for plain messages (a Channel marks handles with 1)
    20      4     crc       u32, CRC-32 of nbytes, tag and the payload
    24      40    reserved
    64      ...   payload   serde body

Ordering: the writer fills the payload, then stores `seq` with release order; a reader loads
`seq` with acquire order, copies the message out, then publishes `read_seq` with a full-barrier
exchange. Waiting: a reader spins for `spin_s` (yielding the CPU), then announces
`sleeping = 1` with an atomic exchange (full barrier), checks once more, and blocks on its own
POSIX semaphore; the writer, after publishing with a full barrier, posts the semaphore of each
reader whose flag it swaps from 1 to 0. The writer waits for slow readers the same way. Both
sides also wake on a short timeout, so a missed post can only delay, never hang.

A reader that attaches after messages were sent starts at the current head: it receives only
messages published after it attached. `wait_for_readers()` on the writer waits until all
n_readers are attached.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from typing import Any

import posix_ipc

from ._closeable import Closeable
from ._ordering import FULL_FENCE
from .errors import (
    Closed,
    CorruptObject,
    IncompatibleSegment,
    MessageTooLarge,
    SegmentClosed,
    Timeout,
    WriterGone,
)
from .segment import (
    ALIGN_BYTES,
    KIND_QUEUE,
    SEGMENT_HEADER,
    Segment,
    align_up,
    check_reader_slot,
    peek_header,
    pid_alive,
)
from .serde import Encoded, decode, encode

__all__ = ["BroadcastQueue", "QueueWriter", "QueueReader", "QUEUE_META", "SLOT_HEADER",
           "remove_semaphores"]

QUEUE_META = struct.Struct("<IIQQQ32x")
QUEUE_READER = struct.Struct("<qQQ40x")
SLOT_HEADER = struct.Struct("<QQII40x")
_SLOT_FIELDS = struct.Struct("<QII")  # nbytes, tag and crc, at slot offset 8
assert QUEUE_META.size == QUEUE_READER.size == SLOT_HEADER.size == ALIGN_BYTES
META_WRITE_SEQ = 8
META_CLOSED = 16
META_WRITER_SLEEPING = 24
READER_READ_SEQ = 8
READER_SLEEPING = 16
MAX_READERS = 1024
MAX_SLOT_BYTES = 1 << 30  # a u32 field; large values go through a Channel's store instead
DEFAULT_SPIN_S = 0.002  # spin this long after the last message before sleeping: keeps latency
#                         at a few microseconds under load and the CPU idle when idle
WAKE_CHECK_S = 0.05 if FULL_FENCE else 0.005  # a sleeper re-checks this often in any case
PID_CHECK_S = 0.2  # how often a waiting side checks that the process it waits for is alive
log = logging.getLogger("shmstore")


def _message_crc(payload: memoryview, tag: int) -> int:
    """CRC-32 of a slot's size, tag and payload."""
    return zlib.crc32(payload, zlib.crc32(struct.pack("<QI", len(payload), tag)))


def _sem_name(name: str, who: str) -> str:
    return f"/{name}.{who}"


def remove_semaphores(name: str, n_readers: int) -> int:
    """Unlink the semaphores of queue `name` (after its writer died); return how many went."""
    removed = 0
    for who in [f"r{r}" for r in range(n_readers)] + ["w"]:
        try:
            posix_ipc.unlink_semaphore(_sem_name(name, who))
            removed += 1
        except posix_ipc.ExistentialError:
            pass
    return removed


class _Doorbell:
    """One named POSIX semaphore a sleeper waits on; owned by the queue side that opened it."""

    _sem: Any = None

    def __init__(self, name: str, create: bool) -> None:
        self.name = name
        self.owner = create
        if not create:
            self._sem = posix_ipc.Semaphore(name)
            return
        try:
            self._sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            # Left by a writer that died: this process owns the queue's name now, so the
            # semaphore is stale. Replace it rather than share a count with nobody.
            posix_ipc.unlink_semaphore(name)
            self._sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=0o600)

    def ring(self) -> None:
        self._sem.release()

    def wait(self, timeout_s: float) -> None:
        try:
            self._sem.acquire(timeout_s)
        except posix_ipc.BusyError:
            pass

    def close(self) -> None:
        if self._sem is not None:
            sem, self._sem = self._sem, None
            sem.close()
            if self.owner:
                try:
                    posix_ipc.unlink_semaphore(self.name)
                except posix_ipc.ExistentialError:
                    pass


class BroadcastQueue(Closeable):
    """What both sides of a queue share; use `create` (writer) or `attach` (reader)."""

    _seg: Segment | None = None
    name = ""
    n_readers = 0
    n_slots = 0
    slot_bytes = 0

    def __init__(self, segment: Segment) -> None:
        self._seg = segment
        self.name = segment.name
        self.n_readers = segment.n_readers
        self._buf: memoryview | None = segment.buf
        self._words = segment.words
        self._meta = SEGMENT_HEADER.size
        self._table = self._meta + QUEUE_META.size
        n_slots, slot_bytes = struct.unpack_from("<II", segment.buf, self._meta)
        stride = ALIGN_BYTES + align_up(slot_bytes)
        if (n_slots == 0 or segment.data_offset < self._table + QUEUE_READER.size * self.n_readers
                or n_slots * stride != segment.capacity_bytes):
            raise IncompatibleSegment(
                f"queue {self.name!r} has an inconsistent header ({n_slots} slots of {slot_bytes} "
                f"bytes in {segment.capacity_bytes}): it is corrupt; recreate it", self.name)
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self._stride = stride
        self._data = segment.data_offset

    @staticmethod
    def create(
        name: str | None,
        n_readers: int,
        slot_bytes: int = 4096,
        n_slots: int = 64,
        *,
        mode: int = 0o600,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> QueueWriter:
        """Create a queue and return its writer (this process owns and later unlinks it)."""
        for value, what, low, high in ((n_readers, "n_readers", 1, MAX_READERS),
                                       (slot_bytes, "slot_bytes", 64, MAX_SLOT_BYTES),
                                       (n_slots, "n_slots", 1, 1 << 20)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{what} must be an int in [{low}, {high}], got {value!r}")
        stride = ALIGN_BYTES + align_up(slot_bytes)
        if name is not None:
            previous = peek_header(name)
            if previous is not None and previous[0] == KIND_QUEUE and not pid_alive(previous[2]):
                remove_semaphores(name, previous[1])  # a dead writer's; Segment.create does the rest
        seg = Segment.create(
            name, kind=KIND_QUEUE, capacity_bytes=stride * n_slots,
            meta_bytes=QUEUE_META.size + QUEUE_READER.size * n_readers, n_readers=n_readers,
            mode=mode,
        )
        try:
            QUEUE_META.pack_into(seg.buf, SEGMENT_HEADER.size, n_slots, slot_bytes, 0, 0, 0)
            return QueueWriter(seg, spin_s)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @staticmethod
    def attach(name: str, reader: int, *, spin_s: float = DEFAULT_SPIN_S) -> QueueReader:
        """Attach as reader `reader` (0..n_readers-1); receive messages published from now on."""
        seg = Segment.attach(name, kind=KIND_QUEUE)
        try:
            return QueueReader(seg, reader, spin_s)
        except BaseException:
            seg.close()
            raise

    # -- shared helpers ----------------------------------------------------------------------

    def _slot(self, seq: int) -> int:
        return self._data + ((seq - 1) % self.n_slots) * self._stride

    def _reader_word(self, reader: int, field: int) -> int:
        return self._table + QUEUE_READER.size * reader + field

    def _reader_pid(self, reader: int) -> int:
        buf = self._live_buf()
        return int(struct.unpack_from("<q", buf, self._reader_word(reader, 0))[0])

    def _live_buf(self) -> memoryview:
        if self._buf is None:
            raise SegmentClosed(f"queue {self.name!r} is closed here; attach it again to use it")
        return self._buf

    @property
    def closed(self) -> bool:
        return self._buf is None

    def close(self) -> None:
        self._buf = None
        if self._seg is not None:
            self._seg.close()


    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} n_readers={self.n_readers} "
                f"{self.n_slots}x{self.slot_bytes} B{' closed' if self.closed else ''}>")


def _spin_then_sleep(ready: Any, sleep_flag: tuple[Any, int], bell: _Doorbell,
                     deadline: float | None, spin_s: float) -> bool:
    """Wait until ready() is true; False if the deadline passed. Spin, then sleep on `bell`."""
    if ready():
        return True
    now = time.monotonic()
    spin_until = now + spin_s if deadline is None else min(now + spin_s, deadline)
    while now < spin_until:
        os.sched_yield()
        if ready():
            return True
        now = time.monotonic()
    words, flag = sleep_flag
    while True:
        if deadline is not None and now >= deadline:
            return False
        words.exchange(flag, 1)  # "I am asleep", with a full barrier before the re-check
        if ready():
            words.exchange(flag, 0)
            return True
        wait = WAKE_CHECK_S if deadline is None else min(WAKE_CHECK_S, deadline - now)
        bell.wait(max(wait, 0.0))
        words.exchange(flag, 0)
        if ready():
            return True
        now = time.monotonic()


class QueueWriter(BroadcastQueue):
    """The single writer: put (blocks while the slowest attached reader is n_slots behind), close."""

    def __init__(self, segment: Segment, spin_s: float) -> None:
        super().__init__(segment)
        self._spin_s = spin_s
        self._write_seq = 0
        self._liveness: dict[int, tuple[int, float, bool]] = {}
        self._reported_dead: set[tuple[int, int]] = set()
        self._bells: list[_Doorbell] = []
        self._writer_bell: _Doorbell | None = None
        try:
            for r in range(self.n_readers):
                self._bells.append(_Doorbell(_sem_name(self.name, f"r{r}"), create=True))
            self._writer_bell = _Doorbell(_sem_name(self.name, "w"), create=True)
        except BaseException:
            self._close_bells()
            segment.close()
            segment.unlink()
            raise

    def attached(self) -> list[int]:
        """Reader indexes attached now."""
        return [r for r in range(self.n_readers) if self._reader_pid(r) != 0]

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until all n_readers are attached (so none misses a message)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.attached()) < self.n_readers:
            if deadline is not None and time.monotonic() >= deadline:
                missing = sorted(set(range(self.n_readers)) - set(self.attached()))
                raise Timeout(f"queue {self.name!r}: reader(s) {missing} did not attach within "
                              f"{timeout} s; start them, or check the name they attach to")
            time.sleep(0.001)

    def _lagging(self, seq: int) -> list[int]:
        """Attached, live readers that have not consumed message seq - n_slots yet."""
        words = self._words
        need = seq - self.n_slots
        lagging = []
        for r in range(self.n_readers):
            pid = self._reader_pid(r)
            if pid and words.load_acquire(self._reader_word(r, READER_READ_SEQ)) < need:
                if self._alive(r, pid):
                    lagging.append(r)
        return lagging

    def _alive(self, reader: int, pid: int) -> bool:
        """Liveness of a lagging reader's pid, checked at most every PID_CHECK_S."""
        known, checked, alive = self._liveness.get(reader, (0, 0.0, True))
        now = time.monotonic()
        if known != pid or now - checked >= PID_CHECK_S:
            alive = pid_alive(pid)
            self._liveness[reader] = (pid, now, alive)
            if not alive and (reader, pid) not in self._reported_dead:
                self._reported_dead.add((reader, pid))
                log.warning("queue %r: reader %d (pid %d) died; no longer waiting for it",
                            self.name, reader, pid)
        return alive

    @property
    def dead_readers(self) -> int:
        """Readers found dead while the writer waited for them."""
        return len(self._reported_dead)

    def put(self, msg: Any, timeout: float | None = None) -> None:
        """Publish `msg` to every attached reader.

        Raises:
            MessageTooLarge: the serialized message exceeds slot_bytes.
            Timeout: a reader stayed n_slots behind for `timeout` seconds (it is named).
        """
        self._publish(encode(msg, root="msg"), 0, timeout)

    def _publish(self, enc: Encoded, tag: int, timeout: float | None) -> None:
        buf = self._live_buf()
        if enc.nbytes > self.slot_bytes:
            raise MessageTooLarge(
                f"message is {enc.nbytes} bytes serialized, more than the {self.slot_bytes}-byte "
                f"slots of queue {self.name!r}: send large values through a Channel (it stores "
                "them and sends a handle), or create the queue with larger slot_bytes",
                enc.nbytes, self.slot_bytes)
        seq = self._write_seq + 1
        if seq > self.n_slots and self._lagging(seq):
            self._wait_for_space(seq, timeout)
        slot = self._slot(seq)
        body = slot + ALIGN_BYTES
        enc.write_into(buf[body:body + enc.nbytes])
        _SLOT_FIELDS.pack_into(buf, slot + 8, enc.nbytes, tag,
                               _message_crc(buf[body:body + enc.nbytes], tag))
        words = self._words
        words.store_release(slot, seq)  # publish: the payload is complete before this store
        words.exchange(self._meta + META_WRITE_SEQ, seq)  # full barrier before reading flags
        self._write_seq = seq
        for r in range(self.n_readers):
            flag = self._reader_word(r, READER_SLEEPING)
            if words.load_acquire(flag) and words.exchange(flag, 0):
                self._bells[r].ring()

    def _wait_for_space(self, seq: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        bell = self._writer_bell
        if bell is None:
            raise SegmentClosed(f"queue {self.name!r} is closed here; create it again to use it")
        ok = _spin_then_sleep(lambda: not self._lagging(seq),
                              (self._words, self._meta + META_WRITER_SLEEPING),
                              bell, deadline, self._spin_s)
        if not ok:
            lagging = self._lagging(seq)
            raise Timeout(
                f"queue {self.name!r} is full after waiting {timeout} s: reader(s) {lagging} have "
                f"not consumed message {seq - self.n_slots} yet ({self.n_slots} slots). Make them "
                "read, or use more slots")

    def close(self) -> None:
        """Mark the queue closed, wake every reader (they get Closed), unlink; idempotent."""
        if self._buf is not None:
            words = self._words
            words.exchange(self._meta + META_CLOSED, 1)
            for r, bell in enumerate(self._bells):
                if words.exchange(self._reader_word(r, READER_SLEEPING), 0):
                    bell.ring()
        self._close_bells()
        super().close()
        if self._seg is not None:
            self._seg.unlink()

    def _close_bells(self) -> None:
        for bell in self._bells:
            bell.close()
        if self._writer_bell is not None:
            self._writer_bell.close()


class QueueReader(BroadcastQueue):
    """One reader: get() returns every message published since it attached, in order."""

    reader = -1
    _bell: _Doorbell | None = None
    _writer_bell: _Doorbell | None = None

    def __init__(self, segment: Segment, reader: int, spin_s: float) -> None:
        super().__init__(segment)
        what = f"queue {self.name!r}"
        check_reader_slot(what, reader, self.n_readers, None)
        check_reader_slot(what, reader, self.n_readers, self._reader_pid(reader))
        self._spin_s = spin_s
        self._bell = _Doorbell(_sem_name(self.name, f"r{reader}"), create=False)
        self._writer_bell = _Doorbell(_sem_name(self.name, "w"), create=False)
        self.reader = reader
        self._writer_pid = segment.writer_pid
        self._writer_checked = time.monotonic()
        self._writer_gone = False
        words = self._words
        self._read_seq = words.load_acquire(self._meta + META_WRITE_SEQ)  # start at the head
        words.exchange(self._reader_word(reader, READER_READ_SEQ), self._read_seq)
        words.exchange(self._reader_word(reader, 0), os.getpid())

    def _ready(self) -> bool:
        """A message is there, or waiting is over (closed, or the writer died)."""
        words = self._words
        if (words.load_acquire(self._slot(self._read_seq + 1)) == self._read_seq + 1
                or words.load_acquire(self._meta + META_CLOSED)):
            return True
        now = time.monotonic()
        if now - self._writer_checked >= PID_CHECK_S:
            self._writer_checked = now
            self._writer_gone = not pid_alive(self._writer_pid)
        return self._writer_gone

    def get(self, timeout: float | None = None) -> Any:
        """Return the next message (an owned copy), waiting up to `timeout` seconds.

        Raises:
            Timeout: nothing arrived in time. Closed: the writer closed the queue and every
            message sent before that has been received.
        """
        return self._receive(timeout)[0]

    def _receive(self, timeout: float | None) -> tuple[Any, int]:
        """Return the next message and its tag."""
        buf = self._live_buf()
        words = self._words
        seq = self._read_seq + 1
        slot = self._slot(seq)
        if words.load_acquire(slot) != seq:
            deadline = None if timeout is None else time.monotonic() + timeout
            bell = self._bell
            if bell is None:
                raise SegmentClosed(f"queue {self.name!r} is closed here; attach it again")
            sleep_flag = (words, self._reader_word(self.reader, READER_SLEEPING))
            if not _spin_then_sleep(self._ready, sleep_flag, bell, deadline, self._spin_s):
                raise Timeout(f"no message on queue {self.name!r} within {timeout} s "
                              f"(reader {self.reader}, next message {seq})")
            found = words.load_acquire(slot)
            if found != seq:
                if words.load_acquire(self._meta + META_CLOSED):
                    raise Closed(f"queue {self.name!r} was closed by its writer; no more messages")
                if self._writer_gone:
                    raise WriterGone(
                        f"the writer of queue {self.name!r} (pid {self._writer_pid}) died; no "
                        "more messages will come. Attach again once a new writer has created "
                        "the queue")
                raise CorruptObject(f"slot of message {seq} on queue {self.name!r} holds message "
                                    f"{found}: the queue is corrupt")
        nbytes, tag, crc = _SLOT_FIELDS.unpack_from(buf, slot + 8)
        if nbytes > self.slot_bytes:
            raise CorruptObject(f"message {seq} on queue {self.name!r} claims {nbytes} bytes, "
                                f"more than its {self.slot_bytes}-byte slot")
        body = slot + ALIGN_BYTES
        if _message_crc(buf[body:body + nbytes], tag) != crc:
            raise CorruptObject(f"message {seq} on queue {self.name!r} is damaged (CRC mismatch)")
        msg = decode(buf[body:body + nbytes], copy=True)
        if words.load_acquire(slot) != seq:
            raise CorruptObject(f"message {seq} on queue {self.name!r} was overwritten while "
                                "read: the queue is corrupt or a second process uses this reader "
                                "index")
        self._read_seq = seq
        words.exchange(self._reader_word(self.reader, READER_READ_SEQ), seq)  # slot given back
        flag = self._meta + META_WRITER_SLEEPING
        if words.load_acquire(flag) and words.exchange(flag, 0) and self._writer_bell is not None:
            self._writer_bell.ring()
        return msg, tag

    def close(self) -> None:
        """Give the reader slot back and detach; idempotent."""
        if self._buf is not None and self.reader >= 0 and self._reader_pid(self.reader) == os.getpid():
            self._words.exchange(self._reader_word(self.reader, 0), 0)
        for bell in (self._bell, self._writer_bell):
            if bell is not None:
                bell.close()
        self._bell = self._writer_bell = None
        super().close()
