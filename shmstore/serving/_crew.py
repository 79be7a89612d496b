"""The miss pool's workers: their lives in the owner's process (Crew: start, read, find the
ones to stop, stop, replace) and the worker process itself (_worker_main).

    owner's dispatcher thread                    worker process (spawned by that thread)
      job frames: [key, job]            ----->     builds its processor, maps the store's
                                                   ring, then per job: process, encode,
      messages:   ["ready"]             <-----       ask for a chunk, write the item into it
                  ["broken", why]                    (a job it cannot read: "failed")
                  ["begin", key, nbytes, crc]
      answers:    ["lent", loan, offset] ----->
                  ["refused", outcome, why]
                  ["done", outcome, detail] <---   (the dispatcher publishes a stored chunk:
                                                   serving/_lending.py)

A worker dies with its owner whatever it is doing: it asks the kernel for SIGKILL when the
thread that started it goes (PR_SET_PDEATHSIG; a thread that watches its parent where prctl
is missing), and the dispatcher thread starts every worker and ends only with the pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import threading
import time
from enum import Enum
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from ..serde._codec import encode
from ..shm._segment import ALIGN_BYTES
from ._lending import LENT, REFUSED, Lending, PoolStore
from ._log import log
from ._outcome import STORED, Outcome, Processor

__all__ = ["BROKEN_STARTS", "DIRECT_FRAME_BYTES", "JOB_TIMEOUT_S", "START_TIMEOUT_S",
           "STOP_TIMEOUT_S", "REAP_POLL_S", "WORKER_NAME", "Says", "Crew", "Worker"]

MAX_DETAIL_CHARS = 512  # a worker's error message, cut here
START_TIMEOUT_S = 300.0  # a worker that is not ready by then is stopped (loading a model is slow)
BROKEN_STARTS = 3  # workers that die or fail before ready, in a row: the pool stops starting them
JOB_TIMEOUT_S = 60.0  # a worker on one item longer than this is stopped (the item falls back)
STOP_TIMEOUT_S = 5.0  # close(): how long a worker has to exit before it is killed
DIRECT_FRAME_BYTES = 4096  # a job frame up to this size is written by the dispatcher itself
# (into a worker's empty socket: an AF_UNIX socket buffers far more), larger ones by a thread
REAP_POLL_S = 0.005  # a killed worker's exit is polled (waitpid), never waited on its pipe
OWNER_CHECK_S = 0.5  # where prctl is missing, a worker looks for its owner this often
WORKER_NAME = "shmstore-pool"  # a worker's process name (/proc/PID/comm, at most 15 bytes)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# glibc's malloc, in a worker: a photo's buffers (a 3 MP photo: 9 MB decoded, several copies)
# come from the heap and stay there between jobs, instead of an mmap per buffer and a trim of
# the heap's top after each job, whose pages the next job faults in again (about 3,000 faults,
# 6 ms of a 20 ms miss; bench/bench_pool.py). Up to 32 MiB a buffer (glibc's most) from the
# heap; up to 64 MiB freed at its top kept.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 64 << 20


class Says(str, Enum):
    """The kinds of message a worker sends: once ready or broken, then per job a begin (the
    item is made: a chunk for it) unless it ends before, and one done."""

    READY = "ready"
    BROKEN = "broken"
    BEGIN = "begin"
    DONE = "done"



class Worker:
    """One worker process and the parent's end of its pipe; `key` is the one it works on."""

    __slots__ = (
        "_closing",
        "_released",
        "_sent_all",
        "busy_since",
        "conn",
        "key",
        "lending",
        "loan",
        "outbox",
        "pid",
        "process",
        "ready",
        "started_at",
    )

    def __init__(self, process: Any, conn: Connection, lending: Lending) -> None:
        self.process, self.pid, self.conn = process, process.pid, conn
        self.lending = lending  # the chunks it writes into
        self.loan: int | None = None  # the one it writes its job's item into now
        self.ready = False
        self.key: str | None = None
        self.started_at = self.busy_since = time.monotonic()
        self._closing = threading.Lock()
        self._released = self._sent_all = False
        # a job larger than DIRECT_FRAME_BYTES goes through a thread of its own: a worker
        # that hangs (stopped, stuck in a library) blocks that thread on a full pipe, never
        # the dispatcher
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=_send_jobs, args=(self,), daemon=True,
                         name=f"shmstore-pool-send-{self.pid}").start()

    def overdue(self, now: float, *, look: bool = True) -> str:
        """Why this worker is to be stopped now ("" if it is not); whether it died is asked
        of the kernel (waitpid) only where `look`."""
        if self.ready and self.key is not None and now - self.busy_since > JOB_TIMEOUT_S:
            return f"took over {JOB_TIMEOUT_S:.0f} s on item {self.key}"
        if not self.ready and now - self.started_at > START_TIMEOUT_S:
            return f"was not ready after {START_TIMEOUT_S:.0f} s"
        if look and not self.process.is_alive():
            return "died"
        return ""

    def send(self, frame: bytes) -> None:
        """Send a job. An idle worker's socket is empty (it has read its last job before it
        answered), so a small frame is written at once, never blocking; a larger one (a photo
        that rides in its job) goes through the sender thread. Written under the lock release()
        takes: the socket is never closed under this write."""
        if len(frame) > DIRECT_FRAME_BYTES:
            self.outbox.put(frame)
            return
        with self._closing, contextlib.suppress(OSError, ValueError):  # died: its sentinel says
            if not self._released:
                self.conn.send_bytes(frame)

    def release(self) -> None:
        """No job goes to this worker any more: its sender thread stops, and the pipe is
        closed once that thread has stopped writing (now, or when it does): closed under a
        write in progress, its descriptor could be reused by a replacement's new pipe and
        receive the rest of this worker's job (the replacement then waits for ever on a
        message that never ends). Idempotent."""
        self.outbox.put(None)
        with self._closing:
            self._released = True
            if self._sent_all:
                self.conn.close()

    def _sender_done(self) -> None:
        with self._closing:
            self._sent_all = True
            if self._released:
                self.conn.close()


