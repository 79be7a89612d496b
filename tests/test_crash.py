"""Crashes: a reader SIGKILLed inside a view, the writer SIGKILLed while putting or sending."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from tests._names import BroadcastQueue, Channel, ObjectStore

from .workers import (
    channel_survivor_main,
    channel_writer_main,
    crash_reader_main,
    sum_checksum,
)

CTX = mp.get_context("spawn")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def expect(results: mp.Queue, kind: str, timeout: float = 60) -> tuple:
    msg = results.get(timeout=timeout)
    assert msg[0] == kind, msg
    return msg


def test_reader_killed_inside_a_view_stops_pinning_objects(name: str) -> None:
    store = ObjectStore.create(name, capacity_bytes=4 << 20, n_readers=2)
    queue = BroadcastQueue.create(name + "-q", n_readers=2, slot_bytes=256, n_slots=16)
    results = CTX.Queue()
    # The victim reports on a queue of its own: killed right after a put, its feeder thread may
    # die holding that queue's cross-process lock, which would block every later put on it.
    victim_results = CTX.Queue()
    survivor = CTX.Process(target=crash_reader_main, args=(name, name + "-q", 0, results, False))
    victim = CTX.Process(target=crash_reader_main,
                         args=(name, name + "-q", 1, victim_results, True))
    replacement = None
    try:
        for p in (survivor, victim):
            p.start()
        expect(results, "attached")
        expect(victim_results, "attached")
        rng = np.random.default_rng(0)
        base = rng.integers(0, 2**63, 1 << 17, dtype=np.uint64)  # 1 MiB
        sent = 0

        def send(i: int) -> None:
            data = base[i % 100:i % 100 + 20_000 + (i * 97) % 100_000]
            handle = store.put(f"k{i}", data, timeout=30)
            queue.put((handle.pack(), sum_checksum(data)), timeout=30)

        send(0)
        sent += 1
        expect(victim_results, "in view")  # the victim now holds a view of object 0
        victim.kill()
        killed_at = time.monotonic()
        victim.join(timeout=30)
        for i in range(1, 300):  # 300 x ~0.5 MiB through a 4 MiB ring: object 0 must go
            send(i)
            sent += 1
        unpinned_after = time.monotonic() - killed_at
        print(f"300 puts after the kill took {unpinned_after:.2f} s")
        assert not store.is_cached("k0")
        stats = store.stats()
        assert stats.dead_readers == 1 and stats.evictions > 250
        # A replacement takes the dead reader's slot and reads what is sent from now on.
        replacement = CTX.Process(target=crash_reader_main,
                                  args=(name, name + "-q", 1, results, False))
        replacement.start()
        expect(results, "attached")
        for i in range(300, 400):
            send(i)
            sent += 1
        queue.close()
        reports = {msg[1]: msg for msg in (expect(results, "done") for _ in range(2))}
        _, _, received, mismatches, stale, error = reports[0]
        assert error is None and (received, mismatches, stale) == (sent, 0, 0)
        _, _, received, mismatches, stale, error = reports[1]
        assert error is None and (received, mismatches, stale) == (100, 0, 0)
        assert unpinned_after < 30
    finally:
        for p in (survivor, victim, replacement):
            if p is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        queue.close()
        store.close()


@pytest.mark.parametrize("big", [True, False], ids=["mid-put", "mid-send"])
def test_writer_killed_readers_get_writer_gone_and_a_new_writer_takes_over(
        name: str, big: bool) -> None:
    results = CTX.Queue()
    writer = CTX.Process(target=channel_writer_main, args=(name, big, results))
    writer.start()
    readers = []
    try:
        expect(results, "writer ready")
        readers = [CTX.Process(target=channel_survivor_main, args=(name, r, results))
                   for r in range(2)]
        for p in readers:
            p.start()
        expect(results, "attached")
        expect(results, "attached")
        time.sleep(1.5)  # values flowing; big ones keep the writer inside put most of the time
        os.kill(writer.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        writer.join(timeout=30)
        reports = [expect(results, "gone", timeout=30) for _ in readers]
        for _, reader, noticed_at, received, mismatches, out_of_order, error in reports:
            assert error is None, f"reader {reader}: {error}"
            assert received > 0 and mismatches == 0 and out_of_order == 0
            assert noticed_at - killed_at < 2.0, f"reader {reader} noticed after " \
                f"{noticed_at - killed_at:.2f} s"
            print(f"reader {reader} noticed the writer's death after "
                  f"{noticed_at - killed_at:.3f} s, having received {received} values")
        # both readers got every value that was completely sent: the same count, in order
        assert abs(reports[0][3] - reports[1][3]) <= 1
        # The dead writer's segments and semaphores are taken over by a new writer.
        with Channel.create(name, n_readers=1, capacity_bytes=8 << 20) as ch:
            reader = Channel.attach(name, reader=0)
            ch.send({"after": "takeover"})
            assert reader.recv(timeout=5) == {"after": "takeover"}
            reader.close()
    finally:
        for p in [writer, *readers]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
