"""Where a sleeping reader's wake-up time goes: shmstore's queue against a bare semaphore.

    OMP_NUM_THREADS=1 python bench/bench_wakeup.py [--messages N] [--gap-ms G] [--warm-ms W]

1. The cost of one `put` (no reader attached) right after the writer was idle for 0, 1 and
   20 ms: the same Python code on a CPU that went idle.
2. One message every G ms (readers fall asleep between them), on the compiled hand-off and on
   the Python path (queue/_slots.py): latency from just before `put`
   to the reader's `get` returning, and the part of it until the reader's semaphore wait
   returned (the rest is the reader's own code after waking).
2b. Flooded: messages per second to one reader, and the CPU a reader blocked in get takes,
   on the compiled hand-off and on the Python path, three rounds in turn.
3. The floor: a bare POSIX semaphore posted by one Python process and waited on by another,
   same pacing.
3b. What a compiled hand-off would buy, bounded from above: the hand-off made of C calls only,
   a few per side, with no Python work between them. The writer packs the message into a slot
   of a shared mapping, CRCs it (zlib), stores the sequence number with release order through
   the words of shm/_ordering.py and posts the semaphore; the reader waits, loads the sequence
   with acquire order, checks the CRC, unpacks and says it took it (one slot: the next
   message waits for that, which a paced send finds done already). One C function per side
   doing the same would only drop the Python calls between these.
4. A Rust-backed peer: iceoryx2's Python bindings, an event notifier to a listener in another
   process, same pacing (`pip install iceoryx2`; skipped when it is not installed). What it
   leaves in /dev/shm and /tmp/iceoryx2 is removed afterwards.
Medians and 99th percentiles over N messages. With --warm-ms W the writer busy-loops for W ms
before each message of 2 and 3 (its CPU is awake and clocked up when it sends). First, what
one full-barrier exchange on a shared word costs after the CPU idled, through the compiled
words and through ctypes (shm/_ordering.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import multiprocessing as mp
import statistics
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

from shmstore import BroadcastQueue


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` in microseconds; nan for none (on a busy machine a reader
    may never have slept in a short run: nothing woke it)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e6


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def put_after_idle() -> dict[float, float]:
    q = BroadcastQueue.create(None, n_readers=1, slot_bytes=64, n_slots=64)
    try:
        costs = {}
        for gap in (0.0, 0.001, 0.02):
            times = []
            for _ in range(60):
                if gap:
                    time.sleep(gap)
                started = time.perf_counter()
                q.put(started, timeout=0)
                times.append(time.perf_counter() - started)
            costs[gap] = statistics.median(times) * 1e6
        return costs
    finally:
        q.close()


def paced_sends(n: int, gap: float, warm: float, send: Callable[[], object]) -> list[float]:
    """Call `send` n times, `gap` s apart (busy `warm` s before each); return when each began."""
    sent = []
    for _ in range(n):
        time.sleep(gap)
        busy(warm)
        sent.append(time.perf_counter())
        send()
    return sent


def exchange_after_idle() -> dict[str, float]:
    """Median time of one full-barrier exchange on a word of a mapping, after 20 ms of sleep,
    through each ordering path this machine has (the compiled words, ctypes into libatomic)."""
    import mmap

    from shmstore.shm import _ordering

    mapping = mmap.mmap(-1, 4096)
    paths: dict[str, Any] = {}
    if _ordering._compiled is not None:  # built, whether or not SHMSTORE_ORDERING opts in
        paths["compiled"] = _ordering._compiled.Words(mapping)
    if _ordering.FULL_FENCE:  # the pure-Python words call libatomic through ctypes
        paths["ctypes"] = _ordering.OrderedWords(mapping)
    times: dict[str, list[float]] = {label: [] for label in paths}
    try:
        for _ in range(60):
            for label, words in paths.items():
                time.sleep(0.02)
                started = time.perf_counter()
                words.exchange(64, 1)
                times[label].append(time.perf_counter() - started)
    finally:
        for words in paths.values():
            words.release()
        mapping.close()
    return {label: statistics.median(t) * 1e6 for label, t in times.items()}


def use_handoff(compiled: bool) -> Any:
    """Make the queues this process creates or attaches take the compiled hand-off or the Python
    twin (queue/_slots.py); return what was set before."""
    from shmstore.queue import _slots

    before = _slots.SLOTS
    _slots.SLOTS = _slots.COMPILED if compiled else _slots.PythonSlots
    return before


def one_reader_queue(compiled: bool) -> Any:
    """A queue of 64-byte slots for one reader, taking the compiled hand-off or the Python
    path; this process's default is left as it was."""
    before = use_handoff(compiled)
    try:
        return BroadcastQueue.create(None, n_readers=1, slot_bytes=64, n_slots=64)
    finally:
        use_handoff(before is not None)


