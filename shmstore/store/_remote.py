"""RemoteWriter: a store's writer called from another process through its WriterHost.

_host.py has the picture, the framing and the limits; a RemoteWriter offers the writer's calls a
second API server needs, each one a request and (unless posted) a reply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import (
    Closed,
    IncompatibleSegment,
    InvalidArgument,
    ProtocolError,
    SegmentNotFound,
    ShmStoreError,
    WrongProcess,
)
from ..handle import Handle, HandOut, check_key
from ..local._service import connect, readable, wait_hang_up
from ..serde._codec import Encoded, encode
from ..shm._closeable import Closeable
from ..shm._readers import check_reader_index
from ..shm._ring import ShmRingBuffer
from ..shm._segment import ALIGN_BYTES
from ..shm._wait import Deadline
from ._api import HandleVerbs
from ._host import CALL_TIMEOUT_S, CONNECT_TIMEOUT_S, host_address
from ._wire import (
    KEY,
    MAX_GROUPS,
    MAX_KEYS,
    MAX_PEEK_BYTES,
    OPS,
    PROTOCOL,
    check_field,
    handle_from_wire,
    handout_from_wire,
    rebuild_error,
    recv_frame,
    request,
    send_frame,
)

__all__ = ["RemoteWriter"]

WAIT_NOTICE_S = 1.0  # a connect still waiting after this long says so, once

log = logging.getLogger("shmstore")


class RemoteWriter(HandleVerbs, Closeable):
    """The writer of store `name`, called from another process of the same user through the
    writer process's WriterHost: WriterAPI (hand-outs as HandOut values, any number of keys:
    batches of MAX_KEYS go in one round trip each), and put, get_cached and is_cached as
    StoreWriter has them. One thread at a time (a lock of the caller's)."""

    _sock: socket.socket | None = None
    _ring: ShmRingBuffer | None = None
    _forked = False  # set in a child forked from the process that made this writer
    _closing = False

    def __init__(self, name: str, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self._io = threading.RLock()  # one exchange on the socket at a time (and the watcher)
        self.name = name
        self._pid = os.getpid()
        deadline = Deadline(connect_timeout_s)
        said_at = time.monotonic() + WAIT_NOTICE_S
        while True:  # the store's epoch names its host's socket: map the ring first
            why = self._connect(name)
            if why is None:
                break
            if time.monotonic() > said_at:  # a wait of 30 s in silence looked like a hang
                said_at = float("inf")
                log.warning("shmstore: waiting up to %s s for the host of store %r (%s); the "
                            "process that creates the store must run a WriterHost",
                            connect_timeout_s, name, why)
            if deadline.expired():
                raise Closed(f"no process serves the writer of store {name!r} (after "
                             f"{connect_timeout_s} s: {why}); start the process that "
                             "creates the store first")
            time.sleep(0.05)
        _LIVE.add(self)
        try:
            protocol, _, n_readers, max_object = self._call("hello")
            if protocol != PROTOCOL:
                raise ProtocolError(f"store {name!r} is served with protocol {protocol}, this "
                                    f"client speaks {PROTOCOL}: run one shmstore version")
            self.n_readers, self.max_object_bytes = n_readers, max_object
        except BaseException:
            self.close()
            raise
        threading.Thread(target=_watch, args=(weakref.ref(self), self._sock), daemon=True,
                         name=f"shmstore-remote-{name}").start()

    def _connect(self, name: str) -> str | None:
        """Map the store's ring and connect to its host; why not, if it could not (yet)."""
        try:
            ring = ShmRingBuffer.attach(name, prefault=False)  # pages as the ring fills
        except (SegmentNotFound, IncompatibleSegment) as exc:
            return str(exc)
        try:
            sock = connect(host_address(name, ring.segment.epoch),
                           what=f"the host of store {name!r}", timeout_s=CALL_TIMEOUT_S)
        except PermissionError as exc:
            ring.close()
            raise Closed(str(exc)) from None
        except OSError as exc:
            ring.close()
            return str(exc)
        except BaseException:
            ring.close()
            raise
        self._sock, self._ring = sock, ring
        return None

    def _check_process(self) -> None:
        if self._forked or os.getpid() != self._pid:
            raise WrongProcess(
                f"the remote writer of store {self.name!r} belongs to process {self._pid}; "
                f"process {os.getpid()} is a child forked from it: make a RemoteWriter of its "
                "own there (its replies would be the parent's)", self._pid, os.getpid())

    def _after_fork_in_child(self) -> None:
        """Give up the parent's connection without a word to the host: closing this copy of
        the socket lets the host see the parent go when it goes (and take back what it
        lent), where a child holding it would keep the connection open."""
        self._forked = True
        self._io = threading.RLock()  # the parent's may have been held by another thread
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()  # this process's descriptor only: the parent's connection stays

    def _post(self, op: str, *args: Any) -> None:
        """Send `op` without waiting for it: the host runs it before anything sent later."""
        self._check_process()
        sock = self._sock
        if sock is None:
            raise Closed(f"the remote writer of store {self.name!r} is closed")
        try:
            with self._io:
                self._check_quiet(sock)
                send_frame(sock, request(op, *args, post=True))
        except OSError as exc:
            self.close()
            raise Closed(f"the host of store {self.name!r} went away ({exc})") from None

    def _call(self, op: str, *args: Any) -> Any:
        self._check_process()
        sock = self._sock
        if sock is None:
            raise Closed(f"the remote writer of store {self.name!r} is closed")
        try:
            with self._io:
                self._check_quiet(sock)
                send_frame(sock, request(op, *args))
                reply = recv_frame(sock)
        except (OSError, ProtocolError) as exc:
            self.close()
            raise Closed(f"the host of store {self.name!r} went away ({exc})") from None
        if reply is None:
            self.close()
            raise Closed(f"the host of store {self.name!r} closed the connection")
        if not isinstance(reply, list) or not reply or reply[0] not in (0, 1):
            self.close()
            raise Closed(f"the host of store {self.name!r} sent a malformed reply")
        if reply[0] == 0 and len(reply) == 2:
            return reply[1]
        raise rebuild_error(reply, args[0] if OPS[op].args[:1] == (KEY,) else None)

    def _check_quiet(self, sock: socket.socket) -> None:
        """Before a request: nothing is there to read, since the host never speaks first. A
        host gone (or bytes no call asked for, which would be taken for the next reply) closes
        this writer. One poll of the socket: the watcher wakes only when the host hangs up."""
        if not readable(sock, 0):
            return
        try:
            stray = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            stray = b""
        self.close()
        if stray:
            raise Closed(f"the host of store {self.name!r} sent bytes no call asked for: not a "
                         "host of this version; the writer is closed")
        raise Closed(f"the host of store {self.name!r} went away")

    # -- the writer's calls ------------------------------------------------------------------

    def cached(self, keys: Iterable[str | bytes]) -> list[bool]:
        """Whether each of `keys` is cached, in one round trip per MAX_KEYS keys."""
        keys = list(keys)
        return [bool(v) for i in range(0, len(keys), MAX_KEYS)
                for v in self._call("cached", keys[i:i + MAX_KEYS])]

    def is_cached(self, key: str | bytes) -> bool:
        return self.cached([key])[0]

    def __len__(self) -> int:
        return int(self._call("len"))

    def hand_out_cached(self, keys: Iterable[str | bytes], field: str | None = None
                        ) -> list[HandOut | None]:
        """As StoreWriter.hand_out_cached, in one round trip per MAX_KEYS keys (each batch is
        all or nothing; every key is checked before the first is sent)."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        if field is not None:
            check_field(field)
        out: list[HandOut | None] = []
        for i in range(0, len(keys), MAX_KEYS):
            batch = keys[i:i + MAX_KEYS]
            found = self._call("hand_out_cached", batch, field)
            if not isinstance(found, list) or len(found) != len(batch):
                self._malformed()
            out.extend(None if f is None else self._handout(f) for f in found)
        return out

    def issued(self, key: str | bytes, handout: HandOut) -> bool:
        return bool(self._call("issued", key, handout))

    def _handout(self, words: Any) -> HandOut:
        try:
            return handout_from_wire(words, MAX_PEEK_BYTES)
        except ProtocolError:
            self._malformed()

    def _malformed(self) -> NoReturn:
        self.close()
        raise Closed(f"the host of store {self.name!r} sent a malformed reply")

    def give_back(self, handle: Handle, number: int | None = None, *, wait: bool = True) -> None:
        """As StoreWriter.give_back. wait=False sends it without waiting: the host gives it
        back before any later call of this client, and logs (does not raise) StaleHandle."""
        if wait:
            self._call("give_back", handle, number)
        else:
            self._post("give_back", handle, number)

    def hand_out(self, handle: Handle) -> HandOut:
        return self._handout(self._call("hand_out", handle))

    def narrow(self, handle: Handle, number: int, readers: Iterable[int], *,
               wait: bool = True) -> None:
        """As StoreWriter.narrow; wait=False as in give_back (narrowing late is safe: until
        then every reader owes the hand-out). Readers are checked here, as the local writer
        checks them (ReaderIndexError), before anything is sent."""
        readers = [check_reader_index(r, self.n_readers, f"store {self.name!r}")
                   for r in readers]
        if wait:
            self._call("narrow", handle, number, readers)
        else:
            self._post("narrow", handle, number, readers)

    def end_handouts(self, groups: Iterable[tuple[Handle, Iterable[int]]]) -> list[bool]:
        """As StoreWriter.end_handouts, in frames of at most MAX_GROUPS groups (a burst of
        ended requests may end many more at once)."""
        groups = list(groups)
        return [bool(v) for i in range(0, len(groups), MAX_GROUPS)
                for v in self._call("end_handouts", groups[i:i + MAX_GROUPS])]

    def unread(self, handle: Handle) -> tuple[int, ...]:
        return tuple(self._call("unread", handle))

    def withdraw(self, handle: Handle) -> bool:
        return bool(self._call("withdraw", handle))

    def clear(self, *, keep_handed_out: bool = False) -> None:
        self._call("clear", keep_handed_out)

    def hand_out_new(self, key: str | bytes, obj: Any, timeout: float | None = 0) -> HandOut:
        """As StoreWriter.hand_out_new (timeout 0 only: the host never waits). The body is
        copied once, straight into the chunk the host lends."""
        if timeout != 0:
            raise InvalidArgument("a remote put does not wait: pass timeout=0", "timeout",
                                  timeout)
        check_key(key)
        enc: Encoded = obj if isinstance(obj, Encoded) else encode(obj)
        with self._io:  # the ring stays mapped from the loan to its commit
            return self._handout(self._put(key, enc))

    def store(self, key: str | bytes, obj: Any) -> Handle:
        """Store `obj` under `key` with no hand-out out (WriterAPI.store; the host commits it
        and gives the hand-out back in one step): cached for whoever asks next, owed by no
        reader, so a client that dies right after pins nothing. Raises as hand_out_new."""
        check_key(key)
        enc: Encoded = obj if isinstance(obj, Encoded) else encode(obj)
        with self._io:
            words = self._put(key, enc, "commit_unowed")
        try:
            return handle_from_wire(words)
        except ProtocolError:
            self._malformed()

    def _put(self, key: str | bytes, enc: Encoded, commit: str = "commit") -> Any:
        loan, offset = self._call("begin", key, enc.nbytes, enc.structure_crc)
        ring = self._ring
        try:
            if ring is None:
                raise Closed(f"the remote writer of store {self.name!r} is closed")
            buf = ring.segment.buf
            if not (ALIGN_BYTES <= offset and offset + enc.nbytes <= len(buf)):
                raise ProtocolError(f"host lent bytes {offset}..{offset + enc.nbytes} outside "
                                    f"the store's {len(buf)}")
            enc.write_into(buf[offset:offset + enc.nbytes])
        except BaseException:
            with contextlib.suppress(ShmStoreError):
                self._call("abandon", loan)
            raise
        return self._call(commit, loan)

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Disconnect and unmap (the host gives back any chunk lent and not committed);
        idempotent. Also done by itself once the host goes away, idle or not."""
        self._closing = True  # the watcher, woken by the shutdown, leaves quietly
        sock = self._sock
        if sock is not None and not self._forked:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._io:
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            ring, self._ring = self._ring, None
            if ring is not None:
                ring.close()



def _watch(ref: weakref.ref[RemoteWriter], sock: socket.socket) -> None:
    """Close the writer `ref` once its host goes away, even while it is idle: the host's
    process died, and its unlinked segment must not stay mapped here (on a tight /dev/shm a
    restarted writer would find no room). Woken only by a hang-up (its own close shuts the
    socket down to wake it), never by a reply."""
    try:
        wait_hang_up(sock)
    except (OSError, ValueError):
        return  # closed here
    writer = ref()
    if writer is None:
        return
    with writer._io:
        if writer._sock is not sock or writer._closing:
            return  # closed, or this is a forked child's copy
        log.warning("shmstore: the host of store %r went away; unmapping the store", writer.name)
        writer.close()


_LIVE: weakref.WeakSet[RemoteWriter] = weakref.WeakSet()  # this process's, for fork


def _forget_in_child() -> None:
    for writer in list(_LIVE):
        writer._after_fork_in_child()


os.register_at_fork(after_in_child=_forget_in_child)


if TYPE_CHECKING:  # mypy checks that RemoteWriter meets the one writer interface
    from ._api import WriterAPI

    _MEETS_WRITER_API: type[WriterAPI] = RemoteWriter

