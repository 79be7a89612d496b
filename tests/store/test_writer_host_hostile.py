"""The writer host and its clients against other users, fork, big bursts and bad arguments:
each test fails on a host that trusts what it should not (issue items in docs/reliability.md)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shmstore.handle import HANDOUT_WORDS
from shmstore.store import _wire
from shmstore.store._host import WriterHost, host_address
from shmstore.store._remote import RemoteWriter
from tests._names import (
    Closed,
    InvalidArgument,
    KeyExists,
    ObjectStore,
    ObjectTooLarge,
    ReaderIndexError,
    StaleHandle,
    StoreFull,
    WrongProcess,
)
from tests.conftest import new_name

KIB = 1024
NOBODY = 65534
SPAWN = multiprocessing.get_context("spawn")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hosted(name: str):
    writer = ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1,
                                max_object_bytes=64 * KIB)
    host = WriterHost(writer, threading.RLock())
    client = RemoteWriter(name, connect_timeout_s=5)
    yield writer, host, client
    client.close()
    host.close()
    writer.close()


def blob(i: int, nbytes: int = 40 * KIB) -> np.ndarray:
    return np.full(nbytes, i % 256, dtype=np.uint8)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_1_another_user_cannot_take_the_hosts_socket_name_first(name: str) -> None:
    """Another user who binds every name it can know of first (the one 0.2 used, and what it
    can read of the segment) does not keep the owner's host from starting."""
    with ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1) as writer:
        bound: list[socket.socket] = []  # the squatted name stays bound while the child lives

        def squat() -> str:
            """Bind the owner's old, predictable name, then try to read the epoch the new
            name derives from."""
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(f"\0shmstore.writer.0.{name}")
            sock.listen(1)
            bound.append(sock)
            try:
                open(f"/dev/shm/{name}", "rb").read(64)
                return "read the segment"
            except PermissionError:
                return "no epoch"

        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: squats, reports, then waits
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = squat()
            except BaseException as exc:
                out = f"raised {exc!r}"
            os.write(write, out.encode())
            os.close(write)
            time.sleep(30)
            os._exit(0)
        os.close(write)
        try:
            assert os.read(read, 200) == b"no epoch"
            host = WriterHost(writer, threading.RLock())  # starts: its name is not the squatted one
            try:
                with RemoteWriter(name, connect_timeout_s=5) as client:
                    assert writer.unread(client.put("k", blob(1))) == (1,)
            finally:
                host.close()
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)


def test_2_a_forked_child_cannot_use_its_parents_remote_writer(hosted) -> None:
    writer, _, client = hosted
    a, b = client.hand_out_new("a", blob(1)), client.hand_out_new("b", blob(2))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        out = b"no error"
        try:
            client.cached(["a"])
        except WrongProcess:
            out = b"WrongProcess"
        os.write(write, out)
        os._exit(0)
    os.close(write)
    assert os.read(read, 64) == b"WrongProcess"
    os.close(read)
    os.waitpid(pid, 0)
    for _ in range(200):  # the parent's replies are its own
        assert client.issued("a", a) and client.issued("b", b) and not client.issued("a", b)


def lend_fork_and_wait(name: str, nbytes: int, ready, how: str) -> None:
    """A client that borrows a chunk, leaves a child holding its socket (a fork, or another
    process given the descriptor) and waits to be killed."""
    client = RemoteWriter(name, connect_timeout_s=10)
    client._call("begin", "lent", nbytes, 0)
    if how == "fork":
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: go with the parent
            time.sleep(60)
            os._exit(0)
    else:
        fd = client._sock.fileno()
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=[fd])
    ready.set()
    time.sleep(60)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "descriptor passed on"])
