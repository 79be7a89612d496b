"""A service on this machine for this user: its name, its server and a client's connect.

Names live in Linux's abstract socket namespace (no file to clean up), which every user can
list (/proc/net/unix). A service's name is a keyed digest of the service's kind, the store's
name and the store's random epoch, which only the store's user can read (the segment is 0600):
another user can neither predict a name nor derive one service's name from another's that it
sees listed, so none can bind a name first. A server serves processes of its own uid only
(SO_PEERCRED), and connect() refuses a server of another uid.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import InvalidArgument
from ..shm._closeable import Closeable

__all__ = ["service_address", "SameUserServer", "connect", "peer", "peer_uid", "readable",
           "wait_hang_up", "SERVICES"]

log = logging.getLogger("shmstore")
SERVICES = ("writer", "pool")  # the kinds of local service a store has
REFUSAL_LOG_S = 60.0  # refused connections are logged at most once this often, with a count
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_DIGEST_BYTES = 16


def service_address(service: str, name: str, epoch: int) -> str:
    """The abstract socket name of `service` ("writer", "pool") of store `name` whose random
    per-create number is `epoch`. One length whatever the store's name (a Linux socket name
    holds 107 bytes); the service is part of the digest's key, so one service's name says
    nothing about another's."""
    if service not in SERVICES:
        raise InvalidArgument(f"no local service {service!r}: one of {', '.join(SERVICES)}",
                              "service", service)
    key = epoch.to_bytes(8, "little", signed=False)
    digest = hashlib.blake2b(f"{service}\0{name}".encode(), digest_size=_DIGEST_BYTES,
                             key=key).hexdigest()
    return f"\0shmstore.{service}.{os.getuid()}.{digest}"


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of `sock` (SO_PEERCRED)."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return int(pid), int(uid)


def peer_uid(sock: socket.socket) -> int:
    return peer(sock)[1]


def readable(sock: socket.socket, timeout_s: float | None) -> bool:
    """Whether `sock` has something to read (or was closed) within `timeout_s` (None: wait).
    poll, not select: a server process may hold descriptors above select's 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


def wait_hang_up(sock: socket.socket) -> None:
    """Return once the other end of `sock` hangs up (or this end is shut down), and not before:
    bytes arriving do not wake the waiter (POLLRDHUP, Linux), so a thread that watches a
    connection for its peer's death costs nothing per exchange on it."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)  # POLLHUP and POLLERR are reported anyway
    poller.poll()


def connect(address: str, *, what: str, timeout_s: float | None) -> socket.socket:
    """A connected socket to the server at `address`, checked to run as this user. OSError when
    none listens there; PermissionError when one of another user does (closed at once)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise PermissionError(f"{what} runs as another user (uid {uid}); refusing it")
    except BaseException:
        sock.close()
        raise
    return sock


class SameUserServer(Closeable):
    """A listening socket at `address` that serves processes of this user only (from
    start()), at most `max_clients` at once: each connection gets a thread running
    serve(sock, pid), which closes the socket when done. Refused connections (another user,
    too many) are counted (`refused`) and logged at most once per REFUSAL_LOG_S. close() stops
    accepting and shuts down every connection (their threads see it and end); idempotent."""

    _listener: socket.socket | None = None

    def __init__(self, address: str, serve: Callable[[socket.socket, int], None], *,
                 what: str, name: str, max_clients: int) -> None:
        self.clients: set[socket.socket] = set()
        self.closing = False
        self.refused = 0
        self._serve, self._what, self._max_clients = serve, what, max_clients
        self._starting = threading.Lock()
        self._accepting: threading.Thread | None = None
        self._logged_at, self._logged_count = -REFUSAL_LOG_S, 0
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
        except OSError as exc:
            listener.close()
            raise InvalidArgument(
                f"cannot serve {what} to other processes: its socket name is taken ({exc}); "
                "another process serves it already", "name", name) from None
        listener.listen(max_clients)
        self._listener = listener
        self._name = name

    def start(self) -> None:
        """Serve from now on. Its owner calls this once it holds the server: until then a
        client that connects waits in the listen queue, where serve() would meet an owner
        still being made (one that counts itself closing, and drops the client). Idempotent:
        one thread accepts, however often it is called."""
        with self._starting:
            if self._accepting is None:
                self._accepting = threading.Thread(
                    target=self._accept, name=f"shmstore-serve-{self._name}", daemon=True)
                self._accepting.start()

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None and not self.closing:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed
            pid, uid = peer(sock)
            if uid != os.getuid() or len(self.clients) >= self._max_clients:
                sock.close()
                self._refused(uid)
                continue
            self.clients.add(sock)
            threading.Thread(target=self._run, args=(sock, pid), daemon=True,
                             name=f"shmstore-serve-{self._what}-client").start()

    def _refused(self, uid: int) -> None:
        """Count a refused connection; log it unless one was logged under REFUSAL_LOG_S ago
        (a flood of connections from another user costs a line a minute)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at < REFUSAL_LOG_S:
            return
        since, self._logged_at, self._logged_count = (self.refused - self._logged_count, now,
                                                      self.refused)
        log.warning("shmstore: %s refused %d connection(s) (the last of uid %d: another user, "
                    "or %d connections already); the next are logged after %.0f s", self._what,
                    since, uid, self._max_clients, REFUSAL_LOG_S)

    def _run(self, sock: socket.socket, pid: int) -> None:
        try:
            self._serve(sock, pid)
        finally:
            self.clients.discard(sock)

    def close(self) -> None:
        """Stop serving; connected clients see their connection end. Idempotent."""
        self.closing = True
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in list(self.clients):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def closed(self) -> bool:
        return self._listener is None
