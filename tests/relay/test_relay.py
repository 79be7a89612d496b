"""The relay (relay/_node.py, relay/_wire.py) in one process: Publisher and Relays in threads, on localhost.

Scenarios of the module doc: bodies once per node, REF on hits, NEED after a node evicted,
LOST after a clear, joining and leaving nodes, END and GONE; the wire format's checks; the
address and key rules. Processes, kills and cut connections: test_relay_mp.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from shmstore import Channel, Closed, InvalidArgument, WriterGone, dumps
from shmstore.errors import ProtocolError
from shmstore.relay import (
    CurveKeys,
    NodeChannel,
    Publisher,
    PublisherSecurity,
    Relay,
    RelaySecurity,
    Timing,
    check_endpoint,
    generate_keys,
)
from shmstore.relay._wire import (
    ACK,
    HELLO,
    INLINE,
    NEED,
    OBJECT,
    PING,
    PROTOCOL_VERSION,
    REF,
    WELCOME,
    pack,
    parse,
)
from shmstore.serde._codec import BODY_HEADER, BODY_MAGIC
from tests.conftest import new_name

pytestmark = pytest.mark.timeout(60)
FAST = Timing(peer_timeout_s=1.0, heartbeat_s=0.1)
PLAIN = PublisherSecurity(plaintext=True)
RELAY_PLAIN = RelaySecurity(plaintext=True)


def image(key: int, nbytes: int = 200_000) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 255, nbytes, dtype=np.uint8)


class Net:
    """A writer channel, its Publisher (thread) and relays (threads) with one reader each."""

    def __init__(self, n_nodes: int, *, relay_capacity: int = 64 << 20,
                 writer_capacity: int = 64 << 20, writer_inline: int = 64 << 10,
                 timing: Timing = FAST, **publisher_kw: Any) -> None:
        self.name = new_name("relay")
        self.writer = Channel.create(self.name, n_readers=1, capacity_bytes=writer_capacity,
                                     inline_threshold=writer_inline)
        self.publisher = Publisher(self.name, 0, "tcp://127.0.0.1:*", security=PLAIN, timing=timing,
                                   **publisher_kw)
        self.publisher.start()
        self.relays: list[Relay] = []
        self.readers = []
        for i in range(n_nodes):
            self.add_node(f"{self.name}-n{i}", relay_capacity)
        self.writer.wait_for_readers(10)

    def add_node(self, name: str, capacity: int, timing: Timing = FAST, **channel: Any) -> None:
        relay = Relay(self.publisher.endpoint, name, n_readers=1, node=name, security=RELAY_PLAIN,
                      timing=timing, channel=NodeChannel(capacity_bytes=capacity, **channel))
        self.relays.append(relay)
        self.readers.append(Channel.attach(name, 0))
        relay.wait_for_readers(10)
        relay.start()
        self.publisher.wait_for_nodes(len(self.relays), 10)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        for relay in self.relays:
            relay.close()
        self.publisher.close()
        self.writer.close()


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net(2)
    yield n
    n.close()


def send_keys(writer, keys: list[int], nbytes: int = 200_000) -> None:
    for k in keys:
        arr = image(k, nbytes)
        writer.send({"k": k, "pv": arr, "crc": zlib.crc32(arr)}, key=f"img-{k}", timeout=10)


def check_received(reader, keys: list[int]) -> None:
    for k in keys:
        value = reader.recv(timeout=10)
        assert value["k"] == k
        assert zlib.crc32(value["pv"]) == value["crc"]
        assert np.array_equal(value["pv"], image(k, len(value["pv"])))


def test_bodies_once_per_node_refs_on_hits(net: Net) -> None:
    keys = [0, 1, 2, 0, 1, 2, 3, 0, 3]
    send_keys(net.writer, keys)
    net.writer.send({"small": "inline", "n": 7}, timeout=10)
    for reader in net.readers:
        check_received(reader, keys)
        assert reader.recv(timeout=10) == {"small": "inline", "n": 7}
    stats = net.publisher.stats()
    assert stats.messages == len(keys) + 1
    for node in stats.nodes:
        assert node.objects_sent == 4 and node.refs_sent == 5
        # 4 bodies of ~200 kB, then a few dozen bytes per REF, PING or inline message
        assert 4 * 200_000 < node.bytes_sent < 4 * 200_000 + 8_000
    for relay in net.relays:
        s = relay.stats()
        assert (s.objects_received, s.refs_hit, s.needs, s.lost) == (4, 5, 0, 0)


def test_ref_for_an_evicted_object_is_asked_for_again() -> None:
    # each relay store holds ~2 objects, the writer's all of them: its REFs find them gone
    n = Net(2, relay_capacity=600_000)
    try:
        keys = [0, 1, 2, 3, 0, 1, 2, 3, 0]
        send_keys(n.writer, keys)
        for reader in n.readers:
            check_received(reader, keys)
        for relay in n.relays:
            s = relay.stats()
            assert s.needs > 0 and s.lost == 0 and s.evictions_reported > 0
        stats = n.publisher.stats()
        assert stats.needs_served > 0 and stats.lost == 0
        # evictions are reported, so REFs go only where the object still is
        for relay in n.relays:
            assert relay.stats().needs <= relay.stats().evictions_reported
    finally:
        n.close()


def test_a_publisher_whose_writer_ends_serves_the_tail_before_end() -> None:
    """The writer ends while a node is behind, and the node must still NEED a body (its small
    store evicted it before the REF came). serve() returns only once every node acknowledged
    every message; closing the Publisher right then loses nothing."""
    n = Net(1, relay_capacity=600_000, window=8)
    reader = n.readers[0]
    keys = [0, 1, 2, 3, 0, 1, 2, 3, 0]
    got: list[int] = []
    ended: list[BaseException] = []

    def read_slowly() -> None:
        time.sleep(0.5)  # the writer has ended by now; the node waits on this reader
        for _ in keys:
            got.append(reader.recv(timeout=10)["k"])
        try:
            reader.recv(timeout=10)
        except BaseException as exc:  # what it was is the check
            ended.append(exc)

    thread = threading.Thread(target=read_slowly)
    thread.start()
    try:
        send_keys(n.writer, keys)
        n.writer.end()
        assert n.publisher.result(timeout=20) == "end"
        stats = n.publisher.stats()
        assert [node.unacked for node in stats.nodes] == [0]  # the whole tail acknowledged
        n.publisher.close()  # at once: nothing may still be on its way
        thread.join(20)
        assert got == keys
        assert len(ended) == 1 and isinstance(ended[0], Closed)
        assert n.relays[0].stats().needs > 0 and n.relays[0].stats().lost == 0
    finally:
        thread.join(20)
        n.close()


def test_end_reaches_remote_readers_as_closed(net: Net) -> None:
    send_keys(net.writer, [5])
    net.writer.end()
    for reader in net.readers:
        check_received(reader, [5])
        with pytest.raises(Closed):
            reader.recv(timeout=10)
    assert net.publisher.result(10) == "end"
    assert [r.result(10) for r in net.relays] == ["end", "end"]


def test_a_node_joining_late_gets_what_comes_next(net: Net) -> None:
    send_keys(net.writer, [1, 2])
    for reader in net.readers:
        check_received(reader, [1, 2])
    net.add_node(f"{net.name}-late", 64 << 20)
    send_keys(net.writer, [2, 3])
    for reader in net.readers:
        check_received(reader, [2, 3])
    late = net.publisher.stats().nodes[-1]
    assert late.objects_sent == 2  # it held nothing: 2 is sent to it, not referenced


def test_a_silent_node_is_dropped_and_does_not_pin_the_writer() -> None:
    net = Net(2, writer_capacity=2 << 20)
    try:
        net.relays[1]._say = lambda frame: None  # it never answers: like a node cut off
        keys = list(range(40))  # 8 MB through a 2 MB writer store: needs the node gone
        done = threading.Thread(target=check_received, args=(net.readers[0], keys))
        done.start()
        send_keys(net.writer, keys)
        done.join(20)
        stats = net.publisher.stats()
        assert stats.nodes_dropped == 1 and len(stats.nodes) == 1
        assert stats.nodes[0].name == net.relays[0].name
    finally:
        net.close()


def test_a_slow_node_holds_the_writer_within_the_window() -> None:
    n = Net(1, window=4)
    try:
        send_keys(n.writer, list(range(12)))  # nobody reads on the node yet
        time.sleep(0.5)
        unacked = n.publisher.stats().nodes[0].unacked
        assert unacked <= 4  # the publisher stopped reading the channel
        check_received(n.readers[0], list(range(12)))
    finally:
        n.close()


@pytest.mark.slow
def test_a_node_whose_readers_stall_past_the_peer_timeout_does_not_reconnect() -> None:
    """While the node waits on its own slow readers it does not read the Publisher's socket;
    that time is not the Publisher's silence. A reconnect here would join at the newest
    message and skip the ones in between (a MultiModalCacheMissError in a vLLM worker)."""
    n = Net(0, window=32)
    try:
        n.add_node(f"{n.name}-slow", 64 << 20, n_slots=2)
        keys = list(range(12))
        send_keys(n.writer, keys, nbytes=1000)  # inline: the node's 2 slots fill at once
        time.sleep(2.5 * FAST.peer_timeout_s)  # the reader stalls: the node waits on it
        check_received(n.readers[0], keys)
        stats = n.relays[0].stats()
        assert stats.reconnects == 0 and stats.lost == 0
        assert n.publisher.stats().nodes_dropped == 0
    finally:
        n.close()


@pytest.mark.slow
def test_relay_reports_writer_gone_after_writer_timeout() -> None:
    n = Net(0)
    try:
        n.add_node(f"{n.name}-w", 64 << 20, timing=replace(FAST, writer_timeout_s=1.5))
        n.publisher.close()  # the writer's node vanishes without a word
        with pytest.raises(WriterGone):
            n.readers[0].recv(timeout=10)
        assert n.relays[0].result(5) == "gone"
    finally:
        n.close()


def test_clear_on_the_writer_keeps_remote_data_right(net: Net) -> None:
    send_keys(net.writer, [1, 2])
    for reader in net.readers:
        check_received(reader, [1, 2])
    net.writer.store.clear()
    # the same keys again, with other bytes: new object ids, so no REF to the old copies
    for k in (1, 2):
        arr = image(100 + k)
        net.writer.send({"k": k, "pv": arr, "crc": zlib.crc32(arr)}, key=f"img-{k}", timeout=10)
    for reader in net.readers:
        for k in (1, 2):
            value = reader.recv(timeout=10)
            assert np.array_equal(value["pv"], image(100 + k))
    assert all(node.refs_sent == 0 for node in net.publisher.stats().nodes)


def test_a_handle_cleared_before_the_publisher_read_it_arrives_as_lost(net: Net) -> None:
    net.publisher.stop()  # hold the publisher while the writer sends and clears
    net.publisher.result(10)
    send_keys(net.writer, [1])
    net.writer.store.clear()
    net.writer.send("after", timeout=10)
    net.publisher._stop.clear()
    net.publisher._thread = None
    net.publisher.start()
    for reader, relay in zip(net.readers, net.relays):
        assert reader.recv(timeout=10) == "after"
        assert relay.stats().lost == 1
    assert net.publisher.stats().lost == 1


# -- the wire format ---------------------------------------------------------------------------


def test_parse_accepts_each_kind_and_rejects_bad_fields() -> None:
    oid = b"x" * 24
    assert parse([pack(REF, 3, oid)]) == (REF, [3, oid], None)
    assert parse([pack(OBJECT, 3, oid), b"body"])[2] == b"body"
    assert parse([pack(HELLO, PROTOCOL_VERSION, "n", 0, [oid], 1)])[0] == HELLO
    with pytest.raises(ProtocolError, match="not a valid id"):
        parse([pack(REF, 3, b"short")])
    with pytest.raises(ProtocolError, match="field 0"):
        parse([pack(ACK, -1, [])])
    with pytest.raises(ProtocolError, match="without a body"):
        parse([pack(REF, 3, oid), b"extra"])
    with pytest.raises(ProtocolError, match="with a body"):
        parse([pack(INLINE, 3)])
    with pytest.raises(ProtocolError, match="unknown message kind"):
        parse([pack(99)])
    with pytest.raises(ProtocolError, match="msgpack"):
        parse([b"\xc1"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_parse_never_raises_anything_else(frames: list[bytes]) -> None:
    try:
        parse(frames)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.lists(st.one_of(st.integers(-5, 2**64 - 1), st.binary(max_size=30),
                                               st.text(max_size=5), st.none(),
                                               st.lists(st.binary(max_size=25), max_size=3)),
                                     max_size=6))
def test_parse_checks_every_field(kind: int, fields: list[object]) -> None:
    try:
        parse([msgpack.packb([kind, *fields])])
    except ProtocolError:
        pass


def test_garbage_from_a_peer_is_dropped_and_counted(net: Net) -> None:
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.connect(net.publisher.endpoint)
        sock.send_multipart([b"\x93garbage", b"x"])
        sock.send(pack(ACK, 10**12, []))  # an unknown peer's ACK: ignored
        sock.send(pack(HELLO, PROTOCOL_VERSION + 1, "old", 0, [], 1))  # another version: ignored
        deadline = time.monotonic() + 5
        while net.publisher.stats().bad_messages < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert net.publisher.stats().bad_messages == 2
    send_keys(net.writer, [1])
    for reader in net.readers:
        check_received(reader, [1])


@contextmanager
def fake_publisher(tag: str) -> Iterator[tuple[Any, bytes, Relay, Any]]:
    """A peer posing as a publisher, and a relay (with one local reader) it has WELCOMEd."""
    name = new_name(tag)
    with zmq.Context.instance().socket(zmq.ROUTER) as fake:
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        relay = Relay(f"tcp://127.0.0.1:{port}", name, n_readers=1, security=RELAY_PLAIN,
                      timing=FAST, channel=NodeChannel(capacity_bytes=8 << 20))
        reader = Channel.attach(name, 0)
        try:
            relay.start()
            rid, hello = fake.recv_multipart()
            assert parse([hello])[0] == HELLO
            fake.send_multipart([rid, pack(WELCOME, PROTOCOL_VERSION, 7, 65536, 1 << 20, 1)])
            yield fake, rid, relay, reader
        finally:
            reader.close()
            relay.close()


def test_a_forged_object_body_is_not_delivered() -> None:
    """A peer posing as a publisher: bodies that do not decode are skipped and counted."""
    with fake_publisher("forge") as (fake, rid, relay, reader):
        fake.send_multipart([rid, pack(OBJECT, 1, b"i" * 24), b"SSB1 not a body"])
        fake.send_multipart([rid, pack(INLINE, 2), b"\x00" * 40])
        fake.send_multipart([rid, pack(PING)])
        fake.send_multipart([rid, pack(INLINE, 3), dumps("fine")])
        assert reader.recv(timeout=10) == "fine"
        assert relay.stats().lost == 2


# -- addresses, keys, arguments ------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [
    "tcp://*:5555", "tcp://0.0.0.0:5555", "tcp://[::]:1", "tcp://:1",
    # other spellings of the unspecified address, which zmq binds as such
    "tcp://0:5555", "tcp://0x0:5555", "tcp://0.0:5555", "tcp://00.0.0.0:5555", "tcp://0000:5555",
    "tcp://[::0]:5555", "tcp://[0:0:0:0:0:0:0:0]:5555"])
def test_wildcard_bind_is_refused_unless_allowed(endpoint: str) -> None:
    with pytest.raises(InvalidArgument, match="every interface"):
        check_endpoint(endpoint, allow_wildcard=False)
    assert check_endpoint(endpoint, allow_wildcard=True) == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://10.0.0.1:1", "tcp://[::1]:1",
                                      "tcp://localhost:1", "tcp://no-such-host.invalid:1"])
def test_one_address_is_accepted(endpoint: str) -> None:
    assert check_endpoint(endpoint, allow_wildcard=False) == endpoint


def test_a_publisher_given_tcp_0_binds_nothing_without_allow_wildcard() -> None:
    name = new_name("zero")
    with Channel.create(name, n_readers=1, capacity_bytes=1 << 20), \
            pytest.raises(InvalidArgument, match="every interface"):
        Publisher(name, 0, "tcp://0:0")


@pytest.mark.parametrize("endpoint", ["10.0.0.1:5555", "tcp://host", "udp://h:1", 5555])
def test_malformed_endpoints_are_refused(endpoint: object) -> None:
    with pytest.raises(InvalidArgument, match=r"endpoint"):
        check_endpoint(endpoint, allow_wildcard=True)  # type: ignore[arg-type]


def test_publisher_arguments_are_checked() -> None:
    name = new_name("args")
    with Channel.create(name, n_readers=1, capacity_bytes=1 << 20):
        with pytest.raises(InvalidArgument, match=r"both security\.keys and security\.allowed"):
            Publisher(name, 0, "tcp://127.0.0.1:*",
                      security=PublisherSecurity(allowed=(b"x" * 40,)))
        with pytest.raises(InvalidArgument, match=r"security\.keys needs the secret key"):
            Publisher(name, 0, "tcp://127.0.0.1:*",
                      security=PublisherSecurity(CurveKeys(b"p" * 40), (b"x" * 40,)))
    with pytest.raises(InvalidArgument, match=r"both security\.keys and security\.server_key"):
        Relay("tcp://127.0.0.1:1", new_name("args"), n_readers=1,
              security=RelaySecurity(server_key=b"p" * 40))
    with pytest.raises(InvalidArgument, match=r"security\.keys needs the secret key"):
        Relay("tcp://127.0.0.1:1", new_name("args"), n_readers=1,
              security=RelaySecurity(CurveKeys(b"c" * 40), b"p" * 40))
    with pytest.raises(InvalidArgument, match=r"timing\.writer_timeout_s"):
        Relay("tcp://127.0.0.1:1", new_name("args"), n_readers=1, security=RELAY_PLAIN,
              timing=Timing(writer_timeout_s=-1))
    with Channel.create(name, n_readers=1, capacity_bytes=1 << 20):
        with pytest.raises(InvalidArgument, match="window"):
            Publisher(name, 0, "tcp://127.0.0.1:*", security=PLAIN, window=0)
        with pytest.raises(InvalidArgument, match=r"timing\.peer_timeout_s"):
            Publisher(name, 0, "tcp://127.0.0.1:*", security=PLAIN, timing=Timing(0))


@pytest.mark.slow
def test_curve_refuses_unknown_relays(tmp_path) -> None:
    server = CurveKeys.load(generate_keys(tmp_path, "server")[1])
    good = CurveKeys.load(generate_keys(tmp_path, "good")[1])
    bad = CurveKeys.load(generate_keys(tmp_path, "bad")[1])
    assert (tmp_path / "server.key_secret").stat().st_mode & 0o077 == 0
    name = new_name("curve")
    writer = Channel.create(name, n_readers=1, capacity_bytes=8 << 20)
    publisher = Publisher(name, 0, "tcp://127.0.0.1:*",
                          security=PublisherSecurity(server, (good.public,)), timing=FAST)
    publisher.start()
    relays = []
    try:
        for tag, keys in (("bad", bad), ("good", good)):
            relays.append(Relay(publisher.endpoint, f"{name}-{tag}", n_readers=1, timing=FAST,
                                security=RelaySecurity(keys, server.public),
                                channel=NodeChannel(capacity_bytes=8 << 20)))
        plain = Relay(publisher.endpoint, f"{name}-plain", n_readers=1, security=RELAY_PLAIN,
                      timing=FAST, channel=NodeChannel(capacity_bytes=8 << 20))
        relays.append(plain)
        readers = [Channel.attach(r.name, 0) for r in relays]
        for relay in relays:
            relay.start()
        publisher.wait_for_nodes(1, 10)
        time.sleep(1.0)
        assert [n.name for n in publisher.stats().nodes] == [relays[1].node]
        writer.send({"secret": np.arange(100_000)}, key="k", timeout=10)
        assert np.array_equal(readers[1].recv(timeout=10)["secret"], np.arange(100_000))
        for i in (0, 2):
            assert not relays[i].stats().connected and relays[i].stats().bytes_received == 0
        for reader in readers:
            reader.close()
    finally:
        for relay in relays:
            relay.close()
        publisher.close()
        writer.close()


def test_missing_key_files_say_how_to_make_them(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match="shmstore relay keygen"):
        CurveKeys.load(tmp_path / "nope.key_secret")


def test_stop_from_another_thread_ends_serve(net: Net) -> None:
    assert net.publisher.serving
    threading.Timer(0.2, net.publisher.stop).start()
    assert net.publisher.result(10) == "closed" and not net.publisher.serving


def test_evictions_by_large_inline_values_are_reported() -> None:
    """A node with a smaller inline threshold stores the writer's inline values; those puts
    evict objects too, and the node must say so (else the writer sends REFs to nothing)."""
    n = Net(0)
    try:
        n.add_node(f"{n.name}-small", 700_000, inline_threshold=1024)
        send_keys(n.writer, [1, 2])  # two 200 kB objects in a ~700 kB store
        for i in range(8):  # 60 kB values: inline for the writer, stored on the node
            n.writer.send({"i": i, "pad": bytes(60_000)}, timeout=10)
        check_received(n.readers[0], [1, 2])
        for i in range(8):
            assert n.readers[0].recv(timeout=10)["i"] == i
        deadline = time.monotonic() + 5  # the ACKs saying so reach the publisher
        while n.publisher.stats().nodes[0].held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert n.publisher.stats().nodes[0].held == 0
        send_keys(n.writer, [1, 2])  # sent as bodies, not as REFs to what is gone
        check_received(n.readers[0], [1, 2])
        s = n.relays[0].stats()
        assert s.evictions_reported == 2 and s.needs == 0 and s.lost == 0
    finally:
        n.close()


def test_small_stored_objects_are_held_on_a_node_with_a_larger_inline_threshold() -> None:
    """An object the writer stored is stored on every node, even one whose inline threshold
    is above its size: a hit is then a REF served from the node's store, not a NEED round
    trip for bytes the node let go."""
    n = Net(0, writer_capacity=8 << 20, writer_inline=1024)
    try:
        n.add_node(f"{n.name}-n", 8 << 20, inline_threshold=256 << 10)
        for _ in range(3):  # 20 kB: stored by the writer, below the node's 256 KiB threshold
            send_keys(n.writer, [1, 2], nbytes=20_000)
            check_received(n.readers[0], [1, 2])
        s = n.relays[0].stats()
        assert (s.objects_received, s.refs_hit, s.needs, s.lost) == (2, 4, 0, 0)
        assert n.publisher.stats().nodes[0].objects_sent == 2
    finally:
        n.close()


# -- hostile peers on the network ------------------------------------------------------------------

class Rogue:
    """A peer speaking the relay protocol by hand: HELLO, then whatever the test wants."""

    def __init__(self, endpoint: str, name: str = "rogue", since: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send(pack(HELLO, PROTOCOL_VERSION, name, 0, [],
                            time.time_ns() if since is None else since))

    def drain(self, timeout_s: float = 0.05) -> list[tuple[int, list[object]]]:
        got = []
        while self.sock.poll(int(timeout_s * 1000)):
            kind, fields, _ = parse(self.sock.recv_multipart())
            got.append((kind, fields))
            timeout_s = 0.0
        return got

    def drain_until(self, enough, timeout_s: float = 30.0) -> list[tuple[int, list[object]]]:
        """Everything received until `enough(received)` holds (waits for what the test
        checks: a busy machine delivers in its own time); AssertionError after timeout_s."""
        got: list[tuple[int, list[object]]] = []
        end = time.monotonic() + timeout_s
        while not enough(got):
            assert time.monotonic() < end, f"timed out; received {[k for k, _ in got]}"
            got += self.drain(0.05)
        return got

    def close(self) -> None:
        self.sock.close()


def wait_until(predicate, timeout_s: float = 30.0) -> bool:  # generous: only a failure waits it out
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_plain_tcp_is_refused_unless_asked_for() -> None:
    name = new_name("plain")
    with Channel.create(name, n_readers=1, capacity_bytes=1 << 20):
        with pytest.raises(InvalidArgument, match=r"without CurveZMQ keys.*relay keygen") as info:
            Publisher(name, 0, "tcp://127.0.0.1:*")
        assert info.value.argument == "security.plaintext"
        with Publisher(name, 0, f"ipc:///tmp/{name}.sock") as local:  # a local socket: allowed
            assert local.endpoint.startswith("ipc://")
            assert os.path.exists(f"/tmp/{name}.sock")
        assert not os.path.exists(f"/tmp/{name}.sock")  # its file goes with it (libzmq's stays)
        # a second bind of the same path takes the name (libzmq replaces the file): the first
        # Publisher's close leaves the second's file alone
        other = new_name("plain2")
        with Channel.create(other, n_readers=1, capacity_bytes=1 << 20), \
                Publisher(name, 0, f"ipc:///tmp/{name}.sock") as first:
            with Publisher(other, 0, f"ipc:///tmp/{name}.sock"):
                first.close()
                assert os.path.exists(f"/tmp/{name}.sock")
            assert not os.path.exists(f"/tmp/{name}.sock")
    with pytest.raises(InvalidArgument, match=r"without CurveZMQ keys.*--insecure"):
        Relay("tcp://127.0.0.1:1", new_name("plain"), n_readers=1)


def test_a_node_that_pings_but_never_acknowledges_is_dropped_and_holds_nothing() -> None:
    net = Net(0, window=8, timing=replace(FAST, ack_timeout_s=1.0))
    rogue = Rogue(net.publisher.endpoint)
    try:
        assert wait_until(lambda: net.publisher.nodes_connected == 1)
        send_keys(net.writer, list(range(40)), nbytes=100_000)  # five windows, none acked
        started = time.monotonic()
        while net.publisher.nodes_connected and time.monotonic() - started < 30:
            rogue.drain(0.1)
            rogue.sock.send(pack(PING))  # alive, but not keeping up
        assert net.publisher.nodes_connected == 0 and net.publisher.stats().nodes_dropped == 1
        # dropped, so the Publisher reads on: the writer's messages are not held for it
        assert wait_until(lambda: net.publisher.stats().messages == 40)
    finally:
        rogue.close()
        net.close()


def test_a_node_connecting_again_replaces_its_older_connection() -> None:
    """A relay restarted (or reconnected) within the peer timeout: its newer connection
    replaces the older one at once, whatever order their HELLOs arrive in, so the node counts
    once and the dead connection's unacknowledged window holds nothing."""
    net = Net(0, window=4, timing=replace(FAST, ack_timeout_s=30.0, peer_timeout_s=30.0))
    old = Rogue(net.publisher.endpoint, "same-name", since=100)
    rogues = [old]
    try:
        assert wait_until(lambda: net.publisher.nodes_connected == 1)
        send_keys(net.writer, list(range(8)), nbytes=100_000)  # two windows: old acks nothing
        # it got the first window, and holds the writer's reads
        old.drain_until(lambda got: sum(k in (OBJECT, INLINE) for k, _ in got) >= 4)
        assert wait_until(lambda: net.publisher.stats().messages == 4)
        new = Rogue(net.publisher.endpoint, "same-name", since=300)
        rogues.append(new)
        assert wait_until(lambda: net.publisher.stats().messages == 8)  # old holds nothing now
        got = new.drain_until(lambda got: any(k in (OBJECT, INLINE) for k, _ in got[1:]))
        assert got[0][0] == WELCOME
        # an older connection's HELLO arriving after the newer one's (sent after it was
        # WELCOMEd: two connections' HELLOs reach the Publisher in either order)
        late = Rogue(net.publisher.endpoint, "same-name", since=200)
        rogues.append(late)
        assert not late.drain(0.5)  # its HELLO was ignored: no WELCOME
        stats = net.publisher.stats()
        assert len(stats.nodes) == 1 and net.publisher.nodes_connected == 1
        assert stats.nodes_joined == 1 and stats.nodes_dropped == 0
    finally:
        for r in rogues:
            r.close()
        net.close()


