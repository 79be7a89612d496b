"""One miss pool per node: the process that runs it (the store's writer) serves it to the
node's other API servers, so that a key in flight anywhere on the node is processed once.

    the pool's process                            another API server
      MissPool <- PoolHost thread(s) <- unix socket <- PoolClient.submit(key, job) -> Future
                  [id, key, job]            (a job carries an image's bytes: frames up to
                  [id, outcome, waited]      MAX_JOB_BYTES)

The socket is in Linux's abstract namespace, named from the store's name and random epoch
(pool_address), as the WriterHost's is; the host serves only processes of its own user id
(SO_PEERCRED) and a client only a host of its own. A frame that is not a request drops that
connection (logged) and nothing else; more than MAX_PENDING jobs of one connection in flight
are answered "full" at once. A client whose host is not there (yet, or any more) answers
"unavailable" at once and tries again after RETRY_S: a miss never waits for a connection.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

from ..errors import InvalidArgument, ProtocolError
from ..local._frames import recv_frame, send_frame
from ..local._service import SameUserServer, connect, service_address
from ..shm._closeable import Closeable
from ..shm._header import peek_epoch
from ._log import log
from ._outcome import Outcome, check_job
from ._pool import MissPool

__all__ = ["PoolHost", "PoolClient", "pool_address", "MAX_JOB_BYTES"]

MAX_JOB_BYTES = 64 << 20  # one job frame: a photo's bytes (a 12 MP JPEG is about 5 MB)
MAX_ANSWER_BYTES = 1 << 10  # [id, outcome, waited]
MAX_CLIENTS = 64  # connections one host serves
MAX_PENDING = 256  # jobs one connection may have in flight
RETRY_S = 1.0  # a client without a host tries to connect again after this long
CONNECT_TIMEOUT_S = 1.0
_WORDS = frozenset(o.value for o in Outcome)


def pool_address(name: str, epoch: int) -> str:
    """The abstract socket name of the miss pool that writes store `name` (local/_service.py:
    one another user can neither predict nor derive from the writer host's name)."""
    return service_address("pool", name, epoch)


class PoolHost(Closeable):
    """Serves `pool` to the node's other processes of this user. close() stops serving (the
    pool is the caller's); jobs in flight go on and their clients are not answered."""

    _server: SameUserServer | None = None

    def __init__(self, pool: MissPool, name: str, epoch: int) -> None:
        self._pool, self.name = pool, name
        self._server = SameUserServer(pool_address(name, epoch), self._serve,
                                      what=f"the miss pool of store {name!r}", name=name,
                                      max_clients=MAX_CLIENTS)
        self._server.start()  # serves once it is ours

    def _serve(self, sock: socket.socket, pid: int) -> None:
        count = threading.Lock()
        pending = [0]
        answers: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()

        def answer(job_id: int, outcome: str, waited: bool) -> None:
            # from the pool's thread: never blocks on this client (its writer thread sends)
            with count:
                pending[0] -= 1
            answers.put([job_id, outcome, waited])

        threading.Thread(target=_write_answers, args=(sock, answers), daemon=True,
                         name=f"shmstore-pool-host-{self.name}-answers").start()
        try:
            while not self.closed:
                frame = recv_frame(sock, limit=MAX_JOB_BYTES)
                if frame is None:
                    return
                job_id, key, job = _request(frame)
                with count:
                    pending[0] += 1
                    over = pending[0] > MAX_PENDING
                if over:
                    answer(job_id, Outcome.FULL.value, False)
                    continue
                try:
                    future, waited = self._pool.join(key, job)
                except InvalidArgument:
                    answer(job_id, Outcome.FAILED.value, False)
                    continue
                future.add_done_callback(functools.partial(_answer_with, answer, job_id,
                                                           waited))
        except (ProtocolError, OSError) as exc:
            if not self.closed:
                log.warning("shmstore: the miss pool of %r dropped a client: %s", self.name, exc)
        except Exception:  # a bug here: logged, and only this client is dropped
            log.exception("shmstore: the miss pool of %r: serving a client failed", self.name)
        finally:
            answers.put(None)  # the writer thread closes the socket

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    @property
    def closed(self) -> bool:
        return self._server is None or self._server.closed


def _answer_with(answer: Any, job_id: int, waited: bool, future: Future[Outcome]) -> None:
    answer(job_id, future.result().value, waited)


def _write_answers(sock: socket.socket, answers: queue.SimpleQueue[list[Any] | None]) -> None:
    """Send one connection's answers in order until told to stop (None); then close it."""
    try:
        while (frame := answers.get()) is not None:
            send_frame(sock, frame, limit=MAX_ANSWER_BYTES, what="miss pool answer")
    except OSError:
        pass
    finally:
        sock.close()


def _request(frame: Any) -> tuple[int, str, Any]:
    if (not isinstance(frame, list) or len(frame) != 3 or type(frame[0]) is not int
            or not isinstance(frame[1], str) or not 0 < len(frame[1]) <= 1024):
        raise ProtocolError("a miss pool request is [id, key (1 to 1024 chars), job]")
    return frame[0], frame[1], frame[2]


class PoolClient(Closeable):
    """The node's miss pool, from another process of the same user: submit(key, job) as
    MissPool's, each answered by the pool's process (STORED or a FALLBACKS reason) or, when
    no pool serves store `name` now, "unavailable" at once. Any thread. close() answers what
    is in flight with "closed"; idempotent."""

    _sock: socket.socket | None = None

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._send = threading.Lock()
        self._pending: dict[int, tuple[socket.socket, Future[Outcome]]] = {}
        self._ids = itertools.count(1)
        self._next_try = 0.0
        self._closed = False
        self.waited = 0  # answers whose key was in flight already on the node

    def submit(self, key: str, job: Any) -> Future[Outcome]:
        return self.join(key, job)[0]

    def join(self, key: str, job: Any) -> tuple[Future[Outcome], bool]:
        """submit; whether the key was in flight is known only when the answer comes (counted
        in `waited` then), so always False here. InvalidArgument for a job a worker could not
        read (check_job), as the local pool's."""
        check_job(job)
        future: Future[Outcome] = Future()
        sock = self._connected()
        if sock is None:
            future.set_result(Outcome.CLOSED if self._closed else Outcome.UNAVAILABLE)
            return future, False
        job_id = next(self._ids)
        with self._lock:
            self._pending[job_id] = (sock, future)
        try:
            with self._send:
                send_frame(sock, [job_id, key, job], limit=MAX_JOB_BYTES, what="miss pool job",
                           advice="the item is processed where it is")
        except (OSError, InvalidArgument, TypeError, ValueError, OverflowError) as exc:
            with self._lock:
                self._pending.pop(job_id, None)
            if isinstance(exc, OSError):
                self._drop(sock)
            future.set_result(Outcome.UNAVAILABLE if isinstance(exc, OSError)
                              else Outcome.FAILED)
        return future, False

    def _connected(self) -> socket.socket | None:
        with self._lock:
            if self._sock is not None or self._closed or time.monotonic() < self._next_try:
                return self._sock
            self._next_try = time.monotonic() + RETRY_S
            epoch = peek_epoch(self.name)
            if epoch is None:
                return None
            try:
                sock = connect(pool_address(self.name, epoch),
                               what=f"the miss pool of store {self.name!r}",
                               timeout_s=CONNECT_TIMEOUT_S)
                sock.settimeout(None)
            except OSError as exc:
                log.debug("shmstore: no miss pool for store %r yet (%s)", self.name, exc)
                return None
            self._sock = sock
        threading.Thread(target=self._read, args=(sock,), daemon=True,
                         name=f"shmstore-pool-client-{self.name}").start()
        return sock

    def _read(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(sock, limit=MAX_ANSWER_BYTES)
                if frame is None:
                    break
                if (not isinstance(frame, list) or len(frame) != 3
                        or type(frame[0]) is not int or frame[1] not in _WORDS
                        or type(frame[2]) is not bool):
                    raise ProtocolError("a miss pool answer is [id, outcome, waited]")
                with self._lock:
                    found = self._pending.pop(frame[0], None)
                    self.waited += frame[2]
                if found is not None:
                    found[1].set_result(Outcome(frame[1]))
        except (ProtocolError, OSError) as exc:
            log.warning("shmstore: the miss pool of %r: connection dropped (%s)", self.name, exc)
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        """The connection is gone: what was in flight on it falls back ("unavailable")."""
        with self._lock:
            if self._sock is sock:
                self._sock = None
            lost = [job_id for job_id, (on, _) in self._pending.items() if on is sock]
            futures = [self._pending.pop(job_id)[1] for job_id in lost]
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        for future in futures:
            if not future.done():
                future.set_result(Outcome.CLOSED if self._closed else Outcome.UNAVAILABLE)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock = self._sock
        if sock is not None:
            self._drop(sock)

    @property
    def closed(self) -> bool:
        return self._closed
