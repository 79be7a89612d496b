"""What both ends of the relay share (relay/_node.py has the protocol): CurveZMQ keys, the address
and argument checks, the defaults, and Peer (the ZeroMQ context, socket and serve thread)."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from .._proc import seconds_arg
from ..errors import (
    InvalidArgument,
    Timeout,
)
from ..shm._closeable import Closeable

__all__ = ["CurveKeys", "PublisherSecurity", "RelaySecurity", "Timing", "generate_keys",
           "check_endpoint", "check_ipc_owner", "check_curve", "check_plaintext",
           "AllowList", "Peer", "DEFAULT_WINDOW", "DEFAULT_PEER_TIMEOUT_S", "DEFAULT_HEARTBEAT_S",
           "DEFAULT_MAX_NODES", "DEFAULT_ACK_TIMEOUT_S", "POLL_S", "MAX_HELD_IDS", "LINGER_MS"]

log = logging.getLogger("shmstore.relay")

DEFAULT_WINDOW = 64  # messages a node may leave unacknowledged before the Publisher waits
DEFAULT_PEER_TIMEOUT_S = 3.0  # silence after which a peer counts as gone
DEFAULT_HEARTBEAT_S = 0.5  # PING interval when nothing else is said
POLL_S = 0.01  # longest the Publisher waits on its channel before serving the network again
MAX_HELD_IDS = 1 << 16  # per node; beyond it the oldest beliefs are forgotten (a resend at most)
DEFAULT_MAX_NODES = 64  # relays one Publisher serves at once; more are refused
DEFAULT_ACK_TIMEOUT_S = 10.0  # a node that acknowledges nothing for this long while behind is dropped
LINGER_MS = 1000  # how long closing waits to flush a last END/GONE/BYE


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


@dataclass(frozen=True, slots=True)
class PublisherSecurity:
    """How a Publisher admits relays, configured once (pyzmq's authenticator idea): its own
    key pair (with the secret) and the public keys of the relays it accepts. Without keys the
    Publisher runs plain TCP, refused unless `plaintext` is set (an ipc:// endpoint needs no
    keys: the filesystem guards it)."""

    keys: CurveKeys | None = None
    allowed: tuple[bytes, ...] | None = None
    plaintext: bool = False

    def check(self, endpoint: str) -> None:
        """InvalidArgument for keys without the relays' (or the reverse), a pair without its
        secret, or plain TCP not asked for."""
        check_curve(self.keys, "security.keys", self.allowed, "security.allowed",
                    "the public keys of the relays that may connect")
        check_plaintext(self.keys, endpoint, self.plaintext, "publisher",
                        "PublisherSecurity(keys=, allowed=)")


@dataclass(frozen=True, slots=True)
class RelaySecurity:
    """How a Relay proves itself and knows its Publisher: its own key pair (with the secret)
    and the Publisher's public key. Without keys, plain TCP, refused unless `plaintext`."""

    keys: CurveKeys | None = None
    server_key: bytes | None = None
    plaintext: bool = False

    def check(self, endpoint: str) -> None:
        """As PublisherSecurity.check."""
        check_curve(self.keys, "security.keys", self.server_key, "security.server_key",
                    "the Publisher's public key")
        check_plaintext(self.keys, endpoint, self.plaintext, "relay",
                        "RelaySecurity(keys=, server_key=)")


@dataclass(frozen=True, slots=True)
class Timing:
    """The relay's clocks, on both sides: a peer silent for `peer_timeout_s` is gone; a PING
    goes every `heartbeat_s` when nothing else is said; a Publisher drops a node that
    acknowledges nothing for `ack_timeout_s` while behind; a Relay whose Publisher is gone
    this long (`writer_timeout_s`, None: never) ends its channel with WriterGone."""

    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S
    writer_timeout_s: float | None = None

    def check(self) -> Timing:
        """This timing with each value checked (InvalidArgument names the field)."""
        return Timing(seconds_arg(self.peer_timeout_s, "timing.peer_timeout_s"),
                      seconds_arg(self.heartbeat_s, "timing.heartbeat_s"),
                      seconds_arg(self.ack_timeout_s, "timing.ack_timeout_s"),
                      None if self.writer_timeout_s is None
                      else seconds_arg(self.writer_timeout_s, "timing.writer_timeout_s"))


def generate_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a new key pair: DIR/NAME.key (public, give it to the peer) and DIR/NAME.key_secret
    (keep it private; mode 0600). Returns both paths."""
    os.makedirs(directory, exist_ok=True)
    public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def check_curve(keys: CurveKeys | None, keys_arg: str, partner: Any, partner_arg: str,
                 partner_what: str) -> None:
    """CurveZMQ needs this side's key pair (with its secret) and `partner` together, or neither."""
    if (keys is None) != (partner is None):
        raise InvalidArgument(f"CurveZMQ needs both {keys_arg} and {partner_arg} ({partner_what}),"
                              " or neither", partner_arg, partner)
    if keys is not None and keys.secret is None:
        raise InvalidArgument(f"{keys_arg} needs the secret key (NAME.key_secret)", keys_arg,
                              keys.public)


def check_plaintext(keys: Any, endpoint: str, allow_plaintext: bool, who: str,
                    keys_arg: str) -> None:
    """Refuse plain TCP unless asked for (anyone who reaches the port could join or pose as a
    peer); warn when it is asked for."""
    if keys is not None or endpoint.startswith("ipc://"):
        return
    if not allow_plaintext:
        raise InvalidArgument(
            f"{who} on {endpoint} without CurveZMQ keys: any host that reaches it could "
            f"{'receive every stored tensor' if who == 'publisher' else 'feed this node data'}. "
            f"Make keys with `shmstore relay keygen DIR NAME` and pass {keys_arg} (--keys, "
            "--allow / --server-key), or pass plaintext=True (--insecure) on a trusted "
            "network", "security.plaintext", allow_plaintext)
    log.warning("%s on %s runs WITHOUT encryption or authentication (plaintext): any "
                "host that reaches it can join; use CurveZMQ keys off a trusted network",
                who, endpoint)


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
    if not allow_wildcard and _unspecified(host):
        raise InvalidArgument(f"endpoint {endpoint!r} listens on every interface; bind the "
                              "address remote nodes reach (tcp://10.0.0.1:5555), or pass "
                              "allow_wildcard=True (--allow-wildcard) on a trusted network",
                              "endpoint", endpoint)
    return endpoint


def check_ipc_owner(endpoint: str) -> None:
    """For an ipc:// endpoint, which needs no keys: refuse a socket file that another user
    made (in a shared directory such as /tmp, whoever binds the path first could pose as the
    Publisher). A path not there yet is the Publisher's to make."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint.removeprefix("ipc://")
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        return
    if owner != os.getuid():
        raise InvalidArgument(
            f"{endpoint}: the socket file belongs to uid {owner}, not to this user "
            f"({os.getuid()}): another user may pose as the Publisher there; use a path in a "
            "directory only this user can write, or tcp:// with CurveZMQ keys",
            "endpoint", endpoint)


def _unspecified(host: str) -> bool:
    """Whether binding `host` listens on every interface: `*`, an empty host, or any spelling
    of 0.0.0.0 or :: (`0`, `0x0`, `0.0`, `00.0.0.0`, `[::0]`, ...), or a name resolving to one."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_unspecified
    except ValueError:
        pass
    try:  # the forms inet_aton (and so the resolver zmq uses) takes: 0, 0x0, 0.0, 00.0.0.0
        return socket.inet_aton(host) == bytes(4)
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False  # unresolvable: binding it fails, naming it
    return any(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_unspecified
               for info in infos)


class AllowList:
    """ZAP credentials provider: a connecting client's public key must be in the set."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self.keys
        if not allowed:
            log.warning("refused a relay with an unknown CurveZMQ key %s", key[:8])
        return allowed


class _Zmq:
    """One Peer's ZeroMQ context and everything made in it, held apart from the Peer. A Peer
    dropped without close() inside a reference cycle has its weak references cleared before
    it is collected: pyzmq's Context.__del__ then sees no socket to close and term() blocks
    for ever on the one still open, in whatever thread the collection runs. The finalizer
    registered on the Peer holds this object instead, and closes it all when the Peer goes."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[Any] = []
        self.auth: Any = None

    def socket(self, kind: int) -> Any:
        self.sockets = [s for s in self.sockets if not s.closed]
        sock = self.ctx.socket(kind)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        """Close what is left at once (linger 0) and end the context; idempotent."""
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets.clear()
        if not self.ctx.closed:
            self.ctx.term()


class Peer(Closeable):
    """The ZeroMQ context, socket and stop flag both ends share; close() stops serve first.
    One dropped without close() may leak until collected, and never hangs the collection."""

    _ctx: Any = None
    _sock: Any = None
    _thread: threading.Thread | None = None
    _result: str | BaseException | None = None

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._zmq = _Zmq()
        self._ctx = self._zmq.ctx
        self._forgotten = weakref.finalize(self, self._zmq.close)
        # not at interpreter exit: exit handlers registered before it (vLLM's shutdown, which
        # ends the head's channel and lets its Publisher send END) must run while it serves
        self._forgotten.atexit = False

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
            self._forgotten()  # what is still open, and the context
            self._ctx = None

    def _close_owned(self) -> None:
        """Close what the subclass owns besides the socket (before the context ends)."""

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=LINGER_MS)
            self._sock = None
