"""Channel: inline and by-handle values look the same to readers; order and bytes across processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random

import numpy as np
import pytest

from shmstore.errors import InvalidArgument
from tests._names import Channel, Closed, CorruptObject, StoreFull, Timeout
from tests.workers import channel_reader_main

CTX = mp.get_context("spawn")
pytestmark = pytest.mark.usefixtures("handoff")  # every test on both hand-off paths


def value(i: int, nbytes: int) -> dict:
    data = np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)
    return {"i": i, "data": data,
            "sum": hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()}


@pytest.fixture
def channel(name: str):
    w = Channel.create(name, n_readers=1, capacity_bytes=1 << 20, inline_threshold=1024)
    r = Channel.attach(name, reader=0)
    yield w, r
    r.close()
    w.close()


def test_inline_and_by_handle_give_the_same_value(channel) -> None:
    w, r = channel
    small, large = np.arange(10, dtype=np.int16), np.arange(10_000, dtype=np.int16)
    w.send({"x": small})
    w.send({"x": large})
    assert np.array_equal(r.recv()["x"], small)
    assert np.array_equal(r.recv()["x"], large)
    assert (w.sent_inline, w.sent_by_handle) == (1, 1)


def test_cached_key_sends_the_handle_again_without_copying(channel) -> None:
    w, r = channel
    big = np.ones(50_000, dtype=np.float32)
    w.send(big, key="img")
    w.send(None, key="img")  # cached: the value is not even looked at
    assert w.store.stats().puts == 1 and w.store.stats().hits == 1
    assert np.array_equal(r.recv(), big)
    with r.recv_view() as view:
        assert np.array_equal(view, big) and not view.flags.writeable
    assert w.store.stats().reader_lag == (0,)


def test_publish_and_recv_handle_take_objects_out_of_order(name: str) -> None:
    """A writer that uses the store itself publishes its hand-outs; a reader takes their
    handles unread and reads them in another order. Each object stays owed to the reader until
    it is read or discarded, and the writer's object_id names the bytes across copies."""
    w = Channel.create(name, n_readers=1, capacity_bytes=1 << 20, inline_threshold=1024)
    r = Channel.attach(name, reader=0)
    try:
        store = w.store
        handles = []
        for i in range(3):
            made = store.hand_out_new(f"k{i}", value(i, 300_000))
            with pytest.raises(InvalidArgument, match="HandOut"):
                w.publish(made.handle, timeout=5)  # a bare handle does not say which hand-out
            w.publish(made, timeout=5)
            handles.append(made.handle)
            assert made.object_id == store.object_id(f"k{i}")
        assert store.object_id("k0") == handles[0].key_digest + handles[0].seq.to_bytes(8, "little")
        assert store.object_id("missing") is None
        got = [r.recv_handle(timeout=5) for _ in range(3)]
        assert got == handles
        with pytest.raises(StoreFull):
            store.put("k3", value(3, 400_000))  # all three owed: nothing can be reclaimed
        assert r.get(got[2])["i"] == 2 and r.get(got[0])["i"] == 0
        r.discard(got[1])
        store.put("k3", value(3, 400_000), timeout=5)  # now they can be
        w.send({"small": 1})
        with pytest.raises(CorruptObject, match="inline"):
            r.recv_handle(timeout=5)
    finally:
        r.close()
        w.close()


def test_recv_view_of_an_inline_value(channel) -> None:
    w, r = channel
    w.send(("a", 1))
    with r.recv_view(timeout=1) as v:
        assert v == ("a", 1)


def test_timeouts_and_close(channel) -> None:
    w, r = channel
    with pytest.raises(Timeout):
        r.recv(timeout=0.02)
    w.send(np.zeros(5000))
    w.close()
    assert r.recv(timeout=1).shape == (5000,)  # sent before close: still delivered
    with pytest.raises(Closed):
        r.recv(timeout=1)


def test_store_full_on_send_releases_nothing_owed(name: str) -> None:
    with Channel.create(name, n_readers=1, capacity_bytes=64 << 10, inline_threshold=0, n_slots=64) as w:
        r = Channel.attach(name, reader=0)
        try:
            w.send(np.zeros(40_000, np.uint8))
            with pytest.raises(MemoryError):  # StoreFull: reader 0 has not read the first one
                w.send(np.zeros(40_000, np.uint8), timeout=0.02)
            r.recv()
            w.send(np.zeros(40_000, np.uint8))
            assert r.recv().shape == (40_000,)
        finally:
            r.close()


def run_channel(name: str, n_readers: int, n_messages: int) -> None:
    rng = random.Random(n_readers)
    with Channel.create(name, n_readers=n_readers, capacity_bytes=4 << 20, inline_threshold=4096,
                        n_slots=32) as w:
        results = CTX.Queue()
        procs = [CTX.Process(target=channel_reader_main, args=(name, r, results, None))
                 for r in range(n_readers)]
        for p in procs:
            p.start()
        try:
            w.wait_for_readers(timeout=60)
            for i in range(n_messages):
                nbytes = rng.choice([rng.randint(0, 3000), rng.randint(5000, 300_000)])
                key = f"k{i % 50}" if rng.random() < 0.1 else None
                if key is not None and w.store.is_cached(key):
                    key = None  # keep checksums tied to i: resend only fresh values here
                w.send(value(i, nbytes), key=key, timeout=60)
            w.end()  # readers drain, then see Closed
            reports = sorted(results.get(timeout=120) for _ in range(n_readers))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        for reader, received, mismatches, out_of_order, error in reports:
            assert error is None, f"reader {reader}: {error}"
            assert (received, mismatches, out_of_order) == (n_messages, 0, 0), reader
        assert w.sent_inline > 100 and w.sent_by_handle > 100


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n_readers", [1, 2, 4])
def test_order_and_bytes_across_reader_processes(name: str, n_readers: int) -> None:
    run_channel(name, n_readers, n_messages=2000)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stalled_reader_applies_backpressure(name: str) -> None:
    with Channel.create(name, n_readers=2, capacity_bytes=1 << 20, inline_threshold=4096, n_slots=8) as w:
        results = CTX.Queue()
        stalled = CTX.Process(target=channel_reader_main, args=(name, 1, results, 3, 20.0))
        stalled.start()
        r0 = Channel.attach(name, reader=0)
        try:
            w.wait_for_readers(timeout=60)
            with pytest.raises(Timeout, match=r"reader\(s\) \[1\]"):
                for i in range(100):
                    w.send(value(i, 100), timeout=0.5)
                    r0.recv(timeout=5)
            assert results.get(timeout=30)[1] == 3  # it read 3, then stopped
        finally:
            r0.close()
            stalled.kill()
            stalled.join(timeout=30)
