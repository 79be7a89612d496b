"""The reader table that the store and the queue share: rows, attach/detach, liveness.

Each reader index owns one row in its segment's meta area. A row starts with a common head; the
layer that owns the segment (store or queue) defines the words after it. Every word of a row is
written only by the reader that holds the row; the writer only reads rows.

Row head (little-endian; the row is `row_bytes`, a multiple of 64)::

    offset  size  field
    0       8     owner      u64, generation << 32 | pid. pid 0: nobody holds the row;
                             generation 0: nobody ever attached; +1 on every attach
    8       8     ready_ns   u64, time.time_ns() when the holder finished attaching; 0 before
    16      ...   layer words (store/_object_store.py, broadcast.py)

What the writer concludes from a row (one atomic load of `owner`, so never a half-written
state):

    generation 0              NEVER     nobody attached yet
    pid != 0, process alive   ATTACHED  a reader holds it
    pid 0, or process gone    GONE      its reader closed or died

The layers differ on NEVER, deliberately: the store treats a NEVER row as owing every hand-out
(a writer may put before its readers start, and pass the handles out of band: those objects must
wait for them), the queue does not wait for it (a queue that waited for absent readers would
block its writer before anyone started; its readers get the messages sent after they attach).
Both ignore GONE rows: a dead or closed reader never blocks the writer.

Attach protocol (reader side, `ReaderTable.attach`)::

    1. check the index; refuse a row held by a live process, or by a live object of this
       process (a second attach of the same index in one process)
    2. ready_ns = 0; the layer's `prepare(row, generation)` writes its words
    3. compare-exchange owner: old value -> generation << 32 | pid   (full barrier; a racing
       attacher of the same index loses here and gets ReaderSlotBusy)
    4. the layer's `settle(row, generation)`: re-reads what the writer may have done between 2
       and 3 (a read position, a hand-out number) and fixes its words
    5. ready_ns = now (release): the writer's wait_for_readers() returns only after this

Detach: ready_ns = 0, then compare-exchange owner -> generation << 32 | 0, only if the row is
still ours (a forked child or a replaced reader never frees someone else's row).

Scenarios (one row; W = the writer's view)::

    1. fresh segment                 owner 0            W: NEVER (store waits, queue not)
    2. reader pid 7 attaches         owner 1<<32|7      W: ATTACHED
    3. pid 7 closes                  owner 1<<32|0      W: GONE, owes nothing
    4. pid 9 attaches the same row   owner 2<<32|9      W: ATTACHED (generation 2 owes only what
                                                        was handed out after it attached)
    5. pid 9 is killed               owner 2<<32|9      W: GONE once kill(9, 0) fails (checked
                                                        at least every LIVENESS_CHECK_S, at once
                                                        when the writer is blocked)

    6. damage sets owner to 0 after  owner 0            W: GONE, not NEVER: generations only
       the writer saw generation 2                      grow, and the writer remembers what it
                                                        saw (a row back at NEVER would be owed
                                                        every hand-out forever)

Liveness uses pids, so the writer and readers must share a pid namespace; a reused pid makes a
dead reader look alive until its row is taken over.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._proc import PID_MAX_LIMIT, pid_alive
from ..errors import ReaderIndexError, ReaderSlotBusy
from ._ordering import Words

__all__ = ["ReaderTable", "Liveness", "NEVER", "ATTACHED", "GONE", "MAX_READERS",
           "ROW_HEAD_BYTES", "LIVENESS_CHECK_S"]

MAX_READERS = 1024  # rows of 64-128 bytes: tensor parallelism stays far below
ROW_OWNER = 0
ROW_READY_NS = 8
ROW_HEAD_BYTES = 16
LIVENESS_CHECK_S = 0.2  # a waiting writer re-checks a reader's pid at least this often
NEVER, ATTACHED, GONE = 0, 1, 2
_PID_MASK = (1 << 32) - 1
_GENERATION_MASK = (1 << 32) - 1
log = logging.getLogger("shmstore")

# Rows held by live objects of this process: (segment name, epoch, reader) -> the object.
_held_here: weakref.WeakValueDictionary[tuple[str, int, int], Any] = weakref.WeakValueDictionary()


def check_reader_index(reader: Any, n_readers: int, what: str) -> int:
    """Return `reader` as an index in 0..n_readers-1 (numpy ints accepted).

    Raises:
        ReaderIndexError: naming the range.
    """
    try:
        if isinstance(reader, bool):
            raise TypeError
        index = int(reader.__index__())
    except (TypeError, AttributeError):
        index = -1
    if n_readers == 0:
        raise ReaderIndexError(f"{what} has no readers (made with n_readers=0: a store only its "
                               "writer uses); make it with n_readers=N to read it from other "
                               "processes", reader, n_readers)
    if not 0 <= index < n_readers:
        raise ReaderIndexError(f"reader index {reader!r:.40} is not valid for {what}: it has "
                               f"{n_readers} readers, so use an int in 0..{n_readers - 1}",
                               reader, n_readers)
    return index


class ReaderTable:
    """The rows of one segment; `words` orders the accesses (see _ordering)."""

    def __init__(self, words: Words, offset: int, n_readers: int, row_bytes: int,
                 what: str, name: str, epoch: int) -> None:
        self.words = words
        self.offset = offset
        self.n_readers = n_readers
        self.row_bytes = row_bytes
        self.what = what  # "store 'x'", for messages
        self.name = name
        self.epoch = epoch

    def row(self, reader: int) -> int:
        """Byte offset (in the segment) of a reader's row."""
        return self.offset + self.row_bytes * reader

    def owner(self, reader: int) -> tuple[int, int]:
        """(pid, generation) of a row as one atomic read."""
        word = self.words.load_acquire(self.row(reader) + ROW_OWNER)
        return word & _PID_MASK, word >> 32

    def ready(self, reader: int) -> bool:
        """Whether a reader holds the row and finished attaching."""
        row = self.row(reader)
        return (self.words.load_acquire(row + ROW_OWNER) & _PID_MASK) != 0 and bool(
            self.words.load_acquire(row + ROW_READY_NS))

    def attach(self, reader: Any, holder: Any,
               prepare: Callable[[int, int], None],
               settle: Callable[[int, int], None]) -> tuple[int, int]:
        """Take row `reader` for `holder` (this process); return (index, generation).

        Raises:
            ReaderIndexError, ReaderSlotBusy.
        """
        index = check_reader_index(reader, self.n_readers, self.what)
        key = (self.name, self.epoch, index)
        me = os.getpid()
        words = self.words
        row = self.row(index)
        old = words.load_acquire(row + ROW_OWNER)
        pid, generation = old & _PID_MASK, old >> 32
        if pid not in (0, me) and pid_alive(pid):
            raise ReaderSlotBusy(
                f"reader {index} of {self.what} is held by live process {pid}: each reader index "
                "belongs to one process; pick a free index", index, pid)
        other = _held_here.get(key)
        if other is not None and not other.closed:
            raise ReaderSlotBusy(
                f"reader {index} of {self.what} is already attached in this process (pid {me}); "
                "one reader index is one reader: close the other first, or use another index",
                index, me)
        generation = (generation + 1) & _GENERATION_MASK or 1
        words.store_release(row + ROW_READY_NS, 0)
        prepare(row, generation)
        if not words.compare_exchange(row + ROW_OWNER, old, generation << 32 | me):
            raced = words.load_acquire(row + ROW_OWNER) & _PID_MASK
            raise ReaderSlotBusy(
                f"reader {index} of {self.what} was taken by process {raced} while this one "
                "attached; pick a free index", index, raced)
        settle(row, generation)
        words.store_release(row + ROW_READY_NS, time.time_ns() or 1)
        _held_here[key] = holder
        return index, generation

    def detach(self, index: int, generation: int, holder: Any) -> None:
        """Give a row back if it is still ours; idempotent."""
        row = self.row(index)
        mine = generation << 32 | os.getpid()
        if self.words.load_acquire(row + ROW_OWNER) == mine:
            self.words.store_release(row + ROW_READY_NS, 0)
            self.words.compare_exchange(row + ROW_OWNER, mine, generation << 32)
        key = (self.name, self.epoch, index)
        if _held_here.get(key) is holder:
            del _held_here[key]


