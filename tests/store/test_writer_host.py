"""WriterHost / RemoteWriter: a store written from several processes, and hostile clients."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import struct
import threading
import time
from typing import Any

import msgpack
import numpy as np
import pytest

from shmstore.handle import HANDOUT_WORDS, HandOut
from shmstore.local import _service as service
from shmstore.store import _wire
from shmstore.store._host import WriterHost, host_address
from shmstore.store._remote import RemoteWriter
from tests._names import (
    Closed,
    InvalidArgument,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    ObjectStore,
    ObjectTooLarge,
    ReaderIndexError,
    StaleHandle,
    StoreFull,
)
from tests._waiting import wait_for

KIB = 1024


@pytest.fixture
def hosted(name: str):
    writer = ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=2,
                                max_object_bytes=64 * KIB)
    lock = threading.RLock()
    host = WriterHost(writer, lock)
    readers = [ObjectStore.attach(name, reader=i) for i in range(2)]
    client = RemoteWriter(name, connect_timeout_s=5)
    yield writer, host, client, readers, lock
    client.close()
    for r in readers:
        r.close()
    host.close()
    writer.close()


def blob(i: int, nbytes: int = 40 * KIB) -> np.ndarray:
    return np.full(nbytes, i % 256, dtype=np.uint8)


def test_remote_put_is_one_store_for_both_writers(hosted) -> None:
    writer, _, client, readers, lock = hosted
    made = client.hand_out_new("a", {"x": blob(1)})
    handle = made.handle
    assert made.number == writer.handout_seq == 1
    assert writer.is_cached("a") and client.is_cached("a") and client.cached(["a", "b"]) == [True, False]
    assert writer.handle_of("a") == handle and made.object_id == writer.object_id("a")
    with lock:
        again = writer.get_cached("a")  # a hit of the host's own thread
    assert again == handle and client.get_cached("a") == handle and writer.handout_seq == 3
    assert client.issued("a", made) and not client.issued("b", made)
    for never in (0, -1, 1 << 40):  # answered as the writer answers, through the words
        with lock:
            assert not writer.issued("a", made._replace(number=never))
        assert not client.issued("a", made._replace(number=never))
    with pytest.raises(InvalidArgument):  # the caller's mistake, refused before it is sent
        client.issued("a", made._replace(number=1.5))
    for r in readers:
        for _ in range(3):
            np.testing.assert_array_equal(r.get(handle)["x"], blob(1))
    assert writer.unread(handle) == client.unread(handle) == (0, 0)
    with pytest.raises(KeyExists):
        client.put("a", {"x": blob(2)})
    with pytest.raises(KeyNotCached):
        client.get_cached("missing")
    with pytest.raises(ObjectTooLarge):
        client.put("big", blob(0, 100 * KIB))
    with pytest.raises(InvalidKey):
        client.is_cached("")
    with pytest.raises(InvalidArgument, match="timeout=0"):
        client.put("b", blob(1), timeout=1)
    assert len(client) == len(writer) == 1
    client.clear()
    assert not writer.is_cached("a")
    with pytest.raises(StaleHandle):
        readers[0].get(handle)


def test_an_object_goes_only_when_every_writer_ended_its_hand_outs(hosted) -> None:
    """Each writer ends its own hand-outs; a full store withdraws an owed object only once
    every hand-out of it is over."""
    writer, _, client, readers, lock = hosted
    mine = client.hand_out_new("a", blob(1))
    handle = mine.handle
    with lock:
        theirs = writer.hand_out_cached(["a"])[0]
    handles = [client.put(f"k{i}", blob(i)) for i in range(1, 6)]  # six fit
    for h in handles:
        for r in readers:
            r.get(h)
    assert client.end_handouts([(handle, [mine.number])]) == [True]  # still owed reads
    with pytest.raises(StoreFull, match="still owed"):  # the host's hand-out is not over
        client.put("more", blob(9))
    with lock:
        assert writer.end_handouts([(handle, [theirs.number, 999])]) == [True]  # 999: ignored
    more = client.put("more", blob(9))  # withdrawn to make room
    assert not writer.is_cached("a") and writer.stats().withdrawn == 1
    with pytest.raises(StaleHandle):
        client.unread(handle)
    assert client.end_handouts([(handle, [1]), (more, [])]) == [False, True]  # gone; owed


def test_give_back_by_number_and_narrowed_hand_outs(hosted) -> None:
    writer, _, client, readers, _ = hosted
    made = client.hand_out_new("a", blob(1))
    handle, put = made.handle, made.number
    second = client.hand_out(handle).number
    assert second == put + 1 and client.hand_out(handle).object_id == made.object_id
    client.give_back(handle, second + 1)
    client.narrow(handle, put, [0])  # the put goes to reader 0 only
    assert client.unread(handle) == (2, 1)
    client.give_back(handle, put)
    assert client.unread(handle) == (1, 1)
    with pytest.raises(StaleHandle, match="no hand-out number"):
        client.give_back(handle, put)
    with pytest.raises(ReaderIndexError):
        client.narrow(handle, second, [2])
    client.narrow(handle, second, [1])
    assert client.unread(handle) == (0, 1)
    readers[1].get(handle)
    assert writer.unread(handle) == (0, 0)


def test_store_full_crosses_as_store_full(hosted) -> None:
    _, _, client, _, _ = hosted
    handles = [client.put(f"k{i}", blob(i)) for i in range(6)]  # six fit
    with pytest.raises(StoreFull, match="still owed"):
        client.put("more", blob(9))
    assert client.unread(handles[0]) == (1, 1)  # the failed put changed nothing


def _begin_and_die(name: str) -> None:
    client = RemoteWriter(name, connect_timeout_s=5)
    client._call("begin", "orphan", 40 * KIB + 200, 0)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_client_killed_while_writing_gives_its_chunk_back(hosted, name: str) -> None:
    writer, _, client, readers, _ = hosted
    proc = multiprocessing.get_context("spawn").Process(target=_begin_and_die, args=(name,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    # the ring goes round several times: the lent chunk must not stay in the way
    for i in range(20):
        deadline = time.monotonic() + 5
        while True:
            try:
                handle = client.put(f"k{i}", blob(i))
                break
            except StoreFull:
                assert time.monotonic() < deadline, "the dead client's chunk was never freed"
                time.sleep(0.05)
        for r in readers:
            np.testing.assert_array_equal(r.get(handle), blob(i))
    assert not writer.is_cached("orphan")


def _raw(writer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(host_address(writer.name, writer.epoch))
    sock.settimeout(5)
    return sock


def test_store_caches_an_object_no_reader_owes_on_either_writer(hosted) -> None:
    writer, _, client, readers, _ = hosted
    handle = client.store("u", blob(5))
    assert writer.unread(handle) == (0, 0) and client.is_cached("u")
    assert writer.get_cached("u") == handle
    with pytest.raises(KeyExists):
        client.store("u", blob(6))
    with pytest.raises(ObjectTooLarge):
        client.store("huge", blob(7, 128 * KIB))
    assert readers[1].get(handle)[0] == 5
    local = writer.store("v", blob(8))  # the writer's own: the same verb, the same meaning
    assert writer.unread(local) == (0, 0) and client.is_cached("v")
    with pytest.raises(KeyExists):
        writer.store("v", blob(9))


def test_hand_out_cached_takes_every_hit_in_one_call(hosted) -> None:
    writer, _, client, readers, lock = hosted
    a, b = client.put("a", blob(1)), client.put("b", blob(2))
    with pytest.raises(InvalidKey):  # checked before anything is handed out
        client._call("hand_out_cached", ["a", ""], None)
    with pytest.raises(InvalidKey):  # the client checks every key before the first batch
        client.hand_out_cached(["a"] * (_wire.MAX_KEYS + 1) + [""])
    assert writer.unread(a) == writer.unread(b) == (1, 1)
    found = client.hand_out_cached(["b", "missing", "a"])
    assert found[1] is None
    assert [f.handle for f in found if f] == [b, a]
    assert [f.number for f in found if f] == [3, 4] and writer.handout_seq == 4
    assert found[2].object_id == writer.object_id("a")
    assert writer.unread(a) == writer.unread(b) == (2, 2)
    client.give_back(a, 4)
    client.give_back(b, 3)
    for r in readers:
        r.get(a), r.get(b)
    assert writer.unread(a) == writer.unread(b) == (0, 0)
    many = client.hand_out_cached(["a", "missing"] * _wire.MAX_KEYS + ["b"])  # in 3 batches
    assert [f.number for f in many if f] == list(range(5, 5 + _wire.MAX_KEYS + 1))
    assert many[1] is None and many[-1].handle == b
    assert writer.unread(a) == (_wire.MAX_KEYS,) * 2 and writer.unread(b) == (1, 1)


def test_posted_calls_run_in_order_and_fail_quietly(hosted, caplog) -> None:
    writer, host, client, readers, _ = hosted
    made = client.hand_out_new("a", blob(1))
    handle, put = made.handle, made.number
    again = client.hand_out(handle)
    client.narrow(handle, put, [0], wait=False)  # no reply waited for
    assert client.unread(handle) == (2, 1)  # but run before the next call
    client.give_back(handle, put, wait=False)
    client.give_back(handle, put, wait=False)  # a second time: stale, logged at debug only
    assert client.unread(handle) == (1, 1) and host.post_errors == 0
    sock = _raw(writer)  # a client that does not check what it posts: no such reader
    frame = msgpack.packb(["post", "narrow", _wire.handle_to_wire(handle), again.number, [5]])
    sock.sendall(struct.pack("<I", len(frame)) + frame)
    wait_for(lambda: host.post_errors == 1, 30, "the host to count the failed post")
    assert client.is_cached("a")  # the connection goes on
    assert "posted narrow failed" in caplog.text
    # only give_back and narrow may be posted
    frame = msgpack.packb(["post", "clear", False])
    sock.sendall(struct.pack("<I", len(frame)) + frame)
    assert sock.recv(1 << 16) == b""  # dropped
    sock.close()
    assert len(writer) == 1


def test_a_request_over_the_frame_limit_is_refused_before_it_is_sent(hosted) -> None:
    _, _, client, _, _ = hosted
    with pytest.raises(InvalidArgument, match="frame limit"):
        client.is_cached("k" * _wire.MAX_FRAME_BYTES)
    client.put("a", blob(1))  # the connection is still in step
    keys = [f"key-{i}" for i in range(3 * _wire.MAX_KEYS)] + ["a"]
    assert client.cached(keys) == [False] * (len(keys) - 1) + [True]  # in several calls


@pytest.mark.parametrize("frame", [
    struct.pack("<I", 0),
    struct.pack("<I", _wire.MAX_FRAME_BYTES + 1),
    struct.pack("<I", 3) + b"\xc1\xc1\xc1",  # not msgpack
    struct.pack("<I", 1) + msgpack.packb(7),  # not a request
    b"".join([struct.pack("<I", len(b := msgpack.packb(["nope"]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["give_back", [1, 2], None]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["commit", 12345]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["commit_unowed", 12345]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["narrow", [64, 1, b"x" * 16], -1, []]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["narrow", [64, 1, b"x" * 16, 1], "1", []]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["len", 1]))), b]),
    # a hand-out asked about that is not [nine int words, None]
    b"".join([struct.pack("<I", len(b := msgpack.packb(["issued", "a", [[1] * 8, None]]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["issued", "a", [[1] * 10, None]]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["issued", "a", [[1] * 8 + ["1"], None]]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["issued", "a", [[1] * 9, b"r"]]))), b]),
    b"".join([struct.pack("<I", len(b := msgpack.packb(["issued", "a", [1] * 9]))), b]),
])
def test_a_hostile_frame_closes_that_connection_only(hosted, frame: bytes) -> None:
    writer, _, client, readers, _ = hosted
    sock = _raw(writer)
    sock.sendall(frame)
    assert sock.recv(1 << 16) == b""  # dropped
    sock.close()
    handle = client.put("after", blob(3))  # the others are still served
    assert readers[0].get(handle)[0] == 3


def test_bad_arguments_get_an_error_reply_not_a_drop(hosted) -> None:
    writer, _, client, _, _ = hosted
    handle = client.put("a", blob(1))
    forged = type(handle)(handle.address, handle.seq + 1, handle.key_digest, handle.epoch)
    with pytest.raises(StaleHandle):
        client.unread(forged)
    with pytest.raises(StaleHandle):
        client.hand_out(forged)
    assert client.is_cached("a")


@pytest.mark.parametrize("wait", [True, False])
@pytest.mark.parametrize(("readers", "number", "error"), [
    ([True], None, ReaderIndexError),  # a bool is no reader index, though True == 1
    ([5], None, ReaderIndexError),
    ([-1], None, ReaderIndexError),
    (["0"], None, ReaderIndexError),
    ([1.0], None, ReaderIndexError),
    ([0], True, InvalidArgument),
    ([0], "1", InvalidArgument),
    ([0], 1.0, InvalidArgument),
])
def test_bad_narrow_arguments_raise_as_the_local_writer_does_and_keep_the_connection(
        hosted, readers: list, number: Any, error: type, wait: bool) -> None:
    writer, host, client, _, _ = hosted
    made = client.hand_out_new("a", blob(1))
    handle, good = made.handle, made.number
    for who in (writer, client):
        with pytest.raises(error):
            if who is writer:
                writer.narrow(handle, good if number is None else number, readers)
            else:
                client.narrow(handle, good if number is None else number, readers, wait=wait)
    assert client.is_cached("a") and host.post_errors == 0  # refused before it was sent
    client.narrow(handle, good, [1])
    assert client.unread(handle) == (0, 1)


def test_another_user_is_refused(hosted, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    writer, host, _, _, _ = hosted
    # both sides read the peer's credentials through local/_service.py: the host sees another
    # user connect, and the client a host of another user
    monkeypatch.setattr(service, "peer", lambda sock: (os.getpid(), os.getuid() + 1))
    sock = _raw(writer)  # the host sees another user: closed before any request
    try:
        sock.sendall(struct.pack("<I", len(b := msgpack.packb(["hello"]))) + b)
        got = sock.recv(64)
    except (ConnectionResetError, BrokenPipeError):
        got = b""  # closed before the request was even sent or read
    assert got == b""  # no reply: closed
    sock.close()
    with pytest.raises(Closed, match="another user"):  # and a client refuses such a host
        RemoteWriter(name, connect_timeout_s=1)


def test_a_second_host_and_a_missing_host(hosted, name: str) -> None:
    writer, host, client, _, lock = hosted
    with pytest.raises(InvalidArgument, match="taken"):
        WriterHost(writer, lock)
    with pytest.raises(Closed, match="no process serves"):
        RemoteWriter(name + "-none", connect_timeout_s=0.2)
    host.close()
    with pytest.raises(Closed):
        client.is_cached("a")
    assert client.closed
    with pytest.raises(Closed):
        client.is_cached("a")


def _structure_byte(writer: ObjectStore, key: str) -> memoryview:
    """The object's payload from its body on, in shared memory (the writer's view)."""
    entry = writer._index.by_key[key]
    return writer._writer_ring.payload(entry.chunk)[writer._header_bytes:]


@pytest.mark.parametrize("side", ["local", "remote"])
def test_hand_out_cached_with_a_field_reads_a_record_beside_the_arrays(hosted, side) -> None:
    writer, _, client, readers, lock = hosted
    store = client if side == "remote" else writer
    with lock:
        a = writer.put("a", {"x": blob(1), "rec": b"\x01record"})
        b = writer.put("b", {"x": blob(2)})  # no record
        c = writer.put("c", {"x": blob(3), "rec": b"r" * (_wire.MAX_PEEK_BYTES + 1)})
        d = writer.put("d", [b"not a map"])
        e = writer.put("e", {"x": blob(5), "rec": "a str, not bytes"})
    with lock if side == "local" else contextlib.nullcontext():
        found = store.hand_out_cached(["a", "missing", "b", "c", "d", "e"], "rec")
    assert found[1] is None
    assert [(f.handle, f.record) for f in found if f] == [
        (a, b"\x01record"), (b, None), (c, None), (d, None), (e, None)]
    numbers = [f.number for f in found if f]
    assert numbers == list(range(6, 11)) and writer.handout_seq == 10
    assert writer.unread(a) == (2, 2)  # handed out, as hand_out_cached does
    with lock if side == "local" else contextlib.nullcontext():
        for handle, number in zip((a, b, c, d, e), numbers):
            store.give_back(handle, number)
    with pytest.raises(InvalidArgument, match="field"):
        store.hand_out_cached(["a"], "")
    with pytest.raises(InvalidArgument, match="field"):
        store.hand_out_cached(["a"], "f" * 65)
    with pytest.raises(InvalidKey):
        store.hand_out_cached(["a", ""], "rec")
    assert writer.unread(a) == (1, 1)  # nothing handed out by the refused calls
    for r in readers:
        assert r.get(a)["rec"] == b"\x01record"


def test_a_peeked_hand_out_is_never_made_of_an_object_whose_structure_is_damaged(hosted) -> None:
    writer, _, client, readers, lock = hosted
    with lock:
        a = writer.put("a", {"x": blob(1), "rec": b"record"})
    body = _structure_byte(writer, "a")
    at = bytes(body[:200]).index(b"record")
    for where in (at, 20):  # the record's bytes; the buffer table
        body[where] ^= 0xFF
        assert client.hand_out_cached(["a"], "rec") == [None]  # the CRC says damaged
        assert writer.unread(a) == (1, 1)  # no hand-out made
        body[where] ^= 0xFF
    assert client.hand_out_cached(["a"], "rec")[0].record == b"record"


def test_a_host_sending_a_bad_hand_out_reply_closes_the_client(hosted, monkeypatch) -> None:
    writer, _, client, _, lock = hosted
    with lock:
        handle = writer.put("a", {"rec": b"x"})
    words = list(HandOut(handle, 2, writer.object_id("a")).to_words())
    number_at = HANDOUT_WORDS.index("number")

    def said(at: int, word: object) -> list[object]:
        return [*words[:at], word, *words[at + 1:]]

    for reply in ([[words, "a str"]],  # a record that is not bytes
                  [[words, b"r" * (_wire.MAX_PEEK_BYTES + 1)]],  # too long
                  [[words]],  # too short
                  [[words, None, None]],  # too long a hand-out
                  [[said(number_at, 0), None]],  # no hand-out has number 0
                  [[said(number_at, True), None]],  # a number that is not an int
                  [[said(number_at, 1 << 64), None]],  # a word out of range
                  [[said(0, -1), None]],  # an address out of range
                  [[words[:-1], None]],  # an object id of the wrong size
                  [[[*words, 0], None]],  # a word too many
                  [None, None]):  # two answers to one key
        monkeypatch.setattr(client, "_call", lambda *a, r=reply: r)
        with pytest.raises(Closed, match="malformed"):
            client.hand_out_cached(["a"], "rec")
        monkeypatch.undo()
        client = RemoteWriter(writer.name, connect_timeout_s=5)
    client.close()


def test_a_remote_writer_waiting_for_a_host_says_so(name: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A store without a host: the wait once went 30 s in silence before 'connection refused'."""
    from shmstore import ObjectStore

    with ObjectStore.create(name, capacity_bytes=1 << 16, n_readers=1):
        with caplog.at_level("WARNING", logger="shmstore"), pytest.raises(Closed):
            RemoteWriter(name, connect_timeout_s=1.5)
    assert any("must run a WriterHost" in r.getMessage() for r in caplog.records)


