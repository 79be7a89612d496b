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
(`_wire.py`: an id names the bytes, not the key). It learns them from what it sent, from the
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
 7. Writer ends or dies. The Publisher's channel read says Closed or WriterGone; it sends END or
    GONE; each relay ends its local queue so its readers get Closed or WriterGone after the last
    message. A writer node that vanishes without a word: a relay with writer_timeout_s set
    reports WriterGone once it has heard nothing that long.

Security: the Publisher binds one explicit address (a wildcard such as tcp://*:5555 or
0.0.0.0 needs allow_wildcard=True). With CurveZMQ keys (CurveKeys, `shmstore relay keygen`)
every connection is encrypted and only relays whose public key is in `allowed_clients` get
past the handshake: others can neither receive nor inject. Every message is checked against its
schema (_wire.py) and every body is decoded with the same checks as bytes from shared memory.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ._closeable import Closeable
from ._proc import int_arg, number_arg
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
from .channel import DEFAULT_INLINE_THRESHOLD, Channel, ChannelReader, ChannelWriter, RawMessage
from .errors import (
    Closed,
    CorruptObject,
    InvalidArgument,
    ObjectTooLarge,
    ProtocolError,
    StaleHandle,
    StoreFull,
    Timeout,
    WriterGone,
)
from .handle import Handle
from .policy import DEFAULT_POLICY
from .serde import dumps, loads

__all__ = ["Publisher", "Relay", "CurveKeys", "PublisherStats", "NodeStats", "RelayStats",
           "generate_keys", "DEFAULT_WINDOW", "DEFAULT_PEER_TIMEOUT_S", "DEFAULT_HEARTBEAT_S"]

log = logging.getLogger("shmstore.relay")

DEFAULT_WINDOW = 64  # messages a node may leave unacknowledged before the Publisher waits
DEFAULT_PEER_TIMEOUT_S = 3.0  # silence after which a peer counts as gone
DEFAULT_HEARTBEAT_S = 0.5  # PING interval when nothing else is said
POLL_S = 0.01  # longest the Publisher waits on its channel before serving the network again
MAX_HELD_IDS = 1 << 20  # per node; beyond it the oldest beliefs are forgotten (a resend at most)
LINGER_MS = 1000  # how long closing waits to flush a last END/GONE/BYE
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CurveZMQ key pair (z85 bytes); `secret` may be None for a peer's public key only."""

    public: bytes
    secret: bytes | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeys:
        """Read a key file written by `generate_keys` (NAME.key_secret, or NAME.key: public)."""
        try:
            public, secret = zmq.auth.load_certificate(os.fspath(path))
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot read CurveZMQ keys from {os.fspath(path)!r}: {exc}; "
                                  "make them with `shmstore relay keygen DIR NAME`",
                                  "path", path) from None
        return cls(public, secret)


def generate_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a new key pair: DIR/NAME.key (public, give it to the peer) and DIR/NAME.key_secret
    (keep it private; mode 0600). Returns both paths."""
    os.makedirs(directory, exist_ok=True)
    public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _seconds(value: Any, argument: str) -> float:
    seconds = number_arg(value, argument, allow_none=False)
    if not seconds:
        raise InvalidArgument(f"{argument} must be more than 0 seconds, got {value!r}",
                              argument, value)
    return float(seconds)


def _check_curve(keys: CurveKeys | None, keys_arg: str, partner: Any, partner_arg: str,
                 partner_what: str) -> None:
    """CurveZMQ needs this side's key pair (with its secret) and `partner` together, or neither."""
    if (keys is None) != (partner is None):
        raise InvalidArgument(f"CurveZMQ needs both {keys_arg} and {partner_arg} ({partner_what}),"
                              " or neither", partner_arg, partner)
    if keys is not None and keys.secret is None:
        raise InvalidArgument(f"{keys_arg} needs the secret key (NAME.key_secret)", keys_arg,
                              keys.public)


