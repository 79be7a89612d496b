"""One store, several writing processes: the writer's process lends its writer to others.

A store has one writer (store/writer.py): its key index, hand-out records and ring state live
in that process. Other processes of the same user on the machine (several API servers of one
inference server) share the store through the WriterHost the writer's process runs::

    writer's process                              another process (RemoteWriter)
      StoreWriter + lock                            is_cached / get_cached / give_back /
      WriterHost thread(s) <--- unix socket --->    hand_out / narrow / end_handouts / ...
                                                      (one round trip each; give_back and
                                                      narrow may be posted: no reply)
      ring in /dev/shm  <------------------------   put: `begin` lends a chunk of the ring,
                                                    the client copies the body straight into
                                                    it, `commit` publishes it (one copy)

The socket is in Linux's abstract namespace (no file to clean up). The host accepts only
peers of its own user id (SO_PEERCRED), and a client only a host of its own user id. Frames are
a u32 length and a msgpack array, at most MAX_FRAME_BYTES; a frame that is not a request the
host knows closes that connection (logged) and nothing else. A lent chunk whose client goes
away before `commit` is given back to the ring.

Every RemoteWriter call (remote.py) takes the host's lock, so the host's own thread and every client see
one writer operation at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import (
    InvalidArgument,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    ObjectTooLarge,
    ProtocolError,
    ReaderIndexError,
    ShmStoreError,
    StaleHandle,
    StoreFull,
)
from ..handle import Handle, check_key
from ..shm._closeable import Closeable
from ._space import Entry
from .writer import StoreWriter

__all__ = ["WriterHost", "host_address", "send_frame", "recv_frame", "handle_to_wire", "handle_from_wire",
           "int_list", "peer_uid", "ERRORS"]

log = logging.getLogger("shmstore")
PROTOCOL = 1
MAX_FRAME_BYTES = 1 << 20  # requests carry keys and hand-out numbers, never object bytes
MAX_CLIENTS = 64  # connections one host serves at once
MAX_KEYS = 1024  # keys in one hand_out_cached or cached call
MAX_LOANS = 16  # chunks one client may hold lent at once
CONNECT_TIMEOUT_S = 30.0  # a client waits this long for the host to listen
CALL_TIMEOUT_S = 60.0  # a reply slower than this means the host is stuck: the call fails
POSTABLE = ("give_back", "narrow")  # calls a client may send without waiting (wait=False)
LENGTH = struct.Struct("<I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def host_address(name: str) -> str:
    """The abstract socket name of the host of store `name` (no file in the filesystem)."""
    return f"\0shmstore.writer.{os.getuid()}.{name}"


def peer_uid(sock: socket.socket) -> int:
    uid: int = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]
    return uid


def send_frame(sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:  # refused before sending: the connection stays usable
        raise InvalidArgument(f"a {obj[0]!r} request of {len(body)} bytes is over the "
                              f"{MAX_FRAME_BYTES}-byte frame limit: use shorter keys (a content "
                              "hash) or fewer at once", "request", len(body))
    sock.sendall(LENGTH.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts = []
    while n:
        part = sock.recv(min(n, 1 << 16))
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> Any:
    """The next frame, None when the peer closed; ProtocolError for a frame out of bounds."""
    head = recv_exact(sock, LENGTH.size)
    if head is None:
        return None
    (size,) = LENGTH.unpack(head)
    if not 0 < size <= MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes (1..{MAX_FRAME_BYTES} allowed)")
    body = recv_exact(sock, size)
    if body is None:
        return None
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise ProtocolError(f"frame is not msgpack: {exc}") from None


def handle_to_wire(handle: Handle) -> list[Any]:
    return [handle.address, handle.seq, handle.key_digest, handle.epoch]


def handle_from_wire(words: Any) -> Handle:
    if not isinstance(words, list) or len(words) != 4:
        raise ProtocolError("a handle is 4 fields")
    address, seq, digest, epoch = words
    try:
        return Handle(address, seq, digest, epoch)
    except (ShmStoreError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad handle: {exc}") from None


def int_list(values: Any, what: str) -> list[int]:
    if not isinstance(values, list) or any(type(v) is not int or v < 0 for v in values):
        raise ProtocolError(f"{what}: a list of non-negative ints")
    return values


class _Sized:
    """What StoreWriter needs of an Encoded to lend a chunk for it (its body is written
    elsewhere)."""

    __slots__ = ("nbytes", "structure_crc")

    def __init__(self, nbytes: int, structure_crc: int) -> None:
        self.nbytes = nbytes
        self.structure_crc = structure_crc


# errors that cross the socket: rebuilt on the client's side with their message
ERRORS: dict[str, Callable[[str], BaseException]] = {
    "StaleHandle": lambda m: StaleHandle(m),
    "KeyNotCached": lambda m: KeyNotCached(m, ""),
    "KeyExists": lambda m: KeyExists(m, ""),
    "ObjectTooLarge": lambda m: ObjectTooLarge(m, 0, 0),
    "StoreFull": lambda m: StoreFull(m, 0, 0),
    "ReaderIndexError": lambda m: ReaderIndexError(m, None, 0),
    "InvalidKey": lambda m: InvalidKey(m),
}


class WriterHost(Closeable):
    """Serves `writer`'s operations to RemoteWriters of this user (see the module docstring).

    The writer's process creates it after the store; `lock` must be held by every other
    thread of this process that calls the writer. close() stops serving and gives back what
    clients had lent; it does not close the writer."""

    _listener: socket.socket | None = None

    def __init__(self, writer: StoreWriter, lock: Any) -> None:
        self._writer = writer
        self._lock = lock
        self._clients: set[socket.socket] = set()
        self._closing = False
        self.post_errors = 0  # calls sent with wait=False that failed other than StaleHandle
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(host_address(writer.name))
        except OSError as exc:
            listener.close()
            raise InvalidArgument(
                f"cannot serve store {writer.name!r} to other processes: its socket name is "
                f"taken ({exc}); another host of this store is running", "name",
                writer.name) from None
        listener.listen(MAX_CLIENTS)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name=f"shmstore-host-{writer.name}",
                                        daemon=True)
        self._thread.start()

    @property
    def clients(self) -> int:
        """Connections being served now."""
        return len(self._clients)

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None and not self._closing:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed
            if peer_uid(sock) != os.getuid() or len(self._clients) >= MAX_CLIENTS:
                log.warning("shmstore: store %r refused a connection (another user, or %d "
                            "connections already)", self._writer.name, MAX_CLIENTS)
                sock.close()
                continue
            self._clients.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name=f"shmstore-host-{self._writer.name}-client").start()

    def _serve(self, sock: socket.socket) -> None:
        loans: dict[int, Entry] = {}
        try:
            while not self._closing:
                request = recv_frame(sock)
                if request is None:
                    return
                if not isinstance(request, list) or not request or not isinstance(request[0], str):
                    raise ProtocolError("a request is [op, args...]")
                if request[0] == "post":  # a call whose client does not wait: no reply
                    self._posted(request[1:], loans)
                    continue
                try:
                    with self._lock:
                        reply = [0, self._call(request[0], request[1:], loans)]
                except ProtocolError:
                    raise
                except (ShmStoreError, ValueError, TypeError, KeyError) as exc:
                    reply = [1, type(exc).__name__, str(exc)]
                send_frame(sock, reply)
        except (ProtocolError, OSError) as exc:
            if not self._closing:
                log.warning("shmstore: store %r dropped a client: %s", self._writer.name, exc)
        finally:
            with self._lock:
                for entry in loans.values():
                    entry.reserved = False  # an orphan: freed when the ring reaches it
            self._clients.discard(sock)
            sock.close()

    def _hand_out_one(self, key: Any) -> list[Any] | None:
        writer = self._writer
        if not writer.is_cached(key):
            return None
        return [handle_to_wire(writer.get_cached(key)), writer.handout_seq, writer.object_id(key)]

    def _posted(self, request: list[Any], loans: dict[int, Entry]) -> None:
        """Run a call sent with wait=False. Its errors are the client's, but it is not waiting
        for them: a handle gone meanwhile is expected (logged at debug), others are logged."""
        if not request or request[0] not in POSTABLE:
            raise ProtocolError(f"only {', '.join(POSTABLE)} may be posted")
        try:
            with self._lock:
                self._call(request[0], request[1:], loans)
        except ProtocolError:
            raise
        except StaleHandle as exc:
            log.debug("shmstore: store %r: posted %s: %s", self._writer.name, request[0], exc)
        except (ShmStoreError, ValueError, TypeError, KeyError) as exc:
            self.post_errors += 1
            log.warning("shmstore: store %r: a client's posted %s failed: %s",
                        self._writer.name, request[0], exc)

    def _call(self, op: str, args: list[Any], loans: dict[int, Entry]) -> Any:
        writer = self._writer
        if op == "hello":
            return [PROTOCOL, writer.name, writer.n_readers, writer.max_object_bytes]
        if op in ("is_cached", "get_cached", "handle_of", "object_id"):
            (key,) = args
            check_key(key)
            if op == "is_cached":
                return writer.is_cached(key)
            if op == "get_cached":
                return [handle_to_wire(writer.get_cached(key)), writer.handout_seq,
                        writer.object_id(key)]
            found = getattr(writer, op)(key)
            return handle_to_wire(found) if isinstance(found, Handle) else found
        if op == "hand_out_cached":
            keys = args[0]
            if not isinstance(keys, list) or len(keys) > MAX_KEYS:
                raise ProtocolError(f"hand_out_cached: a list of at most {MAX_KEYS} keys")
            for key in keys:  # all checked first: a bad key hands nothing out
                check_key(key)
            return [self._hand_out_one(k) for k in keys]
        if op == "cached":
            keys = args[0]
            if not isinstance(keys, list) or len(keys) > MAX_KEYS:
                raise ProtocolError(f"cached: a list of at most {MAX_KEYS} keys")
            return [writer.is_cached(k) for k in keys]
        if op == "len":
            return len(writer)
        if op == "give_back":
            handle, number = handle_from_wire(args[0]), args[1]
            writer.give_back(handle, None if number is None else int_list([number], "number")[0])
            return None
        if op == "hand_out":
            writer.hand_out(handle_from_wire(args[0]))
            return writer.handout_seq
        if op == "narrow":
            handle, number = handle_from_wire(args[0]), int_list([args[1]], "number")[0]
            writer.narrow(handle, number, int_list(args[2], "readers"))
            return None
        if op == "end_handouts":
            groups = args[0]
            if not isinstance(groups, list) or any(
                    not isinstance(g, list) or len(g) != 2 for g in groups):
                raise ProtocolError("end_handouts: a list of [handle, numbers]")
            return writer.end_handouts([(handle_from_wire(h), int_list(n, "numbers")) for h, n in groups])
        if op == "unread":
            return list(writer.unread(handle_from_wire(args[0])))
        if op == "withdraw":
            return writer.withdraw(handle_from_wire(args[0]))
        if op == "clear":
            writer.clear(keep_handed_out=bool(args[0]))
            return None
        if op == "begin":
            key, nbytes, crc = args
            check_key(key)
            nbytes, crc = int_list([nbytes, crc], "size and crc")
            if len(loans) >= MAX_LOANS:
                raise ProtocolError(f"more than {MAX_LOANS} chunks lent at once")
            entry = writer.lend(key, _Sized(nbytes, crc))
            loans[entry.chunk.seq] = entry
            return [entry.chunk.seq, writer.body_offset(entry)]
        if op in ("commit", "abandon"):
            lent = loans.pop(int_list([args[0]], "loan")[0], None)
            if lent is None:
                raise ProtocolError(f"{op}: no chunk lent under that number")
            if op == "abandon":
                lent.reserved = False
                return None
            handle = writer.commit_loan(lent)
            return [handle_to_wire(handle), writer.handout_seq, writer.object_id(lent.key)]
        raise ProtocolError(f"unknown request {op!r}")

    def close(self) -> None:
        """Stop serving; connected clients' calls fail with Closed. Idempotent."""
        self._closing = True
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in list(self._clients):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def closed(self) -> bool:
        return self._listener is None
