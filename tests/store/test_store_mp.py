"""Reader processes (spawn) read many objects through many wraparounds; every byte is verified."""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np
import pytest

from tests._names import ObjectStore
from tests.workers import checksum, reader_main

KIB = 1024
CTX = mp.get_context("spawn")


def make_object(rng: random.Random, i: int, use_torch: bool) -> dict:
    nbytes = rng.randint(1 * KIB, 200 * KIB) // 4 * 4
    data = np.random.default_rng(i).integers(0, 2**31, nbytes // 4, dtype=np.int32)
    extra = [np.full(rng.randint(0, 50), i % 256, dtype=np.uint8)]
    if use_torch:
        import torch

        extra.append(torch.from_numpy(data[: nbytes // 8].astype(np.float32)).to(torch.bfloat16))
    return {"data": data, "extra": extra, "meta": (i, f"item-{i}")}


def run_pipeline(name: str, n_readers: int, n_objects: int, min_wraps: int,
                 use_torch: bool = False) -> None:
    rng = random.Random(n_readers)
    capacity = 1024 * KIB
    with ObjectStore.create(name, capacity_bytes=capacity, n_readers=n_readers) as store:
        inboxes = [CTX.Queue() for _ in range(n_readers)]
        results = CTX.Queue()
        procs = [CTX.Process(target=reader_main, args=(name, r, inboxes[r], results, use_torch),
                             daemon=True)
                 for r in range(n_readers)]
        for p in procs:
            p.start()
        try:
            # The ring fills within a few puts; a put then waits on readers, so they start first
            # (spawning and importing torch took over 30 s once on a loaded machine).
            ready = sorted(results.get(timeout=120) for _ in procs)
            assert ready == [("ready", r) for r in range(n_readers)]
            sums: dict[str, str] = {}
            recent: list[str] = []
            sent = bytes_put = 0
            for i in range(n_objects):
                key = rng.choice(recent) if recent and rng.random() < 0.2 else f"obj-{i}"
                if store.is_cached(key):
                    handle = store.get_cached(key)
                else:
                    obj = make_object(rng, i, use_torch)
                    key = f"obj-{i}"
                    handle = store.put(key, obj, timeout=30)
                    sums[key] = checksum(obj)
                    bytes_put += obj["data"].nbytes
                    recent = ([*recent, key])[-8:]
                for inbox in inboxes:
                    inbox.put((handle.pack(), sums[key]))
                sent += 1
            for inbox in inboxes:
                inbox.put(None)
            reports = sorted(results.get(timeout=60) for _ in range(n_readers))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        for reader, n_read, mismatches, views, error in reports:
            assert error is None, f"reader {reader}: {error}"
            assert n_read == sent and mismatches == 0 and views == sent // 2
        stats = store.stats()
        assert bytes_put > min_wraps * capacity, "the ring must wrap around many times"
        assert stats.hits > 0 and stats.evictions > 0
        assert stats.reader_lag == (0,) * n_readers


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("n_readers", [1, 2, 4])
def test_readers_verify_every_byte_through_wraparounds(name: str, n_readers: int) -> None:
    run_pipeline(name, n_readers, n_objects=1500, min_wraps=40)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torch_tensors_across_processes(name: str) -> None:
    run_pipeline(name, 2, n_objects=200, min_wraps=10, use_torch=True)
