"""Hostile runs against a live Channel: a scribbler on the metadata words, and a kill loop.

Bounded for CI. `SHMSTORE_LONG=1` runs the long versions (release testing): the scribbler for
60 s instead of 4 s, the kill loop for 100 kills instead of 8.

What must hold, whatever the damage or the kill:
- no reader ever receives wrong data (every value carries its own check);
- every call returns or raises a ShmStoreError within its timeout (plus scheduling slack);
- no process crashes; nothing is left in /dev/shm (the session check).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmstore.queue._layout import QUEUE_META, QUEUE_ROW, SLOT_HEADER
from shmstore.shm._segment import SEGMENT_HEADER
from shmstore.store._layout import OBJECT_HEADER, ROW_PIN_MASK, STORE_META, STORE_ROW
from tests._names import Channel, ShmStoreError

SPAWN = mp.get_context("spawn")
LONG = os.environ.get("SHMSTORE_LONG") == "1"
SCRIBBLE_S = 60.0 if LONG else 4.0
KILLS = 100 if LONG else 8
RECV_TIMEOUT_S = 0.5
SLACK_S = 1.5  # a call may overrun its timeout by this much on a loaded 2-core machine
U64 = struct.Struct("<Q")
pytestmark = pytest.mark.timeout(3600 if LONG else 120)


def make_value(i: int) -> dict[str, Any]:
    n = 2000 + (i * 7919) % 30000  # above the inline threshold: through the store
    return {"i": i, "data": np.full(n, i % 251, np.uint8), "n": n}


def check_value(value: Any) -> bool:
    """Whether a received value is exactly what make_value made for its number."""
    try:
        i = value["i"]
        data = value["data"]
        n = 2000 + (i * 7919) % 30000
        return (type(i) is int and value["n"] == n and data.shape == (n,)
                and data.dtype == np.uint8 and bool((data == i % 251).all()))
    except Exception:
        return False


def describe(value: Any) -> str:
    """What is wrong with a value that failed check_value."""
    try:
        i, data = value["i"], value["data"]
        wrong = np.flatnonzero(data != i % 251)
        return (f"i={i} n={value['n']} shape={data.shape} dtype={data.dtype} wrong bytes at "
                f"{wrong[:16].tolist()} ({len(wrong)} in all)")
    except Exception as exc:
        return f"{value!r:.200} ({exc!r})"


def waited_to_run_s() -> float:
    """Seconds this thread has spent runnable but not running (the kernel's run-queue wait,
    /proc/thread-self/schedstat): the part of a call's overrun that the machine's load
    explains (on a shared 2-core machine a process waits seconds for a core at times), which
    the checks of how long a call took leave out: they bound the call's own waiting."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def reader_main(name: str, reader: int, log_path: str, run_s: float) -> None:
    """Receive until run_s passes; log one line per outcome (a SIGKILL loses at most a line)."""
    from shmstore import Closed, ShmStoreError, WriterGone

    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    end = time.monotonic() + run_s
    ch = None
    while time.monotonic() < end:
        try:
            if ch is None:
                ch = Channel.attach(name, reader)
                log("attached")
            started, queued = time.monotonic(), waited_to_run_s()
            try:
                value = ch.recv(timeout=RECV_TIMEOUT_S)
                log("ok" if check_value(value) else f"BAD {describe(value)}")
            finally:
                took = time.monotonic() - started
                unscheduled = waited_to_run_s() - queued
                if took - unscheduled > RECV_TIMEOUT_S + SLACK_S:
                    log(f"SLOW {took:.2f} s, {unscheduled:.2f} s of it waiting for a core")
        except (Closed, WriterGone) as exc:  # the writer went: wait for the next one
            log(f"err {type(exc).__name__}")
            if ch is not None:
                ch.close()
                ch = None
            time.sleep(0.05)
        except ShmStoreError as exc:
            log(f"err {type(exc).__name__} {exc}")
            if ch is None:
                time.sleep(0.05)
        except BaseException as exc:
            log(f"EXC {type(exc).__name__}: {exc}")
            raise
    if ch is not None:
        ch.close()
    log("done")
    os.close(fd)


def writer_main(name: str, log_path: str) -> None:
    """Send numbered values (a third of them resent by key) until killed."""
    from shmstore import ShmStoreError

    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    ch = Channel.create(name, n_readers=2, capacity_bytes=2 << 20, inline_threshold=1024)
    os.write(fd, b"writer ready\n")
    i = 0
    while True:
        try:
            ch.send(make_value(i), key=f"k{i % 50}" if i % 3 == 0 else None, timeout=0.5)
        except ShmStoreError as exc:
            os.write(fd, f"err {type(exc).__name__}\n".encode())
        i += 1


