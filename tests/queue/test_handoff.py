"""The two hand-offs (the compiled Slots of _native/_atomic.c and queue/_slots.py's PythonSlots)
write and accept the same bytes: across processes, byte for byte, under damage to every byte of a slot,
signals and a close from another thread."""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from shmstore.queue import _slots
from shmstore.queue._broadcast import ROW_READ_SEQ, ROW_SLEEPING
from tests._names import BroadcastQueue, CorruptObject, SegmentClosed, Timeout
from tests.conftest import new_name

CTX = mp.get_context("spawn")
N_MESSAGES = 300
PATHS = ["compiled", "python"]


@pytest.fixture(autouse=True)
def _restore_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_slots, "SLOTS", _slots.SLOTS)  # put back after each test


def set_path(path: str) -> None:
    _slots.SLOTS = _slots.COMPILED if path == "compiled" else _slots.PythonSlots


def message(i: int) -> Any:
    """Message i: a mix of sizes and types, arrays among them (written in place, not copied)."""
    if i % 3 == 0:
        return {"i": i, "arr": np.arange(i % 50, dtype=np.int32)}
    if i % 3 == 1:
        return bytes([i % 256]) * (i * 7 % 900)
    return (i, f"m{i}", -i * 1.5)


def cross_writer(name: str, path: str, n_readers: int, report: Any, go: Any) -> None:
    set_path(path)
    q = BroadcastQueue.create(name, n_readers=n_readers, slot_bytes=1024, n_slots=8)
    try:
        report.put("created")
        q.wait_for_readers(30)
        for i in range(N_MESSAGES):
            q.put(message(i), timeout=30, tag=i)
        report.put("sent")
        go.get(timeout=120)  # the readers are done: then close
    finally:
        q.close()


def cross_reader(name: str, path: str, reader: int, report: Any) -> None:
    set_path(path)
    q = BroadcastQueue.attach(name, reader)
    wrong = 0
    try:
        for i in range(N_MESSAGES):
            tag, msg = q.get_message(timeout=30)
            expected = message(i)
            if isinstance(expected, dict):
                same = msg["i"] == i and np.array_equal(msg["arr"], expected["arr"])
            else:
                same = msg == expected
            wrong += tag != i or not same
    finally:
        q.close()
    report.put(("done", reader, wrong))


def _requires_compiled() -> None:
    if _slots.COMPILED is None:
        pytest.skip("the compiled hand-off is not built here")


@pytest.mark.parametrize("writer_path", PATHS)
def test_a_writer_on_one_path_and_readers_on_the_other_in_other_processes(writer_path: str) -> None:
    _requires_compiled()
    name = new_name("cross")
    reader_path = "python" if writer_path == "compiled" else "compiled"
    to_writer, from_all = CTX.Queue(), CTX.Queue()
    writer = CTX.Process(target=cross_writer, args=(name, writer_path, 2, from_all, to_writer))
    writer.start()
    readers = []
    try:
        assert from_all.get(timeout=60) == "created"
        readers = [CTX.Process(target=cross_reader, args=(name, path, r, from_all))
                   for r, path in enumerate([reader_path, writer_path])]
        for p in readers:
            p.start()
        results = [from_all.get(timeout=120) for _ in range(3)]
        assert "sent" in results
        assert sorted(r for r in results if r != "sent") == [("done", 0, 0), ("done", 1, 0)]
    finally:
        for p in readers:
            p.join(30)
        to_writer.put(None)
        writer.join(30)
        for p in [writer, *readers]:
            if p.is_alive():
                p.kill()
    assert writer.exitcode == 0 and all(p.exitcode == 0 for p in readers)


def slot_bytes_of(path: str, msg: Any, tag: int, seq: int) -> bytes:
    """The slot message `seq` of a queue fills, written by `path` (seq - 1 messages before it)."""
    set_path(path)
    with BroadcastQueue.create(new_name("bytes"), n_readers=1, slot_bytes=1024, n_slots=4) as q:
        for _ in range(seq - 1):
            q.put(None)
        q.put(msg, tag=tag)
        slot = q.slot(seq)
        return bytes(q._buf[slot:slot + q._stride])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.one_of(st.binary(max_size=900), st.integers(-2**63, 2**63 - 1),
                         st.text(max_size=100), st.lists(st.floats(allow_nan=False), max_size=20)),
       tag=st.integers(0, 2**32 - 1), seq=st.integers(1, 9))
