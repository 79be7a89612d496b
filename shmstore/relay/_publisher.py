"""The Publisher: the writer's side of the relay (relay/_node.py has the protocol and scenarios)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .._proc import int_arg
from ..errors import (
    Closed,
    CorruptObject,
    InvalidArgument,
    ProtocolError,
    StaleHandle,
    Timeout,
    WriterGone,
)
from ..handle import Handle
from ..queue._channel import Channel, ChannelReader, RawMessage
from ..serde._codec import dumps
from ._peer import (
    DEFAULT_MAX_NODES,
    DEFAULT_WINDOW,
    POLL_S,
    AllowList,
    Peer,
    PublisherSecurity,
    Timing,
    check_endpoint,
)
from ._state import NodeState, NodeStats, PublisherStats
from ._wire import (
    ACK,
    BYE,
    END,
    GONE,
    HELLO,
    INLINE,
    LOST,
    MAX_HEADER_BYTES,
    NEED,
    OBJECT,
    PING,
    PROTOCOL_VERSION,
    REF,
    WELCOME,
    pack,
    parse,
)

__all__ = ["Publisher", "PublisherStats", "NodeStats"]

log = logging.getLogger("shmstore.relay")


class Publisher(Peer):
    """Forwards every message of one Channel to the relays of other nodes (see relay/_node.py's module doc).

    It is reader `reader` of channel `channel` (created with one reader more than the local
    ones) and binds `bind`. Run `serve()` (blocks until the channel ends, the writer dies, or
    stop()/close()) or `start()` for a thread. Only its own thread may call serve().
    """

    _reader: ChannelReader | None = None
    _auth: Any = None
    _ipc_file: tuple[str, int] | None = None  # an ipc:// socket's file and inode, unlinked at close

    def __init__(
        self,
        channel: str,
        reader: int,
        bind: str,
        *,
        security: PublisherSecurity | None = None,
        timing: Timing | None = None,
        window: int = DEFAULT_WINDOW,
        max_nodes: int = DEFAULT_MAX_NODES,
        allow_wildcard: bool = False,
    ) -> None:
        check_endpoint(bind, allow_wildcard)
        self.window = int_arg(window, "window", 1, 1 << 16)
        timing = (timing or Timing()).check()
        security = security or PublisherSecurity()
        self.peer_timeout_s = timing.peer_timeout_s
        self.heartbeat_s = timing.heartbeat_s
        self.ack_timeout_s = timing.ack_timeout_s
        self.max_nodes = int_arg(max_nodes, "max_nodes", 1, 1 << 16)
        security.check(bind)
        server_keys, allowed_clients = security.keys, security.allowed
        self._curve = server_keys is not None
        super().__init__()
        try:
            self._reader = Channel.attach(channel, reader)
            sock = self._zmq.socket(zmq.ROUTER)
            self._sock = sock
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, not drops
            # per node: the window's messages, each sent at most twice (once more for a NEED),
            # and the PINGs and LOSTs between them; never hit by a node that keeps up
            sock.setsockopt(zmq.SNDHWM, 2 * self.window + 64)
            sock.setsockopt(zmq.RCVHWM, 10_000)  # relays send small messages: a bound, not a limit
            # relays send headers only; a larger message disconnects its sender
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES + 1024)
            if server_keys is not None:
                self._auth = self._zmq.auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback(
                    "*", credentials_provider=AllowList(set(allowed_clients or ())))
                sock.curve_server = True
                sock.curve_secretkey = server_keys.secret
                sock.curve_publickey = server_keys.public
            sock.bind(bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.endpoint.startswith("ipc://"):  # no keys there: only this user connects
                path = self.endpoint.removeprefix("ipc://")
                self._ipc_file = (path, os.stat(path).st_ino)
                os.chmod(path, 0o600)
        except BaseException:
            self.close()
            raise
        self._nodes: dict[bytes, NodeState] = {}
        self._pending: deque[tuple[int, int, Handle]] = deque()  # (msg_no, handout, handle)
        # the one copy of each pending message's body that every node's queue shares (the
        # forward and every NEED answer): at most a window of them, dropped once all have it
        self._frames: dict[int, zmq.Frame] = {}
        self._msg_no = 0
        self._last_ping = 0.0
        self._joined = self._dropped = self._needs = self._lost = self._bad = self._refused = 0
        self._bytes_sent = 0

    # -- public --------------------------------------------------------------------------------

    @property
    def nodes_connected(self) -> int:
        """Distinct relays connected now (WELCOMEd and not dropped; a node on two connections
        counts once: by its public key with CurveZMQ, else by its name); safe from another
        thread."""
        return len({n.identity for n in list(self._nodes.values())})

    def wait_for_nodes(self, n_nodes: int, timeout: float | None = None) -> None:
        """Block until at least `n_nodes` relays are connected (serve() runs in a thread)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.nodes_connected < n_nodes:
            if end is not None and time.monotonic() >= end:
                raise Timeout(f"{self.nodes_connected} of {n_nodes} nodes connected to "
                              f"{self.endpoint} within {timeout} s", timeout)
            time.sleep(0.005)

    def stats(self) -> PublisherStats:
        """A snapshot (cheap; safe from another thread)."""
        nodes = tuple(NodeStats(n.name, n.acked, self._msg_no - n.acked, len(n.held),
                                n.objects_sent, n.refs_sent, n.bytes_sent)
                      for n in list(self._nodes.values()))
        return PublisherStats(self.endpoint, self._msg_no, nodes, self._joined, self._dropped,
                              self._needs, self._lost, self._bad, self._bytes_sent,
                              self._refused)

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
                self._finish(pack(END))
                return "end"
            except WriterGone as exc:
                self._finish(pack(GONE, exc.writer_pid))
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
        self._unlink_ipc_file()

    def _unlink_ipc_file(self) -> None:
        """Remove the socket file an ipc:// bind made (libzmq leaves it), unless another
        socket has taken its name since (its inode differs)."""
        made, self._ipc_file = self._ipc_file, None
        if made is None:
            return
        path, inode = made
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)

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
                frame = self._frames[number] = zmq.Frame(raw.stored.data, copy=True)
            node.hold(object_id)
            node.objects_sent += 1
            self._send(node, [pack(OBJECT, number, object_id), frame])
        self._pending.append((number, raw.handout, raw.handle))

    def _broadcast(self, frames: list[Any]) -> None:
        for node in list(self._nodes.values()):
            self._send(node, frames)

    def _send(self, node: NodeState, frames: list[Any]) -> None:
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
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid = parts[0].bytes
            try:
                kind, fields, _ = parse([p.bytes for p in parts[1:]])
            except ProtocolError as exc:
                self._bad += 1
                log.warning("publisher %s: dropped a message: %s", self.endpoint, exc)
                continue
            if kind == HELLO:
                # with CurveZMQ the node is its public key (ZAP's User-Id), else its name
                key = parts[1].get("User-Id") if self._curve and len(parts) > 1 else None
                self._hello(rid, fields, ("key", key) if key else ("name", fields[1]))
                continue
            node = self._nodes.get(rid)
            if node is None:
                continue  # a peer dropped earlier: it times out and says HELLO again
            node.last_heard = time.monotonic()
            if kind == ACK:
                through, evicted = fields
                if node.acked < through <= self._msg_no:
                    node.acked = through
                    node.last_progress = node.last_heard
                    node.answered = {n for n in node.answered if n > through}
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

    def _hello(self, rid: bytes, fields: list[Any], identity: tuple[str, Any]) -> None:
        version, name, epoch, held, since = fields
        if version != PROTOCOL_VERSION:
            self._bad += 1
            log.warning("publisher %s: node %r speaks protocol %d, this one %d; ignored",
                        self.endpoint, name, version, PROTOCOL_VERSION)
            return
        assert self._reader is not None  # serve() checked
        same = [n for n in self._nodes.values() if n.identity == identity]
        if any(n.since > since for n in same):
            # an older connection's HELLO arriving late: that connection is dead already
            log.info("publisher %s: node %r: a HELLO of an older connection ignored",
                     self.endpoint, name)
            return
        for n in same:  # the node connected again (a relay restarted or reconnected)
            if n.rid == rid:
                self._drop(n, "it said HELLO again")
            else:  # not a drop: the node stays, on its newer connection
                del self._nodes[n.rid]
                log.warning("publisher %s: node %r: its newer connection replaces the older one "
                            "(if this repeats, two relays use one key or node name)",
                            self.endpoint, name)
        # joined: counted once while any connection of this node lives
        again = bool(same)
        others = {n.identity for n in self._nodes.values()}
        if len(others) >= self.max_nodes:
            self._refused += 1
            log.warning("publisher %s: node %r refused: %d nodes connected already (max_nodes)",
                        self.endpoint, name, len(self._nodes))
            return
        now = time.monotonic()
        node = NodeState(rid, name, self._msg_no, now, identity, since=since, last_progress=now)
        if epoch == self._reader.store_epoch:
            for object_id in held:
                node.hold(object_id)
        self._nodes[rid] = node
        self._joined += not again
        log.info("publisher %s: node %r joined at message %d, holding %d objects",
                 self.endpoint, name, self._msg_no + 1, len(node.held))
        self._send(node, [pack(WELCOME, PROTOCOL_VERSION, self._reader.store_epoch,
                               self._reader.max_inline_bytes, self._reader.max_object_bytes,
                               self._msg_no + 1)])

    def _need(self, node: NodeState, number: int) -> None:
        assert self._reader is not None
        if number in node.answered:
            self._bad += 1  # asked for twice while unacknowledged: one body per NEED
            return
        handle = None
        if node.acked < number <= self._msg_no:  # else: not one it waits for (LOST)
            node.answered.add(number)
            handle = next((h for n, _, h in self._pending if n == number), None)
        if handle is not None:
            try:
                with self._reader.body(handle) as stored:
                    frame = self._frames.get(number)
                    if frame is None:  # every node held it when it was forwarded
                        frame = self._frames[number] = zmq.Frame(stored.data, copy=True)
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

    def _finish(self, last: bytes) -> None:
        """The channel ended: serve the nodes until each has acknowledged every message (one
        may still NEED a body), then send `last` (END or GONE). A node that stops making
        progress is dropped by _heartbeat as always, and stop() ends the wait; so does
        ack_timeout_s. Returning at once would leave the tail in the socket's queue, which a
        close within LINGER_MS of a slow link drops."""
        give_up = time.monotonic() + self.ack_timeout_s
        while (not self._stop.is_set() and time.monotonic() < give_up
               and any(n.acked < self._msg_no for n in self._nodes.values())):
            self._sock.poll(int(POLL_S * 1000))
            self._receive()
            self._heartbeat()
            self._release()
        self._broadcast([last])

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for node in list(self._nodes.values()):
            if node.acked >= self._msg_no:
                node.last_progress = now  # caught up: nothing to keep up with
            if now - node.last_heard > self.peer_timeout_s:
                self._drop(node, f"silent for {now - node.last_heard:.1f} s")
            elif now - node.last_progress > self.ack_timeout_s:  # alive, but not keeping up
                self._drop(node, f"it acknowledged nothing for {now - node.last_progress:.1f} s "
                           f"with {self._msg_no - node.acked} message(s) outstanding")
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            self._broadcast([pack(PING)])

    def _drop(self, node: NodeState, why: str) -> None:
        if self._nodes.pop(node.rid, None) is not None:
            self._dropped += 1
            log.warning("publisher %s: dropped node %r: %s", self.endpoint, node.name, why)

    def _release(self) -> None:
        """Give up objects every node has acknowledged (or all, with no node)."""
        floor = min((n.acked for n in self._nodes.values()), default=self._msg_no)
        last = 0
        pending = self._pending
        while pending and pending[0][0] <= floor:
            number, last, _ = pending.popleft()
            self._frames.pop(number, None)
        if last and self._reader is not None:
            self._reader.release_through(last)