def check_endpoint(endpoint: str, allow_wildcard: bool) -> str:
    """Return `endpoint` if it is tcp://HOST:PORT (or ipc://PATH) and, unless allowed, names
    one address rather than every interface."""
    if type(endpoint) is not str:
        raise InvalidArgument(f"an endpoint is a str such as 'tcp://10.0.0.1:5555', got "
                              f"{type(endpoint).__name__}", "endpoint", endpoint)
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return endpoint
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not (port.isdigit() or port == "*"):
        raise InvalidArgument(f"endpoint {endpoint!r} is not tcp://HOST:PORT (or ipc://PATH)",
                              "endpoint", endpoint)
    if host in _WILDCARD_HOSTS and not allow_wildcard:
        raise InvalidArgument(f"endpoint {endpoint!r} listens on every interface; bind the "
                              "address remote nodes reach (tcp://10.0.0.1:5555), or pass "
                              "allow_wildcard=True (--allow-wildcard) on a trusted network",
                              "endpoint", endpoint)
    return endpoint


class _AllowList:
    """ZAP credentials provider: a connecting client's public key must be in the set."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self.keys
        if not allowed:
            log.warning("refused a relay with an unknown CurveZMQ key %s", key[:8])
        return allowed


@dataclass(frozen=True, slots=True)
class NodeStats:
    """One connected node as the Publisher sees it."""

    name: str
    acked: int  # messages through this number are acknowledged
    unacked: int  # messages sent and not yet acknowledged
    held: int  # objects the Publisher believes the node holds
    objects_sent: int  # bodies sent (OBJECT)
    refs_sent: int  # REFs sent instead of a body
    bytes_sent: int  # every frame to this node, headers included


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """A snapshot of a Publisher."""

    endpoint: str
    messages: int  # messages read from the channel
    nodes: tuple[NodeStats, ...]
    nodes_joined: int
    nodes_dropped: int  # silent for peer_timeout_s, too slow for ZeroMQ's queue, or gone
    needs_served: int  # bodies sent again on a NEED
    lost: int  # messages sent as LOST: cleared or damaged before they could be read
    bad_messages: int  # dropped: not of this protocol
    bytes_sent: int


@dataclass
class _Node:
    rid: bytes
    name: str
    acked: int
    last_heard: float
    held: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    objects_sent: int = 0
    refs_sent: int = 0
    bytes_sent: int = 0

    def hold(self, object_id: bytes) -> None:
        self.held[object_id] = None
        if len(self.held) > MAX_HELD_IDS:
            self.held.popitem(last=False)


class _Peer(Closeable):
    """The ZeroMQ context, socket and stop flag both ends share; close() stops serve first."""

    _ctx: Any = None
    _sock: Any = None
    _thread: threading.Thread | None = None
    _result: str | BaseException | None = None

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._ctx = zmq.Context()

    def start(self) -> threading.Thread:
        """Run serve() in a daemon thread; close() stops it. Returns the thread."""
        if self._thread is not None:
            raise InvalidArgument(f"{type(self).__name__} is already serving", "start", None)
        thread = threading.Thread(target=self._serve_thread, name=type(self).__name__,
                                  daemon=True)
        self._thread = thread
        thread.start()
        return thread

    @property
    def serving(self) -> bool:
        """serve() runs in the thread start() made (False before start and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    def _serve_thread(self) -> None:
        try:
            self._result = self.serve()
        except BaseException as exc:  # kept for result(); the thread must not die silently
            log.exception("%s stopped", type(self).__name__)
            self._result = exc

    def result(self, timeout: float | None = None) -> str:
        """Wait for a start()ed serve() to end; return why ("end", "gone", "closed") or raise
        what it raised. Raises Timeout if it is still serving."""
        thread = self._thread
        if thread is None:
            raise InvalidArgument("result() needs start() first", "result", None)
        thread.join(timeout)
        if thread.is_alive():
            raise Timeout(f"{type(self).__name__} still serving after {timeout} s", timeout)
        if isinstance(self._result, BaseException):
            raise self._result
        return str(self._result)

    def serve(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        """Ask serve() to return (within ~POLL_S); safe from a signal handler or a thread."""
        self._stop.set()

    def close(self) -> None:
        """Stop serving, then close the socket, what the subclass owns, and the context;
        idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._close_socket()
        self._close_owned()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _close_owned(self) -> None:
        """Close what the subclass owns besides the socket (before the context ends)."""

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=LINGER_MS)
            self._sock = None


class Publisher(_Peer):
    """Forwards every message of one Channel to the relays of other nodes (see the module doc).

    It is reader `reader` of channel `channel` (created with one reader more than the local
    ones) and binds `bind`. Run `serve()` (blocks until the channel ends, the writer dies, or
    stop()/close()) or `start()` for a thread. Only its own thread may call serve().
    """

    _reader: ChannelReader | None = None
    _auth: Any = None

    def __init__(
        self,
        channel: str,
        reader: int,
        bind: str,
        *,
        server_keys: CurveKeys | None = None,
        allowed_clients: list[bytes] | None = None,
        allow_wildcard: bool = False,
        window: int = DEFAULT_WINDOW,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        check_endpoint(bind, allow_wildcard)
        self.window = int_arg(window, "window", 1, 1 << 16)
        self.peer_timeout_s = _seconds(peer_timeout_s, "peer_timeout_s")
        self.heartbeat_s = _seconds(heartbeat_s, "heartbeat_s")
        _check_curve(server_keys, "server_keys", allowed_clients, "allowed_clients",
                     "the public keys of the relays that may connect")
        super().__init__()
        try:
            self._reader = Channel.attach(channel, reader)
            sock = self._ctx.socket(zmq.ROUTER)
            self._sock = sock
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, not drops
            sock.setsockopt(zmq.SNDHWM, 4 * self.window + 64)  # above the window: never hit
            sock.setsockopt(zmq.RCVHWM, 10_000)  # relays send small messages: a bound, not a limit
            if server_keys is not None:
                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback(
                    "*", credentials_provider=_AllowList(set(allowed_clients or ())))
                sock.curve_server = True
                sock.curve_secretkey = server_keys.secret
                sock.curve_publickey = server_keys.public
            sock.bind(bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise
        self._nodes: dict[bytes, _Node] = {}
        self._pending: deque[tuple[int, int, Handle]] = deque()  # (msg_no, handout, handle)
        self._msg_no = 0
        self._last_ping = 0.0
        self._joined = self._dropped = self._needs = self._lost = self._bad = 0
        self._bytes_sent = 0

    # -- public --------------------------------------------------------------------------------

    @property
    def nodes_connected(self) -> int:
        """Relays connected now (WELCOMEd and not dropped); safe from another thread."""
        return len(self._nodes)

    def wait_for_nodes(self, n_nodes: int, timeout: float | None = None) -> None:
        """Block until at least `n_nodes` relays are connected (serve() runs in a thread)."""
        end = None if timeout is None else time.monotonic() + timeout
        while len(self._nodes) < n_nodes:
            if end is not None and time.monotonic() >= end:
                raise Timeout(f"{len(self._nodes)} of {n_nodes} nodes connected to "
                              f"{self.endpoint} within {timeout} s", timeout)
            time.sleep(0.005)

    def stats(self) -> PublisherStats:
        """A snapshot (cheap; safe from another thread)."""
        nodes = tuple(NodeStats(n.name, n.acked, self._msg_no - n.acked, len(n.held),
                                n.objects_sent, n.refs_sent, n.bytes_sent)
                      for n in list(self._nodes.values()))
        return PublisherStats(self.endpoint, self._msg_no, nodes, self._joined, self._dropped,
                              self._needs, self._lost, self._bad, self._bytes_sent)

    def serve(self) -> str:
        """Forward until the channel ends ("end"), its writer dies ("gone") or stop() ("closed")."""
        reader = self._reader
        if reader is None:
            raise InvalidArgument("the Publisher is closed", "serve", None)
        while not self._stop.is_set():
            self._receive()
            self._heartbeat()
            self._release()
            if self._nodes and any(self._msg_no - n.acked >= self.window
                                   for n in self._nodes.values()):
                self._sock.poll(int(POLL_S * 1000))  # a slow node: wait for its ACKs
                continue
            try:
                with reader.recv_raw(timeout=POLL_S, keep=True) as raw:
                    self._forward(raw)
            except Timeout:
                continue
            except (CorruptObject, StaleHandle) as exc:
                # damaged, or cleared before it was read: a local reader would get this error;
                # the nodes get LOST for it (they skip it and count it)
                log.warning("publisher %s: %s", self.endpoint, exc)
                self._msg_no += 1
                self._lost += 1
                self._broadcast([pack(LOST, self._msg_no)])
            except Closed:
                self._broadcast([pack(END)])
                return "end"
            except WriterGone as exc:
                self._broadcast([pack(GONE, exc.writer_pid)])
                return "gone"
        return "closed"

    def close(self) -> None:
        """Stop serving, close the socket (flushing a last END/GONE), the authenticator and the
        channel reader; idempotent. Connected relays notice within peer_timeout_s."""
        super().close()

    def _close_owned(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # -- internals -----------------------------------------------------------------------------

    def _forward(self, raw: RawMessage) -> None:
        self._msg_no += 1
        number = self._msg_no
        if raw.stored is None:
            self._broadcast([pack(INLINE, number), dumps(raw.value)])
            return
        assert raw.handle is not None  # a stored message has one
        object_id = raw.stored.object_id
        frame = None
        for node in list(self._nodes.values()):
            if object_id in node.held:
                node.refs_sent += 1
                self._send(node, [pack(REF, number, object_id)])
                continue
            if frame is None:  # one copy for every node, taken while the chunk is pinned
                frame = zmq.Frame(raw.stored.data, copy=True)
            node.hold(object_id)
            node.objects_sent += 1
            self._send(node, [pack(OBJECT, number, object_id), frame])
        self._pending.append((number, raw.handout, raw.handle))

    def _broadcast(self, frames: list[Any]) -> None:
        for node in list(self._nodes.values()):
            self._send(node, frames)

    def _send(self, node: _Node, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart([node.rid, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._drop(node, "its ZeroMQ send queue is full")
            return
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its connection is gone
            self._drop(node, f"it is unreachable ({exc})")
            return
        nbytes = sum(len(f.buffer) if isinstance(f, zmq.Frame) else len(f) for f in frames)
        node.bytes_sent += nbytes
        self._bytes_sent += nbytes

    def _receive(self) -> None:
        sock = self._sock
        for _ in range(1000):  # then forward again: a flood of relay messages cannot starve it
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            rid = frames[0]
            try:
                kind, fields, _ = parse(frames[1:])
            except ProtocolError as exc:
                self._bad += 1
                log.warning("publisher %s: dropped a message: %s", self.endpoint, exc)
                continue
            if kind == HELLO:
                self._hello(rid, fields)
                continue
            node = self._nodes.get(rid)
            if node is None:
                continue  # a peer dropped earlier: it times out and says HELLO again
            node.last_heard = time.monotonic()
            if kind == ACK:
                through, evicted = fields
                if through <= self._msg_no:
                    node.acked = max(node.acked, through)
                for object_id in evicted:
                    node.held.pop(object_id, None)
            elif kind == NEED:
                self._need(node, fields[0])
            elif kind == BYE:
                self._drop(node, "it said BYE")
            elif kind != PING:
                self._bad += 1
                log.warning("publisher %s: node %r sent a publisher's message kind %d",
                            self.endpoint, node.name, kind)

    def _hello(self, rid: bytes, fields: list[Any]) -> None:
        version, name, epoch, held = fields
        if version != PROTOCOL_VERSION:
            self._bad += 1
            log.warning("publisher %s: node %r speaks protocol %d, this one %d; ignored",
                        self.endpoint, name, version, PROTOCOL_VERSION)
            return
        assert self._reader is not None  # serve() checked
        node = _Node(rid, name, self._msg_no, time.monotonic())
        if epoch == self._reader.store_epoch:
            for object_id in held:
                node.hold(object_id)
        self._nodes[rid] = node
        self._joined += 1
        log.info("publisher %s: node %r joined at message %d, holding %d objects",
                 self.endpoint, name, self._msg_no + 1, len(node.held))
        self._send(node, [pack(WELCOME, PROTOCOL_VERSION, self._reader.store_epoch,
                               self._reader.max_inline_bytes, self._reader.max_object_bytes,
                               self._msg_no + 1)])

    def _need(self, node: _Node, number: int) -> None:
        assert self._reader is not None
        handle = next((h for n, _, h in self._pending if n == number), None)
        if handle is not None and number > node.acked:
            try:
                with self._reader.body(handle) as stored:
                    frame = zmq.Frame(stored.data, copy=True)
                    object_id = stored.object_id
            except (StaleHandle, CorruptObject) as exc:
                log.warning("publisher %s: message %d for node %r is gone: %s", self.endpoint,
                            number, node.name, exc)
            else:
                self._needs += 1
                node.hold(object_id)
                node.objects_sent += 1
                self._send(node, [pack(OBJECT, number, object_id), frame])
                return
        self._lost += 1
        self._send(node, [pack(LOST, number)])

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for node in list(self._nodes.values()):
            if now - node.last_heard > self.peer_timeout_s:
                self._drop(node, f"silent for {now - node.last_heard:.1f} s")
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            self._broadcast([pack(PING)])

    def _drop(self, node: _Node, why: str) -> None:
        if self._nodes.pop(node.rid, None) is not None:
            self._dropped += 1
            log.warning("publisher %s: dropped node %r: %s", self.endpoint, node.name, why)

    def _release(self) -> None:
        """Give up objects every node has acknowledged (or all, with no node)."""
        floor = min((n.acked for n in self._nodes.values()), default=self._msg_no)
        last = 0
        pending = self._pending
        while pending and pending[0][0] <= floor:
            last = pending.popleft()[1]
        if last and self._reader is not None:
            self._reader.release_through(last)


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


class Relay(_Peer):
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
        n_readers: int,
        capacity_bytes: int = 1 << 30,
        *,
        node: str | None = None,
        client_keys: CurveKeys | None = None,
        server_key: bytes | None = None,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        n_slots: int = 64,
        policy: str = DEFAULT_POLICY,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        writer_timeout_s: float | None = None,
        mode: int = 0o600,
    ) -> None:
        self.connect = check_endpoint(connect, allow_wildcard=False)
        _check_curve(client_keys, "client_keys", server_key, "server_key",
                     "the Publisher's public key")
        self.peer_timeout_s = _seconds(peer_timeout_s, "peer_timeout_s")
        self.heartbeat_s = _seconds(heartbeat_s, "heartbeat_s")
        self.writer_timeout_s = (None if writer_timeout_s is None
                                 else _seconds(writer_timeout_s, "writer_timeout_s"))
        self.node = node if node is not None else f"{os.uname().nodename}:{os.getpid()}"
        self._keys = client_keys
        self._server_key = server_key
        super().__init__()
        try:
            self._channel = Channel.create(name, n_readers, capacity_bytes, inline_threshold,
                                           n_slots=n_slots, policy=policy, mode=mode)
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
            if self._sock.poll(int(self.heartbeat_s * 500)):
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
            if now - self._last_heard > self.peer_timeout_s:
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
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16))
        sock.setsockopt(zmq.RCVHWM, 0)  # bounded by the Publisher's window
        sock.setsockopt(zmq.SNDHWM, 1000)
        if self._keys is not None:
            sock.curve_secretkey = self._keys.secret
            sock.curve_publickey = self._keys.public
            sock.curve_serverkey = self._server_key
        sock.connect(self.connect)
        self._sock = sock
        self._expect = self._waiting = None
        self._backlog.clear()
        self._last_heard = time.monotonic()
        self._say(pack(HELLO, PROTOCOL_VERSION, self.node[:256], self._epoch, list(self._held)))

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
                self._send_local(loads(body.buffer, copy=True), None)
            elif kind == OBJECT:
                object_id = fields[1]
                self._objects += 1
                if self.channel.store.is_cached(object_id):
                    self._dups += 1
                    self._send_local(None, object_id)
                else:
                    self._send_local(loads(body.buffer, copy=False), object_id)
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
            self._lost += 1
            log.error("relay %r: message %d skipped on this node: %s", self.name, number, exc)
        self._expect = number + 1
        self._say(pack(ACK, number, self._evicted))
        self._reported += len(self._evicted)
        self._evicted = []

    def _send_local(self, value: Any, object_id: bytes | None) -> None:
        """Hand a value (or the cached object `object_id`) to the local readers; while they are
        slow, keep the Publisher told that this node lives. An object stored on the writer's
        node is stored here too, whatever its size: the node holds it for the next REF, and
        its readers get a handle, as there."""
        channel = self.channel
        store = channel.store
        objects, by_handle = len(store), channel.sent_by_handle
        while True:
            try:
                if object_id is None:
                    channel.send(value, timeout=self.heartbeat_s)
                else:
                    handle = (store.get_cached(object_id) if store.is_cached(object_id)
                              else store.put(object_id, value, timeout=self.heartbeat_s))
                    channel.publish(handle, timeout=self.heartbeat_s)
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