def tally(paths: list[Path]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            word = line.split(" ")[0]
            assert word not in ("BAD", "EXC", "SLOW"), f"{path.name}: {line}"
            key = " ".join(line.split(" ")[:2]) if word == "err" else word
            counts[key] = counts.get(key, 0) + 1
    return counts


class Scribbler:
    """Damages random metadata words of a live channel: bit flips, zeros, huge values, other
    readers' pids. Fixed words are put back after up to 4 ms (a word damaged for good that names a
    live process, or says "closed", stops the stream loudly: StoreFull naming the reader, or
    Closed; tested elsewhere). Chunk headers stay damaged until the writer reclaims the chunk.
    Runs in the writer's thread between its calls, so that a chunk it picks is still a chunk."""

    def __init__(self, ch: Any, seed: int) -> None:
        self.ch = ch
        self.rng = random.Random(seed)
        self.hits = 0
        self.pending: list[tuple[float, memoryview, int, int]] = []
        store, queue = ch.store, ch._queue
        self.store_buf = store._buf
        self.queue_buf = queue._buf
        self.store_ring = store._writer_ring
        n = store.n_readers
        meta = SEGMENT_HEADER.size
        rows = meta + STORE_META.size
        self.store_fixed = [8 * w for w in range(SEGMENT_HEADER.size // 8)]
        self.store_fixed += [meta + 8 * w for w in range(STORE_META.size // 8)]
        for r in range(n):
            row = rows + r * STORE_ROW.size
            self.store_fixed += [row + off for off in range(0, ROW_PIN_MASK, 8)]
        qrows = meta + QUEUE_META.size
        self.queue_fixed = [8 * w for w in range(SEGMENT_HEADER.size // 8)]
        self.queue_fixed += [meta + 8 * w for w in range(QUEUE_META.size // 8)]
        self.queue_fixed += [qrows + r * QUEUE_ROW.size + 8 * w for r in range(n)
                             for w in range(QUEUE_ROW.size // 8)]
        self.queue_slots = [queue.slot(s) for s in range(1, queue.n_slots + 1)]
        self.slot_words = (SLOT_HEADER.size + 64) // 8  # header, and the start of the message
        self.object_words = (64 + OBJECT_HEADER.size + 8 * n) // 8  # chunk + object headers

    def target(self) -> tuple[memoryview, int, bool]:
        """(buffer, offset, whether the word may be put back later)."""
        rng = self.rng
        pick = rng.random()
        if pick < 0.3:
            return self.store_buf, rng.choice(self.store_fixed), True
        if pick < 0.5:
            return self.queue_buf, rng.choice(self.queue_fixed), True
        if pick < 0.75:
            slot = rng.choice(self.queue_slots)
            return self.queue_buf, slot + 8 * rng.randrange(self.slot_words), True
        chunks = list(self.store_ring)
        if not chunks:
            return self.queue_buf, rng.choice(self.queue_fixed), True
        # A chunk's header is a header only while the chunk lives: damage it now, never put it
        # back later (by then those bytes may be another object's array, which is not checked).
        chunk = rng.choice(chunks)
        return self.store_buf, chunk.address + 8 * rng.randrange(self.object_words), False

    def damage(self, old: int) -> int:
        rng = self.rng
        kind = rng.randrange(5)
        if kind == 0:
            return old ^ (1 << rng.randrange(64))
        if kind == 1:
            return 0
        if kind == 2:
            return rng.choice([2**63, 2**64 - 1, 2**32, 2**31 + 7])
        if kind == 3:
            return (old & ~0xFFFFFFFF) | rng.choice([1, os.getpid(), 2**22 + 1])  # a pid
        return rng.getrandbits(64)

    def step(self) -> None:
        """Put back what is due, then damage one word (between two writer calls)."""
        now = time.monotonic()
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, buf, offset, old in due:
            U64.pack_into(buf, offset, old)
        buf, offset, restorable = self.target()
        if any(p[1] is buf and p[2] == offset for p in self.pending):
            return  # damaged already: a second damage would make the first put-back wrong
        old = U64.unpack_from(buf, offset)[0]
        U64.pack_into(buf, offset, self.damage(old))
        self.hits += 1
        if restorable:
            self.pending.append((now + self.rng.random() * 0.004, buf, offset, old))


@pytest.mark.slow
def test_scribbler_on_metadata_words_during_live_traffic(name: str, tmp_path: Path) -> None:
    logs = [tmp_path / f"reader{r}.log" for r in range(2)]
    ch = Channel.create(name, n_readers=2, capacity_bytes=2 << 20, inline_threshold=1024)
    readers = [SPAWN.Process(target=reader_main, args=(name, r, str(logs[r]), SCRIBBLE_S + 3))
               for r in range(2)]
    scribbler = Scribbler(ch, seed=int.from_bytes(os.urandom(4), "little"))
    sent = refused = 0
    refusals: dict[str, int] = {}
    try:
        for p in readers:
            p.start()
        ch.wait_for_readers(timeout=60)
        end = time.monotonic() + SCRIBBLE_S
        i = 0
        while time.monotonic() < end:
            if i % 2 == 0:
                scribbler.step()
            started, queued = time.monotonic(), waited_to_run_s()
            try:
                ch.send(make_value(i), key=f"k{i % 40}" if i % 3 == 0 else None, timeout=0.2)
                sent += 1
            except ShmStoreError as exc:
                refused += 1
                if refused <= 3:
                    print(f"refused: {exc}")
                refusals[type(exc).__name__] = refusals.get(type(exc).__name__, 0) + 1
            took, unscheduled = time.monotonic() - started, waited_to_run_s() - queued
            assert took - unscheduled < 0.2 + SLACK_S, f"send took {took:.2f} s"
            i += 1
    finally:
        ch.close()
        for p in readers:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in readers] == [0, 0]
    counts = tally(logs)
    print(f"scribbler: {scribbler.hits} damaged words; writer: {sent} sent, {refused} refused "
          f"{refusals}; readers: {counts}")
    assert scribbler.hits > 100 and sent > 50
    assert counts.get("ok", 0) > 0  # traffic got through the damage
    assert counts.get("done", 0) == 2


@pytest.mark.slow
def test_kill_loop_writer_and_readers_killed_at_random_points(name: str, tmp_path: Path) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    writer_log = tmp_path / "writer.log"
    run_s = 3600.0
    reader_logs = [tmp_path / f"reader{r}.log" for r in range(2)]

    def start_writer() -> Any:
        p = SPAWN.Process(target=writer_main, args=(name, str(writer_log)))
        p.start()
        return p

    def start_reader(r: int) -> Any:
        p = SPAWN.Process(target=reader_main, args=(name, r, str(reader_logs[r]), run_s))
        p.start()
        return p

    def oks() -> int:
        return tally(reader_logs).get("ok", 0)

    writer = start_writer()
    readers = [start_reader(r) for r in range(2)]
    kills = {"writer": 0, "reader": 0}
    try:
        for _ in range(KILLS):
            before = oks()
            deadline = time.monotonic() + 60
            while oks() < before + 5:  # values flow again after the last kill
                assert time.monotonic() < deadline, f"no progress after kills {kills}"
                time.sleep(0.05)
            time.sleep(rng.random() * 0.5)
            victim = rng.randrange(3)
            if victim == 2:
                writer.kill()
                writer.join(30)
                kills["writer"] += 1
                writer = start_writer()  # takes the dead writer's names over
            else:
                readers[victim].kill()
                readers[victim].join(30)
                kills["reader"] += 1
                readers[victim] = start_reader(victim)
        before = oks()
        deadline = time.monotonic() + 60
        while oks() < before + 5:
            assert time.monotonic() < deadline, "no progress after the last kill"
            time.sleep(0.05)
    finally:
        for p in [writer, *readers]:
            p.kill()
            p.join(30)
        # the last writer's segments and semaphores: a new writer takes them over and unlinks
        Channel.create(name, n_readers=2, capacity_bytes=2 << 20, inline_threshold=1024).close()
    counts = tally(reader_logs)
    print(f"kills: {kills}; readers: {counts}")
    assert counts.get("ok", 0) > 5 * (KILLS + 1)


def test_a_get_whose_pin_words_were_damaged_fails_instead_of_returning_reused_bytes(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin is what keeps bytes under read; damage it mid-read, let the writer reuse the
    space, and the copy must be refused (StaleHandle), not returned."""
    import shmstore.store._object_store as store_module
    from shmstore.store._layout import ROW_PINS
    from tests._names import ObjectStore, StaleHandle

    real_decode = store_module.decode
    with ObjectStore.create(name, capacity_bytes=256 << 10, n_readers=1) as w, \
            ObjectStore.attach(name, 0) as r:
        h = w.put("victim", np.full(40_000, 7, np.uint8))

        def decode_after_reuse(body: Any, **kwargs: Any) -> Any:
            row = r._row
            for offset in [ROW_PIN_MASK, *range(ROW_PINS, ROW_PINS + 64, 8)]:
                U64.pack_into(r._buf, row + offset, 0)  # the damage: no pin visible
            w.clear()
            for i in range(12):  # the ring wraps: the victim's space is reused
                w.give_back(w.put(f"new{i}", np.full(40_000, 200 + i, np.uint8)))
            assert r._words.load_acquire(h.address) not in (h.seq, 0)
            return real_decode(body, **kwargs)

        monkeypatch.setattr(store_module, "decode", decode_after_reuse)
        with pytest.raises(StaleHandle, match="overwritten while it was copied"):
            r.get(h)


def test_a_queue_reader_the_writer_stopped_waiting_for_is_told_and_goes_on(name: str) -> None:
    """Damage a reader's owner word so the writer takes it for gone and writes past it: the
    reader must say what it lost once and go on with the oldest message still held."""
    from shmstore.shm._readers import ROW_OWNER
    from tests._names import BroadcastQueue, CorruptObject

    with BroadcastQueue.create(name, n_readers=1, slot_bytes=64, n_slots=4) as w, \
            BroadcastQueue.attach(name, 0) as r:
        w.put(0)
        assert r.get(timeout=1) == 0
        owner_word = r._table.row(0) + ROW_OWNER
        owner = U64.unpack_from(r._buf, owner_word)[0]
        U64.pack_into(r._buf, owner_word, owner & ~0xFFFFFFFF)  # pid 0: "gone" to the writer
        for i in range(1, 11):
            w.put(i, timeout=0)  # does not wait for the "gone" reader
        U64.pack_into(r._buf, owner_word, owner)
        with pytest.raises(CorruptObject, match=r"overtaken: messages 2\.\.7 .* goes on with 8"):
            r.get(timeout=1)
        # message m carries value m - 1: messages 8..11 (values 7..10) were still held
        assert [r.get(timeout=1) for _ in range(4)] == [7, 8, 9, 10]
        assert r.skipped == 6
        w.put(11)
        assert r.get(timeout=1) == 11


def test_a_handle_lost_with_a_damaged_message_is_not_owed_forever(name: str) -> None:
    """A Channel reader that skips a damaged handle message never learns the handle, so it can
    never read that object; reading the next one in order must release it."""
    from tests._names import CorruptObject

    with Channel.create(name, n_readers=1, capacity_bytes=256 << 10, inline_threshold=1024) as ch, \
            Channel.attach(name, 0) as rd:
        ch.send(make_value(0))
        assert check_value(rd.recv(timeout=1))
        ch.send(make_value(1))
        queue = ch._queue
        queue._buf[queue.slot(2) + 64] ^= 0x01  # message 2 (value 1's handle): CRC mismatch
        ch.send(make_value(2))
        with pytest.raises(CorruptObject, match="CRC"):
            rd.recv(timeout=1)
        assert rd.recv(timeout=1)["i"] == 2
        for i in range(3, 40):  # wraps the 256 KiB store several times
            ch.send(make_value(i), timeout=0)
            value = rd.recv(timeout=1)
            assert check_value(value) and value["i"] == i


def test_a_row_damaged_back_to_never_attached_is_not_owed_forever(name: str) -> None:
    """Generations only grow: a row the writer saw attached that reads 0 later is damage, and
    must not make the store wait for a reader that 'never came'."""
    from shmstore.shm._readers import ROW_OWNER
    from tests._names import ObjectStore

    with ObjectStore.create(name, capacity_bytes=256 << 10, n_readers=2) as w, \
            ObjectStore.attach(name, 0) as r0, ObjectStore.attach(name, 1) as r1:
        w.wait_for_readers(timeout=1)  # the writer has seen both rows attached
        r0.get(w.put("a", np.zeros(1000, np.uint8)))
        r1.close()
        U64.pack_into(r0._buf, r0._table.row(1) + ROW_OWNER, 0)  # the damage
        for i in range(40):  # wraps the store: nothing may be owed to row 1
            r0.get(w.put(f"k{i}", np.full(30_000, i, np.uint8)))
