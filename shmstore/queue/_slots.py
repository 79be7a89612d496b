"""The queue's hand-off, chosen once at import: the compiled Slots or its Python twin.

Each step of the hand-off drawn in queue/_layout.py (the writer's copy, CRC, publish and wake; a
reader's check, consume and doorbell sleep) is one method of a Slots object. Two implement it:

    compiled   _native/_atomic.c Slots: one C call per step, the default where it was built
    python     PythonSlots below: the same steps in Python, where no compiler was at install
               or SHMSTORE_ORDERING asks for a pure-Python ordering

`SLOTS` is the one chosen (tests switch it; tests/queue/test_handoff.py runs both against each
other on the same bytes); the queue classes call it and never ask which it is. Both are made as
`SLOTS(words, buf, layout, row, post, wait)`:

    words   the segment's Words      buf     its bytes (the Python twin copies through them)
    layout  QueueBase.handoff_layout(): a dict of offsets, by name (the compiled side refuses a
            missing or an extra name, so a reorder cannot load)
    row     this reader's row offset, or -1 for the writer
    post    the doorbell names this side posts (the writer: each reader's; a reader: the writer's)
    wait    the doorbell a reader sleeps on (None for the writer)

    publish(seq, tag, body)   writer: `body` a buffer, or an int: that many bytes are in the slot
    take(seq)                 reader: None (not there), (tag, nbytes), 1 (too large), 2 (CRC)
    finish(seq) -> bool       reader: consume it if its slot still holds it
    sleep(seq, seconds)       reader: the doorbell handshake; whether `seq` arrived
    release()                 close the doorbells; idempotent
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Protocol

from .._native import ATOMIC, ORDERING
from ..shm._ordering import Words
from ..shm._wait import Doorbell

__all__ = ["Slots", "SLOTS", "COMPILED", "PythonSlots", "ATOMIC", "message_crc"]

_SIZE_TAG = struct.Struct("<QI")
_FIELDS = struct.Struct("<QII")  # nbytes, tag, crc: where the layout puts slot_nbytes
_TOO_LARGE, _BAD_CRC = 1, 2


def message_crc(payload: memoryview, tag: int) -> int:
    """CRC-32 of a slot's size, tag and payload (the compiled side computes the same)."""
    return zlib.crc32(payload, zlib.crc32(_SIZE_TAG.pack(len(payload), tag)))


class Slots(Protocol):
    """One side's hand-off (see the module docstring)."""

    def publish(self, seq: int, tag: int, body: Any, /) -> None: ...
    def take(self, seq: int, /) -> tuple[int, int] | int | None: ...
    def finish(self, seq: int, /) -> bool: ...
    def sleep(self, seq: int, seconds: float, /) -> bool: ...
    def release(self) -> None: ...


class PythonSlots:
    """The hand-off in Python: byte for byte what the compiled Slots writes and reads."""

    def __init__(self, words: Words, buf: memoryview, layout: dict[str, int], row: int,
                 post: tuple[str, ...], wait: str | None) -> None:
        if (row >= 0) != (wait is not None) or (row >= 0 and len(post) != 1):
            raise ValueError("a reader posts one doorbell and waits on its own; the writer "
                             "posts one per reader and waits on none")
        at = layout["slot_nbytes"]
        if (layout["slot_tag"], layout["slot_crc"]) != (at + 8, at + 12):  # _FIELDS' order
            raise ValueError(f"the Python hand-off reads nbytes, tag and crc as one field "
                             f"group; this layout splits them: {layout}")
        self._words = words
        self._buf = buf
        self._at = dict(layout)
        self._row = row
        self._post: list[Doorbell] = []
        self._wait: Doorbell | None = None
        try:
            for name in post:
                self._post.append(Doorbell.open(name))
            if wait is not None:
                self._wait = Doorbell.open(wait)
        except BaseException:
            self.release()
            raise

    def _slot(self, seq: int) -> int:
        at = self._at
        return at["data"] + ((seq - 1) % at["n_slots"]) * at["stride"]

    def publish(self, seq: int, tag: int, body: Any) -> None:
        at, buf, words = self._at, self._buf, self._words
        slot = self._slot(seq)
        start = slot + at["body"]
        view = None if type(body) is int else memoryview(body).cast("B")
        nbytes = body if view is None else view.nbytes
        if nbytes > at["slot_bytes"]:
            raise ValueError(f"a body of {nbytes} bytes does not fit a "
                             f"{at['slot_bytes']}-byte slot")
        if view is not None:
            buf[start:start + nbytes] = view
        crc = message_crc(buf[start:start + nbytes], tag)
        _FIELDS.pack_into(buf, slot + at["slot_nbytes"], nbytes, tag, crc)
        words.store_release(slot, seq)  # published: the payload is complete before this
        words.exchange(at["write_seq"], seq)  # a full barrier before the flags
        for r, bell in enumerate(self._post):
            flag = at["table"] + r * at["row_bytes"] + at["row_sleeping"]
            if words.load_acquire(flag) and words.exchange(flag, 0):
                bell.ring()

    def take(self, seq: int) -> tuple[int, int] | int | None:
        at, buf = self._at, self._buf
        slot = self._slot(seq)
        if self._words.load_acquire(slot) != seq:
            return None
        nbytes, tag, crc = _FIELDS.unpack_from(buf, slot + at["slot_nbytes"])
        if nbytes > at["slot_bytes"]:
            return _TOO_LARGE
        start = slot + at["body"]
        if message_crc(buf[start:start + nbytes], tag) != crc:
            return _BAD_CRC
        return tag, nbytes

    def finish(self, seq: int) -> bool:
        words, at = self._words, self._at
        if words.load_acquire(self._slot(seq)) != seq:
            return False
        words.exchange(self._row + at["row_read_seq"], seq)  # the slot is given back
        flag = at["writer_sleeping"]
        if words.load_acquire(flag) and words.exchange(flag, 0):
            self._post[0].ring()
        return True

    def sleep(self, seq: int, seconds: float) -> bool:
        words, at, bell = self._words, self._at, self._wait
        assert bell is not None, "sleep() is for the queue's readers"
        slot = self._slot(seq)
        flag = self._row + at["row_sleeping"]
        words.exchange(flag, 1)  # "I am asleep", with a full barrier before the re-check
        try:
            if words.load_acquire(slot) == seq or words.load_acquire(at["closed"]):
                return True
            bell.wait(seconds)
        finally:
            try:
                words.exchange(flag, 0)
            except BaseException:  # a signal handler that raised as this line began: the
                words.exchange(flag, 0)  # flag still said "asleep" (writers would ring)
                raise
        return words.load_acquire(slot) == seq

    def release(self) -> None:
        for bell in self._post:
            bell.close()
        self._post = []
        if self._wait is not None:
            self._wait.close()
            self._wait = None


def _compiled(words: Words, buf: memoryview, layout: dict[str, int], row: int,
              post: tuple[str, ...], wait: str | None) -> Slots:
    slots: Slots = ATOMIC.Slots(words, layout, row, post, wait)  # type: ignore[union-attr]
    return slots


# The compiled hand-off runs on the compiled words only (it reads their mapping directly).
COMPILED: Any = _compiled if ORDERING == "compiled" else None
SLOTS: Any = COMPILED or PythonSlots