def test_one_curve_key_on_two_relays_counts_as_one_node(tmp_path) -> None:
    for who in ("pub", "node"):
        generate_keys(tmp_path, who)
    server = CurveKeys.load(tmp_path / "pub.key_secret")
    client = CurveKeys.load(tmp_path / "node.key_secret")
    name = new_name("twice")
    with Channel.create(name, n_readers=1, capacity_bytes=8 << 20) as writer:
        publisher = Publisher(name, 0, "tcp://127.0.0.1:*",
                              security=PublisherSecurity(server, (client.public,)), timing=FAST)
        publisher.start()
        relays = [Relay(publisher.endpoint, f"{name}-{i}", n_readers=1, node=f"n{i}",
                        security=RelaySecurity(client, server.public), timing=FAST,
                        channel=NodeChannel(capacity_bytes=8 << 20)) for i in range(2)]
        try:
            for relay in relays:
                relay.start()
            # each connection of the key replaces the one before: one node, counted once
            assert wait_until(lambda: all(r.stats().connected for r in relays), 5)
            for _ in range(20):
                assert len(publisher.stats().nodes) <= 1 and publisher.nodes_connected <= 1
                time.sleep(0.05)
            assert publisher.stats().nodes_joined == 1
        finally:
            for relay in relays:
                relay.close()
            publisher.close()
            writer.end()


