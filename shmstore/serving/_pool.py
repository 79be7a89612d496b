"""The miss pool: a node's misses processed in parallel by worker processes, straight into the
store, whatever the engine (an adapter says how one item is processed: a Processor).

    the store's writer process                   worker process i (spawned)
      MissPool                                     builds its processor once: factory(*args)
        submit(key, job) -> Future[outcome]        then, for each job:
          a key in flight is waited for,              value = process(job)
          not processed twice (single flight)         RemoteWriter.store_unowed(key, value)
          no worker ready, or more than                 (one copy, into a chunk the host
          max_waiting queued: an outcome at once        lends; no reader owes it)
        the dispatcher thread: jobs to idle  -----> [key, job]            (msgpack, a Pipe)
          workers; a worker that dies fails  <----- [outcome, detail]
          its job and is started again

A job is msgpack data (the item's original bytes and what the processor needs to know of the
request); a value is what the store stores (serde: tensors go straight into the lent chunk).
The outcome says what the caller does next: STORED (the item is in the store: a hit now) or a
fallback reason (FALLBACKS): the caller processes the item itself, as without the pool, and
the engine's own errors are the ones the client sees. No outcome waits without bound: a job
the pool cannot take now is answered at once; the caller bounds its own wait.

Threads: submit and stats from any thread; the dispatcher thread owns the pipes.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import msgpack

from ..errors import InvalidArgument
from ._log import log

__all__ = ["MissPool", "PoolStats", "Processor", "STORED", "FALLBACKS", "default_workers"]

STORED = "stored"  # the item is in the store (processed by the pool, or by another meanwhile)
FALLBACKS = ("failed", "declined", "died", "full", "starting", "store_full", "unavailable",
             "closed", "timeout")  # why the caller processes an item itself (PoolStats.fallback;
# "timeout" is the caller's own: it gave up waiting)
MAX_DETAIL_CHARS = 512  # a worker's error message, cut here
START_TIMEOUT_S = 300.0  # a worker that is not ready by then is stopped (loading a model is slow)
BROKEN_STARTS = 3  # workers that die or fail before ready, in a row: the pool stops starting them
JOB_TIMEOUT_S = 60.0  # a worker on one item longer than this is stopped (the item falls back)
STOP_TIMEOUT_S = 5.0  # close(): how long a worker has to exit before it is killed
MIN_DEFAULT_WORKERS = 2  # a default pool smaller than this is none
MAX_DEFAULT_WORKERS = 8  # each worker holds the model's processor (about 0.5 GB here)
_READY, _BROKEN = "ready", "broken"  # what a worker says once, before any outcome
WORKER_NAME = "shmstore-pool"  # a worker's process name (/proc/PID/comm, at most 15 bytes)
ALREADY = "stored already"  # a STORED answer's detail when the worker did not run


def default_workers(*, taken: int, cores: int | None = None) -> int:
    """The pool's size where none is set: the cores this process may run on that the server's
    own processes do not take (`taken`: its API servers, engines and their workers, each
    busy on a core), at most MAX_DEFAULT_WORKERS; 0 (no pool) below MIN_DEFAULT_WORKERS,
    where a pool would take cores from the server (a pool of 1 is no faster than the API
    server's own thread: docs/performance.md)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    spare = min(MAX_DEFAULT_WORKERS, cores - taken)
    return spare if spare >= MIN_DEFAULT_WORKERS else 0


@dataclass(frozen=True)
class Processor:
    """How a worker processes one item: `factory` ("module:function") is called once in the
    worker with `args` (sent at spawn, so picklable) and returns process(job) -> value, or None
    for a job it does not take (the caller processes it: "declined"). An exception from
    process is the "failed" outcome, with its message."""

    factory: str
    args: tuple[Any, ...] = ()

    def build(self) -> Callable[[Any], Any]:
        module, _, name = self.factory.partition(":")
        return getattr(importlib.import_module(module), name)(*self.args)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class PoolStats:
    """The pool now: workers (ready, busy, starting), jobs queued, and counts since it started:
    submitted (jobs sent to a worker), processed (jobs a worker ran the processor for: not
    those it found stored already), stored, waited (a key already in flight: single flight),
    fallback (by reason), restarts (workers started again after dying)."""

    workers: int
    ready: int
    busy: int
    queued: int
    submitted: int
    processed: int
    stored: int
    waited: int
    restarts: int
    fallback: dict[str, int] = field(default_factory=dict)


class _Worker:
    """One worker process and the parent's end of its pipe; `key` is the one it works on."""

    __slots__ = ("busy_since", "conn", "key", "outbox", "pid", "process", "ready", "started_at")

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process, self.pid, self.conn = process, process.pid, conn
        self.ready = False
        self.key: str | None = None
        self.started_at = self.busy_since = time.monotonic()
        # jobs go through a thread of their own: a worker that hangs (stopped, stuck in a
        # library) blocks that thread on a full pipe, never the dispatcher
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=_send_jobs, args=(conn, self.outbox), daemon=True,
                         name=f"shmstore-pool-send-{self.pid}").start()