def queue_reader(name: str, n: int, compiled: bool, out: Any) -> None:
    import shmstore.shm._wait as wait

    use_handoff(compiled)
    woke: list[float] = []
    original = wait.Doorbell.wait

    def timed_wait(self: Any, seconds: float) -> None:  # the Python path's sleep
        original(self, seconds)
        woke.append(time.perf_counter())

    wait.Doorbell.wait = timed_wait  # type: ignore[method-assign]
    q = BroadcastQueue.attach(name, 0)
    rows = []
    for _ in range(n):
        sent = q.get()
        rows.append((sent, woke[-1] if woke else 0.0, time.perf_counter()))
    out.put(rows)
    q.close()


def queue_handoff(n: int, gap: float, warm: float, ctx: Any,
                  compiled: bool) -> tuple[list[float], list[float]]:
    """Put-to-get latency of a queue whose writer and reader take the compiled hand-off or the
    Python path, one message per gap; and, on the Python path, the part until the reader's
    semaphore wait returned."""
    q = one_reader_queue(compiled)
    out = ctx.Queue()
    p = ctx.Process(target=queue_reader, args=(q.name, n, compiled, out))
    p.start()
    try:
        q.wait_for_readers(60)
        time.sleep(0.5)
        for _ in range(n):
            time.sleep(gap)
            busy(warm)
            q.put(time.perf_counter())
        rows = out.get(timeout=120)
    finally:
        p.join(60)
        q.close()
    total = [done - sent for sent, _, done in rows]
    return total, [woke - sent for sent, woke, _ in rows if woke > sent]


def flood_reader(name: str, n: int, compiled: bool, out: Any) -> None:
    use_handoff(compiled)
    q = BroadcastQueue.attach(name, 0)
    try:
        cpu = time.process_time()
        with contextlib.suppress(Exception):
            q.get(timeout=IDLE_S)  # nothing comes: how much CPU a blocked get takes
        idle = (time.process_time() - cpu) / IDLE_S
        out.put("idle measured")
        for _ in range(n):
            q.get()
        out.put((idle, time.perf_counter()))
    finally:
        q.close()


IDLE_S = 1.0


def flood(n: int, ctx: Any, compiled: bool) -> tuple[float, float]:
    """(messages per second, a blocked reader's share of a core) on the compiled hand-off or
    the Python path: one reader, n small messages sent as fast as the slots allow."""
    q = one_reader_queue(compiled)
    out = ctx.Queue()
    p = ctx.Process(target=flood_reader, args=(q.name, n, compiled, out))
    p.start()
    try:
        q.wait_for_readers(60)
        out.get(timeout=60)
        started = time.perf_counter()
        for i in range(n):
            q.put(float(i), timeout=60)
        idle, done = out.get(timeout=120)
    finally:
        p.join(60)
        q.close()
    return n / (done - started), idle


def semaphore_reader(name: str, n: int, out: Any) -> None:
    import posix_ipc

    sem = posix_ipc.Semaphore(name)
    got = []
    for _ in range(n):
        sem.acquire()
        got.append(time.perf_counter())
    out.put(got)
    sem.close()


SLOT = struct.Struct("<dQ")  # the message (a timestamp), its sequence number; then a CRC
SLOT_OFFSET = 64
TAKEN_OFFSET = 8  # the last sequence number the reader took: the writer's one slot is free
TAKEN_WAIT_S = 120.0


def c_calls_reader(sem_name: str, shm_name: str, n: int, out: Any) -> None:
    import mmap

    import posix_ipc

    from shmstore.shm._ordering import ordered_words

    sem = posix_ipc.Semaphore(sem_name)
    memory = posix_ipc.SharedMemory(shm_name)
    mapping = mmap.mmap(memory.fd, memory.size)
    memory.close_fd()
    words = ordered_words(mapping)
    rows = []
    for expected in range(1, n + 1):
        sem.acquire()
        seq = words.load_acquire(0)
        body = mapping[SLOT_OFFSET:SLOT_OFFSET + SLOT.size]
        if seq != expected or zlib.crc32(body) != words.load_acquire(SLOT_OFFSET + SLOT.size):
            raise RuntimeError(f"message {expected}: sequence {seq} or its CRC is wrong")
        sent, _ = SLOT.unpack(body)
        rows.append((sent, time.perf_counter()))
        words.store_release(TAKEN_OFFSET, expected)
    out.put(rows)
    words.release()
    mapping.close()
    sem.close()


