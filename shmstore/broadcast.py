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
    24      8     writer_sleeping  u64, 1 while the writer waits for space on its doorbell
    32      32    reserved
    64      64*n  reader rows (_readers.py head, then the queue's words):
                    0   8  owner      _readers.py
                    8   8  ready_ns   _readers.py
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
then publishes `read_seq` with a full-barrier exchange. Sleeping: _wait.py (spin, then a
per-reader doorbell; the writer has its own for waiting on slow readers).

Attach (_readers.py protocol): prepare sets read_seq to the current write_seq W; after the row
is visible, settle re-reads write_seq W' and starts there. A message the writer was publishing
while it could not yet see the row overwrote at most slot W'+1-n_slots, which this reader never
reads. A reader receives every message published after attach returns.

Damage: a reader never waits on bytes that cannot change. If write_seq says message s was
published but its slot holds neither s nor the slot's previous message (or the next message is
visibly published), the slot is damaged: the reader skips it and raises CorruptObject once;
the same for a message whose size or CRC is wrong. The next get() goes on with message s + 1.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from typing import Any

from ._closeable import CallGuard, Closeable
from ._proc import int_arg, pid_alive
from ._readers import (
    ATTACHED,
    MAX_READERS,
    ROW_HEAD_BYTES,
    Liveness,
    ReaderTable,
    check_reader_index,
)
from ._wait import Deadline, Doorbell, wait_until
from .errors import (
    Closed,
    CorruptObject,
    IncompatibleSegment,
    MessageTooLarge,
    Timeout,
    WriterGone,
)
from .segment import ALIGN_BYTES, KIND_QUEUE, SEGMENT_HEADER, Segment, align_up, peek_header
from .serde import Encoded, decode, encode

__all__ = ["BroadcastQueue", "QueueWriter", "QueueReader", "QUEUE_META", "QUEUE_ROW",
           "SLOT_HEADER", "remove_semaphores"]

QUEUE_META = struct.Struct("<IIQQQ32x")
QUEUE_ROW = struct.Struct("<QQQQQ24x")
SLOT_HEADER = struct.Struct("<QQII40x")
_SLOT_FIELDS = struct.Struct("<QII")  # nbytes, tag and crc, at slot offset 8
_SIZE_TAG = struct.Struct("<QI")
assert QUEUE_META.size == QUEUE_ROW.size == SLOT_HEADER.size == ALIGN_BYTES
META_WRITE_SEQ = 8
META_CLOSED = 16
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
log = logging.getLogger("shmstore")


def _message_crc(payload: memoryview, tag: int) -> int:
    """CRC-32 of a slot's size, tag and payload."""
    return zlib.crc32(payload, zlib.crc32(_SIZE_TAG.pack(len(payload), tag)))


def _bell_name(name: str, who: str) -> str:
    return f"/{name}.{who}"


def remove_semaphores(name: str, n_readers: int) -> int:
    """Unlink the doorbells of queue `name` (after its writer died); return how many went."""
    import posix_ipc

    removed = 0
    for who in [f"r{r}" for r in range(n_readers)] + ["w"]:
        try:
            posix_ipc.unlink_semaphore(_bell_name(name, who))
            removed += 1
        except posix_ipc.ExistentialError:
            pass
    return removed


class BroadcastQueue(Closeable):
    """What both sides of a queue share; use `create` (writer) or `attach` (reader)."""

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
        n_readers = int_arg(n_readers, "n_readers", 1, MAX_READERS)
        slot_bytes = int_arg(slot_bytes, "slot_bytes", 64, MAX_SLOT_BYTES)
        n_slots = int_arg(n_slots, "n_slots", 1, MAX_SLOTS)
        stride = ALIGN_BYTES + align_up(slot_bytes)
        if name is not None:
            previous = peek_header(name)
            if previous is not None and previous[0] == KIND_QUEUE and not pid_alive(previous[2]):
                remove_semaphores(name, previous[1])  # a dead writer's; Segment.create does the rest
        seg = Segment.create(
            name, kind=KIND_QUEUE, capacity_bytes=stride * n_slots,
            meta_bytes=QUEUE_META.size + QUEUE_ROW.size * n_readers, n_readers=n_readers,
            mode=mode,
        )
        try:
            QUEUE_META.pack_into(seg.buf, SEGMENT_HEADER.size, n_slots, slot_bytes, 0, 0, 0)
            return QueueWriter(seg, spin_s, mode)
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

    def _slot(self, seq: int) -> int:
        return self._data + ((seq - 1) % self.n_slots) * self._stride

    @property
    def closed(self) -> bool:
        return self._guard is None or self._guard.closing

    def close(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} n_readers={self.n_readers} "
                f"{self.n_slots}x{self.slot_bytes} B{' closed' if self.closed else ''}>")