def test_both_paths_write_the_same_slot_bytes(payload: Any, tag: int, seq: int) -> None:
    _requires_compiled()
    before = _slots.SLOTS  # hypothesis runs every example inside one fixture's scope
    try:
        assert slot_bytes_of("compiled", payload, tag, seq) == slot_bytes_of("python", payload, tag,
                                                                                seq)
    finally:
        _slots.SLOTS = before


def outcome_after_damage(path: str, offset: int, msg: Any) -> tuple[str, ...]:
    """What a reader on `path` gets from a slot whose byte at `offset` was flipped, then whether
    the next message still comes through."""
    set_path(path)
    with BroadcastQueue.create(new_name("dmg"), n_readers=1, slot_bytes=256, n_slots=4) as q:
        r = BroadcastQueue.attach(q.name, 0)
        try:
            q.put(msg, tag=7)
            q._buf[q.slot(1) + offset] ^= 0xFF
            try:
                first: tuple[str, ...] = ("message", repr(r.get_message(timeout=0.05)))
            except (CorruptObject, Timeout) as exc:
                first = (type(exc).__name__, str(exc).replace(q.name, "Q"))
            q.put("next", timeout=1)
            try:
                second = repr(r.get(timeout=0.05))
            except (CorruptObject, Timeout) as exc:
                second = type(exc).__name__
            return (*first, second, str(r.skipped))
        finally:
            r.close()


def test_damage_to_every_byte_of_a_slot_reads_the_same_on_both_paths() -> None:
    _requires_compiled()
    msg = {"k": b"x" * 40, "n": 12345}
    size = 64 + 100  # the header, then the payload and a little past it
    seen = set()
    for offset in range(size):
        compiled = outcome_after_damage("compiled", offset, msg)
        python = outcome_after_damage("python", offset, msg)
        assert compiled == python, offset
        seen.add(compiled[0])
    assert {"CorruptObject", "message"} <= seen  # damage was found, and reserved bytes ignored


class Stop(Exception):
    pass


@contextmanager
def alarm_during_a_sleeping_get(name: str, handler: Any) -> Iterator[tuple[Any, Any]]:
    """A queue and its reader, with SIGALRM going to `handler` 0.1 s from now; the handler
    and the timer are put back on the way out."""
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with BroadcastQueue.create(name, n_readers=1, spin_s=0) as q:
            r = BroadcastQueue.attach(name, 0)
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.1)
                yield q, r
                assert q._words.load_acquire(r._row + ROW_SLEEPING) == 0  # not left "asleep"
                q.put("after")
                assert r.get(timeout=1) == "after"  # and the reader goes on
            finally:
                r.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_signal_handler_that_raises_ends_a_sleeping_get_and_the_reader_goes_on(name: str
                                                                                 ) -> None:
    _requires_compiled()
    set_path("compiled")

    def stop(*_: Any) -> None:
        raise Stop

    with alarm_during_a_sleeping_get(name, stop) as (_, r):
        t0 = time.monotonic()
        with pytest.raises(Stop):
            r.get(timeout=5)
        assert time.monotonic() - t0 < 2


def test_on_the_python_path_posix_ipc_loses_what_a_raising_handler_raised(name: str) -> None:
    """A limitation of the Python path, pinned: posix_ipc runs the handler during a semaphore
    wait, then replaces its exception with its own SignalError, so the wait goes on to its
    deadline (the compiled path raises it: the test above)."""
    set_path("python")
    ran = []

    def stop(*_: Any) -> None:
        ran.append(1)
        raise Stop

    lost = False
    for attempt in range(5):  # until the alarm lands inside a semaphore wait: on a loaded
        ran.clear()  # machine it can land between two of them (Stop, as in any Python code)
        with alarm_during_a_sleeping_get(f"{name}-{attempt}", stop) as (_, r):
            try:
                r.get(timeout=0.5)
            except Timeout:
                lost = bool(ran)  # the handler ran and raised; the wait went on to its end
            except Stop:
                continue
        if lost:
            break
    assert lost