def c_calls_handoff(n: int, gap: float, warm: float, ctx: Any) -> list[float]:
    """Latency of the C-calls-only hand-off (see the module's docstring), one message per gap."""
    import mmap

    import posix_ipc

    from shmstore.shm._ordering import ordered_words

    sem_name, shm_name = f"/bench-wakeup-c-{os.getpid()}", f"/bench-wakeup-c-{os.getpid()}"
    sem = posix_ipc.Semaphore(sem_name, flags=posix_ipc.O_CREX)
    memory = posix_ipc.SharedMemory(shm_name, flags=posix_ipc.O_CREX, size=4096)
    mapping = mmap.mmap(memory.fd, memory.size)
    memory.close_fd()
    words = ordered_words(mapping)
    out = ctx.Queue()
    p = ctx.Process(target=c_calls_reader, args=(sem_name, shm_name, n, out))
    p.start()
    seq = 0

    def send() -> None:
        nonlocal seq
        # one slot: the next message waits until the reader took this one (a reader slowed by
        # a loaded machine would otherwise find a later message there); paced sends find it
        # taken already, so nothing waits in a quiet run
        deadline = time.monotonic() + TAKEN_WAIT_S
        while words.load_acquire(TAKEN_OFFSET) != seq:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reader did not take message {seq} in {TAKEN_WAIT_S} s")
            time.sleep(0.0001)
        seq += 1
        SLOT.pack_into(mapping, SLOT_OFFSET, time.perf_counter(), seq)
        words.store_release(SLOT_OFFSET + SLOT.size,
                            zlib.crc32(mapping[SLOT_OFFSET:SLOT_OFFSET + SLOT.size]))
        words.store_release(0, seq)
        sem.release()

    try:
        time.sleep(1.0)
        paced_sends(n, gap, warm, send)
        rows = out.get(timeout=120)
    finally:
        p.join(60)
        words.release()
        mapping.close()
        memory.unlink()
        sem.unlink()
        sem.close()
    return [got - sent for sent, got in rows]


def iceoryx2_listener(service: str, n: int, ready: Any, out: Any) -> None:
    import iceoryx2 as iox2

    iox2.set_log_level(iox2.LogLevel.Error)  # not the note that no config file was found
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    event = node.service_builder(iox2.ServiceName.new(service)).event().open_or_create()
    listener = event.listener_builder().create()
    ready.put(True)
    got = []
    while len(got) < n:
        woken = listener.blocking_wait()
        now = time.perf_counter()
        got.extend([now] * max(1, len(woken)))
    out.put(got[:n])
    listener.delete()
    del event, node  # the node and its service go with their last reference


