"""QueueWriter: the single writer of a broadcast queue (layout: queue/_layout.py)."""

from __future__ import annotations

import os
from typing import Any

from .._proc import int_arg
from ..errors import MessageTooLarge, Timeout
from ..serde._codec import Encoded, encode
from ..shm._closeable import CallGuard
from ..shm._readers import ATTACHED, Liveness
from ..shm._segment import ALIGN_BYTES, Segment
from ..shm._wait import Deadline, Doorbell, checked_wait, deadline_of, wait_until
from ._layout import (
    CLOSED_UPSTREAM_GONE,
    MAX_TAG,
    META_CLOSED,
    META_WRITER_SLEEPING,
    ROW_READ_SEQ,
    ROW_SLEEPING,
    QueueBase,
    bell_name,
)
from ._slots import Slots

__all__ = ["QueueWriter"]


class QueueWriter(QueueBase):
    """The single writer: put (blocks while the slowest attached reader is n_slots behind),
    close. Only the creating process may call it."""

    _slots: Slots | None = None  # the hand-off (queue/_slots.py), once the doorbells exist

    def __init__(self, segment: Segment, spin_s: float, mode: int) -> None:
        super().__init__(segment)
        self._spin_s = spin_s
        self._write_seq = 0
        # Every reader attached now has read through this message (readers only move forward,
        # and one attaching later starts at the head): puts up to n_slots past it need no check.
        self._read_through = 0
        self._liveness = Liveness(self._table)
        self._bells: list[Doorbell] = []
        self._writer_bell: Doorbell | None = None
        try:
            for r in range(self.n_readers):
                self._bells.append(Doorbell.create(bell_name(self.name, f"r{r}"), mode,
                                                   beside=self.name))
            self._writer_bell = Doorbell.create(bell_name(self.name, "w"), mode,
                                                beside=self.name)
            self._slots = self.open_slots(-1, tuple(bell.name for bell in self._bells), None)
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
        self.publish(encode(msg, root="msg"), timeout, tag=tag)

    def put_encoded(self, enc: Encoded, timeout: float | None = None, *, tag: int = 0) -> None:
        """put() of a value already encoded with serde.encode."""
        self.publish(enc, timeout, tag=tag)

    def publish(self, enc: Encoded, timeout: Deadline | float | None, *, tag: int = 0) -> None:
        """put_encoded(), where `timeout` may also be a Deadline shared with other waits of the
        caller (Channel). A Deadline is made only when the put has to wait."""
        if type(tag) is not int or not 0 <= tag <= MAX_TAG:
            tag = int_arg(tag, "tag", 0, MAX_TAG)
        timeout = checked_wait(timeout)
        if enc.nbytes > self.slot_bytes:
            raise MessageTooLarge(
                f"message is {enc.nbytes} bytes serialized, {enc.nbytes - self.slot_bytes} more "
                f"than the {self.slot_bytes}-byte slots of queue {self.name!r}: send large values "
                "through a Channel (it stores them and sends a handle), or create the queue with "
                "larger slot_bytes", enc.nbytes, self.slot_bytes)
        guard = self._enter()
        try:
            seq = self._write_seq + 1
            if seq - self.n_slots > self._read_through and self._lagging(seq, force=False):
                self._wait_for_space(seq, deadline_of(timeout), guard)
            self._publish(seq, enc, tag)
        finally:
            guard.leave()

    def _publish(self, seq: int, enc: Encoded, tag: int) -> None:
        slots = self._slots
        assert slots is not None  # made in __init__
        body = enc.whole()
        if body is None:  # arrays: written in place, then published with the rest
            start = self.slot(seq) + ALIGN_BYTES
            enc.write_into(self._buf[start:start + enc.nbytes])
        try:
            slots.publish(seq, tag, enc.nbytes if body is None else body)
        except BaseException:
            if self._words.load_acquire(self.slot(seq)) == seq:  # a doorbell failed: it is sent
                self._write_seq = seq
            raise
        self._write_seq = seq

    def close(self, *, upstream_gone: bool = False) -> None:
        """Mark the queue closed, wake every reader (they get Closed once they have every
        message sent before), unlink; idempotent. A put blocked in another thread raises
        SegmentClosed. `upstream_gone`: readers get WriterGone instead of Closed (a relay whose
        writer on another node died)."""
        guard = self._guard
        if guard is None or guard.closing:
            if guard is None:  # half-built
                self._release()
            return
        words = self._words
        words.exchange(self._meta + META_CLOSED, CLOSED_UPSTREAM_GONE if upstream_gone else 1)
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
        if self._slots is not None:
            self._slots.release()
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
        lowest = self._write_seq
        for r in range(self.n_readers):
            read = words.load_acquire(table.row(r) + ROW_READ_SEQ)
            if read >= need:
                lowest = min(lowest, read)
                continue
            if self._liveness.status(r, force)[0] == ATTACHED:
                lagging.append(r)
        if not lagging:
            self._read_through = lowest
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