def test_2_a_client_killed_while_a_child_holds_its_socket_gives_its_loan_back(
        name: str, how: str) -> None:
    writer = ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1,
                                max_object_bytes=200 * KIB)
    host = WriterHost(writer, threading.RLock())
    client = RemoteWriter(name, connect_timeout_s=5)
    ready = SPAWN.Event()
    proc = SPAWN.Process(target=lend_fork_and_wait, args=(writer.name, 200 * KIB, ready, how))
    proc.start()
    try:
        assert ready.wait(30)
        with pytest.raises(StoreFull):
            client.put("x", blob(1, 100 * KIB))  # the loan holds most of the ring
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        deadline = time.monotonic() + 10
        while True:
            try:
                handle = client.put("x", blob(1, 60 * KIB))
                break
            except StoreFull:
                assert time.monotonic() < deadline, "the dead client's loan was never taken back"
                time.sleep(0.1)
        assert writer.unread(handle) == (1,)
    finally:
        subprocess.run(["pkill", "-9", "-f", "import time; time.sleep(60)"], check=False)
        if proc.is_alive():
            proc.kill()
        client.close()
        host.close()
        writer.close()


def test_3_a_long_store_name_is_served(tmp_path) -> None:
    name = new_name("long") + "-" + "n" * (200 - len(new_name("long")) - 1)
    assert len(name) == 200
    with ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1) as writer:
        host = WriterHost(writer, threading.RLock())
        try:
            with RemoteWriter(name, connect_timeout_s=5) as client:
                assert writer.unread(client.put("k", blob(1))) == (1,)
            assert len(host_address(name, writer.epoch)) < 108
        finally:
            host.close()


def test_4_an_error_about_a_huge_key_is_answered_bounded(hosted) -> None:
    writer, _, client = hosted
    key = "k" * 300_000
    client.put(key, blob(1, 100))
    with pytest.raises(KeyExists) as info:
        client.put(key, blob(1, 100))
    assert info.value.key == key and len(str(info.value)) <= 4096
    assert client.is_cached(key)  # the connection lives


def test_5_errors_cross_with_their_attributes(hosted) -> None:
    writer, _, client = hosted
    with pytest.raises(ObjectTooLarge) as too_large:
        client.put("big", blob(1, 100 * KIB))
    assert too_large.value.max_object_bytes == 64 * KIB and too_large.value.object_bytes > 100 * KIB
    for i in range(5):
        client.put(f"k{i}", blob(i))  # nobody reads: the ring fills
    with pytest.raises(StoreFull) as full:
        for i in range(5, 20):
            client.put(f"k{i}", blob(i))
    assert full.value.lagging_readers == (0,) and full.value.capacity_bytes == writer.capacity_bytes
    with pytest.raises(KeyExists) as exists:
        client.put("k0", blob(0))
    assert exists.value.key == "k0"
    h = writer.handle_of("k0")
    writer.clear()
    with pytest.raises(StaleHandle) as stale:
        client.unread(h)
    assert stale.value.handle == h and stale.value.name == writer.name


def test_6_a_wrong_but_well_typed_argument_is_answered_not_dropped(hosted) -> None:
    writer, _, client = hosted
    made = client.hand_out_new("a", blob(1))
    h, n = made.handle, made.number
    with pytest.raises(ReaderIndexError):
        client.narrow(h, n, [-1])
    with pytest.raises(StaleHandle):
        client.give_back(h, -1)
    assert client.end_handouts([(h, [-1])]) == [True]  # an unknown number is ignored
    with pytest.raises(InvalidArgument):
        client._call("begin", "x", -5, 0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a peer sending its own frames
    sock.connect(host_address(writer.name, writer.epoch))
    sock.settimeout(5)
    try:
        _wire.send_frame(sock, ["unread", [h.address, h.seq, h.key_digest, -1]])
        assert _wire.recv_frame(sock)[:2] == [1, "InvalidHandle"]  # answered, not dropped
        _wire.send_frame(sock, ["len"])
        assert _wire.recv_frame(sock) == [0, 1]
        for bad in (made._replace(number=n + 1),  # a number not made yet
                    made._replace(object_id=b"x" * 24),  # another object's id
                    made._replace(number=0)):  # a number never made
            _wire.send_frame(sock, ["issued", "a", [list(bad.to_words()), None]])
            assert _wire.recv_frame(sock) == [0, False]  # answered: not issued
        words = list(made.to_words())
        words[HANDOUT_WORDS.index("number")] = -1  # well typed, out of every word's range
        _wire.send_frame(sock, ["issued", "a", [words, None]])
        assert _wire.recv_frame(sock)[:2] == [1, "InvalidHandle"]  # answered, not dropped
        _wire.send_frame(sock, ["issued", "a", [list(made.to_words()), None]])
        assert _wire.recv_frame(sock) == [0, True]
    finally:
        sock.close()
    assert client.is_cached("a") and writer.unread(h) == (1,)


def test_7_a_burst_of_ended_hand_outs_goes_in_frames_the_host_takes(hosted) -> None:
    writer, _, client = hosted
    h = client.put("a", blob(1, 100))
    for _ in range(3):
        last = client.hand_out(h)
    groups = [(h, [last.number])] * 30_000  # 30,000 groups: above one frame's worth
    assert client.end_handouts(groups) == [True] * 30_000
    assert client.is_cached("a")


def host_main(name: str, ready) -> None:
    writer = ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1)
    WriterHost(writer, threading.RLock())
    ready.set()
    time.sleep(60)


def mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm/{name}" in line for line in maps)


@pytest.mark.slow
def test_an_idle_remote_writer_unmaps_the_store_once_its_host_is_gone(name: str) -> None:
    """The writer's process dies and its segment is removed (vLLM's exit hook, or shmstore gc):
    an API server that makes no call meanwhile must not keep the deleted segment mapped."""
    from shmstore.shm._segment import Segment

    ready = SPAWN.Event()
    proc = SPAWN.Process(target=host_main, args=(name, ready))
    proc.start()
    try:
        assert ready.wait(30)
        client = RemoteWriter(name, connect_timeout_s=10)
        assert mapped(name) and not client.closed
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        Segment.remove_stale(name)  # unless the writer's tracker removed it first
        assert not os.path.exists(f"/dev/shm/{name}")
        deadline = time.monotonic() + 10
        while mapped(name) or not client.closed:
            assert time.monotonic() < deadline, "the idle client still maps the deleted store"
            time.sleep(0.05)
        client.close()  # idempotent
    finally:
        if proc.is_alive():
            proc.kill()
        Segment.remove_stale(name)


def test_descriptors_above_1024_are_served(name: str) -> None:
    """A server process (vLLM's API server with its HTTP connections) may hold more than 1024
    descriptors: the host's and the client's waits use poll, which select cannot replace."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine allows {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1) as writer:
            host = WriterHost(writer, threading.RLock())
            try:
                with RemoteWriter(name, connect_timeout_s=5) as client:
                    assert client._sock.fileno() > 1024
                    for i in range(3):  # lent, written, committed: the host waits on poll
                        assert writer.unread(client.put(f"k{i}", blob(i))) == (1,)
            finally:
                host.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_bytes_a_host_sends_unasked_are_never_taken_for_a_reply(name: str) -> None:
    """A host never speaks first. One that does (not a host of this version) must close the
    client at its next call: its bytes would otherwise be read as that call's reply (here a
    `cached` answer of True for a key nobody stored). The watcher does not wake on bytes, so
    the call itself looks before it asks."""
    from shmstore.local._service import readable

    writer = ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=1)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    accepted: list[socket.socket] = []
    try:
        server.bind(host_address(name, writer.epoch))
        server.listen(1)

        def fake_host() -> None:
            conn, _ = server.accept()
            accepted.append(conn)
            assert _wire.recv_frame(conn)[0] == "hello"
            _wire.send_frame(conn, [0, [_wire.PROTOCOL, name, 1, 64 * KIB]])
            _wire.send_frame(conn, [0, [True]])  # unasked
        thread = threading.Thread(target=fake_host, daemon=True)
        thread.start()
        client = RemoteWriter(name, connect_timeout_s=10)
        thread.join(10)
        assert readable(client._sock, 10), "the fake host's stray reply never arrived"
        with pytest.raises(Closed, match="no call asked for"):
            client.cached(["nobody stored this"])
        assert client.closed
        client.close()  # idempotent
    finally:
        server.close()
        for conn in accepted:
            conn.close()
        writer.close()
