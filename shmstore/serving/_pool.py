"""The miss pool: a node's misses processed in parallel by worker processes, straight into the
store, whatever the engine (an adapter says how one item is processed: a Processor).

    the store's writer process                   worker process i (spawned)
      MissPool (the callers' side)                 builds its processor once: factory(*args)
        submit(key, job) -> Future[Outcome]        then, for each job:
          a key in flight is waited for,              value = process(job)
          not processed twice (single flight)         written into a chunk the dispatcher
          no worker ready, or more than               lends (one copy; published owed by
          max_waiting queued: an outcome at once      no reader: serving/_lending.py)
        the dispatcher thread (one loop):
          jobs to idle workers             -----> [key, job]   (msgpack, a socket pair;
                                                  written by the dispatcher, one over 4 KiB
                                                  by the worker's sender thread)
            (a key stored meanwhile: STORED,
            not sent; asked of the writer here)
          the workers' messages            <----- ["ready"] | ["broken", why]
                                                  | ["begin", key, nbytes, crc]
          a chunk lent (the writer's)      -----> ["lent", loan, offset] | ["refused", ...]
          the chunk published              <----- ["done", outcome, detail]
        Crew (the workers' lives): start, ready, the job and start time limits, reap and
          replace (outside the lock submit takes), broken after BROKEN_STARTS failed starts

A job is msgpack data with string map keys (the item's original bytes and what the processor
needs to know of the request), checked where it is submitted; a value is what the store
stores (serde: tensors go straight into the lent chunk). The Outcome says what the caller
does next: STORED (the item is in the store: a hit now) or a fallback reason: the caller
processes the item itself, as without the pool, and the engine's own errors are the ones the
client sees. No outcome waits without bound: a job the pool cannot take now is answered at
once; the caller bounds its own wait.

Workers die with their owner, whatever they are doing: the dispatcher thread starts them all,
and each asks the kernel for SIGKILL when that thread's process goes (PR_SET_PDEATHSIG; a
thread that watches its parent where prctl is missing).

Threads: submit and stats from any thread; the dispatcher thread owns the pipes and the crew,
and takes the writer's lock (never while it holds the pool's) to lend and publish a chunk: the
store's bookkeeping, no copy, and no caller of the writer waits for the pool while it holds
that lock (an API server waits for its items outside it).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import msgpack

from ..errors import InvalidArgument, ShmStoreError
from ._crew import BROKEN_STARTS, REAP_POLL_S, STOP_TIMEOUT_S, Crew, Says, Worker
from ._lending import LENT, REFUSED, PoolStore
from ._log import log
from ._outcome import FALLBACKS, STORED, Outcome, PoolStats, Processor, check_job

__all__ = ["MissPool", "default_workers"]

MIN_DEFAULT_WORKERS = 2  # a default pool smaller than this is none
MAX_DEFAULT_WORKERS = 8  # each worker holds the model's processor (about 0.5 GB here)
SWEEP_S = 1.0  # the dispatcher looks at every worker (time limits, alive) this often
ALREADY = "stored already"  # a STORED answer's detail when no worker ran


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


class MissPool:
    """`workers` processes that store what `processor` makes of each job in `store` (its
    writer in this process: serving/_lending.py PoolStore). Owner: the process that made it;
    submit from any thread of it. close() stops every worker; idempotent."""

    _closed = True
    _thread: threading.Thread | None = None

    def __init__(self, store: PoolStore, processor: Processor, *, workers: int,
                 max_waiting: int | None = None, env: dict[str, str] | None = None) -> None:
        if workers < 1:
            raise InvalidArgument(f"a miss pool needs at least 1 worker, not {workers}",
                                  "workers", workers)
        self.store, self.processor, self.size = store, processor, workers
        self.store_name = store_name = store.name
        self.max_waiting = 2 * workers if max_waiting is None else max_waiting
        self._crew = Crew(store, processor, dict(env or {}))
        self._lock = threading.Lock()
        self._flight: dict[str, Future[Outcome]] = {}
        self._ended: list[tuple[Future[Outcome], Outcome]] = []  # set by _flush, out of the lock
        self._queue: deque[tuple[str, bytes]] = deque()
        self._counts = dict.fromkeys(("submitted", "processed", "stored", "waited"), 0)
        self._fallback = dict.fromkeys(FALLBACKS, 0)
        self._starts = 0
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, daemon=True,
                                        name=f"shmstore-pool-{store_name}")
        self._thread.start()
        log.info("shmstore: miss pool of %d worker(s) for store %r (processor %s)", workers,
                 store_name, processor.factory)

    @property
    def broken(self) -> str:
        """Why the pool stopped starting workers ("" while it runs)."""
        return self._crew.broken

    @property
    def waited(self) -> int:
        return self._counts["waited"]

    # -- the caller's side -----------------------------------------------------------------------

    def submit(self, key: str, job: Any) -> Future[Outcome]:
        """A future of `key`'s Outcome. A key in flight gets the future of the job already
        running (counted as waited). InvalidArgument for a job a worker could not read
        (check_job). Any thread."""
        return self.join(key, job)[0]

    def join(self, key: str, job: Any) -> tuple[Future[Outcome], bool]:
        """submit, and whether the key was in flight already (waited for, not sent again)."""
        check_job(job)
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
            if reason is not None:
                self._fallback[reason] += 1
                done: Future[Outcome] = Future()
                done.set_result(reason)
                return done, False
            future: Future[Outcome] = Future()
            self._flight[key] = future
            self._queue.append((key, frame))
        self._wake()
        return future, False

    def _refusal(self) -> Outcome | None:
        """Why a new job cannot be taken now (None if it can); under the lock."""
        if self._closed:
            return Outcome.CLOSED
        if self._crew.broken:
            return Outcome.UNAVAILABLE
        if not any(w.ready for w in self._crew.workers):
            return Outcome.STARTING
        if len(self._queue) >= self.max_waiting:
            return Outcome.FULL
        return None

    def stats(self) -> PoolStats:
        with self._lock:
            workers = self._crew.workers
            return PoolStats(
                workers=len(workers), ready=sum(w.ready for w in workers),
                busy=sum(w.key is not None for w in workers), queued=len(self._queue),
                fallback={o.value: n for o, n in self._fallback.items()},
                restarts=max(0, self._starts - self.size), **self._counts)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._crew.workers]

    # -- the dispatcher thread -------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _dispatch(self) -> None:
        """The loop: jobs out, the workers' messages in, the dead and the overdue replaced.
        One selector for the pool's life, each worker's socket and sentinel registered while
        it is in the crew: a wake-up reads only the workers that spoke, and asks the kernel
        whether a worker died only for those that spoke or ended, and of every worker each
        SWEEP_S, busy or idle (a worker whose forked helper holds its socket and sentinel
        dies unseen otherwise: an idle one is replaced before a job is sent to it)."""
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._wake_r, selectors.EVENT_READ, None)
            self._fill(selector)
            swept = time.monotonic()
            while not self._closed:
                self._assign()
                said, spoke = self._heard_from(selector, SWEEP_S)
                now = time.monotonic()
                look: set[Worker] | None = spoke
                if now - swept >= SWEEP_S:
                    swept, look = now, None
                said = [(w, m) for w, m in said if not self._lend(w, m)]
                with self._lock:
                    for w, message in said:
                        self._heard(w, message)
                    gone = self._gone(now, look)
                for w in gone:
                    for fileobj in (w.conn, w.process.sentinel):
                        with contextlib.suppress(KeyError, ValueError):
                            selector.unregister(fileobj)
                self._crew.stop(gone)  # killed and reaped outside the lock
                self._fill(selector)
                self._flush()
        except Exception:  # a bug here: every job falls back from now on, nothing hangs
            log.exception("shmstore: miss pool of store %r stopped", self.store_name)
            with self._lock:
                self._crew.broken = "its dispatcher failed"
                self._fail_all(Outcome.UNAVAILABLE)
            self._flush()
        finally:
            selector.close()

    def _heard_from(self, selector: selectors.BaseSelector, timeout: float | None,
                    ) -> tuple[list[tuple[Worker, Any]], set[Worker]]:
        """Wait for the next event: the messages read, and the workers to look at (their
        socket ended, or their sentinel is readable: whatever such a worker said last is read
        first, all of it, never blocking)."""
        said, look = [], set()
        events = selector.select(timeout)
        ended = {key.data[0] for key, _ in events if key.data is not None and not key.data[1]}
        for key, _ in events:
            if key.data is None:
                os.read(self._wake_r, 4096)
                continue
            w, is_socket = key.data
            if w in ended:
                if not is_socket:
                    said += [(w, message) for message in self._crew.drain(w)]
                    look.add(w)
            elif (message := self._crew.read(w)) is not None:
                said.append((w, message))
            else:  # its end: not reported again; the sentinel or a sweep finds it gone
                selector.unregister(w.conn)
                look.add(w)
        return said, look

    def _fill(self, selector: selectors.BaseSelector) -> None:
        """Start workers up to the pool's size (outside the lock: a spawn takes milliseconds),
        unless the pool is closed or broken. The dispatcher thread starts every worker: each
        dies with it (PR_SET_PDEATHSIG follows the thread that started a process)."""
        while True:
            with self._lock:
                if self._closed or self._crew.broken or len(self._crew.workers) >= self.size:
                    return
            w = self._crew.start()
            selector.register(w.conn, selectors.EVENT_READ, (w, True))
            selector.register(w.process.sentinel, selectors.EVENT_READ, (w, False))
            with self._lock:
                self._crew.workers.append(w)
                self._starts += 1

    def _assign(self) -> None:
        """Send queued jobs to ready, idle workers. A job whose key is stored already (the
        store's answer, asked outside the pool's lock: the writer's lock is taken there, and
        a caller may hold it while it submits) ends STORED at once, its worker taking the
        next job."""
        while picked := self._pick():
            already = []
            for w, key, frame in picked:
                if self._stored_now(key):
                    already.append(w)
                else:
                    w.send(frame)
            if not already:
                return
            with self._lock:
                for w in already:  # as a worker answers a key it finds stored
                    self._done(w, STORED.value, ALREADY)
            self._flush()

    def _pick(self) -> list[tuple[Worker, str, bytes]]:
        """The next queued job for each ready, idle worker, the worker marked busy with it."""
        picked = []
        with self._lock:
            for w in self._crew.workers:
                if not self._queue:
                    break
                if w.ready and w.key is None:
                    key, frame = self._queue.popleft()
                    w.key, w.busy_since = key, time.monotonic()
                    self._counts["submitted"] += 1
                    picked.append((w, key, frame))
        return picked

    def _stored_now(self, key: str) -> bool:
        """The writer's answer, asked just before a job goes to a worker: "no" where it cannot
        be had at once (PoolStore.stored), or the store is closing (the worker's begin finds
        out)."""
        try:
            return self.store.stored(key)
        except ShmStoreError:
            return False

    def _lend(self, w: Worker, message: Any) -> bool:
        """A worker's message about its chunk, handled here, outside the pool's lock (the
        writer's is taken, for the store's bookkeeping only: serving/_lending.py): a begin is
        answered (True: nothing more to do). Any other message ends the chunk lent to `w`: a
        done that says stored has it published, anything else gives it back; a done then
        carries the job's final outcome (False: _heard settles it)."""
        kind = message[0] if isinstance(message, list) and message else None
        if kind == Says.BEGIN:
            answer: list[Any] = [REFUSED, Outcome.FAILED.value, "a begin out of turn"]
            if len(message) == 4 and w.key is not None and w.loan is None:
                answer = w.lending.begin(*message[1:])
            if answer[0] == LENT:
                w.loan = answer[1]
            w.send(msgpack.packb(answer, use_bin_type=True))
            return True
        if w.loan is None:
            return False
        loan, w.loan = w.loan, None
        done = kind == Says.DONE and len(message) == 3
        try:
            said = Outcome(message[1]) if done else Outcome.FAILED
        except ValueError:
            said = Outcome.FAILED
        final, detail = w.lending.end(loan, said, str(message[2]) if done else "")
        if done:
            message[1:] = [final.value, detail]
        return False

    def _heard(self, w: Worker, message: Any) -> None:
        """One message of `w`'s; under the lock."""
        kind = message[0] if isinstance(message, list) and message else None
        if kind == Says.READY and len(message) == 1:
            w.ready = True
            self._crew.failed_starts = 0
        elif kind == Says.BROKEN and len(message) == 2:
            self._crew.failed_starts = BROKEN_STARTS
            self._crew.broken = str(message[1])
            log.warning("shmstore: the miss pool cannot build its processor (%s): every miss "
                        "takes the engine's own path", self._crew.broken)
            self._fail_all(Outcome.UNAVAILABLE)
        elif kind == Says.DONE and len(message) == 3 and isinstance(message[2], str):
            self._done(w, message[1], message[2])
        else:
            log.warning("shmstore: a miss pool worker (pid %s) sent %.80r", w.pid, message)
            self._done(w, Outcome.FAILED.value, "malformed answer")

    def _done(self, w: Worker, word: Any, detail: str) -> None:
        key, w.key = w.key, None
        if key is None:
            return
        try:
            outcome = Outcome(word)
        except ValueError:
            outcome = Outcome.FAILED
        if detail != ALREADY:
            self._counts["processed"] += 1
        if outcome is STORED:
            self._counts["stored"] += 1
        else:
            self._fallback[outcome] += 1
            log.debug("shmstore: miss pool: %s %s (%s)", key, outcome.value, detail)
        self._settle(key, outcome)

    def _gone(self, now: float, look: set[Worker] | None) -> list[Worker]:
        """Take out the workers that died (of those in `look`; None: of all) or are over a
        time limit, their jobs falling back ("died"); under the lock. The caller stops them,
        outside it."""
        keep, gone = [], []
        for w in self._crew.workers:
            why = w.overdue(now, look=look is None or w in look)
            if not why:
                keep.append(w)
                continue
            if w.key is not None:
                log.warning("shmstore: a miss pool worker (pid %s) %s: it is stopped and item "
                            "%s falls back", w.pid, why, w.key)
                self._fallback[Outcome.DIED] += 1
                self._settle(w.key, Outcome.DIED)
                w.key = None
            elif w.ready or why != "died":
                log.warning("shmstore: a miss pool worker (pid %s) %s", w.pid, why)
            if not w.ready:
                was = self._crew.broken
                self._crew.started_badly(w)
                if self._crew.broken and not was:
                    log.warning("shmstore: the miss pool stops: %s; every miss takes the "
                                "engine's own path", self._crew.broken)
                    self._fail_all(Outcome.UNAVAILABLE)
            gone.append(w)
        self._crew.workers = keep
        return gone

    def _settle(self, key: str, outcome: Outcome) -> None:
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

    def _fail_all(self, reason: Outcome) -> None:
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
            if self._closed and not self._crew.workers:
                return
            self._closed = True
            self._fail_all(Outcome.CLOSED)
            for key in list(self._flight):
                self._fallback[Outcome.CLOSED] += 1
                self._settle(key, Outcome.CLOSED)
        self._flush()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)
        with self._lock:
            workers, self._crew.workers = self._crew.workers, []
        for w in workers:
            w.release()  # the worker reads EOF and exits
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (any(w.process.exitcode is None for w in workers)
               and time.monotonic() < deadline):
            time.sleep(REAP_POLL_S)
        self._crew.stop(workers)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> MissPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