def test_a_need_is_answered_once_while_unacknowledged() -> None:
    net = Net(0, writer_inline=1024)
    rogue = Rogue(net.publisher.endpoint)
    rogues = [rogue]
    try:
        assert wait_until(lambda: net.publisher.nodes_connected == 1)
        send_keys(net.writer, [1], nbytes=200_000)
        got = []
        assert wait_until(lambda: got.extend(rogue.drain(0)) or any(k == OBJECT for k, _ in got))
        number = next(f[0] for k, f in got if k == OBJECT)
        for _ in range(500):  # a flood of NEEDs for the same message, never acknowledged
            rogue.sock.send(pack(NEED, number))
        assert wait_until(lambda: net.publisher.stats().bad_messages >= 499)
        stats = net.publisher.stats()
        assert stats.needs_served == 1 and stats.nodes[0].objects_sent == 2  # sent once more
        # ... from the one copy the forward made, shared, not a second one; kept only while
        # the message is unacknowledged
        assert list(net.publisher._frames) == [number]
        rogues.append(Rogue(net.publisher.endpoint, "second"))
        assert wait_until(lambda: net.publisher.nodes_connected == 2)
        rogue.sock.send(pack(ACK, number, []))
        assert wait_until(lambda: not net.publisher._frames)  # every node has it: dropped
    finally:
        for r in rogues:
            r.close()
        net.close()