def _send_jobs(conn: Connection, outbox: queue.SimpleQueue[bytes | None]) -> None:
    """Send a worker its jobs until told to stop (None) or its pipe closes (it died: the
    dispatcher sees its sentinel)."""
    with contextlib.suppress(OSError, ValueError):
        while (frame := outbox.get()) is not None:
            conn.send_bytes(frame)


class MissPool:
    """`workers` processes that store what `processor` makes of each job in store `store_name`
    (through its WriterHost, which the caller runs). Owner: the process that made it; submit
    from any thread of it. close() stops every worker; idempotent."""

    _closed = True
    _thread: threading.Thread | None = None

    def __init__(self, store_name: str, processor: Processor, *, workers: int,
                 max_waiting: int | None = None, env: dict[str, str] | None = None) -> None:
        if workers < 1:
            raise InvalidArgument(f"a miss pool needs at least 1 worker, not {workers}",
                                  "workers", workers)
        self.store_name, self.processor, self.size = store_name, processor, workers
        self.max_waiting = 2 * workers if max_waiting is None else max_waiting
        self._env = dict(env or {})
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._flight: dict[str, Future[str]] = {}
        self._ended: list[tuple[Future[str], str]] = []  # set by _flush, out of the lock
        self._queue: deque[tuple[str, bytes]] = deque()
        self._workers: list[_Worker] = []
        self._counts = dict.fromkeys(("submitted", "processed", "stored", "waited", "restarts"),
                                     0)
        self._fallback = dict.fromkeys(FALLBACKS, 0)
        self._failed_starts = 0
        self.broken = ""  # why the pool stopped starting workers ("" while it runs)
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        try:
            for _ in range(workers):
                self._workers.append(self._start())
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._dispatch, daemon=True,
                                        name=f"shmstore-pool-{store_name}")
        self._thread.start()
        log.info("shmstore: miss pool of %d worker(s) for store %r (processor %s)", workers,
                 store_name, processor.factory)

    # -- the caller's side -----------------------------------------------------------------------

    def submit(self, key: str, job: Any) -> Future[str]:
        """A future of `key`'s outcome (STORED or a FALLBACKS reason). A key in flight gets the
        future of the job already running (counted as waited). Any thread."""
        return self.join(key, job)[0]

    def join(self, key: str, job: Any) -> tuple[Future[str], bool]:
        """submit, and whether the key was in flight already (waited for, not sent again)."""
        try:  # outside the lock: a photo's bytes are copied into the frame
            frame = msgpack.packb([key, job], use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(f"a miss pool job must be msgpack data: {exc}", "job",
                                  None) from None
        with self._lock:
            running = self._flight.get(key)
            if running is not None:
                self._counts["waited"] += 1
                return running, True
            reason = self._refusal()
            if reason:
                self._fallback[reason] += 1
                done: Future[str] = Future()
                done.set_result(reason)
                return done, False
            future: Future[str] = Future()
            self._flight[key] = future
            self._queue.append((key, frame))
        self._wake()
        return future, False

    def _refusal(self) -> str:
        """Why a new job cannot be taken now ("" if it can); under the lock."""
        if self._closed:
            return "closed"
        if self.broken:
            return "unavailable"
        if not any(w.ready for w in self._workers):
            return "starting"
        if len(self._queue) >= self.max_waiting:
            return "full"
        return ""

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                workers=len(self._workers), ready=sum(w.ready for w in self._workers),
                busy=sum(w.key is not None for w in self._workers), queued=len(self._queue),
                fallback=dict(self._fallback), **self._counts)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers]

    # -- the dispatcher thread -------------------------------------------------------------------

    def _start(self) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(self.store_name, self.processor, theirs, self._env),
            name="shmstore-pool-worker", daemon=True)
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return _Worker(process, ours)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _dispatch(self) -> None:
        try:
            while not self._closed:
                with self._lock:
                    self._assign()
                    waitables: list[Any] = [self._wake_r]
                    for w in self._workers:
                        waitables += [w.conn, w.process.sentinel]
                    watch = any(not w.ready or w.key is not None for w in self._workers)
                timeout = 1.0 if watch else None  # a start or a job to time
                for ready in wait(waitables, timeout):
                    if ready == self._wake_r:
                        os.read(self._wake_r, 4096)
                self._collect()
                self._flush()
        except Exception:  # a bug here: every job falls back from now on, nothing hangs
            log.exception("shmstore: miss pool of store %r stopped", self.store_name)
            with self._lock:
                self.broken = "its dispatcher failed"
                self._fail_all("unavailable")
            self._flush()

    def _assign(self) -> None:
        """Send queued jobs to ready, idle workers; under the lock."""
        for w in self._workers:
            if not self._queue:
                return
            if w.ready and w.key is None:
                key, frame = self._queue.popleft()
                w.outbox.put(frame)
                w.key, w.busy_since = key, time.monotonic()
                self._counts["submitted"] += 1

    def _collect(self) -> None:
        """Read the workers' answers, and replace the workers that died."""
        with self._lock:
            workers: list[_Worker] = []
            for w in self._workers:
                answer = self._answer(w)
                if answer is not None:
                    self._answered(w, *answer)
                now = time.monotonic()
                if w.ready and w.key is not None and now - w.busy_since > JOB_TIMEOUT_S:
                    log.warning("shmstore: a miss pool worker (pid %s) took over %.0f s on "
                                "item %s: it is stopped and the item falls back", w.pid,
                                JOB_TIMEOUT_S, w.key)
                elif w.process.is_alive() and (w.ready or now - w.started_at < START_TIMEOUT_S):
                    workers.append(w)
                    continue
                new = self._replace(w)
                if new is not None:
                    workers.append(new)
            self._workers = workers

    def _answer(self, w: _Worker) -> tuple[str, str] | None:
        try:
            if not w.conn.poll():
                return None
            words = msgpack.unpackb(w.conn.recv_bytes(), raw=False)
            outcome, detail = words
            if not isinstance(outcome, str) or not isinstance(detail, str):
                raise ValueError("not [str, str]")
            return outcome, detail
        except (OSError, EOFError):
            return None  # died: the sentinel says so
        except Exception as exc:  # our own child, yet: never trust a frame
            log.warning("shmstore: a miss pool worker sent a malformed answer (%s)", exc)
            return "failed", "malformed answer"

    def _answered(self, w: _Worker, outcome: str, detail: str) -> None:
        if outcome == _READY:
            w.ready = True
            self._failed_starts = 0
            return
        if outcome == _BROKEN:
            self._failed_starts = BROKEN_STARTS
            self.broken = detail
            log.warning("shmstore: the miss pool cannot build its processor (%s): every miss "
                        "takes the engine's own path", detail)
            self._fail_all("unavailable")
            return
        key, w.key = w.key, None
        if key is None:
            return
        if detail != ALREADY:
            self._counts["processed"] += 1
        if outcome == STORED:
            self._counts["stored"] += 1
        else:
            outcome = outcome if outcome in FALLBACKS else "failed"
            self._fallback[outcome] += 1
            log.debug("shmstore: miss pool: %s %s (%s)", key, outcome, detail)
        self._settle(key, outcome)

    def _settle(self, key: str, outcome: str) -> None:
        """`key`'s job ended; its future is set once the lock is released (_flush): its
        callbacks (another process's answer, an event loop's wake-up) never run under it."""
        future = self._flight.pop(key, None)
        if future is not None:
            self._ended.append((future, outcome))

    def _flush(self) -> None:
        """Set the futures of the jobs that ended; not under the lock."""
        with self._lock:
            ended, self._ended = self._ended, []
        for future, outcome in ended:
            if not future.done():
                future.set_result(outcome)

    def _replace(self, w: _Worker) -> _Worker | None:
        """`w` died (or never got ready): its job falls back, and a new worker starts unless
        workers keep dying before they are ready."""
        _stop(w)
        if w.key is not None:
            self._fallback["died"] += 1
            log.warning("shmstore: a miss pool worker (pid %s) died on item %s: it falls back",
                        w.pid, w.key)
            self._settle(w.key, "died")
            w.key = None
        if not w.ready:
            self._failed_starts += 1
        if self._failed_starts >= BROKEN_STARTS and not self.broken:
            self.broken = f"{BROKEN_STARTS} workers in a row died before they were ready"
            log.warning("shmstore: the miss pool stops: %s; every miss takes the engine's own "
                        "path", self.broken)
            self._fail_all("unavailable")
        if self.broken or self._closed:
            return None
        self._counts["restarts"] += 1
        return self._start()

    def _fail_all(self, reason: str) -> None:
        """Every queued job ends with `reason`; under the lock."""
        while self._queue:
            key, _ = self._queue.popleft()
            self._fallback[reason] += 1
            self._settle(key, reason)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop: queued and running jobs end with "closed", every worker exits (killed after
        STOP_TIMEOUT_S). Idempotent."""
        with self._lock:
            if self._closed and not self._workers:
                return
            self._closed = True
            self._fail_all("closed")
            for key in list(self._flight):
                self._fallback["closed"] += 1
                self._settle(key, "closed")
            workers, self._workers = self._workers, []
        self._flush()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)
        for w in workers:
            w.outbox.put(None)
            w.conn.close()  # the worker reads EOF and exits
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            _stop(w)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> MissPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(w: _Worker) -> None:
    """Kill `w` if it still runs, reap it, close its pipe (its sender thread ends)."""
    w.outbox.put(None)
    if w.process.is_alive():
        w.process.kill()
    w.process.join(STOP_TIMEOUT_S)
    with contextlib.suppress(ValueError):
        w.process.close()
    w.conn.close()


# -- the worker process ---------------------------------------------------------------------------

def _worker_main(store_name: str, processor: Processor, conn: Connection,
                 env: dict[str, str]) -> None:
    """Build the processor, say ready, then answer each job until the pipe closes."""
    os.environ.update(env)
    with contextlib.suppress(OSError):  # the name ps and /proc/PID/comm show
        with open("/proc/self/comm", "w") as comm:
            comm.write(WORKER_NAME)
    from ..errors import KeyExists, ObjectTooLarge, ShmStoreError, StoreFull
    from ..store._remote import RemoteWriter

    def say(outcome: str, detail: str = "") -> None:
        conn.send_bytes(msgpack.packb([outcome, detail[:MAX_DETAIL_CHARS]], use_bin_type=True))

    try:
        process = processor.build()
        writer = RemoteWriter(store_name)
    except Exception as exc:
        say(_BROKEN, f"{type(exc).__name__}: {exc}")
        return
    say(_READY)
    with writer:
        while True:
            try:
                key, job = msgpack.unpackb(conn.recv_bytes(), raw=False)
            except (EOFError, OSError):
                return  # the pool closed, or its process is gone
            try:  # stored meanwhile (sent again just after it was stored): not run again
                if writer.cached([key])[0]:
                    say(STORED, ALREADY)
                    continue
            except ShmStoreError as exc:
                say("failed", f"{type(exc).__name__}: {exc}")
                continue
            try:
                value = process(job)
            except Exception as exc:
                say("failed", f"{type(exc).__name__}: {exc}")
                continue
            if value is None:
                say("declined")
                continue
            try:
                writer.store_unowed(key, value)
                say(STORED)
            except KeyExists:
                say(STORED, "stored by another meanwhile")
            except (StoreFull, ObjectTooLarge) as exc:
                say("store_full", str(exc))
            except ShmStoreError as exc:
                say("failed", f"{type(exc).__name__}: {exc}")