def test_a_close_from_another_thread_ends_a_sleeping_get(name: str, handoff: str) -> None:
    with BroadcastQueue.create(name, n_readers=1, spin_s=0) as q:
        r = BroadcastQueue.attach(name, 0)
        threading.Timer(0.2, r.close).start()
        t0 = time.monotonic()
        with pytest.raises(SegmentClosed):
            r.get(timeout=10)
        assert time.monotonic() - t0 < 5
        q.put(1)  # the writer is not held up by the closed reader


def test_the_compiled_slots_check_their_layout_and_their_role(name: str) -> None:
    _requires_compiled()
    set_path("compiled")
    with BroadcastQueue.create(name, n_readers=1, slot_bytes=64, n_slots=2) as q:
        layout = q.handoff_layout()
        bells = (q._bells[0].name,)
        Slots = _slots.ATOMIC.Slots
        assert tuple(layout) == _slots.ATOMIC.HANDOFF_LAYOUT  # the same names, the same order
        lacking = dict(layout)
        del lacking["body"]
        with pytest.raises(ValueError, match="lacks body"):
            Slots(q._words, lacking, -1, bells, None)
        with pytest.raises(ValueError, match="has 16 names"):
            Slots(q._words, {**layout, "spare": 0}, -1, bells, None)
        with pytest.raises(TypeError):
            Slots(q._words, tuple(layout.values()), -1, bells, None)  # by position: refused
        with pytest.raises(ValueError, match="does not fit"):
            Slots(q._words, {**layout, "n_slots": 10**6}, -1, bells, None)  # past the mapping
        with pytest.raises(ValueError, match="posts one doorbell"):
            Slots(q._words, layout, -1, bells, bells[0])
        with pytest.raises(FileNotFoundError):
            Slots(q._words, layout, -1, ("/no-such-bell-" + name[-8:],), None)
        with pytest.raises(TypeError, match="for the queue's readers"):
            q._slots.take(1)
        with pytest.raises(ValueError, match="start at 1"):
            q._slots.publish(0, 0, b"")
        with pytest.raises(ValueError, match="does not fit a 64-byte slot"):
            q._slots.publish(1, 0, b"x" * 65)
        with pytest.raises(OverflowError):
            q._slots.publish(1, 2**32, b"")
        slots = q._slots
    with pytest.raises(ValueError, match="released"):
        slots.publish(1, 0, b"")


class QueueModel(RuleBasedStateMachine):
    """Random puts and gets by two readers against a model of who has read what; where the
    compiled hand-off is built, the writer and reader 0 take it and reader 1 the Python path."""

    N_SLOTS = 3

    def __init__(self) -> None:
        super().__init__()
        self.name = new_name("qsm")
        before = _slots.SLOTS
        try:
            self.writer = BroadcastQueue.create(self.name, n_readers=2, slot_bytes=128,
                                                n_slots=self.N_SLOTS, spin_s=0)
            self.readers = [BroadcastQueue.attach(self.name, reader=0, spin_s=0)]
            set_path("python")
            self.readers.append(BroadcastQueue.attach(self.name, reader=1, spin_s=0))
        finally:
            _slots.SLOTS = before
        self.sent: list[int] = []
        self.next_index = [0, 0]

    def teardown(self) -> None:
        for r in self.readers:
            r.close()
        self.writer.close()

    @rule(value=st.integers(0, 10**6))
    def put(self, value: int) -> None:
        full = len(self.sent) - min(self.next_index) >= self.N_SLOTS
        if full:
            with pytest.raises(Timeout):
                self.writer.put(value, timeout=0)
        else:
            self.writer.put(value, timeout=0)
            self.sent.append(value)

    @rule(reader=st.integers(0, 1))
    def get(self, reader: int) -> None:
        i = self.next_index[reader]
        if i == len(self.sent):
            with pytest.raises(Timeout):
                self.readers[reader].get(timeout=0)
        else:
            assert self.readers[reader].get(timeout=0) == self.sent[i]
            self.next_index[reader] += 1

    @precondition(lambda self: True)
    @rule()
    def slots_flags_agree(self) -> None:
        words = self.writer._words
        for r in range(2):
            read_seq = words.load_acquire(self.writer._table.row(r) + ROW_READ_SEQ)
            assert read_seq == self.next_index[r]
            assert words.load_acquire(self.writer._table.row(r) + ROW_SLEEPING) == 0  # nobody asleep


QueueModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_queue_state_machine = QueueModel.TestCase
test_queue_state_machine.pytestmark = [pytest.mark.slow]