def test_nodes_beyond_max_nodes_are_refused() -> None:
    net = Net(0, max_nodes=3)
    rogues = [Rogue(net.publisher.endpoint, f"r{i}") for i in range(8)]
    try:
        assert wait_until(lambda: net.publisher.stats().nodes_refused == 5)
        assert net.publisher.nodes_connected == 3
    finally:
        for r in rogues:
            r.close()
        net.close()


def test_an_oversized_message_disconnects_only_its_sender() -> None:
    net = Net(1)
    rogue = Rogue(net.publisher.endpoint)
    try:
        rogue.sock.send(pack(PING) + b"\x00" * (5 << 20))  # over the 4 MiB header limit
        send_keys(net.writer, [1, 2])
        check_received(net.readers[0], [1, 2])  # the real node is served on
    finally:
        rogue.close()
        net.close()


def _deep(depth: int) -> bytes:
    """A body nested `depth` levels: decode takes up to msgpack's ~1000, encode makes 100."""
    structure = b"\x91" * depth + b"\xc0"  # [[[...[None]...]]]
    return BODY_HEADER.pack(BODY_MAGIC, 0, len(structure)) + structure


def test_a_body_decode_accepts_is_stored_as_received_and_one_it_refuses_is_lost() -> None:
    """The relay stores a checked body as it came (never decoded and encoded again), so what a
    reader can decode reaches it, even nesting encode would refuse to make; a body decode
    refuses is lost on that node, and the relay lives."""
    deep: Any = None
    for _ in range(200):
        deep = [deep]
    with fake_publisher("deep") as (fake, rid, relay, reader):
        fake.send_multipart([rid, pack(OBJECT, 1, b"d" * 24), _deep(200)])
        fake.send_multipart([rid, pack(INLINE, 2), _deep(200)])
        fake.send_multipart([rid, pack(INLINE, 3), _deep(5000)])  # beyond msgpack's stack
        fake.send_multipart([rid, pack(OBJECT, 4, b"e" * 24), _deep(5000)])
        fake.send_multipart([rid, pack(INLINE, 5), dumps("fine")])
        assert reader.recv(timeout=10) == deep  # by handle, from the node's store
        assert reader.recv(timeout=10) == deep  # inline
        assert reader.recv(timeout=10) == "fine"
        assert relay.stats().lost == 2 and relay.serving
        assert relay.channel.store.is_cached(b"d" * 24)
        assert not relay.channel.store.is_cached(b"e" * 24)


