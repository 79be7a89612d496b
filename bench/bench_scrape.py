"""What a metrics scrape of a full store costs: `stats()` against the walk of every object it
made before (Space.recount), and a Prometheus scrape of the store's metrics, in one run.

    OMP_NUM_THREADS=1 python bench/bench_scrape.py [--objects 50000] [--readers 8] [--lagging]

The store holds --objects small objects, each read by all --readers readers (attached in this
process) except the last 16 put; between two scrapes 64 of them are handed out again and
read, all but the last 4, which are read after the scrape: a serving store whose workers keep
up, between two scrapes. Times are medians of 20 calls, with
each scrape after the first finding what the previous one left.

--lagging: one more reader index that never attached, and the last reader stops reading after
the fill: together they owe every object. Then also the pause a scrape adds to puts: the
longest and the 99th-percentile put of 2,000 (with a give-back) while another thread runs
stats() in a loop, against the same with that thread running the walk of every object, and
with no scrape at all.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from shmstore import ObjectStore
from shmstore.metrics import register_store_metrics


def median_ms(fn, repeats: int = 20, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def put_pauses(writer, scraper, label: str) -> tuple[float, float]:
    """(p99, longest) of 2,000 puts (each given back) in ms while `scraper` (None: nothing)
    runs in a loop in another thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            scraper()

    thread = threading.Thread(target=loop) if scraper is not None else None
    if thread is not None:
        thread.start()
    times = []
    try:
        value = {"a": np.zeros(64, np.uint8)}
        for i in range(2_000):
            t0 = time.perf_counter()
            writer.give_back(writer.put(f"{label}-{i}", value))
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    times.sort()
    return times[int(len(times) * 0.99)] * 1e3, times[-1] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=50_000)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--lagging", action="store_true",
                        help="a reader that stopped and one never attached; put pauses")
    args = parser.parse_args()
    name = f"bench-scrape-{os.getpid()}"
    value = {"a": np.zeros(64, np.uint8)}
    writer = ObjectStore.create(name, n_readers=args.readers + args.lagging,
                                capacity_bytes=args.objects * 1024 + (8 << 20),
                                max_object_bytes=4096)
    readers = [ObjectStore.attach(name, reader=r) for r in range(args.readers)]
    reading = readers[:-1] if args.lagging else readers  # lagging: the last one stopped
    try:
        handles = [writer.put(f"k{i}", value) for i in range(args.objects)]
        for reader in reading:
            for h in handles[:-16]:
                reader.discard(h)
        keys = iter(range(10**9))

        late: list = []

        def hand_out_64() -> None:  # between two scrapes, the server hands 64 out again and
            made = [writer.get_cached(f"k{next(keys) % (args.objects - 16)}")  # the workers
                    for _ in range(64)]             # read them, all but the last 4, which are
            for reader in reading:                  # read after the next scrape
                for h in late + made[:-4]:
                    reader.discard(h)
            late[:] = made[-4:]

        first = writer.stats()
        assert (list(first.reader_lag), first.objects) == writer._space.recount(), "differ"
        stats_ms = median_ms(writer.stats, before=hand_out_64)
        walk_ms = median_ms(writer._space.recount)
        registry = CollectorRegistry()
        register_store_metrics(writer, registry)
        scrape_ms = median_ms(lambda: generate_latest(registry), before=hand_out_64)
        again = writer.stats()
        assert (list(again.reader_lag), again.objects) == writer._space.recount(), "differ"
        lag = ", ".join(f"{n:,}" for n in again.reader_lag)
        print(f"{args.objects:,} objects, {args.readers} readers"
              + (" (the last stopped) and one never attached" if args.lagging else "")
              + f", 64 hand-outs between scrapes; reads owed: {lag}")
        print(f"  stats()                     {stats_ms:8.3f} ms")
        print(f"  walk of every object        {walk_ms:8.3f} ms   (what stats() did before)")
        print(f"  Prometheus scrape           {scrape_ms:8.3f} ms")
        print(f"  stats() / walk              {stats_ms / walk_ms:8.4f}x")
        if args.lagging:
            print("  2,000 puts, p99 / longest, while another thread runs in a loop:")
            put_pauses(writer, None, "warm-up")  # the first puts after the fill (not shown)
            for label, scraper in (("nothing", None), ("stats()", writer.stats),
                                   ("the walk", writer._space.recount)):
                p99, longest = put_pauses(writer, scraper, label)
                print(f"    {label:<10} {p99:8.3f} / {longest:8.3f} ms")
    finally:
        for reader in readers:
            reader.close()
        writer.close()


if __name__ == "__main__":
    main()