def iceoryx2_floor(n: int, gap: float, warm: float, ctx: Any) -> list[float] | None:
    """Latency from notify() to the listener's wait returning, one event per gap; None without
    iceoryx2. Removes the shared-memory files and /tmp/iceoryx2 entries it made."""
    try:
        import iceoryx2 as iox2
    except ImportError:
        return None
    import glob
    import shutil

    before = set(glob.glob("/dev/shm/iox2_*"))
    tmp_existed = os.path.exists("/tmp/iceoryx2")
    service = f"bench-wakeup-{os.getpid()}"
    try:
        iox2.set_log_level(iox2.LogLevel.Error)
        node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
        event = node.service_builder(iox2.ServiceName.new(service)).event().open_or_create()
        notifier = event.notifier_builder().create()
        ready, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=iceoryx2_listener, args=(service, n, ready, out))
        p.start()
        try:
            ready.get(timeout=60)
            time.sleep(0.5)
            sent = paced_sends(n, gap, warm, notifier.notify)
            got = out.get(timeout=120)
        finally:
            p.join(60)
            notifier.delete()
            del event, node
        return [g - s for g, s in zip(got, sent)]
    finally:
        for path in set(glob.glob("/dev/shm/iox2_*")) - before:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not tmp_existed:
            shutil.rmtree("/tmp/iceoryx2", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--warm-ms", type=float, default=0.0)
    args = parser.parse_args()
    n, gap, warm = args.messages, args.gap_ms / 1e3, args.warm_ms / 1e3
    ctx = mp.get_context("spawn")

    exchanges = exchange_after_idle()
    print("one full-barrier exchange after 20 ms idle: "
          + ", ".join(f"{label} {us:.1f} us" for label, us in exchanges.items()))
    costs = put_after_idle()
    print("put with no reader, after the writer was idle for: "
          + ", ".join(f"{g * 1e3:g} ms: {c:.1f} us" for g, c in costs.items()))

    from shmstore.queue._slots import COMPILED as COMPILED_SLOTS
    from shmstore.shm._ordering import ORDERING

    python_total, to_wake = queue_handoff(n, gap, warm, ctx, compiled=False)
    print(f"queue, Python hand-off ({ORDERING} words), one message per {args.gap_ms:g} ms "
          f"(writer busy {args.warm_ms:g} ms before each): put to get p50 "
          f"{pct(python_total, 0.5):.0f} us, p99 {pct(python_total, 0.99):.0f} us; of which "
          f"until the reader's wait returned p50 {pct(to_wake, 0.5):.0f} us")
    total = python_total
    if COMPILED_SLOTS is None:
        print("queue, compiled hand-off: not built here (SHMSTORE_ORDERING or no C compiler)")
    else:
        total, _ = queue_handoff(n, gap, warm, ctx, compiled=True)
        print(f"queue, compiled hand-off (the default), same pacing: put to get p50 "
              f"{pct(total, 0.5):.0f} us, p99 {pct(total, 0.99):.0f} us; "
              f"/ Python hand-off: p50 {pct(total, 0.5) / pct(python_total, 0.5):.2f}x, "
              f"p99 {pct(total, 0.99) / pct(python_total, 0.99):.2f}x")
    if COMPILED_SLOTS is not None:
        rates: dict[bool, list[float]] = {True: [], False: []}
        idles: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(3):  # the two paths in turn, three rounds each
            for compiled in (True, False):
                rate, idle = flood(20_000, ctx, compiled)
                rates[compiled].append(rate)
                idles[compiled].append(idle)
        print("flood, one reader, 20,000 messages, three rounds in turn: compiled "
              + ", ".join(f"{r:,.0f}" for r in rates[True]) + " msgs/s; Python "
              + ", ".join(f"{r:,.0f}" for r in rates[False]) + " msgs/s; median ratio "
              f"{statistics.median(rates[True]) / statistics.median(rates[False]):.2f}x. A get "
              f"blocked {IDLE_S:g} s: compiled {statistics.median(idles[True]) * 100:.2f}%, Python "
              f"{statistics.median(idles[False]) * 100:.2f}% of a core")
    out = ctx.Queue()

    import posix_ipc

    name = f"/bench-wakeup-{os.getpid()}"
    sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX)
    p = ctx.Process(target=semaphore_reader, args=(name, n, out))
    p.start()
    try:
        time.sleep(1.0)
        sent = paced_sends(n, gap, warm, sem.release)
        got = out.get(timeout=120)
    finally:
        p.join(60)
        sem.unlink()
        sem.close()
    floor = [g - s for g, s in zip(got, sent)]
    print(f"bare semaphore, same pacing: p50 {pct(floor, 0.5):.0f} us, p99 {pct(floor, 0.99):.0f} us")
    c_calls = c_calls_handoff(n, gap, warm, ctx)
    print(f"hand-off of C calls only ({ORDERING} words), same pacing: p50 "
          f"{pct(c_calls, 0.5):.0f} us, p99 {pct(c_calls, 0.99):.0f} us")
    iox = iceoryx2_floor(n, gap, warm, ctx)
    if iox is None:
        print("iceoryx2, same pacing: skipped (pip install iceoryx2)")
    else:
        print(f"iceoryx2 event, same pacing: p50 {pct(iox, 0.5):.0f} us, p99 {pct(iox, 0.99):.0f} us; "
              f"shmstore put to get / iceoryx2: p50 {pct(total, 0.5) / pct(iox, 0.5):.1f}x, "
              f"p99 {pct(total, 0.99) / pct(iox, 0.99):.1f}x; C calls only / iceoryx2: p50 "
              f"{pct(c_calls, 0.5) / pct(iox, 0.5):.1f}x, p99 {pct(c_calls, 0.99) / pct(iox, 0.99):.1f}x")


if __name__ == "__main__":
    main()
