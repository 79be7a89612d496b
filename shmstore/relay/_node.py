"""Readers on other nodes: a Publisher forwards one Channel over ZeroMQ, one Relay per node
writes what it receives into that node's own Channel, and the node's readers attach to that.

    node A (writer)                                   node B                    node C
    ChannelWriter --queue+store--> local readers      Relay --queue+store-->    Relay --> ...
          |                                             ^   local readers B0, B1  ^
          +--> Publisher (reader n of the channel) --ROUTER==tcp==DEALER--+-------+

The Publisher is one more reader of the writer's channel (create the channel with
n_readers = local readers + 1), so the lower layers know nothing of the network and the
local path is unchanged. It keeps each stored object owed to itself (recv_raw(keep=True))
until every node has acknowledged the message, so it can always send the bytes again.

What each node holds: the Publisher keeps, per node, the ids of the objects the node holds
(`relay/_wire.py`: an id names the bytes, not the key). It learns them from what it sent, from the
node's HELLO (a reconnecting relay lists what it kept) and from the evictions each ACK reports.
It sends an object's bytes only to a node it believes lacks them, else a REF of a few dozen
bytes. A belief that is stale the other way (the node evicted it; the ACK saying so is still
on the wire) costs one round trip, never data:

 1. Miss everywhere. Writer puts K; Publisher reads handle H (message n), copies the body once
    into a ZeroMQ frame, sends OBJECT(n, id, body) to each node, marks id held by each. Relays
    store the body under id in their own store, hand it to their readers, ACK(n).
 2. Hit on a node that holds it. Writer hands K out again; Publisher sends REF(n, id) (35 bytes);
    the relay hands its own copy out again (get_cached), ACK(n).
 3. REF for an object the relay evicted meanwhile. The relay sends NEED(n) and holds back
    messages n+1.. (order per node); the Publisher still owes nothing (n is not acknowledged by
    this node, so the object is still owed to the Publisher and not reclaimed) and answers
    OBJECT(n, id, body); the relay goes on in order. Only if the writer cleared the store
    meanwhile is the answer LOST(n): that message is skipped on that node, and counted.
 4. New node. A relay connects (new routing id), says HELLO with what it holds (empty after a
    restart; its store is new) and the writer epoch those came from; the Publisher keeps that
    list only for the same epoch, WELCOMEs it with the next message number, and from then on
    the node gets every message. Messages before it joined are not sent to it.
 5. Slow node. A node that has `window` messages unacknowledged stops the Publisher from
    reading further: the writer's channel fills and the writer waits, exactly as for a slow
    local reader. Memory is bounded by the window (ZeroMQ's HWM is set above it).
 6. Dead or cut-off node. No message (ACKs and PINGs every heartbeat_s) for peer_timeout_s:
    the Publisher drops the node and forgets its acknowledgements; the writer is not pinned and
    the other nodes go on. A relay that hears nothing for peer_timeout_s reconnects (scenario 4)
    and goes on with what comes next; what was sent meanwhile is lost on that node (counted).
    Time a relay spends waiting on its own slow readers is not silence: it PINGs meanwhile, and
    what the Publisher sent waits in its socket, read before silence is judged.
 7. Writer ends or dies. The Publisher's channel read says Closed or WriterGone; it serves the
    nodes until each acknowledged every message (answering NEEDs), for at most ack_timeout_s,
    then sends END or GONE; each relay ends its local queue so its readers get Closed or
    WriterGone after the last message. A writer node that vanishes without a word: a relay
    with writer_timeout_s set reports WriterGone once it has heard nothing that long.

Security: the Publisher binds one explicit address (a wildcard such as tcp://*:5555 or
0.0.0.0 needs allow_wildcard=True). With CurveZMQ keys (CurveKeys, `shmstore relay keygen`)
every connection is encrypted and only relays whose public key is in `allowed_clients` get
past the handshake: others can neither receive nor inject. Every message is checked against its
schema (relay/_wire.py) and every body is decoded with the same checks as bytes from shared memory.

Modules: this one has the Relay; the Publisher is in relay/_publisher.py, and what both ends
share (keys, checks, the serve thread) in relay/_peer.py. Import every name from here.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth

from ..errors import (
    CorruptObject,
    InvalidArgument,
    ObjectTooLarge,
    ProtocolError,
    StoreFull,
    Timeout,
)
from ..queue._channel import DEFAULT_INLINE_THRESHOLD, Channel, ChannelWriter
from ..serde._codec import Encoded, Verbatim
from ..store._policy import DEFAULT_POLICY
from ._peer import (
    Peer,
    RelaySecurity,
    Timing,
    check_endpoint,
    check_ipc_owner,
)
from ._wire import (
    ACK,
    BYE,
    END,
    GONE,
    HELLO,
    INLINE,
    LOST,
    NEED,
    OBJECT,
    PING,
    PROTOCOL_VERSION,
    REF,
    WELCOME,
    pack,
    parse,
)

__all__ = ["Relay", "NodeChannel", "RelayStats"]

log = logging.getLogger("shmstore.relay")


@dataclass(frozen=True, slots=True)
class RelayStats:
    """A snapshot of a Relay."""

    name: str
    connected: bool
    messages: int  # handed to the local readers
    objects_received: int  # bodies received (OBJECT)
    refs_hit: int  # REFs served from this node's store
    needs: int  # REFs for objects no longer here: asked for again
    duplicates: int  # bodies received for an object already here
    lost: int  # messages this node did not get (reconnect gaps, LOST, undecodable bodies)
    evictions_reported: int
    reconnects: int
    bad_messages: int
    bytes_received: int


@dataclass(frozen=True, slots=True)
class NodeChannel:
    """The Channel a Relay creates on its node, as Channel.create takes it."""

    capacity_bytes: int = 1 << 30
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD
    n_slots: int = 64
    policy: str = DEFAULT_POLICY
    mode: int = 0o600


class Relay(Peer):
    """Feeds the readers of one node from a Publisher on another node (see the module doc).

    It creates (and owns, and unlinks) the node's Channel `name` with `n_readers` readers;
    they attach with `Channel.attach(name, i)` as on the writer's node. Connect to the
    Publisher's `connect` endpoint with serve() (blocks) or start() (a thread).
    """

    _channel: ChannelWriter | None = None

    def __init__(
        self,
        connect: str,
        name: str,
        *,
        n_readers: int,
        node: str | None = None,
        security: RelaySecurity | None = None,
        timing: Timing | None = None,
        channel: NodeChannel | None = None,
    ) -> None:
        self.connect = check_endpoint(connect, allow_wildcard=False)
        check_ipc_owner(self.connect)
        timing = (timing or Timing()).check()
        security = security or RelaySecurity()
        security.check(self.connect)
        channel = channel or NodeChannel()
        self.peer_timeout_s = timing.peer_timeout_s
        self.heartbeat_s = timing.heartbeat_s
        self.writer_timeout_s = timing.writer_timeout_s
        self.node = node if node is not None else f"{os.uname().nodename}:{os.getpid()}"
        self._keys = security.keys
        self._server_key = security.server_key
        super().__init__()
        try:
            self._channel = Channel.create(name, n_readers=n_readers,
                                           capacity_bytes=channel.capacity_bytes,
                                           inline_threshold=channel.inline_threshold,
                                           n_slots=channel.n_slots, policy=channel.policy,
                                           mode=channel.mode)
        except BaseException:
            self.close()
            raise
        self.name = self._channel.name
        self._held: dict[bytes, None] = {}  # ids of the objects this node's store holds
        self._evicted: list[bytes] = []  # reported with the next ACK
        self._epoch = 0  # the writer store epoch the held ids belong to
        self._expect: int | None = None  # next message number; None until WELCOMEd
        self._waiting: int | None = None  # a NEED sent for this message number
        self._backlog: deque[tuple[int, list[Any], Any]] = deque()
        self._last_heard = self._last_contact = self._last_ping = 0.0
        self._since = 0  # the last HELLO's connection time (ns)
        self._messages = self._objects = self._refs = self._needs = self._dups = 0
        self._lost = self._reported = self._reconnects = self._bad = self._bytes = 0

    @property
    def channel(self) -> ChannelWriter:
        """The node's local channel (its writer); readers attach to `name`."""
        if self._channel is None:
            raise InvalidArgument("the Relay is closed", "channel", None)
        return self._channel

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until every local reader has attached (call before serve() so they miss
        nothing the node receives)."""
        self.channel.wait_for_readers(timeout)

    def stats(self) -> RelayStats:
        """A snapshot (cheap; safe from another thread)."""
        return RelayStats(self.name, self._expect is not None, self._messages, self._objects,
                          self._refs, self._needs, self._dups, self._lost, self._reported,
                          self._reconnects, self._bad, self._bytes)

    def serve(self) -> str:
        """Relay until the writer ends ("end"), dies ("gone") or stop() ("closed")."""
        channel = self.channel
        self._connect()
        self._last_contact = time.monotonic()
        while not self._stop.is_set():
            heard = self._sock.poll(int(self.heartbeat_s * 500))
            if heard:
                frames = self._sock.recv_multipart(copy=False)
                self._last_heard = self._last_contact = time.monotonic()
                self._bytes += sum(len(f.buffer) for f in frames)
                try:
                    kind, fields, body = parse(frames)
                except ProtocolError as exc:
                    self._bad += 1
                    log.warning("relay %r: dropped a message: %s", self.name, exc)
                    continue
                if kind == END:
                    channel.end()
                    return "end"
                if kind == GONE:
                    log.warning("relay %r: the writer (pid %d on the publisher's node) died",
                                self.name, fields[0])
                    channel.end(upstream_gone=True)
                    return "gone"
                self._on_message(kind, fields, body)
            now = time.monotonic()
            if now - self._last_ping >= self.heartbeat_s:
                self._say(pack(PING))
            # silence only after a poll that found nothing: a delivery that waited on slow
            # local readers did not read the socket, and what arrived meanwhile is queued there
            if not heard and now - self._last_heard > self.peer_timeout_s:
                if (self.writer_timeout_s is not None
                        and now - self._last_contact > self.writer_timeout_s):
                    log.warning("relay %r: no word from %s for %.1f s: reporting the writer "
                                "gone", self.name, self.connect, now - self._last_contact)
                    channel.end(upstream_gone=True)
                    return "gone"
                log.warning("relay %r: no word from %s for %.1f s; reconnecting", self.name,
                            self.connect, now - self._last_heard)
                self._reconnects += 1
                self._connect()
        self._say(pack(BYE))
        return "closed"

    def close(self) -> None:
        """Stop serving, disconnect, close (and unlink) the node's channel; idempotent."""
        super().close()

    def _close_owned(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- internals -----------------------------------------------------------------------------

    def _connect(self) -> None:
        """A new socket with a new routing id (a new peer to the Publisher), then HELLO."""
        self._close_socket()
        sock = self._zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16))
        sock.setsockopt(zmq.RCVHWM, 0)  # bounded by the Publisher's window
        sock.setsockopt(zmq.SNDHWM, 1000)
        if self._keys is not None:
            sock.curve_secretkey = self._keys.secret
            sock.curve_publickey = self._keys.public
            sock.curve_serverkey = self._server_key
        if self.connect.startswith("ipc://"):
            check_ipc_owner(self.connect)  # again: the file may have been replaced
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # no silent reconnect to another file
        sock.connect(self.connect)
        self._sock = sock
        self._expect = self._waiting = None
        self._backlog.clear()
        self._last_heard = time.monotonic()
        # since: later for every connection, of this relay or of one restarted in its place, so
        # the Publisher keeps the newest connection of a node, whatever order HELLOs arrive in
        self._since = max(time.time_ns(), self._since + 1)
        self._say(pack(HELLO, PROTOCOL_VERSION, self.node[:256], self._epoch, list(self._held),
                       self._since))

    def _say(self, frame: bytes) -> None:
        self._last_ping = time.monotonic()
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet, or the Publisher is not reading: the next one goes

    def _on_message(self, kind: int, fields: list[Any], body: Any) -> None:
        if kind == WELCOME:
            self._welcome(fields)
            return
        if kind == PING:
            return
        if kind not in (INLINE, OBJECT, REF, LOST) or self._expect is None:
            if self._expect is not None:
                self._bad += 1
            return
        if self._waiting is not None:
            if fields[0] != self._waiting or kind not in (OBJECT, LOST):
                self._backlog.append((kind, fields, body))
                return
            self._waiting = None
        self._deliver(kind, fields, body)
        while self._backlog and self._waiting is None:
            self._deliver(*self._backlog.popleft())

    def _welcome(self, fields: list[Any]) -> None:
        # Inline values larger than this relay's inline_threshold go through its store.
        _, epoch, _, max_object, first = fields
        channel = self.channel
        if max_object > channel.store.max_object_bytes and self._expect is None:
            log.warning("relay %r: the writer stores objects up to %d bytes, this node's store "
                        "takes %d: larger ones will be lost here; give the relay a larger "
                        "capacity", self.name, max_object, channel.store.max_object_bytes)
        if epoch != self._epoch:
            if self._held:
                channel.store.clear()  # ids from another writer store: meaningless now
                self._held.clear()
            self._epoch = epoch
        if self._expect is None:
            log.info("relay %r: joined %s at message %d", self.name, self.connect, first)
        self._expect = first

    def _deliver(self, kind: int, fields: list[Any], body: Any) -> None:
        number = fields[0]
        expect = self._expect
        assert expect is not None  # checked by _on_message
        if number < expect:
            return  # a duplicate
        if number > expect:
            self._lost += number - expect
            log.warning("relay %r: messages %d..%d never arrived", self.name, expect, number - 1)
        try:
            if kind == INLINE:
                self._send_local(Verbatim(body.buffer), None)
            elif kind == OBJECT:
                object_id = fields[1]
                self._objects += 1
                if self.channel.store.is_cached(object_id):
                    self._dups += 1
                    self._send_local(None, object_id)
                else:
                    self._send_local(Verbatim(body.buffer), object_id)
            elif kind == REF:
                object_id = fields[1]
                if not self.channel.store.is_cached(object_id):
                    self._needs += 1
                    self._waiting = number
                    self._say(pack(NEED, number))
                    return
                self._refs += 1
                self._send_local(None, object_id)
            else:
                self._lost += 1
        except (CorruptObject, ObjectTooLarge) as exc:
            # stored as received (Verbatim): what decode accepts is stored, never encoded again;
            # a body decode refuses, or one too large for this node's store, is lost here
            self._lost += 1
            log.error("relay %r: message %d skipped on this node: %s", self.name, number, exc)
        self._expect = number + 1
        self._say(pack(ACK, number, self._evicted))
        self._reported += len(self._evicted)
        self._evicted = []

    def _send_local(self, enc: Encoded | None, object_id: bytes | None) -> None:
        """Hand a body (or the cached object `object_id`) to the local readers; while they are
        slow, keep the Publisher told that this node lives. An object stored on the writer's
        node is stored here too, whatever its size: the node holds it for the next REF, and
        its readers get a handle, as there."""
        channel = self.channel
        store = channel.store
        objects, by_handle = len(store), channel.sent_by_handle
        while True:
            try:
                found = None if object_id is None else store.hand_out_cached([object_id])[0]
                if object_id is None:
                    assert enc is not None
                    channel.send_encoded(enc, timeout=self.heartbeat_s)
                elif found is not None:
                    channel.publish(found, timeout=self.heartbeat_s)
                else:
                    assert enc is not None  # a REF or duplicate is answered only when cached
                    channel.publish(store.hand_out_new(object_id, enc, timeout=self.heartbeat_s),
                                    timeout=self.heartbeat_s)
                break
            except (Timeout, StoreFull):
                if self._stop.is_set():
                    raise
                self._say(pack(PING))
        self._messages += 1
        if object_id is None:  # stored only if larger than this node's inline threshold
            put = channel.sent_by_handle > by_handle
        else:
            put = object_id not in self._held and store.is_cached(object_id)
            if put:
                self._held[object_id] = None
        if len(store) < objects + put:  # the put made room by dropping objects: find which
            gone = [k for k in self._held if not store.is_cached(k)]
            for k in gone:
                del self._held[k]
            self._evicted.extend(gone)

