"""The reader-table contract (shm/_readers.py), run against both layers that use it: store and queue.

One class, two sides. Each test states one rule of the table; the only difference between the
sides (a row nobody ever attached is owed by the store and ignored by the queue) is a test too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests._names import (
    BroadcastQueue,
    ObjectStore,
    ReaderIndexError,
    ReaderSlotBusy,
    SegmentClosed,
    StoreFull,
    Timeout,
    WrongProcess,
)

SPAWN = mp.get_context("spawn")


@dataclass(frozen=True)
class Side:
    kind: str

    def create(self, name: str, n_readers: int) -> Any:
        if self.kind == "store":
            return ObjectStore.create(name, capacity_bytes=64 << 10, n_readers=n_readers)
        return BroadcastQueue.create(name, n_readers=n_readers, slot_bytes=64, n_slots=4)

    def attach(self, name: str, reader: Any) -> Any:
        if self.kind == "store":
            return ObjectStore.attach(name, reader)
        return BroadcastQueue.attach(name, reader)

    def fill(self, writer: Any) -> None:
        """Write more than the segment holds without waiting: raises if some reader is owed."""
        for i in range(40):
            if self.kind == "store":
                writer.put(f"k{i}", np.zeros(4096, np.uint8), timeout=0)
            else:
                writer.put(i, timeout=0)

    def owes_rows_never_attached(self) -> bool:
        return self.kind == "store"  # the store owes a reader that has not come yet; the queue
        #                              delivers only what is published after attach


def _missing(writer: Any) -> tuple[int, ...]:
    try:
        writer.wait_for_readers(timeout=0)
    except Timeout as exc:
        return exc.lagging_readers
    return ()


def _hold(kind: str, name: str, reader: int, attached: Any) -> None:
    """Attach and sleep until killed (waiting on no multiprocessing lock a SIGKILL could hold)."""
    Side(kind).attach(name, reader)
    attached.set()
    time.sleep(60)


def _contend(kind: str, name: str, rounds: int, holders: Any, overlaps: Any, wins: Any,
             busy: Any, ready: Any, go: Any) -> None:
    side = Side(kind)
    ready.release()
    go.wait(60)  # both processes start racing together
    for _ in range(rounds):
        try:
            reader = side.attach(name, 0)
        except ReaderSlotBusy:
            with busy.get_lock():
                busy.value += 1
            continue
        with holders.get_lock():
            holders.value += 1
            if holders.value > 1:
                overlaps.value += 1
        with wins.get_lock():
            wins.value += 1
        time.sleep(0.0002)  # hold the row a little: the other process tries meanwhile
        with holders.get_lock():
            holders.value -= 1
        reader.close()


@pytest.fixture(params=["store", "queue"])
def side(request: pytest.FixtureRequest) -> Iterator[Side]:
    yield Side(request.param)


class TestReaderTableContract:
    def test_index_must_be_an_int_in_range(self, side: Side, name: str) -> None:
        with side.create(name, 2):
            for bad in (-1, 2, 2**70, "0", 1.0, True, None):
                with pytest.raises(ReaderIndexError, match=r"0\.\.1"):
                    side.attach(name, bad)
            with side.attach(name, np.int64(1)) as r:  # numpy ints are ints
                assert r.reader == 1 and type(r.reader) is int

    def test_one_index_one_reader_in_a_process_and_generations_count_up(
            self, side: Side, name: str) -> None:
        with side.create(name, 1):
            first = side.attach(name, 0)
            with pytest.raises(ReaderSlotBusy, match="already attached in this process"):
                side.attach(name, 0)
            generation = first.generation
            first.close()
            with side.attach(name, 0) as second:
                assert second.generation == generation + 1

    def test_writer_sees_exactly_the_ready_rows(self, side: Side, name: str) -> None:
        with side.create(name, 3) as w:
            assert _missing(w) == (0, 1, 2)
            r1 = side.attach(name, 1)
            assert _missing(w) == (0, 2)
            r0, r2 = side.attach(name, 0), side.attach(name, 2)
            w.wait_for_readers(timeout=1)
            r1.close()
            assert _missing(w) == (1,)
            r0.close()
            r2.close()

    def test_a_live_holder_in_another_process_keeps_its_row_a_dead_one_does_not(
            self, side: Side, name: str) -> None:
        with side.create(name, 1) as w:
            attached = SPAWN.Event()
            p = SPAWN.Process(target=_hold, args=(side.kind, name, 0, attached))
            p.start()
            try:
                assert attached.wait(30)
                with pytest.raises(ReaderSlotBusy, match=f"live process {p.pid}"):
                    side.attach(name, 0)
                os.kill(p.pid, signal.SIGKILL)
                p.join(30)
                # the dead holder is not waited for: writing past the segment's size works
                side.fill(w)
                with side.attach(name, 0) as again:  # and its row can be taken over
                    assert again.generation == 2
            finally:
                p.kill()
                p.join(30)

    def test_rows_never_attached_are_owed_by_the_store_only(self, side: Side, name: str) -> None:
        with side.create(name, 2) as w, side.attach(name, 0) as r0:
            if side.owes_rows_never_attached():
                with pytest.raises(StoreFull, match=r"reader\(s\) \[0, 1\]"):
                    side.fill(w)
                assert r0.reader == 0
            else:
                with pytest.raises(Timeout, match=r"reader\(s\) \[0\]"):
                    side.fill(w)  # only the attached reader 0 holds the queue back

    def test_attach_is_exclusive_across_racing_processes(self, side: Side, name: str) -> None:
        with side.create(name, 1):
            holders, overlaps = SPAWN.Value("i", 0), SPAWN.Value("i", 0)
            wins, busy = SPAWN.Value("i", 0), SPAWN.Value("i", 0)
            ready, go = SPAWN.Semaphore(0), SPAWN.Event()
            procs = [SPAWN.Process(target=_contend, args=(side.kind, name, 150, holders,
                                                          overlaps, wins, busy, ready, go))
                     for _ in range(2)]
            for p in procs:
                p.start()
            for _ in procs:
                assert ready.acquire(timeout=60)
            go.set()
            for p in procs:
                p.join(60)
                assert p.exitcode == 0
            print(f"{side.kind}: {wins.value} attaches won, {busy.value} refused as busy")
            assert overlaps.value == 0  # never two holders of one index
            assert wins.value + busy.value == 300
            assert wins.value > 0 and busy.value > 0, (wins.value, busy.value)  # a real race

    def test_a_forked_child_cannot_use_the_parents_reader(self, side: Side, name: str) -> None:
        with side.create(name, 1), side.attach(name, 0) as r:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # child: report what using the parent's reader raised, then leave
                code = 1
                try:
                    if side.kind == "store":
                        r.discard(None)
                    else:
                        r.get(timeout=0)
                except WrongProcess:
                    code = 0
                except BaseException:
                    code = 2
                os.write(write, bytes([code]))
                os._exit(0)
            os.close(write)
            result = os.read(read, 1)
            os.close(read)
            os.waitpid(pid, 0)
            assert result == b"\x00"
            assert r.reader == 0 and not r.closed  # the parent's reader is untouched

    def test_close_from_another_thread_is_safe_and_final(self, side: Side, name: str) -> None:
        with side.create(name, 1):
            r = side.attach(name, 0)
            t = threading.Thread(target=r.close)
            t.start()
            t.join(10)
            assert r.closed
            with pytest.raises(SegmentClosed):
                if side.kind == "store":
                    r.discard(None)
                else:
                    r.get(timeout=0)
            with side.attach(name, 0):  # the row was given back
                pass


def test_attaching_a_store_made_without_readers_says_so(name: str) -> None:
    """Once: 'use an int in 0..-1'."""
    import pytest

    from shmstore import ObjectStore
    from shmstore.errors import ReaderIndexError

    with ObjectStore.create(name, capacity_bytes=1 << 16, n_readers=0):
        with pytest.raises(ReaderIndexError, match=r"has no readers .*n_readers=N"):
            ObjectStore.attach(name, reader=0)
