"""BroadcastQueue: order, backpressure, timeouts, close, late attach, and a model-checked machine."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time

import numpy as np
import pytest

from shmstore.errors import InvalidName, SegmentExists
from shmstore.queue._broadcast import (
    QUEUE_META,
    QUEUE_ROW,
    SLOT_HEADER,
)
from shmstore.queue._layout import BELL_MARK, remove_semaphores
from shmstore.shm._header import validate_name
from tests._names import (
    BroadcastQueue,
    Closed,
    MessageTooLarge,
    ObjectStore,
    ReaderIndexError,
    ReaderSlotBusy,
    SegmentClosed,
    Timeout,
    WrongSegmentKind,
)
from tests.workers import queue_reader_main

CTX = mp.get_context("spawn")
pytestmark = pytest.mark.usefixtures("handoff")  # every test on both hand-off paths


def test_layout_offsets() -> None:
    raw = QUEUE_META.pack(3, 4096, 5, 1, 0)
    assert struct.unpack_from("<IIQQQ", raw) == (3, 4096, 5, 1, 0)
    raw = SLOT_HEADER.pack(7, 100, 1, 9)
    assert struct.unpack_from("<QQII", raw) == (7, 100, 1, 9)
    assert QUEUE_META.size == QUEUE_ROW.size == SLOT_HEADER.size == 64


@pytest.fixture
def queue(name: str):
    w = BroadcastQueue.create(name, n_readers=2, slot_bytes=1024, n_slots=4)
    readers = [BroadcastQueue.attach(name, reader=i) for i in range(2)]
    yield w, readers
    for r in readers:
        r.close()
    w.close()


def test_every_reader_gets_every_message_in_order(queue) -> None:
    w, readers = queue
    received: list[list[object]] = [[], []]
    for i in range(50):
        w.put({"i": i, "arr": np.full(3, i)})
        for r, out in zip(readers, received):
            msg = r.get(timeout=1)
            out.append((msg["i"], int(msg["arr"][2])))
    assert received[0] == received[1] == [(i, i) for i in range(50)]


def test_backpressure_names_the_lagging_reader(queue) -> None:
    w, (r0, r1) = queue
    for i in range(4):
        w.put(i)
    assert [r0.get(timeout=1) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(Timeout, match=r"reader\(s\) \[1\] have not consumed message 1"):
        w.put(4, timeout=0.05)
    assert r1.get(timeout=1) == 0
    w.put(4, timeout=0.05)  # one slot came back


def test_backpressure_after_the_writer_remembered_how_far_readers_read(name: str) -> None:
    # The writer skips the check while every reader it last saw is n_slots ahead. A reader that
    # stops reading, or one that attaches in between, must still hold it back.
    with BroadcastQueue.create(name, n_readers=2, slot_bytes=256, n_slots=4) as w:
        r0 = BroadcastQueue.attach(name, reader=0)
        for i in range(6):  # the writer checks at the fifth put, when reader 0 has read two
            w.put(i, timeout=0)
            if i < 2:
                assert r0.get(timeout=1) == i
        with pytest.raises(Timeout, match=r"reader\(s\) \[0\] have not consumed message 3"):
            w.put(6, timeout=0.05)
        assert [r0.get(timeout=1) for _ in range(4)] == [2, 3, 4, 5]
        for i in range(6, 12):
            w.put(i, timeout=0)
            assert r0.get(timeout=1) == i
        r1 = BroadcastQueue.attach(name, reader=1)
        for i in range(12, 16):
            w.put(i, timeout=0)
        assert [r0.get(timeout=1) for _ in range(4)] == [12, 13, 14, 15]
        with pytest.raises(Timeout, match=r"reader\(s\) \[1\] have not consumed message 13"):
            w.put(16, timeout=0.05)
        assert [r1.get(timeout=1) for _ in range(4)] == [12, 13, 14, 15]
        for i in range(16, 20):
            w.put(i, timeout=0)
        with pytest.raises(Timeout, match=r"reader\(s\) \[0, 1\] have not consumed message 17"):
            w.put(20, timeout=0.05)
        assert [r.get(timeout=1) for r in (r0, r1) for _ in range(4)] == [16, 17, 18, 19] * 2
        r0.close()
        r1.close()


def test_reader_timeout(queue) -> None:
    _, (r0, _) = queue
    t0 = time.monotonic()
    with pytest.raises(Timeout, match=r"no message .* within 0.05 s"):
        r0.get(timeout=0.05)
    assert time.monotonic() - t0 < 2


def test_message_larger_than_a_slot(queue) -> None:
    w, _ = queue
    with pytest.raises(MessageTooLarge, match="Channel") as info:
        w.put(b"x" * 2000)
    assert info.value.slot_bytes == 1024


def test_late_reader_starts_at_the_head(name: str) -> None:
    with BroadcastQueue.create(name, n_readers=2, slot_bytes=256, n_slots=4) as w:
        early = BroadcastQueue.attach(name, reader=0)
        w.put("before")
        late = BroadcastQueue.attach(name, reader=1)
        w.put("after")
        assert early.get(timeout=1) == "before" and early.get(timeout=1) == "after"
        assert late.get(timeout=1) == "after"
        early.close()
        late.close()


def test_unattached_readers_do_not_block_the_writer(name: str) -> None:
    with BroadcastQueue.create(name, n_readers=3, slot_bytes=256, n_slots=2) as w:
        for i in range(10):
            w.put(i, timeout=0)
        with pytest.raises(Timeout, match=r"reader\(s\) \[0, 1, 2\] did not attach"):
            w.wait_for_readers(timeout=0.01)


def test_close_drains_then_raises_closed(queue) -> None:
    w, (r0, _) = queue
    w.put("last")
    w.close()
    w.close()
    assert r0.get(timeout=1) == "last"
    with pytest.raises(Closed, match="closed by its writer"):
        r0.get(timeout=1)
    with pytest.raises(SegmentClosed):
        w.put("more")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_close_wakes_a_reader_blocked_in_another_process(name: str) -> None:
    w = BroadcastQueue.create(name, n_readers=1, slot_bytes=256, n_slots=4)
    results = CTX.Queue()
    proc = CTX.Process(target=queue_reader_main, args=(name, 0, results, 30.0))
    proc.start()
    try:
        assert results.get(timeout=30) == ("attached", 0)
        time.sleep(0.3)  # let it fall asleep on its semaphore
        w.close()
        kind, text, waited = results.get(timeout=10)
        assert kind == "Closed", text
        assert waited < 5
    finally:
        w.close()
        proc.join(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_sleeping_reader_wakes_for_a_message(name: str) -> None:
    with BroadcastQueue.create(name, n_readers=1, slot_bytes=256, n_slots=4) as w:
        results = CTX.Queue()
        proc = CTX.Process(target=queue_reader_main, args=(name, 0, results, 30.0))
        proc.start()
        try:
            assert results.get(timeout=30) == ("attached", 0)
            time.sleep(0.3)
            w.put({"hello": [1, 2]})
            kind, msg, _ = results.get(timeout=10)
            assert kind == "message" and msg == {"hello": [1, 2]}
        finally:
            proc.join(timeout=10)


def test_reader_index_and_busy_slot(queue, name: str) -> None:
    w, _ = queue
    with pytest.raises(ReaderIndexError, match=r"use an int in 0\.\.1"):
        BroadcastQueue.attach(name, reader=2)
    table = w._table.row(0)
    saved = bytes(w._buf[table:table + 8])
    w._buf[table:table + 8] = (1 << 32 | 1).to_bytes(8, "little")
    with pytest.raises(ReaderSlotBusy, match="live process 1"):
        BroadcastQueue.attach(name, reader=0)
    w._buf[table:table + 8] = saved


def test_attach_to_a_store_name_is_refused(name: str) -> None:
    from shmstore import ObjectStore

    with ObjectStore.create(name, capacity_bytes=4096, n_readers=1):
        with pytest.raises(WrongSegmentKind):
            BroadcastQueue.attach(name, reader=0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"n_readers": 0}, "n_readers"), ({"n_readers": 1, "slot_bytes": 8}, "slot_bytes"),
    ({"n_readers": 1, "n_slots": 0}, "n_slots")])
def test_bad_create_arguments(name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BroadcastQueue.create(name, **kwargs)


def test_idle_reader_sleeps(queue) -> None:
    """A reader waiting for a long time uses (almost) no CPU: measured as process CPU time."""
    _, (r0, _) = queue
    cpu0 = time.process_time()
    with pytest.raises(Timeout):
        r0.get(timeout=0.5)
    used = time.process_time() - cpu0
    assert used < 0.25, f"an idle reader burned {used:.3f} s of CPU in 0.5 s"


def test_a_doorbells_file_is_never_a_segments_name(name: str) -> None:
    """A queue Q's doorbell files were once sem.Q.w and sem.Q.rN, also valid segment names:
    with live stores of those names, creating Q waited for ever on their lock, and removing
    a dead Q's doorbells removed them. Now a doorbell's name holds a character no segment
    name may."""
    stores = [ObjectStore.create(f"sem.{name}.{who}", n_readers=1, capacity_bytes=1 << 16)
              for who in ("w", "r0")]
    try:
        queue = BroadcastQueue.create(name, n_readers=1)
        queue.close()
        assert remove_semaphores(name, 1) == 0  # the closed queue took its own
        for who in ("w", "r0"):
            assert os.path.exists(f"/dev/shm/sem.{name}.{who}")  # the live stores stay
        with pytest.raises(InvalidName):
            validate_name(f"{name}{BELL_MARK}w")
    finally:
        for store in stores:
            store.close()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's file needs root")
def test_another_users_file_at_a_doorbells_name_is_refused_and_never_removed(
        name: str) -> None:
    path = f"/dev/shm/sem.{name}{BELL_MARK}w"
    with open(path, "wb") as f:
        f.write(bytes(32))
    os.chown(path, 65534, 65534)  # nobody's
    try:
        with pytest.raises(SegmentExists, match="not a dead writer's of this user"):
            BroadcastQueue.create(name, n_readers=1)
        assert remove_semaphores(name, 1) == 0
        assert os.path.exists(path)
    finally:
        os.unlink(path)
