"""BroadcastQueue: one writer, N readers; every reader gets every message, in order.

`BroadcastQueue.create` makes a queue and returns its QueueWriter (queue/_writer.py);
`BroadcastQueue.attach` returns a QueueReader (here). The binary layout, the attach protocol and
the damage rules are drawn in queue/_layout.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .._proc import int_arg, pid_alive
from ..errors import Closed, CorruptObject, Timeout, WriterGone
from ..serde._codec import decode
from ..shm._closeable import CallGuard
from ..shm._readers import MAX_READERS, check_reader_index
from ..shm._segment import (
    ALIGN_BYTES,
    KIND_QUEUE,
    SEGMENT_HEADER,
    Segment,
    align_up,
    on_sweep,
    peek_header,
)
from ..shm._wait import Deadline, Doorbell, checked_wait, deadline_of, wait_until
from ._layout import (
    CLOSED_UPSTREAM_GONE,
    DEFAULT_SPIN_S,
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    META_CLOSED,
    META_WRITE_SEQ,
    META_WRITER_SLEEPING,
    QUEUE_META,
    QUEUE_ROW,
    ROW_READ_SEQ,
    ROW_SKIPPED,
    ROW_SLEEPING,
    SLOT_FIELDS,
    SLOT_HEADER,
    SLOT_NBYTES,
    WRITER_CHECK_S,
    QueueBase,
    bell_name,
    remove_semaphores,
)
from ._slots import Slots
from ._writer import QueueWriter

__all__ = ["BroadcastQueue", "QueueWriter", "QueueReader", "QUEUE_META", "QUEUE_ROW",
           "SLOT_HEADER", "ROW_READ_SEQ", "ROW_SLEEPING", "META_WRITE_SEQ", "remove_semaphores"]

log = logging.getLogger("shmstore")

on_sweep(KIND_QUEUE, remove_semaphores)  # a dead writer's queue goes with its doorbells

OVERWRITTEN = ("was overwritten while read (a second process uses this reader index, or the "
               "segment was damaged)")
CRC_MISMATCH = "is damaged (CRC mismatch)"
SLOT_TOO_LARGE = 1  # what take() says of a size larger than a slot (2: the CRC)


class BroadcastQueue:
    """Makes queues: `create` (the writer) and `attach` (a reader)."""

    @staticmethod
    def create(
        name: str | None,
        *,
        n_readers: int,
        slot_bytes: int = 4096,
        n_slots: int = 64,
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


class QueueReader(QueueBase):
    """One reader: get() returns every message published since it attached, in order.

    Only the attaching process may use it (threads included; not a forked child).
    """

    reader = -1
    generation = 0
    _bell: Doorbell | None = None
    _writer_bell: Doorbell | None = None
    _slots: Slots | None = None  # the hand-off (queue/_slots.py), once attached

    def __init__(self, segment: Segment, reader: Any, spin_s: float) -> None:
        super().__init__(segment)
        self._spin_s = spin_s
        self._writer_pid = segment.writer_pid
        self._writer_checked = time.monotonic()
        self._writer_gone = False
        index = check_reader_index(reader, self.n_readers, f"queue {self.name!r}")
        self._bell = Doorbell.open(bell_name(self.name, f"r{index}"))
        self._writer_bell = Doorbell.open(bell_name(self.name, "w"))
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
        try:
            self._slots = self.open_slots(self._row, (self._writer_bell.name,), self._bell.name)
        except BaseException:
            self._table.detach(self.reader, self.generation, self)
            self._close_bells()
            raise
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
        return self.receive(timeout)[1]

    def get_message(self, timeout: float | None = None) -> tuple[int, Any]:
        """Like get(), but return (tag, message)."""
        return self.receive(timeout)

    def receive(self, timeout: Deadline | float | None) -> tuple[int, Any]:
        """get_message(), where `timeout` may also be a Deadline shared with other waits of the
        caller (Channel). A Deadline is made only when the call has to wait."""
        timeout = checked_wait(timeout)
        guard = self._guard
        assert guard is not None  # set at the end of __init__
        guard.enter()
        try:
            return self._receive(timeout, guard)
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

    def _receive(self, timeout: Deadline | float | None, guard: CallGuard) -> tuple[int, Any]:
        seq = self._read_seq + 1
        slots = self._slots
        assert slots is not None  # made in __init__
        got = slots.take(seq)
        if got is None:
            self._await(seq, timeout, guard, lambda seconds: slots.sleep(seq, seconds))
            got = slots.take(seq)
        if type(got) is not tuple:
            self._refuse(seq, self._slot_problem(seq, got))
        tag, nbytes = got
        msg, problem = self._decode(seq, nbytes)
        if not problem:
            if slots.finish(seq):
                self._read_seq = seq
                return tag, msg
            problem = OVERWRITTEN
        self._refuse(seq, problem)

    def _decode(self, seq: int, nbytes: int) -> tuple[Any, str]:
        """(message, "") from the slot of message `seq`, or (None, why it does not decode)."""
        body = self.slot(seq) + ALIGN_BYTES
        try:
            return decode(self._buf[body:body + nbytes], copy=True), ""
        except CorruptObject as exc:
            return None, f"does not decode: {exc}"

    def _slot_problem(self, seq: int, got: Any) -> str:
        """What take() found wrong with message `seq` (None: it left its slot)."""
        if got is None:
            return OVERWRITTEN
        if got == SLOT_TOO_LARGE:
            nbytes = SLOT_FIELDS.unpack_from(self._buf, self.slot(seq) + SLOT_NBYTES)[0]
            return f"claims {nbytes} bytes, more than its {self.slot_bytes}-byte slot"
        return CRC_MISMATCH

    def _refuse(self, seq: int, problem: str) -> NoReturn:
        self._skip(seq)
        raise CorruptObject(f"message {seq} on queue {self.name!r} {problem}; skipped it",
                            self.name)

    def _await(self, seq: int, timeout: Deadline | float | None, guard: CallGuard,
               sleep: Callable[[float], bool]) -> None:
        """Return once message `seq` is in its slot; else raise why it will not come."""
        deadline = deadline_of(timeout)
        words = self._words
        slot = self.slot(seq)
        if not wait_until(self._ready, deadline, check=guard.check, spin_s=self._spin_s,
                          bell=self._bell, words=words, flag=self._row + ROW_SLEEPING,
                          sleep=sleep):
            raise Timeout(f"no message on queue {self.name!r} within {deadline.timeout_s} s "
                          f"(reader {self.reader}, next message {seq})", deadline.timeout_s)
        if words.load_acquire(slot) == seq:
            return
        resume = self._overtaken(seq)
        if resume:
            self._skip(resume - 1, lost=resume - seq)
            raise CorruptObject(
                f"reader {self.reader} of queue {self.name!r} was overtaken: messages "
                f"{seq}..{resume - 1} were overwritten before it read them (its row was "
                f"damaged, or its index is used twice); it goes on with {resume}",
                self.name)
        if self._damaged(seq):
            self._skip(seq)
            raise CorruptObject(f"slot of message {seq} on queue {self.name!r} is "
                                "damaged; skipped it", self.name)
        closed = words.load_acquire(self._meta + META_CLOSED)
        if closed == CLOSED_UPSTREAM_GONE:
            raise WriterGone(
                f"queue {self.name!r} was closed by its relay because the writer it "
                "forwards for died; no more messages will come", self.name, 0)
        if closed:
            raise Closed(f"queue {self.name!r} was closed by its writer; no more messages")
        raise WriterGone(
            f"the writer of queue {self.name!r} (pid {self._writer_pid}) died; no more "
            "messages will come. Attach again once a new writer has created the queue",
            self.name, self._writer_pid)

    def _ready(self) -> bool:
        """A message is there, or waiting is over (damage, closed, or the writer died)."""
        words = self._words
        seq = self._read_seq + 1
        if words.load_acquire(self.slot(seq)) == seq:
            return True
        if (words.load_acquire(self._meta + META_CLOSED) or self._damaged(seq)
                or self._overtaken(seq)):
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
        found = words.load_acquire(self.slot(seq))
        if found == seq:
            return False
        previous = seq - self.n_slots if seq > self.n_slots else 0
        if found != previous:
            return True
        return self.n_slots > 1 and words.load_acquire(self.slot(seq + 1)) == seq + 1

    def _overtaken(self, seq: int) -> int:
        """If the writer wrote past message `seq` before this reader read it (it did not wait
        for this row: damage), the oldest message still held, else 0."""
        words = self._words
        head = words.load_acquire(self._meta + META_WRITE_SEQ)
        found = words.load_acquire(self.slot(seq))
        if not seq < found <= head or (found - seq) % self.n_slots:
            return 0  # not overtaken (or a damaged word: _damaged decides)
        return max(head - self.n_slots + 1, seq + 1)

    def _consume(self, seq: int) -> None:
        words = self._words
        self._read_seq = seq
        words.exchange(self._row + ROW_READ_SEQ, seq)  # the slot is given back
        flag = self._meta + META_WRITER_SLEEPING
        if words.load_acquire(flag) and words.exchange(flag, 0) and self._writer_bell is not None:
            self._writer_bell.ring()

    def _skip(self, seq: int, lost: int = 1) -> None:
        """Count `lost` messages up to `seq` as skipped and go on after `seq`."""
        self._skipped += lost
        self._words.store_release(self._row + ROW_SKIPPED, self._skipped)
        log.warning("queue %r reader %d: skipped %d damaged or lost message(s) up to %d",
                    self.name, self.reader, lost, seq)
        self._consume(seq)

    def _release(self) -> None:
        assert self._guard is not None
        if self._slots is not None:
            self._slots.release()
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
