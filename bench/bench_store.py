"""Benchmark put / get / view of one tensor against a plain numpy copy measured in the same run.

    OMP_NUM_THREADS=1 python bench/bench_store.py [--quick] [--json PATH]

For each size: put on a warm (pre-faulted) ring, put on a cold ring (prefault=False, first pass
over fresh pages), get (owned copy), view (zero copy). Baselines, measured in the same run:
  copy     np.copyto into warm private memory of the ring's size, at rotating offsets (the same
           memory traffic as put: the destination is not in the CPU cache);
  hot copy np.copyto into one array that stays in the CPU cache (shown, not used for ratios);
  new copy arr.copy() into fresh memory (what get does: the result must be owned).
Times are medians; ratios are baseline_time / shmstore_time (1.0 = as fast as the copy).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from shmstore import ObjectStore

MIB = 1 << 20
SIZES = [64 << 10, 256 << 10, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(size: int, repeats: int, tag: str) -> dict[str, float]:
    src = np.random.default_rng(0).random(size // 4, dtype=np.float32)
    capacity = max(4 * size + MIB, 64 * MIB)
    hot_dst = np.empty_like(src)
    hot_copy_s = median_time(lambda: np.copyto(hot_dst, src), repeats)
    footprint = np.empty(capacity // 4, dtype=np.float32)
    footprint.fill(1.0)  # warm: every page touched before timing
    slots = len(footprint) // len(src)
    turn = iter(range(10**9))

    def rotating_copy() -> None:
        start = (next(turn) % slots) * len(src)
        np.copyto(footprint[start:start + len(src)], src)

    copyto_s = median_time(rotating_copy, repeats)
    alloc_copy_s = median_time(lambda: src.copy(), repeats)
    name = f"shmstore-bench-{tag}-{os.getpid()}"

    # put on a warm ring with no readers: every object is reclaimable at once
    with ObjectStore.create(name, capacity_bytes=capacity, n_readers=0) as store:
        counter = iter(range(10**9))
        for _ in range(capacity // size + 1):  # touch the whole ring once
            store.put(f"w{next(counter)}", {"pixel_values": src})
        put_s = median_time(lambda: store.put(f"k{next(counter)}", {"pixel_values": src}), repeats)

    # put on a cold ring: the first pass over pages never touched
    with ObjectStore.create(name, capacity_bytes=capacity, n_readers=0, prefault=False) as store:
        n_cold = max(1, min(repeats, capacity // size - 1))
        cold = []
        for i in range(n_cold):
            t0 = time.perf_counter()
            store.put(f"c{i}", {"pixel_values": src})
            cold.append(time.perf_counter() - t0)
        cold_put_s = statistics.median(cold)

    # get and view by a reader
    with ObjectStore.create(name, capacity_bytes=capacity, n_readers=1) as store:
        reader = ObjectStore.attach(name, reader=0)
        try:
            handle = store.put("x", {"pixel_values": src})
            for _ in range(2 * repeats + 2):
                store.get_cached("x")

            def view() -> None:
                with reader.view(handle) as obj:
                    obj["pixel_values"]

            get_s = median_time(lambda: reader.get(handle), repeats)
            view_s = median_time(view, repeats)
        finally:
            reader.close()
    gbs = size / 1e9
    return {
        "size_bytes": size, "copyto_s": copyto_s, "hot_copy_s": hot_copy_s,
        "alloc_copy_s": alloc_copy_s,
        "put_s": put_s, "cold_put_s": cold_put_s, "get_s": get_s, "view_s": view_s,
        "put_gbps": gbs / put_s, "get_gbps": gbs / get_s, "cold_put_gbps": gbs / cold_put_s,
        "copy_gbps": gbs / copyto_s, "hot_copy_gbps": gbs / hot_copy_s,
        "put_vs_copy": copyto_s / put_s, "get_vs_copy": alloc_copy_s / get_s,
        "cold_put_vs_copy": copyto_s / cold_put_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--json", default="bench/results/bench_store.json")
    args = parser.parse_args()
    sizes = SIZES[:4] if args.quick else SIZES
    rows = []
    header = (f"{'size':>8} {'hot copy':>8} {'copy GB/s':>9} {'put GB/s':>8} {'put/copy':>8} "
              f"{'get GB/s':>8} {'get/new copy':>12} {'cold put/copy':>13} {'view us':>7}")
    print(header)
    for i, size in enumerate(sizes):
        repeats = max(5, min(200, (256 * MIB) // size))
        r = bench_size(size, repeats, str(i))
        rows.append(r)
        label = f"{size // MIB} MiB" if size >= MIB else f"{size >> 10} KiB"
        print(f"{label:>8} {r['hot_copy_gbps']:8.1f} {r['copy_gbps']:9.1f} {r['put_gbps']:8.1f} "
              f"{r['put_vs_copy']:8.2f} {r['get_gbps']:8.1f} {r['get_vs_copy']:12.2f} "
              f"{r['cold_put_vs_copy']:13.2f} {r['view_s'] * 1e6:7.1f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"omp_num_threads": os.environ["OMP_NUM_THREADS"], "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
