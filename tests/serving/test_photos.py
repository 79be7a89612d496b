"""A miss's photo by shared memory (serving/_photos.py): written once into the API server's
outbox, read by a worker in another process through a reference of four words, freed only
when its job has come back (oldest first), and never read as another photo's bytes: a chunk
freed before or during a read is StaleHandle."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest

from shmstore.errors import CorruptObject, InvalidArgument, SegmentNotFound, StaleHandle
from shmstore.serving import _photos
from shmstore.serving._deployment import NodePool
from shmstore.serving._outcome import STORED, Processor
from shmstore.serving._photos import PhotoOutbox, read_photo
from shmstore.serving._pool import MissPool
from shmstore.shm._ring import ShmRingBuffer
from tests._names import ObjectStore
from tests._waiting import wait_for
from tests.serving.test_pool import READY_S, STORES, TOY, hosted

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
KIB = 1024


def _read_in_child(ref: list[Any], out: Any) -> None:
    out.put(read_photo(ref))


def test_a_photo_is_read_in_another_process_through_its_reference(name: str) -> None:
    photo = bytes(range(256)) * 4000
    with PhotoOutbox(name) as outbox:
        ref = outbox.put(photo)
        assert ref is not None and ref[0] == outbox.name and ref[3] == len(photo)
        ctx = multiprocessing.get_context("spawn")
        out: Any = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(ref, out))
        child.start()
        try:
            assert out.get(timeout=READY_S) == photo
        finally:
            child.join(READY_S)
        outbox.done(ref)
        assert outbox.outstanding == 0


def test_chunks_are_freed_oldest_first_once_their_jobs_came_back(name: str) -> None:
    with PhotoOutbox(name, capacity_bytes=64 * KIB) as outbox:
        first, second = outbox.put(b"a" * 20 * KIB), outbox.put(b"b" * 20 * KIB)
        assert first is not None and second is not None
        assert outbox.put(b"c" * 40 * KIB) is None  # full: the job carries its bytes
        outbox.done(second)  # came back first: kept until the older one has
        assert outbox.outstanding == 2 and read_photo(second) == b"b" * 20 * KIB
        outbox.done(first)
        assert outbox.outstanding == 0
        for ref in (first, second):  # a late reader of a freed chunk: never other bytes
            with pytest.raises(StaleHandle):
                read_photo(ref)
        assert outbox.put(b"c" * 40 * KIB) is not None


def test_a_chunk_freed_while_it_is_copied_is_stale_not_another_photo(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with PhotoOutbox(name, capacity_bytes=64 * KIB) as outbox:
        ref = outbox.put(b"x" * KIB)
        assert ref is not None
        original = ShmRingBuffer.payload_view

        def freed_meanwhile(ring: Any, header: Any) -> memoryview:
            view = original(ring, header)
            outbox.done(ref)  # the owner frees it between the check and the copy
            outbox.put(b"y" * KIB)  # and reuses the bytes
            return view
        monkeypatch.setattr(ShmRingBuffer, "payload_view", freed_meanwhile)
        with pytest.raises(StaleHandle, match="freed while it was read"):
            read_photo(ref)


@pytest.mark.parametrize("bad", [None, ["n", 1, 2], ["n", -1, 2, 3], [1, 2, 3, 4],
                                 ["n", True, 2, 3]])
def test_a_malformed_reference_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="photo reference"):
        read_photo(bad)


def test_a_reference_with_a_wrong_size_or_a_gone_outbox_is_refused(name: str) -> None:
    with PhotoOutbox(name) as outbox:
        ref = outbox.put(b"z" * 100)
        assert ref is not None
        with pytest.raises(CorruptObject):
            read_photo([ref[0], ref[1], ref[2], 99])
        with pytest.raises(CorruptObject):
            read_photo([ref[0], ref[1] + 1, ref[2], 100])  # not a chunk address
    _photos._ATTACHED.clear()
    with pytest.raises(SegmentNotFound):
        read_photo(ref)


def test_the_pool_reads_a_photo_in_place_and_frees_it_when_the_outcome_comes(
        name: str) -> None:
    payload = bytes(range(256)) * 40
    with hosted(name) as writer:
        pool = MissPool(STORES[name], Processor(TOY), workers=1)
        node = NodePool(pool=pool, outbox=PhotoOutbox(name))
        try:
            wait_for(lambda: pool.stats().ready == 1, READY_S, "the worker")
            future, waited = node.send("k", {"n": 1}, payload)
            assert future.result(READY_S) == STORED and not waited
            wait_for(lambda: node.outbox.outstanding == 0, READY_S,  # type: ignore[union-attr]
                     "the photo's chunk to be freed")
            handout = writer.hand_out_cached(["k"])[0]
            with ObjectStore.attach(name, reader=0) as reader:
                assert bytes(reader.get(handout.handle)["data"] ^ 0xFF) == payload
            assert node.photos_inline == 0
        finally:
            node.close()


def test_many_photos_at_once_from_threads_each_read_as_sent(name: str) -> None:
    with hosted(name, capacity_bytes=4096 * KIB) as writer:
        pool = MissPool(STORES[name], Processor(TOY), workers=2, max_waiting=64)
        node = NodePool(pool=pool, outbox=PhotoOutbox(name, capacity_bytes=256 * KIB))
        try:
            wait_for(lambda: pool.stats().ready == 2, READY_S, "the workers")
            results: dict[int, Any] = {}

            def send(i: int) -> None:
                results[i] = node.send(f"k{i}", {"n": i}, bytes([i]) * (3 * KIB + i))[0]
            threads = [threading.Thread(target=send, args=(i,)) for i in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            outcomes = {i: f.result(READY_S) for i, f in results.items()}
            with ObjectStore.attach(name, reader=0) as reader:
                for i, outcome in outcomes.items():
                    if outcome == STORED:
                        got = reader.get(writer.hand_out_cached([f"k{i}"])[0].handle)
                        assert bytes(got["data"] ^ 0xFF) == bytes([i]) * (3 * KIB + i)
            assert sum(o == STORED for o in outcomes.values()) >= 1
            wait_for(lambda: node.outbox.outstanding == 0, READY_S,  # type: ignore[union-attr]
                     "every chunk freed")
        finally:
            node.close()


def test_another_api_servers_photo_crosses_by_its_own_outbox(name: str) -> None:
    """From a client of the node's pool: the message carries the reference; the worker reads
    the client's outbox (the photo never crosses the pool's socket)."""
    from shmstore.serving import _pool_share as share
    from shmstore.serving._pool_share import PoolClient, PoolHost

    photo = b"p" * (share.MAX_ANSWER_BYTES * 40)
    with hosted(name) as writer:
        pool = MissPool(STORES[name], Processor(TOY), workers=1)
        host = PoolHost(pool, name, writer.epoch)
        client = NodePool(client=PoolClient(name), outbox=PhotoOutbox(name))
        sent: list[Any] = []
        original = share.send_frame

        def counting(sock: Any, obj: Any, **kw: Any) -> None:
            sent.append(len(repr(obj)))
            original(sock, obj, **kw)
        try:
            wait_for(lambda: pool.stats().ready == 1, READY_S, "the worker")
            share.send_frame = counting  # type: ignore[assignment]
            assert client.send("c", {"n": 1}, photo)[0].result(READY_S) == STORED
            assert max(sent) < 1024  # bytes, not the photo's 40 KiB
            wait_for(lambda: client.outbox.outstanding == 0, READY_S,  # type: ignore[union-attr]
                     "the chunk to be freed")
        finally:
            share.send_frame = original  # type: ignore[assignment]
            client.close()
            host.close()
            pool.close()
