"""Where the fixed cost of one put / get / view of a small object goes.

    OMP_NUM_THREADS=1 python bench/bench_percall.py [--size BYTES] [--repeats N]

The object is what a multimodal preprocessor hands over: {"pixel_values": float32 array of
--size bytes, "image_sizes": (336, 336)}. Each step of the real call is timed on its own, on
the same inputs, with the same code the call runs (microseconds per call, the median of
--repeats batches); "rest" is what the call costs beyond the steps listed (Python calls, the
ring's and the index's bookkeeping, the eviction of the oldest object, the read count). The
copy rows show what a bare numpy copy of the same bytes costs in the same run. Then a queue's
put and get of a float message, and a second API server's calls to the store's host (a
RemoteWriter in a spawned process, timed by its own CPU clock, against the same call made on
the writer in this process).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import multiprocessing
import statistics
import threading
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import wait

import numpy as np

from shmstore import BroadcastQueue, ObjectStore
from shmstore.handle import key_digest
from shmstore.serde._codec import _PACK, _Encoder, encode
from shmstore.serde._decode import decode
from shmstore.store._layout import U64

BATCH = 200


def per_call_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(BATCH):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        times.append((time.perf_counter() - t0) / BATCH)
    return statistics.median(times) * 1e6


def table(title: str, total: float, parts: list[tuple[str, float]], rest: str) -> None:
    print(f"\n{title}: {total:.2f} us per call")
    for label, us in parts:
        print(f"  {label:<44} {us:6.2f} us  {100 * us / total:5.1f} %")
    left = total - sum(us for _, us in parts)
    print(f"  {'rest: ' + rest:<44} {left:6.2f} us  {100 * left / total:5.1f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64 << 10)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    r = args.repeats
    src = np.random.default_rng(0).random(args.size // 4, dtype=np.float32)
    obj = {"pixel_values": src, "image_sizes": (336, 336)}
    keys = (f"image-{i:012d}" for i in itertools.count())
    name = f"shmstore-percall-{os.getpid()}"
    capacity = max(64 << 20, 64 * args.size)

    with ObjectStore.create(name, capacity_bytes=capacity, n_readers=0) as store:
        for _ in range(capacity // args.size + 1):  # steady state: every put evicts one
            store.put(next(keys), obj)
        put = per_call_us(lambda: store.put(next(keys), obj), r)
        enc = encode(obj)
        tree = _Encoder("obj", False).walk(obj, (), 0)
        dst = memoryview(bytearray(enc.nbytes + 64))
        words = store._words
        word = store._meta
        parts = [
            ("key digest (blake2b-128 of the key)", per_call_us(lambda: key_digest(next(keys)), r)),
            ("encode: walk the value, size the body", per_call_us(lambda: encode(obj), r)),
            ("  of which msgpack's pack of the structure", per_call_us(lambda: _PACK(tree), r)),
            ("structure CRC-32 + object header pack",
             per_call_us(lambda: zlib.crc32(U64.pack(enc.nbytes), enc.structure_crc), r)),
            ("write_into: prefix + array copy", per_call_us(lambda: enc.write_into(dst), r)),
            ("  of which the array's copy alone",
             per_call_us(lambda: dst.__setitem__(slice(64, 64 + src.nbytes), src.data.cast("B")),
                         r)),
            ("full barrier (atomic exchange, hand-out)", per_call_us(lambda: words.exchange(word, 0), r)),
            ("call guard enter + leave",
             per_call_us(lambda: (store._guard_enter(), store._guard_leave()), r)),
        ]
        table(f"put of {args.size} B", put, parts, "ring, index, policy, eviction, calls")

    with ObjectStore.create(name, capacity_bytes=capacity, n_readers=1) as store:
        reader = ObjectStore.attach(name, reader=0)
        try:
            handle = store.put("x", obj)
            for _ in range(BATCH * (3 * r + 10)):
                store.get_cached("x")
            get = per_call_us(lambda: reader.get(handle), r)

            def view() -> None:
                with reader.view(handle) as value:
                    value["pixel_values"]

            view_us = per_call_us(view, r)
            body, body_bytes, crc, _ = reader._locate(handle)
            data = reader._buf[body:body + body_bytes]
            suffix = U64.pack(body_bytes)
            guard = reader._guard
            parts = [
                ("call guard enter + leave", per_call_us(lambda: (guard.enter(), guard.leave()), r)),
                ("pin + unpin (two full barriers, a lock)",
                 per_call_us(lambda: reader._unpin(reader._pin(handle), None), r)),
                ("locate: chunk + object header checks", per_call_us(lambda: reader._locate(handle), r)),
                ("decode, zero copy (msgpack, checks, CRC)",
                 per_call_us(lambda: decode(data, copy=False, expected_crc=crc, crc_suffix=suffix), r)),
                ("array copy into fresh memory (arr.copy)", per_call_us(lambda: src.copy(), r)),
            ]
            table(f"get of {args.size} B (owned copy)", get, parts, "read count, reuse check, calls")
            table(f"view of {args.size} B (zero copy)", view_us, parts[:4],
                  "read count, context manager, calls")
        finally:
            reader.close()
    queue_round_trip(r)
    remote_calls(r)


def queue_round_trip(repeats: int) -> None:
    """put and get of a small message (a float) on a queue, one process: batches of puts, then
    the same number of gets, so neither side waits."""
    name = f"shmstore-percall-q-{os.getpid()}"
    with BroadcastQueue.create(name, n_readers=1, slot_bytes=256, n_slots=256) as q:
        reader = BroadcastQueue.attach(name, 0)
        try:
            put_s, get_s = [], []
            for _ in range(10 + repeats * 10):
                t0 = time.perf_counter()
                for _ in range(BATCH):
                    q.put(1.5)
                t1 = time.perf_counter()
                for _ in range(BATCH):
                    reader.get()
                put_s.append((t1 - t0) / BATCH)
                get_s.append((time.perf_counter() - t1) / BATCH)
        finally:
            reader.close()
    print(f"\nqueue, a float message: put {statistics.median(put_s) * 1e6:.2f} us, "
          f"get {statistics.median(get_s) * 1e6:.2f} us per call")


def remote_client(name: str, repeats: int, conn: object) -> None:
    """A second API server: CPU µs per call of this process (its watcher thread included, and
    shown apart), median of `repeats` batches."""
    from shmstore.store._remote import RemoteWriter

    def watcher_s() -> float:
        return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
                   for t in threading.enumerate() if t.name.startswith("shmstore-remote-"))

    def cpu_us(call: Callable[[], object]) -> tuple[float, float]:
        runs, watched = [], []
        for _ in range(repeats):
            c0, w0 = time.process_time(), watcher_s()
            for _ in range(BATCH):
                call()
            runs.append((time.process_time() - c0) / BATCH * 1e6)
            watched.append((watcher_s() - w0) / BATCH * 1e6)
        return statistics.median(runs), statistics.median(watched)

    def hit() -> None:
        found = writer.hand_out_cached(["x"])[0]
        assert found is not None
        writer.give_back(found.handle, found.number)

    with RemoteWriter(name) as writer:
        for _ in range(BATCH):  # warm
            writer.cached(["x"])
        conn.send([cpu_us(lambda: writer.cached(["x"])), cpu_us(hit)])  # type: ignore[attr-defined]


def remote_calls(repeats: int) -> None:
    """The store's host in this process, a RemoteWriter in a spawned one: each call's CPU on
    the client's side against the same call on the writer here."""
    from shmstore.store._host import WriterHost

    name = f"shmstore-percall-r-{os.getpid()}"
    with ObjectStore.create(name, capacity_bytes=8 << 20, n_readers=1) as store:
        store.store("x", {"pixel_values": np.zeros(16, dtype=np.float32)})
        host = WriterHost(store, threading.RLock())
        try:
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe()
            client = ctx.Process(target=remote_client, args=(name, repeats, theirs))
            client.start()
            theirs.close()
            if ours not in wait([ours, client.sentinel], 600):  # answered, died, or stuck
                client.kill()
                client.join(60)  # reaped: its exit code below, no zombie left
                raise SystemExit(f"the remote client did not answer (exit code "
                                 f"{client.exitcode})")
            (cached, cached_watch), (hit, hit_watch) = ours.recv()
            client.join(60)
        finally:
            host.close()
        local_cached = per_call_us(lambda: store.cached(["x"]), repeats)

        def local_hit() -> None:
            found = store.hand_out_cached(["x"])[0]
            assert found is not None
            store.give_back(found.handle, found.number)
        local = per_call_us(local_hit, repeats)
    print("\na second API server's call to the store's host (its process's CPU; of which its "
          "watcher thread) against the call on the writer here:")
    print(f"  cached:                        {cached:7.2f} us (watcher {cached_watch:5.2f}), "
          f"{cached / local_cached:6.1f}x the local {local_cached:.2f} us")
    print(f"  hand_out_cached + give_back:   {hit:7.2f} us (watcher {hit_watch:5.2f}), "
          f"{hit / local:6.1f}x the local {local:.2f} us")


if __name__ == "__main__":
    main()