class QueueWriter(BroadcastQueue):
    """The single writer: put (blocks while the slowest attached reader is n_slots behind),
    close. Only the creating process may call it."""

    def __init__(self, segment: Segment, spin_s: float, mode: int) -> None:
        super().__init__(segment)
        self._spin_s = spin_s
        self._write_seq = 0
        self._liveness = Liveness(self._table)
        self._bells: list[Doorbell] = []
        self._writer_bell: Doorbell | None = None
        try:
            for r in range(self.n_readers):
                self._bells.append(Doorbell.create(_bell_name(self.name, f"r{r}"), mode))
            self._writer_bell = Doorbell.create(_bell_name(self.name, "w"), mode)
        except BaseException:
            self._close_bells()
            raise
        self._guard = CallGuard(f"queue {self.name!r} (writer)", os.getpid())

    def attached(self) -> list[int]:
        """Reader indexes attached (and done attaching) now."""
        return [r for r in range(self.n_readers) if self._table.ready(r)]

    @property
    def dead_readers(self) -> int:
        """Readers found dead while the writer waited for them."""
        return self._liveness.dead_readers

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until all n_readers are attached (so none misses a message).

        Raises:
            Timeout: naming the readers that did not attach in time.
        """
        guard = self._enter()
        try:
            if not wait_until(lambda: len(self.attached()) == self.n_readers, Deadline(timeout),
                              check=guard.check):
                missing = tuple(sorted(set(range(self.n_readers)) - set(self.attached())))
                raise Timeout(f"queue {self.name!r}: reader(s) {list(missing)} did not attach "
                              f"within {timeout} s; start them, or check the name they use",
                              timeout, missing)
        finally:
            guard.leave()

    def put(self, msg: Any, timeout: float | None = None, *, tag: int = 0) -> None:
        """Publish `msg` to every attached reader.

        Args:
            timeout: how long to wait while a reader is n_slots behind: None (the default)
                without limit, 0 not at all, t up to t seconds.
            tag: a u32 the readers get with the message (QueueReader.get_message).

        Raises:
            MessageTooLarge: the serialized message exceeds slot_bytes.
            NotSerializable: `msg` holds something the serializer cannot carry.
            Timeout: a reader stayed n_slots behind for `timeout` seconds (it is named).
        """
        self.put_encoded(encode(msg, root="msg"), timeout, tag=tag)

    def put_encoded(self, enc: Encoded, timeout: float | None = None, *, tag: int = 0) -> None:
        """put() of a value already encoded with serde.encode."""
        self.publish(enc, Deadline(timeout), tag=tag)

    def publish(self, enc: Encoded, deadline: Deadline, *, tag: int = 0) -> None:
        """put_encoded() with a Deadline shared with other waits of the caller (Channel)."""
        tag = int_arg(tag, "tag", 0, MAX_TAG)
        if enc.nbytes > self.slot_bytes:
            raise MessageTooLarge(
                f"message is {enc.nbytes} bytes serialized, {enc.nbytes - self.slot_bytes} more "
                f"than the {self.slot_bytes}-byte slots of queue {self.name!r}: send large values "
                "through a Channel (it stores them and sends a handle), or create the queue with "
                "larger slot_bytes", enc.nbytes, self.slot_bytes)
        guard = self._enter()
        try:
            seq = self._write_seq + 1
            if seq > self.n_slots and self._lagging(seq, force=False):
                self._wait_for_space(seq, deadline, guard)
            buf = self._buf
            slot = self._slot(seq)
            body = slot + ALIGN_BYTES
            payload = buf[body:body + enc.nbytes]
            enc.write_into(payload)
            _SLOT_FIELDS.pack_into(buf, slot + 8, enc.nbytes, tag, _message_crc(payload, tag))
            words = self._words
            published = False
            try:
                words.store_release(slot, seq)  # publish: the payload is complete before this
                published = True
                self._write_seq = seq
                words.exchange(self._meta + META_WRITE_SEQ, seq)  # full barrier before the flags
            except BaseException:
                if published:  # readers may take it: it is sent
                    self._write_seq = seq
                raise
            for r in range(self.n_readers):
                flag = self._table.row(r) + ROW_SLEEPING
                if words.load_acquire(flag) and words.exchange(flag, 0):
                    self._bells[r].ring()
        finally:
            guard.leave()

    def close(self) -> None:
        """Mark the queue closed, wake every reader (they get Closed once they have every
        message sent before), unlink; idempotent. A put blocked in another thread raises
        SegmentClosed."""
        guard = self._guard
        if guard is None or guard.closing:
            if guard is None:  # half-built
                self._release()
            return
        words = self._words
        words.exchange(self._meta + META_CLOSED, 1)
        for r, bell in enumerate(self._bells):
            if words.exchange(self._table.row(r) + ROW_SLEEPING, 0):
                bell.ring()
        if self._seg is not None:
            self._seg.unlink()  # the names go now; the mapping once calls in flight end
        for bell in self._bells:
            bell.unlink()
        if self._writer_bell is not None:
            self._writer_bell.unlink()
        guard.close(self._release)
        if self._writer_bell is not None:
            self._writer_bell.ring()  # a put of ours blocked in another thread wakes now

    def _enter(self) -> CallGuard:
        guard = self._guard
        assert guard is not None  # set at the end of __init__
        guard.enter()
        return guard

    def _release(self) -> None:
        self._close_bells()
        if self._seg is not None:
            self._seg.close()
            self._seg.unlink()

    def _close_bells(self) -> None:
        for bell in self._bells:
            bell.close()
        if self._writer_bell is not None:
            self._writer_bell.close()

    def _lagging(self, seq: int, force: bool) -> tuple[int, ...]:
        """Attached, live readers that have not consumed message seq - n_slots yet."""
        words = self._words
        table = self._table
        need = seq - self.n_slots
        lagging = []
        for r in range(self.n_readers):
            if words.load_acquire(table.row(r) + ROW_READ_SEQ) >= need:
                continue
            if self._liveness.status(r, force)[0] == ATTACHED:
                lagging.append(r)
        return tuple(lagging)

    def _wait_for_space(self, seq: int, deadline: Deadline, guard: CallGuard) -> None:
        if not wait_until(lambda: not self._lagging(seq, force=False), deadline,
                          check=guard.check, spin_s=self._spin_s, bell=self._writer_bell,
                          words=self._words, flag=self._meta + META_WRITER_SLEEPING):
            lagging = self._lagging(seq, force=True)
            if not lagging:
                return
            raise Timeout(
                f"queue {self.name!r} is full after waiting {deadline.timeout_s} s: reader(s) "
                f"{list(lagging)} have not consumed message {seq - self.n_slots} yet "
                f"({self.n_slots} slots). Make them read, or use more slots",
                deadline.timeout_s, lagging)


class QueueReader(BroadcastQueue):
    """One reader: get() returns every message published since it attached, in order.

    Only the attaching process may use it (threads included; not a forked child).
    """

    reader = -1
    generation = 0
    _bell: Doorbell | None = None
    _writer_bell: Doorbell | None = None

    def __init__(self, segment: Segment, reader: Any, spin_s: float) -> None:
        super().__init__(segment)
        self._spin_s = spin_s
        self._writer_pid = segment.writer_pid
        self._writer_checked = time.monotonic()
        self._writer_gone = False
        index = check_reader_index(reader, self.n_readers, f"queue {self.name!r}")
        self._bell = Doorbell.open(_bell_name(self.name, f"r{index}"))
        self._writer_bell = Doorbell.open(_bell_name(self.name, "w"))
        words = self._words
        write_seq = self._meta + META_WRITE_SEQ

        def prepare(row: int, generation: int) -> None:
            self._read_seq = words.load_acquire(write_seq)
            words.store_release(row + ROW_READ_SEQ, self._read_seq)
            words.store_release(row + ROW_SLEEPING, 0)

        def settle(row: int, generation: int) -> None:
            head = words.load_acquire(write_seq)
            if head != self._read_seq:
                self._read_seq = head
                words.exchange(row + ROW_READ_SEQ, head)

        try:
            self.reader, self.generation = self._table.attach(index, self, prepare, settle)
        except BaseException:
            self._close_bells()
            raise
        self._row = self._table.row(self.reader)
        self._skipped = words.load_acquire(self._row + ROW_SKIPPED)
        self._guard = CallGuard(f"queue {self.name!r} reader {self.reader}", os.getpid())

    @property
    def skipped(self) -> int:
        """Damaged messages this reader index skipped, ever."""
        return self._skipped

    def get(self, timeout: float | None = None) -> Any:
        """Return the next message (an owned copy), waiting up to `timeout` seconds.

        Raises:
            Timeout: nothing arrived in time (None waits without limit, 0 does not wait).
            Closed: the writer closed the queue and every message sent before was received.
            WriterGone: the writer died and every message it sent was received.
            CorruptObject: the next message was damaged; it is skipped, the next get() goes on.
            SegmentClosed: this reader was closed (before or during the call).
        """
        return self.get_message(timeout)[1]

    def get_message(self, timeout: float | None = None) -> tuple[int, Any]:
        """Like get(), but return (tag, message)."""
        return self.receive(Deadline(timeout))

    def receive(self, deadline: Deadline) -> tuple[int, Any]:
        """get_message() with a Deadline shared with other waits of the caller (Channel)."""
        guard = self._guard
        assert guard is not None  # set at the end of __init__
        guard.enter()
        try:
            return self._receive(deadline, guard)
        finally:
            guard.leave()

    def close(self) -> None:
        """Give the reader index back and detach; idempotent. A get() blocked in another
        thread raises SegmentClosed."""
        guard = self._guard
        if guard is None:
            self._close_bells()
            return
        guard.close(self._release)
        if self._bell is not None and not guard.forked:
            self._bell.ring()  # wake a get of ours blocked in another thread

    # -- internals ---------------------------------------------------------------------------

    def _receive(self, deadline: Deadline, guard: CallGuard) -> tuple[int, Any]:
        words = self._words
        seq = self._read_seq + 1
        slot = self._slot(seq)
        if words.load_acquire(slot) != seq:
            if not wait_until(self._ready, deadline, check=guard.check, spin_s=self._spin_s,
                              bell=self._bell, words=words, flag=self._row + ROW_SLEEPING):
                raise Timeout(f"no message on queue {self.name!r} within {deadline.timeout_s} s "
                              f"(reader {self.reader}, next message {seq})", deadline.timeout_s)
            if words.load_acquire(slot) != seq:
                if self._damaged(seq):
                    self._skip(seq)
                    raise CorruptObject(f"slot of message {seq} on queue {self.name!r} is "
                                        "damaged; skipped it", self.name)
                if words.load_acquire(self._meta + META_CLOSED):
                    raise Closed(f"queue {self.name!r} was closed by its writer; no more messages")
                raise WriterGone(
                    f"the writer of queue {self.name!r} (pid {self._writer_pid}) died; no more "
                    "messages will come. Attach again once a new writer has created the queue",
                    self.name, self._writer_pid)
        buf = self._buf
        nbytes, tag, crc = _SLOT_FIELDS.unpack_from(buf, slot + 8)
        body = slot + ALIGN_BYTES
        problem = ""
        msg: Any = None
        if nbytes > self.slot_bytes:
            problem = f"claims {nbytes} bytes, more than its {self.slot_bytes}-byte slot"
        elif _message_crc(buf[body:body + nbytes], tag) != crc:
            problem = "is damaged (CRC mismatch)"
        else:
            try:
                msg = decode(buf[body:body + nbytes], copy=True)
            except CorruptObject as exc:
                problem = f"does not decode: {exc}"
            if not problem and words.load_acquire(slot) != seq:
                problem = ("was overwritten while read (a second process uses this reader "
                           "index, or the segment was damaged)")
        if problem:
            self._skip(seq)
            raise CorruptObject(f"message {seq} on queue {self.name!r} {problem}; skipped it",
                                self.name)
        self._consume(seq)
        return tag, msg

    def _ready(self) -> bool:
        """A message is there, or waiting is over (damage, closed, or the writer died)."""
        words = self._words
        seq = self._read_seq + 1
        if words.load_acquire(self._slot(seq)) == seq:
            return True
        if words.load_acquire(self._meta + META_CLOSED) or self._damaged(seq):
            return True
        now = time.monotonic()
        if now - self._writer_checked >= WRITER_CHECK_S:
            self._writer_checked = now
            self._writer_gone = not pid_alive(self._writer_pid)
        return self._writer_gone

    def _damaged(self, seq: int) -> bool:
        """Whether message `seq` was published but its slot's seq word says otherwise."""
        words = self._words
        head = words.load_acquire(self._meta + META_WRITE_SEQ)
        if not seq <= head < seq + self.n_slots:  # not published yet (or head is damaged)
            return False
        found = words.load_acquire(self._slot(seq))
        if found == seq:
            return False
        previous = seq - self.n_slots if seq > self.n_slots else 0
        if found != previous:
            return True
        return self.n_slots > 1 and words.load_acquire(self._slot(seq + 1)) == seq + 1

    def _consume(self, seq: int) -> None:
        words = self._words
        self._read_seq = seq
        words.exchange(self._row + ROW_READ_SEQ, seq)  # the slot is given back
        flag = self._meta + META_WRITER_SLEEPING
        if words.load_acquire(flag) and words.exchange(flag, 0) and self._writer_bell is not None:
            self._writer_bell.ring()

    def _skip(self, seq: int) -> None:
        self._skipped += 1
        self._words.store_release(self._row + ROW_SKIPPED, self._skipped)
        log.warning("queue %r reader %d: message %d is damaged; skipped it", self.name,
                    self.reader, seq)
        self._consume(seq)

    def _release(self) -> None:
        assert self._guard is not None
        if not self._guard.forked:
            self._table.detach(self.reader, self.generation, self)
        self._close_bells()
        if self._seg is not None:
            self._seg.close()

    def _close_bells(self) -> None:
        for bell in (self._bell, self._writer_bell):
            if bell is not None:
                bell.close()
        self._bell = self._writer_bell = None