def _send_jobs(w: Worker) -> None:
    """Send a worker its jobs until told to stop (None) or its pipe breaks (it died: the
    dispatcher sees its sentinel); the pipe is closed after (Worker.release)."""
    try:
        with contextlib.suppress(OSError, ValueError):
            while (frame := w.outbox.get()) is not None:
                w.conn.send_bytes(frame)
    finally:
        w._sender_done()


class Crew:
    """The workers' lives, one method per step: start, read what they say, find the ones to
    stop, stop (kill and reap, never waiting on a pipe a worker's child may hold), replace.
    Called by the dispatcher thread only (and by close once it has ended); the MissPool's
    lock guards `workers` and each worker's ready and key, and is never held while a worker
    is started or stopped."""

    def __init__(self, store: PoolStore, processor: Processor, env: dict[str, str]) -> None:
        self.store, self.processor, self.env = store, processor, env
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: list[Worker] = []
        self.failed_starts = 0
        self.broken = ""  # why no worker is started any more ("" while they are)

    def start(self) -> Worker:
        ours, theirs = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(
            target=_worker_main,
            args=(self.store.name, self.store.epoch, self.processor, theirs, self.env,
                  os.getpid()),
            name="shmstore-pool-worker", daemon=True)
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return Worker(process, ours, self.store.lending())

    @staticmethod
    def read(w: Worker) -> Any:
        """The message `w` sent (its socket is readable: a worker writes each message whole),
        a list; None at the socket's end (it died: its sentinel, or is_alive, says so)."""
        try:
            return msgpack.unpackb(w.conn.recv_bytes(), raw=False)
        except (OSError, EOFError):
            return None
        except Exception as exc:  # our own child, yet: never trust a frame
            log.warning("shmstore: a miss pool worker (pid %s) sent a malformed message (%s)",
                        w.pid, exc)
            return [Says.DONE.value, Outcome.FAILED.value, "malformed answer"]

    @staticmethod
    def drain(w: Worker) -> list[Any]:
        """Every message `w` left in its socket (it ended: its sentinel is readable), read
        without waiting."""
        said = []
        try:
            while w.conn.poll():
                if (message := Crew.read(w)) is None:
                    break
                said.append(message)
        except (OSError, EOFError, ValueError):  # its end, or the socket closed
            pass
        return said

    def started_badly(self, w: Worker) -> None:
        """`w` died or was stopped before it was ready; after BROKEN_STARTS in a row, broken."""
        self.failed_starts += 1
        if self.failed_starts >= BROKEN_STARTS and not self.broken:
            self.broken = f"{BROKEN_STARTS} workers in a row died before they were ready"

    @staticmethod
    def stop(workers: list[Worker]) -> None:
        """Kill each of `workers` that still runs and reap it; its pipe is released
        (Worker.release). Not under the pool's lock: a worker in uninterruptible sleep costs at
        most STOP_TIMEOUT_S here, and never a submit."""
        for w in workers:
            w.release()
            with contextlib.suppress(OSError):
                if w.process.exitcode is None:
                    w.process.kill()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for w in workers:
            # exitcode asks waitpid without waiting; join would wait for the worker's pipe to
            # close, which a helper process it forked may hold open after it is gone
            while w.process.exitcode is None and time.monotonic() < deadline:
                time.sleep(REAP_POLL_S)
            with contextlib.suppress(ValueError):
                w.process.close()
            w.loan = None
            w.lending.close()  # a chunk it was writing: given back