FORGOTTEN = """
import gc, sys, time
from shmstore import Channel
from shmstore.relay import Publisher, PublisherSecurity, Relay, RelaySecurity
name = sys.argv[1]
writer = Channel.create(name, n_readers=1, capacity_bytes=1 << 20)
publisher = Publisher(name, 0, "tcp://127.0.0.1:*", security=PublisherSecurity(plaintext=True))
publisher.cycle = publisher
relay = Relay(publisher.endpoint, name + "-n", n_readers=1, security=RelaySecurity(plaintext=True))
relay.cycle = relay
del publisher, relay
gc.collect()
print("collected", flush=True)
writer.close()
"""


@pytest.mark.slow
def test_a_publisher_and_relay_dropped_in_a_cycle_never_hang_the_collection() -> None:
    """Forgotten close() inside a reference cycle: the collection that finds them must return
    (it blocked for ever in pyzmq's Context.term before). What they held may leak."""
    from shmstore.cli._commands import remove

    name = new_name("forgot")
    try:
        done = subprocess.run([sys.executable, "-c", FORGOTTEN, name], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0 and "collected" in done.stdout, done.stderr
    finally:
        for leaked in (f"{name}-n.queue", f"{name}-n.store"):  # the relay's channel: leaked
            remove(leaked)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_an_ipc_socket_another_user_made_first_is_refused_and_a_publishers_is_private(
        tmp_path) -> None:
    """ipc:// needs no keys, so who owns the socket file is what says who the Publisher is."""
    path = f"/tmp/shmstore-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: another user binds the path first
        os.close(read)
        os.setgid(65534)
        os.setuid(65534)
        squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squat.bind(path)
        squat.listen(1)
        os.write(write, b"bound")
        time.sleep(30)
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 16) == b"bound"
        with pytest.raises(InvalidArgument, match="belongs to uid 65534"):
            Relay(f"ipc://{path}", new_name("ipc"), n_readers=1)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
        os.unlink(path)
    name = new_name("ipcpub")
    with Channel.create(name, n_readers=1, capacity_bytes=1 << 20), \
            Publisher(name, 0, f"ipc://{tmp_path}/pub.sock") as publisher:
        mode = os.stat(publisher.endpoint.removeprefix("ipc://")).st_mode & 0o777
        assert mode == 0o600
