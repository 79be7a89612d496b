"""Soak: 20,000 objects of 1 KiB-8 MiB through a small ring to 4 readers, one killed and replaced."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections import deque

import numpy as np
import pytest

from tests._names import BroadcastQueue, ObjectStore

from .workers import crash_reader_main, sum_checksum

CTX = mp.get_context("spawn")
N_OBJECTS = 20_000
RING_BYTES = 64 << 20
N_READERS = 4
MIN_WORDS, MAX_WORDS = 128, 1 << 20  # 1 KiB .. 8 MiB of uint64


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak(name: str) -> None:
    t0 = time.monotonic()
    rng = np.random.default_rng(2026)
    base = rng.integers(0, 2**63, MAX_WORDS, dtype=np.uint64)
    store = ObjectStore.create(name, capacity_bytes=RING_BYTES, n_readers=N_READERS)
    queue = BroadcastQueue.create(name + "-q", n_readers=N_READERS, slot_bytes=256, n_slots=64)
    results = CTX.Queue()
    procs = [CTX.Process(target=crash_reader_main, args=(name, name + "-q", r, results, False))
             for r in range(N_READERS)]
    replacement = None
    try:
        for p in procs:
            p.start()
        for _ in procs:
            assert results.get(timeout=60)[0] == "attached"
        sums: dict[str, int] = {}
        recent: deque[str] = deque(maxlen=16)
        objects = sent = resent = released = bytes_put = 0
        sent_after_replacement = 0
        while objects < N_OBJECTS:
            roll = rng.random()
            key = recent[int(rng.integers(len(recent)))] if recent else ""
            if roll < 0.15 and key and store.is_cached(key):
                handle = store.get_cached(key)
                resent += 1
            else:
                n = int(math.exp(rng.uniform(math.log(MIN_WORDS), math.log(MAX_WORDS))))
                start = int(rng.integers(0, MAX_WORDS - n + 1))
                data = base[start:start + n]
                key = f"o{objects}"
                handle = store.put(key, data, timeout=60)
                objects += 1
                bytes_put += data.nbytes
                if roll < 0.20:  # an aborted request: handed back, never sent
                    store.give_back(handle)
                    released += 1
                    continue
                sums[key] = sum_checksum(data)
                recent.append(key)
            queue.put((handle.pack(), sums[key]), timeout=60)
            sent += 1
            if replacement is not None:
                sent_after_replacement += 1
            if objects == N_OBJECTS // 2 and procs[3].is_alive():
                procs[3].kill()  # wherever it is: inside a view, between reads, asleep
                procs[3].join(timeout=30)
            if objects == N_OBJECTS // 2 + 1000 and replacement is None:
                # 1,000 objects later (the ring wrapped several times past objects the dead
                # reader owed), a replacement takes its slot
                replacement = CTX.Process(target=crash_reader_main,
                                          args=(name, name + "-q", 3, results, False))
                replacement.start()
                assert results.get(timeout=60)[0] == "attached"
        queue.close()
        reports = [results.get(timeout=120) for _ in range(N_READERS)]
        stats = store.stats()
    finally:
        for p in [*procs, replacement]:
            if p is not None:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        queue.close()
        store.close()
    elapsed = time.monotonic() - t0
    by_reader = {r[1]: r for r in reports}
    for reader in range(3):
        _, _, received, mismatches, stale, error = by_reader[reader]
        assert error is None, error
        assert (received, mismatches, stale) == (sent, 0, 0), by_reader[reader]
    _, _, received, mismatches, stale, error = by_reader[3]  # the replacement
    assert error is None and mismatches == 0 and stale == 0
    assert received == sent_after_replacement
    assert stats.dead_readers == 1
    assert bytes_put > 100 * RING_BYTES, "the ring must wrap around hundreds of times"
    assert resent > 1000 and released > 1000
    for leftover in (name, name + "-q"):
        assert not os.path.exists(f"/dev/shm/{leftover}")
    print(f"soak: {objects} objects ({bytes_put / 2**30:.1f} GiB, {bytes_put / RING_BYTES:.0f} "
          f"wraps), {sent} sent, {resent} resent, {released} released, "
          f"{N_READERS - 1}x{sent} + {received} verified reads, in {elapsed:.0f} s")