# -- the worker process ---------------------------------------------------------------------------

def _die_with_owner(owner: int) -> None:
    """Be killed when the thread that started this process goes (with its process), whatever
    this process is doing then; where prctl is missing, a thread watches the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):
        def watch() -> None:
            while os.getppid() == owner:
                time.sleep(OWNER_CHECK_S)
            os._exit(1)
        threading.Thread(target=watch, daemon=True, name="shmstore-pool-owner").start()
    if os.getppid() != owner:  # gone before the request took effect
        os._exit(1)


def keep_freed_memory() -> bool:
    """Keep a job's freed buffers for the next job (glibc's malloc; elsewhere nothing is
    changed): whether it took effect."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def _worker_main(store_name: str, epoch: int, processor: Processor, conn: Connection,
                 env: dict[str, str], owner: int) -> None:
    """Build the processor and map the store's ring, say ready, then answer each job until the
    pipe closes: process it, and write the item into a chunk the dispatcher lends."""
    _die_with_owner(owner)
    keep_freed_memory()
    os.environ.update(env)
    with contextlib.suppress(OSError):  # the name ps and /proc/PID/comm show
        with open("/proc/self/comm", "w") as comm:
            comm.write(WORKER_NAME)
    from ..shm._ring import ShmRingBuffer

    def say(kind: Says, *words: Any) -> None:
        conn.send_bytes(msgpack.packb([kind.value, *words], use_bin_type=True))

    def done(outcome: Outcome, detail: str = "") -> None:
        say(Says.DONE, outcome.value, detail[:MAX_DETAIL_CHARS])

    try:
        process = processor.build()
        ring = ShmRingBuffer.attach(store_name, prefault=False)  # pages as they are written
        if ring.segment.epoch != epoch:
            ring.close()
            raise RuntimeError(f"store {store_name!r} was made anew; this pool's is gone")
    except Exception as exc:
        say(Says.BROKEN, f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS])
        return
    say(Says.READY)
    with ring:
        while True:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the pool closed, or its process is gone
            try:
                key, job = msgpack.unpackb(frame, raw=False)
            except Exception as exc:  # checked where submitted; never a reason to die
                done(Outcome.FAILED, f"unreadable job: {exc}")
                continue
            try:
                value = process(job)
            except Exception as exc:
                done(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
                continue
            if value is None:
                done(Outcome.DECLINED)
                continue
            try:
                done(*_write(say, conn, ring.segment.buf, key, value))
            except (EOFError, OSError):
                return


def _write(say: Any, conn: Connection, buf: memoryview, key: str, value: Any
           ) -> tuple[Outcome, str]:
    """Encode `value`, ask the dispatcher for a chunk and write it there: the job's outcome
    (STORED: written, for the dispatcher to publish). EOFError, OSError: the pool is gone."""
    try:
        enc = encode(value)
    except Exception as exc:
        return Outcome.FAILED, f"{type(exc).__name__}: {exc}"
    say(Says.BEGIN, key, enc.nbytes, enc.structure_crc)
    answer = msgpack.unpackb(conn.recv_bytes(), raw=False)
    try:
        if answer[0] == REFUSED:
            return Outcome(answer[1]), str(answer[2])
        word, loan, offset = answer
        if word != LENT or type(offset) is not int:
            raise ValueError(word)
    except (ValueError, TypeError, IndexError, KeyError):
        return Outcome.FAILED, f"an answer to begin that is not one: {answer!r:.80}"
    if not ALIGN_BYTES <= offset <= len(buf) - enc.nbytes:
        return Outcome.FAILED, f"chunk {loan} lent outside the store's {len(buf)} bytes"
    try:
        enc.write_into(buf[offset:offset + enc.nbytes])
    except Exception as exc:  # a value that changed under it: the chunk is given back
        return Outcome.FAILED, f"{type(exc).__name__}: {exc}"
    return STORED, ""
