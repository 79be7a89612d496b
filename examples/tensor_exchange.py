"""One writer puts image tensors into a shmstore; two reader processes read them in place.

    python examples/tensor_exchange.py [--items 200] [--readers 2]

The writer sends only the 40-byte packed Handle to each reader (here over a multiprocessing
queue); the readers attach to the store by name and verify every tensor against its checksum.
Resent images are handed out again with get_cached instead of being copied.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import random
import signal
import sys
import time

import numpy as np

from shmstore import Handle, ObjectStore

IMAGE_SHAPES = [(1, 3, 336, 336), (1, 3, 448, 448), (5, 3, 336, 336)]  # LLaVA, Qwen2-VL, 5 tiles


def digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(arr).cast("B"), digest_size=16).hexdigest()


def reader(name: str, index: int, inbox: mp.Queue, results: mp.Queue) -> None:
    with ObjectStore.attach(name, reader=index) as store:
        verified = 0
        while (msg := inbox.get(timeout=60)) is not None:
            packed, expected = msg
            with store.view(Handle.unpack(packed)) as kwargs:  # zero copy: a view into shm
                verified += digest(kwargs["pixel_values"]) == expected
        results.put((index, verified))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--readers", type=int, default=2)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind the with-block: it unlinks
    ctx = mp.get_context("spawn")
    name = f"shmstore-example-{os.getpid()}"
    rng = random.Random(0)
    with ObjectStore.create(name, capacity_bytes=256 << 20, n_readers=args.readers) as store:
        inboxes = [ctx.Queue() for _ in range(args.readers)]
        for inbox in inboxes:  # on Ctrl-C, exit without waiting to flush handles nobody reads
            inbox.cancel_join_thread()
        results = ctx.Queue()
        procs = [ctx.Process(target=reader, args=(name, i, inboxes[i], results))
                 for i in range(args.readers)]
        for p in procs:
            p.start()
        sums: dict[str, str] = {}
        t0 = time.perf_counter()
        for _ in range(args.items):
            key = f"image-{rng.randrange(args.items // 3)}"  # users resend the same images
            if store.is_cached(key):
                handle = store.get_cached(key)
            else:
                pixels = np.random.default_rng(len(sums)).standard_normal(
                    rng.choice(IMAGE_SHAPES), dtype=np.float32)
                handle = store.put(key, {"pixel_values": pixels}, timeout=30)
                sums[key] = digest(pixels)
            for inbox in inboxes:
                inbox.put((handle.pack(), sums[key]))
        for inbox in inboxes:
            inbox.put(None)
        verified = dict(results.get(timeout=120) for _ in procs)
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(timeout=30)
        stats = store.stats()
    print(f"{args.items} requests, {stats.puts} puts, {stats.hits} cache hits, "
          f"{stats.evictions} evictions in {elapsed:.2f} s")
    for index in sorted(verified):
        print(f"reader {index}: {verified[index]}/{args.items} tensors verified")
    if any(v != args.items for v in verified.values()):
        raise SystemExit("verification FAILED")


if __name__ == "__main__":
    main()
