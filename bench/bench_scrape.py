"""What a metrics scrape of a full store costs: `stats()` against the walk of every object it
made before (Space.recount), and a Prometheus scrape of the store's metrics, in one run.

    OMP_NUM_THREADS=1 python bench/bench_scrape.py [--objects 50000] [--readers 8]

The store holds --objects small objects, each read by all --readers readers (attached in this
process) except the last 16 put; between two scrapes 64 of them are handed out again and
read, all but the last 4, which are read after the scrape: a serving store whose workers keep
up, between two scrapes. Times are medians of 20 calls, with
each scrape after the first finding what the previous one left.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=50_000)
    parser.add_argument("--readers", type=int, default=8)
    args = parser.parse_args()
    name = f"bench-scrape-{os.getpid()}"
    value = {"a": np.zeros(64, np.uint8)}
    writer = ObjectStore.create(name, n_readers=args.readers,
                                capacity_bytes=args.objects * 1024 + (8 << 20),
                                max_object_bytes=4096)
    readers = [ObjectStore.attach(name, reader=r) for r in range(args.readers)]
    try:
        handles = [writer.put(f"k{i}", value) for i in range(args.objects)]
        for reader in readers:
            for h in handles[:-16]:
                reader.discard(h)
        keys = iter(range(10**9))

        late: list = []

        def hand_out_64() -> None:  # between two scrapes, the server hands 64 out again and
            made = [writer.get_cached(f"k{next(keys) % (args.objects - 16)}")  # the workers
                    for _ in range(64)]             # read them, all but the last 4, which are
            for reader in readers:                  # read after the next scrape
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
        print(f"{args.objects:,} objects, {args.readers} readers, 64 hand-outs between scrapes")
        print(f"  stats()                     {stats_ms:8.3f} ms")
        print(f"  walk of every object        {walk_ms:8.3f} ms   (what stats() did before)")
        print(f"  Prometheus scrape           {scrape_ms:8.3f} ms")
        print(f"  stats() / walk              {stats_ms / walk_ms:8.4f}x")
    finally:
        for reader in readers:
            reader.close()
        writer.close()


if __name__ == "__main__":
    main()
