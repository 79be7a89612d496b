"""What each eviction policy costs the writer: time per hit and per put, and memory per object.

    OMP_NUM_THREADS=1 python bench/bench_policy_cost.py [--policies fifo,freq,adaptive]
                                                        [--capacity-mib 64]

1. A full store of `capacity` with objects of 64 KiB and no readers (every object reclaimable),
   one per policy: the median time of a hit (`get_cached` of a cached key) and of a put of a new
   key (which evicts, or copies forward what the policy keeps), warm, in 41 rounds that time
   every policy in turn; and the median of each round's ratio to freq.
2. For `adaptive`, its shadows' own work alone: `requested` for a cached key and for a new one,
   timed on a policy fed the same puts (no ring, no bytes).
3. The writer's Python heap (tracemalloc) with the store filled by objects of 128 bytes (the
   most objects it can hold, so the policy's per-object records dominate), per policy.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from shmstore import ObjectStore
from shmstore.store._policy import AdaptivePolicy, make_policy

KIB = 1024


def median_us(call: Callable[[int], object], n: int, batches: int = 15) -> float:
    """Median over `batches` of the mean time of `n` calls of `call(i)`, in microseconds."""
    results = []
    i = 0
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(n):
            call(i)
            i += 1
        results.append((time.perf_counter() - started) / n)
    return statistics.median(results) * 1e6


def hit_and_put(policies: list[str], capacity: int, rounds: int = 41
                ) -> dict[str, tuple[float, float, float, float]]:
    """Per policy: median µs of a hit and of a put of 64 KiB in a full store, and the median
    of its ratios to freq's over rounds that time every policy in turn (so that a busy spell of
    the machine weighs on all alike): (hit, put, hit / freq, put / freq)."""
    value = np.zeros(64 * KIB, np.uint8)
    stores = {policy: ObjectStore.create(None, capacity_bytes=capacity, n_readers=0,
                                         policy=policy) for policy in policies}
    try:
        n = capacity // (64 * KIB) * 2  # twice round the ring: full, with its policy's state
        cached = {}
        for policy, w in stores.items():
            for i in range(n):
                w.put(f"warm-{i}", value)
            cached[policy] = [f"warm-{i}" for i in range(n) if w.is_cached(f"warm-{i}")]
        hits: dict[str, list[float]] = {p: [] for p in policies}
        puts: dict[str, list[float]] = {p: [] for p in policies}
        for _ in range(rounds):  # hits first: a put would evict what the hits ask for
            for policy, w in stores.items():
                keys = cached[policy]
                hits[policy].append(median_us(
                    lambda i, w=w, keys=keys: w.get_cached(keys[i % len(keys)]), 300, batches=1))
        for r in range(rounds):
            for policy, w in stores.items():
                puts[policy].append(median_us(
                    lambda i, w=w, r=r: w.put(f"new-{r}-{i}", value), 60, batches=1))
    finally:
        for w in stores.values():
            w.close()

    def ratio(times: dict[str, list[float]], policy: str) -> float:
        if "freq" not in times:
            return float("nan")
        return statistics.median(a / f for a, f in zip(times[policy], times["freq"]))

    return {p: (statistics.median(hits[p]), statistics.median(puts[p]), ratio(hits, p),
                ratio(puts, p)) for p in policies}


def shadow_work(capacity: int) -> tuple[float, float]:
    """Median µs of adaptive's `requested` (its shadows and its LRU) for a hit and a miss."""
    policy = make_policy("adaptive")
    assert isinstance(policy, AdaptivePolicy)
    policy.start(capacity)
    chunk = 64 * KIB + 4 * KIB
    n = capacity // chunk
    for i in range(2 * n):
        policy.requested(f"warm-{i}", chunk)
    live = [f"warm-{i}" for i in range(n, 2 * n)]  # the last ring's worth: cached in every shadow
    hit = median_us(lambda i: policy.requested(live[i % len(live)], chunk), 200)
    miss = median_us(lambda i: policy.requested(f"new-{i}", chunk), 200)
    return hit, miss


def heap_with_tiny_objects(policy: str, capacity: int) -> tuple[int, float]:
    """Objects cached, and the writer's traced Python heap in MB, with 128-byte objects."""
    value = np.zeros(128, np.uint8)
    tracemalloc.start()
    try:
        with ObjectStore.create(None, capacity_bytes=capacity, n_readers=0, policy=policy) as w:
            i = 0
            while w.is_cached("k0") or i == 0:  # until the ring came round once
                w.put(f"k{i}", value)
                i += 1
            objects = w.stats().objects
            heap = tracemalloc.get_traced_memory()[0] / 1e6
    finally:
        tracemalloc.stop()
    return objects, heap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="fifo,freq,adaptive")
    parser.add_argument("--capacity-mib", type=int, default=64)
    args = parser.parse_args()
    capacity = args.capacity_mib << 20
    policies = [p for p in args.policies.split(",") if p]
    print(f"full store of {args.capacity_mib} MiB, 64 KiB objects, no readers (median µs)")
    times = hit_and_put(policies, capacity)
    for policy, (hit, put, _, _) in times.items():
        print(f"{policy:>9}: hit {hit:6.2f} us, put {put:6.2f} us", flush=True)
    for policy, (_, _, hit_ratio, put_ratio) in times.items():
        if policy != "freq" and "freq" in times:
            print(f"{policy:>9} / freq: hit {hit_ratio:.2f}x, put {put_ratio:.2f}x "
                  "(median of the ratios of rounds timed in turn)")
    if "adaptive" in policies:
        hit, miss = shadow_work(capacity)
        print(f"adaptive's shadows alone (requested): hit {hit:.2f} us, miss {miss:.2f} us",
              flush=True)
    print(f"writer's Python heap, {args.capacity_mib} MiB store full of 128-byte objects")
    per_object = {}
    for policy in policies:
        objects, heap = heap_with_tiny_objects(policy, capacity)
        per_object[policy] = heap * 1e6 / objects
        print(f"{policy:>9}: {objects:,} objects, {heap:.0f} MB "
              f"({per_object[policy]:.0f} bytes per object)", flush=True)
    if "freq" in per_object:
        for policy in policies:
            if policy != "freq":
                print(f"{policy:>9} - freq: {per_object[policy] - per_object['freq']:+.0f} bytes "
                      "per object")


if __name__ == "__main__":
    main()