class Liveness:
    """The writer's view of every row (NEVER / ATTACHED / GONE), with cached pid checks."""

    def __init__(self, table: ReaderTable) -> None:
        self.table = table
        n = table.n_readers
        self._checked: list[tuple[int, float, bool]] = [(0, 0.0, True)] * n  # owner word, when, alive
        self._reported: set[tuple[int, int]] = set()  # (reader, generation) logged dead
        self._seen = [False] * n  # a generation >= 1 was seen: the row can never be NEVER again

    @property
    def dead_readers(self) -> int:
        """Readers found dead since the writer started."""
        return len(self._reported)

    def observe(self) -> None:
        """Note every row that has been attached (wait_for_readers does, so that damage setting
        a row back to generation 0 later is recognised)."""
        for r in range(self.table.n_readers):
            if self.table.owner(r)[1]:
                self._seen[r] = True

    def status(self, reader: int, force: bool = False) -> tuple[int, int]:
        """(NEVER | ATTACHED | GONE, generation) of one row; pids re-checked every
        LIVENESS_CHECK_S, or now when `force`."""
        pid, generation = self.table.owner(reader)
        if generation == 0:
            return (GONE if self._seen[reader] else NEVER), 0
        self._seen[reader] = True
        if pid == 0:
            return GONE, generation
        word = generation << 32 | pid
        known, checked, alive = self._checked[reader]
        now = time.monotonic()
        if force or known != word or now - checked >= LIVENESS_CHECK_S:
            alive = pid <= PID_MAX_LIMIT and pid_alive(pid)
            self._checked[reader] = (word, now, alive)
            if not alive and (reader, generation) not in self._reported:
                self._reported.add((reader, generation))
                log.warning("%s: reader %d (pid %d) is gone; no longer waiting for it",
                            self.table.what, reader, pid)
        return (ATTACHED if alive else GONE), generation
