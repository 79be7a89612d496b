"""The engine-neutral serving core, driven as a second engine's adapter would drive it, with no
vLLM: a sender's misses, hits and touches, the request ledger settling what ended requests
left, a worker's receiver counting each hand-out once per request, open_writer's roles for
two API servers, and open_pool's for the node's miss pool. CI runs this folder with vLLM made
unimportable too (SHMSTORE_TEST_WITHOUT_VLLM=1: tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from shmstore.errors import InvalidArgument
from shmstore.serving._deployment import NodePool, Shape, open_pool, open_writer
from shmstore.serving._outcome import STORED, Processor
from shmstore.serving._receiver import Receiver, Unreadable
from shmstore.serving._sender import PRUNE_BESIDE, Beside, Queries, Sender
from tests._names import ObjectStore
from tests._waiting import wait_for
from tests.serving.test_pool import READY_S, TOY

KIB = 1024


def shape(name: str, **changes: Any) -> Shape:
    base = Shape(name=name, capacity_bytes=256 * KIB, max_object_bytes=64 * KIB, policy="fifo",
                 api_servers=1, api_rank=0, engines=1, engine=0, per_engine=2, nodes=1,
                 node_rank=0, settle_s=0.0, lease_s=60.0, wait_s=1.0, publish="", keys_file="",
                 allow=(), insecure=False, pool_workers=0)
    return dataclasses.replace(base, **changes)


def no_head(make: Any) -> Any:
    raise AssertionError("no relay head on one node")


def value(n: int) -> dict[str, Any]:
    return {"pixel_values": np.full(64, n, np.float32)}


def test_the_core_imports_without_vllm() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import shmstore.serving._deployment, shmstore.serving._sender, "
            "shmstore.serving._receiver, shmstore.serving._requests, shmstore.serving._nodes\n"
            "assert not any(m.startswith('vllm') and sys.modules[m] for m in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_miss_then_hits_each_read_once_per_request_and_unread_ones_settled(
        name: str) -> None:
    lock = threading.RLock()
    writers = open_writer(shape(name), lock, no_head)
    assert writers.local is not None and writers.host is None  # one API server: no host
    sender = Sender(writers.store, lock, settle_s=0.0, lease_s=60.0)
    receivers = [Receiver(lambda r=r: ObjectStore.attach(name, reader=r)) for r in (0, 1)]
    try:
        assert sender.hit("k", cached_here=False) is None  # a miss
        made = sender.store_miss("k", value(1))
        assert made is not None
        sent = sender.deliver(made, "k", has_data=True)
        assert sent is not None
        sender.ledger.request_added("r1", [sent.number])
        for receiver in receivers:  # a worker reads it, the engine sends it again: once
            for _ in range(2):
                np.testing.assert_array_equal(receiver.read(sent, "k", "r1")["pixel_values"],
                                              value(1)["pixel_values"])
        assert writers.store.unread(sent.handle) == (0, 0)
        sender.ledger.request_ended("r1", aborted=False)

        hit = sender.hit("k", cached_here=True)  # a hit: a hand-out of its own
        assert hit is not None and hit.number != sent.number
        hit = sender.deliver(hit, "k", has_data=False)
        assert hit is not None
        sender.ledger.request_added("r2", [hit.number])
        sender.ledger.request_ended("r2", aborted=True)  # no worker read it
        assert writers.store.unread(hit.handle) == (1, 1)
        assert sender.ledger.settle(full=True)  # settle_s 0: over now, the store told
        # the object's two hand-outs are over together, one of them aborted and unread
        assert sender.ledger.settled["aborted"] == 2 and sender.ledger.live_requests == 0
        assert writers.store.withdraw(hit.handle)  # what nobody will read may go
        assert sender.items["stored"] == 1 and sender.items["hit"] == 1
        with pytest.raises(Unreadable):  # another item's handle is refused, not read
            receivers[0].read(sent, "other-key", "r3")
    finally:
        for receiver in receivers:
            receiver.close()
        sender.close()
        writers.close()


def test_open_writer_gives_the_second_api_server_the_first_ones_store(name: str) -> None:
    first_lock, second_lock = threading.RLock(), threading.RLock()
    first = open_writer(shape(name, api_servers=2), first_lock, no_head)
    try:
        assert first.local is not None and first.host is not None  # serves the other
        second = open_writer(shape(name, api_servers=2, api_rank=1), second_lock, no_head)
        try:
            assert second.local is None and second.role == "writes it through API server 0"
            a, b = Sender(first.store, first_lock, settle_s=0, lease_s=60), \
                Sender(second.store, second_lock, settle_s=0, lease_s=60)
            made = b.store_miss("photo", value(2))
            assert made is not None and a.hit("photo", cached_here=True) is not None
            assert first.local.stats().puts == 1  # one copy on the node
            a.close()
            b.close()
        finally:
            second.close()
    finally:
        first.close()


def test_store_or_share_hands_out_what_another_api_server_stored_meanwhile(name: str) -> None:
    first_lock, second_lock = threading.RLock(), threading.RLock()
    first = open_writer(shape(name, api_servers=2), first_lock, no_head)
    second = open_writer(shape(name, api_servers=2, api_rank=1), second_lock, no_head)
    a = Sender(first.store, first_lock, settle_s=0, lease_s=60)
    b = Sender(second.store, second_lock, settle_s=0, lease_s=60)
    try:
        mine = a.store_or_share("photo", value(3))
        theirs = b.store_or_share("photo", value(4))  # processed twice: the first copy stays
        assert mine is not None and theirs is not None and theirs.handle == mine.handle
        assert theirs.number != mine.number  # a hand-out of its own, owed by the readers
        assert (a.items["stored"], b.items["shared"], b.items["stored"]) == (1, 1, 0)
        assert first.local is not None and first.local.stats().puts == 1
        assert b.stored(["photo", "other"]) == [True, False]
        a.check_issued("photo", theirs)  # another API server's hand-out, by the same store
        with pytest.raises(InvalidArgument, match="did not issue"):  # not for this key
            b.check_issued("other", mine)
        with pytest.raises(InvalidArgument, match="did not issue"):  # not a hand-out it made
            b.check_issued("photo", mine._replace(number=mine.number + 1000))
    finally:
        a.close()
        b.close()
        second.close()
        first.close()


def test_beside_keeps_a_value_only_while_the_store_keeps_its_key(name: str) -> None:
    lock = threading.RLock()
    writers = open_writer(shape(name, capacity_bytes=64 * KIB, max_object_bytes=8 * KIB),
                          lock, no_head)
    sender = Sender(writers.store, lock, settle_s=0.0, lease_s=60.0)
    beside = Beside(writers.store)
    try:
        made = sender.store_miss("a", value(1))
        assert made is not None
        writers.store.give_back(made.handle, made.number)
        beside.add("a", "updates of a")
        assert beside.usable("a") and beside["a"] == "updates of a"
        assert not beside.usable("b")  # stored nowhere, kept nowhere
        beside["b"] = "kept without a store call"
        assert "b" in beside and not beside.usable("b")  # the store has no b: no hit
        beside.drop_if_gone("a")
        assert "a" in beside  # still stored
        writers.store.clear()
        beside.drop_if_gone("a")
        assert "a" not in beside
        beside.clear()
        assert "b" not in beside
        for i in range(PRUNE_BESIDE + 1):  # none of these is stored: the prune drops them
            beside.add(f"gone-{i}", i)
        assert not [i for i in range(PRUNE_BESIDE) if f"gone-{i}" in beside]
        assert f"gone-{PRUNE_BESIDE}" in beside  # added after the prune
    finally:
        sender.close()
        writers.close()


def test_queries_count_true_hits_and_deltas_since_the_last() -> None:
    q = Queries()
    for hit in (True, False, True):
        q.count(hit)
    assert (q.hits, q.total) == (2, 3) and q.delta() == (2, 3)
    q.count(False)
    assert q.delta() == (0, 1) and q.delta() == (0, 0)
    q.reset()
    assert (q.hits, q.total) == (0, 0) and q.delta() == (0, 0)


def test_a_shape_has_a_pool_only_with_workers_and_on_one_node(name: str) -> None:
    assert not shape(name).pooled
    assert shape(name, pool_workers=2).pooled
    assert not shape(name, pool_workers=2, nodes=2).pooled  # a TP group across nodes


def test_the_pools_question_stored_never_waits_on_a_thread_holding_the_writer(
        name: str) -> None:
    """Writers.stored (what the miss pool's dispatcher asks before each job) answers from the
    local writer under its lock, and "not known" (False) at once when another thread holds
    the lock: a caller that holds it while it waits for the pool never stalls the pool. A
    remote writer cannot answer it: InvalidArgument."""
    lock = threading.RLock()
    writers = open_writer(shape(name), lock, no_head)
    try:
        writers.store.put("k", value(1))
        assert writers.stored("k") and not writers.stored("other")
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with lock:
                held.set()
                release.wait(60)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(60)
            assert writers.stored("k") is False  # not known: the worker finds out
        finally:
            release.set()
            holder.join(60)
        assert writers.stored("k")
        remote = dataclasses.replace(writers, local=None)
        for ask in (lambda: remote.stored("k"), lambda: remote.epoch, remote.lending):
            with pytest.raises(InvalidArgument, match="through a miss pool; a remote writer"):
                ask()
    finally:
        writers.close()


def test_open_pool_decides_every_role(name: str) -> None:
    lock = threading.RLock()
    processor = Processor(TOY)
    assert open_pool(shape(name), None, processor) is None  # type: ignore[arg-type]
    one = shape(name, pool_workers=1)
    relay = shape(name, pool_workers=1, nodes=2)
    assert open_pool(relay, None, processor) is None  # type: ignore[arg-type]
    writers = open_writer(shape(name, api_servers=2, pool_workers=1), lock, no_head)
    owner: NodePool | None = None
    client: NodePool | None = None
    try:
        owner = open_pool(dataclasses.replace(one, api_servers=2), writers, processor)
        assert owner is not None and owner.pool is not None and owner.host is not None
        client = open_pool(dataclasses.replace(one, api_servers=2, api_rank=1),
                           dataclasses.replace(writers, local=None), processor)
        assert client is not None and client.pool is None and client.client is not None
        wait_for(lambda: owner.stats().ready == 1, READY_S, "the pool's worker")  # type: ignore[union-attr]
        assert client.submit("c", {"bytes": b"c"}).result(READY_S) == STORED
        assert owner.submit("o", {"bytes": b"o"}).result(READY_S) == STORED
        assert client.stats() is None and owner.stats().stored == 2  # type: ignore[union-attr]
    finally:
        for each in (client, owner):
            if each is not None:
                each.close()
        writers.close()


def test_a_pool_workers_chunk_is_lent_published_owed_by_no_one_or_given_back(name: str) -> None:
    """serving/_lending.py, as the pool's dispatcher calls it for a worker: a begin is lent a
    chunk or refused with the outcome the job ends with; a chunk whose job did not end
    stored, or whose worker went (close), goes back to the ring and is never published."""
    from shmstore.serde._codec import encode
    from shmstore.serving._lending import ANOTHER
    from shmstore.serving._outcome import Outcome

    writers = open_writer(shape(name, capacity_bytes=64 * KIB, max_object_bytes=16 * KIB),
                          threading.RLock(), no_head)
    store = writers.local
    assert store is not None and writers.name == name and writers.epoch == store.epoch
    try:
        lending = writers.lending()
        enc = encode(value(1))
        word, loan, offset = lending.begin("a", enc.nbytes, enc.structure_crc)
        assert word == "lent"
        enc.write_into(store._ring.segment.buf[offset:offset + enc.nbytes])
        assert lending.end(loan, STORED, "") == (STORED, "")
        handout = store.hand_out_cached(["a"])[0]
        assert handout is not None and store.unread(handout.handle) == (1, 1)  # ours only
        assert lending.begin("a", enc.nbytes, enc.structure_crc) == ["refused", "stored",
                                                                      ANOTHER]
        assert lending.begin("big", 32 * KIB, 0)[:2] == ["refused", "store_full"]
        for bad in ((b"k", 8, 0), ("k", -1, 0), ("k", 8, 1 << 32), ("k", 8.0, 0)):
            assert lending.begin(*bad) == ["refused", "failed", "a malformed begin"]
        _, failed, _ = lending.begin("f", enc.nbytes, enc.structure_crc)
        assert lending.end(failed, Outcome.FAILED, "why") == (Outcome.FAILED, "why")
        _, raced, _ = lending.begin("r", enc.nbytes, enc.structure_crc)
        store.put("r", value(2))  # another writer of the node, meanwhile
        assert lending.end(raced, STORED, "") == (STORED, ANOTHER)
        for _ in range(8):  # chunks of a worker that went: given back, the ring goes on
            lending.begin("gone", enc.nbytes, enc.structure_crc)
            lending.close()
        assert store.cached(["f", "gone"]) == [False, False]
        assert store.stats().objects == 2
        store.put("after", value(3))
    finally:
        writers.close()


def test_one_api_server_with_a_pool_serves_its_store_to_no_one(name: str) -> None:
    """The pool's workers write through their own pipes (serving/_lending.py): one API server
    with a pool starts no store host (no socket, no thread per worker), and its pool stores."""
    one = shape(name, pool_workers=1)
    writers = open_writer(one, threading.RLock(), no_head)
    node: NodePool | None = None
    try:
        assert writers.host is None
        node = open_pool(one, writers, Processor(TOY))
        assert node is not None and node.pool is not None and node.host is None
        wait_for(lambda: node.stats().ready == 1, READY_S, "the pool's worker")  # type: ignore[union-attr]
        assert node.submit("k", {"bytes": b"k"}).result(READY_S) == STORED
        assert writers.local is not None and writers.local.cached(["k"]) == [True]
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("shmstore-serve") and name in t.name]
    finally:
        if node is not None:
            node.close()
        writers.close()
