"""One store, several writing processes: the writer's process lends its writer to others.

A store has one writer (store/_writer.py): its key index, hand-out records and ring state live
in that process. Other processes of the same user on the machine (several API servers of one
inference server) share the store through the WriterHost the writer's process runs::

    writer's process                              another process (RemoteWriter)
      StoreWriter + lock                            cached / hand_out_cached / give_back /
      WriterHost thread(s) <--- unix socket --->    hand_out / narrow / end_handouts / ...
                                                      (one round trip each; give_back and
                                                      narrow may be posted: no reply)
      ring in /dev/shm  <------------------------   hand_out_new: `begin` lends a chunk of the ring,
                                                    the client copies the body straight into
                                                    it, `commit` publishes it (one copy)

The socket is in Linux's abstract namespace (no file to clean up), under a name derived from
the store's random epoch (host_address), which only the store's user can read: another user
can neither predict it nor bind it first. The host accepts only peers of its own user id
(SO_PEERCRED), and a client only a host of its own user id. _wire.py has the frames and the
one table of operations; a frame that is not a request the host knows closes that connection
(logged) and nothing else, and an argument the writer refuses is answered with its error. A
lent chunk whose client goes away before `commit` is given back to the ring, also when the
client's process died and a child it forked still holds the socket (the host checks the
process that connected, while it lends). A RemoteWriter used in a forked child raises
WrongProcess, and the child drops its copy of the socket at the fork.

Every RemoteWriter call (_remote.py) takes the host's lock, so the host's own thread and
every client see one writer operation at a time.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from .._proc import pid_alive
from ..errors import InvalidArgument, ProtocolError, ShmStoreError, StaleHandle
from ..local._service import SameUserServer, readable, service_address
from ..shm._closeable import Closeable
from ._lender import Lender
from ._wire import (
    MAX_FRAME_BYTES,
    PROTOCOL,
    error_reply,
    handle_to_wire,
    handout_to_wire,
    parse_request,
    recv_frame,
    send_frame,
)
from ._writer import StoreWriter

__all__ = ["WriterHost", "host_address"]

log = logging.getLogger("shmstore")
MAX_CLIENTS = 64  # connections one host serves at once
MAX_LOANS = 16  # chunks one client may hold lent at once
CONNECT_TIMEOUT_S = 30.0  # a client waits this long for the host to listen
CALL_TIMEOUT_S = 60.0  # a reply slower than this means the host is stuck: the call fails
PEER_CHECK_S = 1.0  # while a client holds lent chunks, how often the host checks it lives


def host_address(name: str, epoch: int) -> str:
    """The abstract socket name of the host of store `name` whose epoch is `epoch`
    (local/_service.py: one another user can neither predict nor bind first)."""
    return service_address("writer", name, epoch)


class WriterHost(Closeable):
    """Serves `writer`'s operations to RemoteWriters of this user (see the module docstring).

    The writer's process creates it after the store; `lock` must be held by every other
    thread of this process that calls the writer. close() stops serving and gives back what
    clients had lent; it does not close the writer."""

    _server: SameUserServer | None = None

    def __init__(self, writer: StoreWriter, lock: Any) -> None:
        self._writer = writer
        self._lock = lock
        self.post_errors = 0  # calls sent with wait=False that failed other than StaleHandle
        self._handlers = self._handler_table()
        self._server = SameUserServer(host_address(writer.name, writer.epoch), self._serve,
                                      what=f"store {writer.name!r}", name=writer.name,
                                      max_clients=MAX_CLIENTS)
        self._server.start()  # serves once it is ours

    @property
    def clients(self) -> int:
        """Connections being served now."""
        return 0 if self._server is None else len(self._server.clients)

    @property
    def _closing(self) -> bool:
        return self._server is None or self._server.closing

    def _serve(self, sock: socket.socket, pid: int) -> None:
        loans = Lender(self._writer)
        try:
            while not self._closing:
                if len(loans) and not self._lender_alive(sock, pid, len(loans)):
                    return
                frame = recv_frame(sock)
                if frame is None:
                    return
                posted = isinstance(frame, list) and frame[:1] == ["post"]
                try:
                    op, args, posted = parse_request(frame)
                    with self._lock:
                        reply = [0, self._handlers[op](args, loans)]
                except ProtocolError:
                    raise
                except (ShmStoreError, ValueError, TypeError, KeyError) as exc:
                    if posted:
                        self._post_failed(str(frame[1])[:40], exc)
                        continue
                    reply = error_reply(exc)
                if not posted:  # a call whose client does not wait gets no reply
                    self._reply(sock, reply)
        except (ProtocolError, OSError) as exc:
            if not self._closing:
                log.warning("shmstore: store %r dropped a client: %s", self._writer.name, exc)
        except Exception:  # a bug here: logged, and only this client is dropped
            log.exception("shmstore: store %r: serving a client failed", self._writer.name)
        finally:
            with self._lock:
                loans.close()  # what is still lent: orphans, freed when the ring reaches them
            sock.close()

    def _lender_alive(self, sock: socket.socket, pid: int, lent: int) -> bool:
        """Wait for the next frame of a client that holds lent chunks; False (drop it, taking
        them back) once the process that connected is gone, even if a child it forked still
        holds the socket open."""
        while not self._closing:
            if readable(sock, PEER_CHECK_S):
                return True
            if not pid_alive(pid):
                log.warning("shmstore: store %r: client process %d is gone with %d chunk(s) "
                            "lent; taking them back", self._writer.name, pid, lent)
                return False
        return False

    def _reply(self, sock: socket.socket, reply: list[Any]) -> None:
        try:
            send_frame(sock, reply)
        except InvalidArgument:  # over the frame limit (not for a bounded error): say so
            send_frame(sock, error_reply(ShmStoreError(
                f"the reply to this call is over the {MAX_FRAME_BYTES}-byte frame limit; "
                "ask for fewer keys at once")))

    def _post_failed(self, op: str, exc: BaseException) -> None:
        """A posted call's errors are the client's, but it is not waiting for them: a handle
        gone meanwhile is expected (logged at debug), others are logged and counted."""
        if isinstance(exc, StaleHandle):
            log.debug("shmstore: store %r: posted %s: %s", self._writer.name, op, exc)
            return
        self.post_errors += 1
        log.warning("shmstore: store %r: a client's posted %s failed: %s",
                    self._writer.name, op, exc)

    # -- one handler per operation of _wire.OPS: (decoded args, this client's loans) -> reply

    def _handler_table(self) -> dict[str, Callable[[list[Any], Lender], Any]]:
        w = self._writer
        table: dict[str, Callable[[list[Any], Lender], Any]] = {
            "hello": lambda a, _: [PROTOCOL, w.name, w.n_readers, w.max_object_bytes],
            "len": lambda a, _: len(w),
            "cached": lambda a, _: w.cached(a[0]),
            "hand_out_cached": lambda a, _: [None if found is None else handout_to_wire(found)
                                             for found in w.hand_out_cached(a[0], a[1])],
            "hand_out": lambda a, _: handout_to_wire(w.hand_out(a[0])),
            "issued": lambda a, _: w.issued(a[0], a[1]),
            "give_back": lambda a, _: w.give_back(a[0], a[1]),
            "narrow": lambda a, _: w.narrow(a[0], a[1], a[2]),
            "end_handouts": lambda a, _: w.end_handouts(a[0]),
            "unread": lambda a, _: list(w.unread(a[0])),
            "withdraw": lambda a, _: w.withdraw(a[0]),
            "clear": lambda a, _: w.clear(keep_handed_out=a[0]),
            "begin": self._begin,
            "commit": self._commit,
            "commit_unowed": self._commit_unowed,
            "abandon": self._abandon,
        }
        return table

    def _begin(self, args: list[Any], loans: Lender) -> list[int]:
        key, nbytes, crc = args
        if len(loans) >= MAX_LOANS:
            raise ProtocolError(f"more than {MAX_LOANS} chunks lent at once")
        if nbytes < 0 or not 0 <= crc < 1 << 32:
            raise InvalidArgument(f"a loan of {nbytes} bytes with structure crc {crc}: the size "
                                  "is at least 0 and the crc a u32", "begin", [nbytes, crc])
        return list(loans.begin(key, nbytes, crc))

    def _lent(self, op: str, loan: int, loans: Lender) -> int:
        if loan not in loans:
            raise ProtocolError(f"{op}: no chunk lent under that number")
        return loan

    def _commit(self, args: list[Any], loans: Lender) -> list[Any]:
        return handout_to_wire(loans.commit(self._lent("commit", args[0], loans))[1])

    def _commit_unowed(self, args: list[Any], loans: Lender) -> list[Any]:
        """Commit and give the hand-out back in one step (under the host's lock): the object is
        cached and no reader owes it, even if the client dies right after."""
        return handle_to_wire(loans.commit_unowed(self._lent("commit_unowed", args[0], loans)))

    def _abandon(self, args: list[Any], loans: Lender) -> None:
        loans.abandon(self._lent("abandon", args[0], loans))

    def close(self) -> None:
        """Stop serving; connected clients' calls fail with Closed. Idempotent."""
        if self._server is not None:
            self._server.close()

    @property
    def closed(self) -> bool:
        return self._server is None or self._server.closed