def test_attaching_a_channels_name_as_a_store_names_the_channel(name: str) -> None:
    from shmstore import Channel, ObjectStore
    from shmstore.errors import SegmentNotFound

    with Channel.create(name, n_readers=1, capacity_bytes=1 << 16):
        with pytest.raises(SegmentNotFound, match=r"is a Channel .*Channel.attach"):
            ObjectStore.attach(name, reader=0)


def test_a_client_that_connects_while_the_host_is_being_made_is_answered(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's socket listens before WriterHost's constructor has returned: a client that
    connects in that moment (another API server polling for the host, on a loaded machine)
    is answered once the host is made, never dropped as if the host were closing (before:
    ConnectionResetError, every time)."""
    early: list[socket.socket] = []

    class ConnectedToBeforeItReturns(service.SameUserServer):
        def __init__(self, address: str, serve: Any, **kw: Any) -> None:
            super().__init__(address, serve, **kw)
            sock = service.connect(address, what="the host", timeout_s=10)
            _wire.send_frame(sock, _wire.request("hello"))
            early.append(sock)
            # a server that serves already answers (or drops) it now, while its owner is still
            # being made; one that waits for its owner leaves it queued (up to 2 s here)
            service.readable(sock, 2.0)

    monkeypatch.setattr("shmstore.store._host.SameUserServer", ConnectedToBeforeItReturns)
    with ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1) as writer:
        host = WriterHost(writer, threading.RLock())
        (sock,) = early
        try:
            answer = _wire.recv_frame(sock)
            assert isinstance(answer, list) and answer[0] == 0, answer
            assert answer[1][0] == _wire.PROTOCOL
        finally:
            sock.close()
            host.close()


def test_a_same_user_server_started_twice_accepts_on_one_thread(tmp_path: Any) -> None:
    """start() is idempotent: a second call starts no second accepting thread (two would race
    on the count of clients), and the server serves as before."""
    address = str(tmp_path / "twice.sock")
    served: list[int] = []

    def serve(sock: socket.socket, pid: int) -> None:
        served.append(pid)
        sock.close()

    server = service.SameUserServer(address, serve, what="a test service", name="twice",
                                    max_clients=4)
    try:
        server.start()
        server.start()
        accepting = [t for t in threading.enumerate() if t.name == "shmstore-serve-twice"]
        assert len(accepting) == 1
        with service.connect(address, what="the test service", timeout_s=10):
            wait_for(lambda: served == [os.getpid()], 10, "the connection served")
    finally:
        server.close()


def test_the_watch_on_a_connection_wakes_for_a_hang_up_and_not_for_bytes() -> None:
    """A RemoteWriter's watcher waits on its socket for the host's death; bytes arriving (every
    reply) must not wake it (each wake costs the client a thread switch per call), a hang-up
    must, and so must this end's own shutdown (how close() ends the watcher)."""
    for how in ("peer closes", "own shutdown"):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        woke = threading.Event()

        def watch(sock: socket.socket = ours, woke: threading.Event = woke) -> None:
            service.wait_hang_up(sock)
            woke.set()
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        theirs.sendall(b"a reply")
        assert ours.recv(16, socket.MSG_PEEK) == b"a reply"  # arrived
        # nothing may happen: load can hide a wake from one run, never invent one
        assert not woke.wait(0.2), "bytes woke the watcher"
        if how == "peer closes":
            theirs.close()
        else:
            ours.shutdown(socket.SHUT_RDWR)
        assert woke.wait(10), f"the watcher slept through: {how}"
        thread.join(10)
        ours.close()
        theirs.close()
