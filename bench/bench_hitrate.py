"""Hit ratios of the real caches on realistic traces, cross-checked with libCacheSim.

    OMP_NUM_THREADS=1 python bench/bench_hitrate.py [--quick] [--scale 256] [--out bench/results]

For each trace (Zipf alpha 0.6-1.2, one-time images, multi-turn conversations, sizes of real
preprocessors) and each cache size (1, 5, 10, 25% of the trace's working set), the real caches
run: a sender and n_readers receivers in this process, every payload resolved by every receiver.
Payload sizes are divided by `scale`, and so is the capacity, so a run takes seconds.

Kinds: shm-fifo, shm-reinsert, lru at the same budget, and lru at the same total RAM (its
n_readers mirrors share the budget: each gets budget / n_readers). libCacheSim's FIFO and LRU
run on the same trace and byte capacity as the oracle: LRU with the serialized sizes shmstore's
LRU charges, FIFO with the ring bytes a shm chunk takes (headers and alignment included). What
libCacheSim cannot see is the ring's contiguity: when the next chunk does not fit before the end,
the tail is skipped and one more old object goes; that is the expected FIFO gap.

Writes a table, hitrate.csv and hitrate.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from traces import TraceSpec, make_trace, working_set_bytes

from shmstore.cache import ReceiverCache, SenderCache
from shmstore.segment import align_up
from shmstore.serde import encode
from shmstore.store import ObjectStore

PERCENTS = (1, 5, 10, 25)
ALPHAS = (0.6, 0.8, 1.0, 1.2)
N_READERS = 2


def scaled_sizes(trace: list[tuple[str, int]], scale: int) -> dict[int, int]:
    """Original size -> serialized size of a scaled uint8 payload (what every cache charges)."""
    return {size: encode(np.empty(max(1, size // scale), np.uint8)).nbytes
            for size in {s for _, s in trace}}


def run_real(kind: str, trace: list[tuple[str, int]], capacity: int, scale: int) -> dict[str, Any]:
    name = f"shmstore-bench-hr-{os.getpid()}"
    sender = SenderCache.create(kind, capacity_bytes=capacity, n_readers=N_READERS,
                                name=None if kind == "lru" else name)
    receivers = [ReceiverCache.attach(kind, capacity_bytes=capacity, reader=r,
                                      name=getattr(sender, "name", None)) for r in range(N_READERS)]
    pool = np.zeros(max(s for _, s in trace) // scale + 1, dtype=np.uint8)
    try:
        for key, size in trace:
            n = max(1, size // scale)
            payload = sender.process(key, lambda n=n: pool[:n])
            for r in receivers:
                with r.resolve_view(payload):
                    pass
        s = sender.stats()
    finally:
        for r in receivers:
            r.close()
        sender.close()
    return {"hit_ratio": s.hit_ratio, "byte_hit_ratio": s.byte_hit_ratio,
            "inline_fallbacks": s.inline_fallbacks, "bytes_reinserted": s.bytes_reinserted * scale,
            "memory_bytes": s.memory_bytes * scale, "evictions": s.evictions}


def run_libcachesim(algo: str, trace: list[tuple[str, int]], capacity: int,
                    charged: dict[int, int]) -> float:
    import libcachesim as lcs

    cache = lcs.FIFO(cache_size=capacity) if algo == "FIFO" else lcs.LRU(cache_size=capacity)
    ids: dict[str, int] = {}
    hits = 0
    for key, size in trace:
        obj_id = ids.setdefault(key, len(ids) + 1)
        hits += bool(cache.get(lcs.Request(obj_size=charged[size], obj_id=obj_id)))
    return hits / len(trace)


def chunk_bytes(body_bytes: int) -> int:
    """Ring bytes one shm cache object takes: chunk header, object header, counters, body."""
    return ObjectStore.ring_bytes_for(body_bytes, N_READERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter trace, two alphas")
    parser.add_argument("--scale", type=int, default=256, help="divide payload sizes by this")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    n_requests = args.requests or (4_000 if args.quick else 20_000)
    alphas = (0.6, 1.0) if args.quick else ALPHAS
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    header = (f"{'trace':>10} {'size':>5} {'shm-fifo':>8} {'reinsert':>8} {'lru':>6} "
              f"{'lru@RAM':>7} | {'lcs FIFO':>8} {'lcs LRU':>7} | {'dFIFO pp':>8} {'dLRU pp':>7} "
              f"{'reinsert MB':>11} {'fallback':>8}")
    print(f"hit ratio, {N_READERS} readers, payloads scaled 1/{args.scale}, {n_requests} requests")
    print(header)
    t0 = time.perf_counter()
    for alpha in alphas:
        trace = make_trace(TraceSpec(alpha=alpha, n_requests=n_requests, seed=int(alpha * 10)))
        ws = working_set_bytes(trace)
        serialized = scaled_sizes(trace, args.scale)
        ring_charged = {size: chunk_bytes(b) for size, b in serialized.items()}
        for pct in PERCENTS:
            capacity = align_up(ws * pct // 100 // args.scale)
            fifo = run_real("shm-fifo", trace, capacity, args.scale)
            reinsert = run_real("shm-reinsert", trace, capacity, args.scale)
            lru = run_real("lru", trace, capacity, args.scale)
            lru_ram = run_real("lru", trace, capacity // N_READERS, args.scale)
            lcs_fifo = run_libcachesim("FIFO", trace, capacity, ring_charged)
            lcs_lru = run_libcachesim("LRU", trace, capacity, serialized)
            row = {
                "alpha": alpha, "cache_pct": pct, "requests": n_requests,
                "working_set_bytes": ws, "capacity_bytes": capacity * args.scale,
                "shm_fifo": fifo["hit_ratio"], "shm_reinsert": reinsert["hit_ratio"],
                "lru": lru["hit_ratio"], "lru_equal_ram": lru_ram["hit_ratio"],
                "shm_fifo_bytes": fifo["byte_hit_ratio"],
                "shm_reinsert_bytes": reinsert["byte_hit_ratio"],
                "lru_bytes": lru["byte_hit_ratio"], "lru_equal_ram_bytes": lru_ram["byte_hit_ratio"],
                "libcachesim_fifo": lcs_fifo, "libcachesim_lru": lcs_lru,
                "fifo_minus_oracle_pp": 100 * (fifo["hit_ratio"] - lcs_fifo),
                "lru_minus_oracle_pp": 100 * (lru["hit_ratio"] - lcs_lru),
                "reinsert_bytes_copied": reinsert["bytes_reinserted"],
                "inline_fallbacks": fifo["inline_fallbacks"] + reinsert["inline_fallbacks"],
                "shm_memory_bytes": fifo["memory_bytes"], "lru_memory_bytes": lru["memory_bytes"],
            }
            rows.append(row)
            print(f"{'a=' + str(alpha):>10} {str(pct) + '%':>5} {row['shm_fifo']:8.3f} "
                  f"{row['shm_reinsert']:8.3f} {row['lru']:6.3f} {row['lru_equal_ram']:7.3f} | "
                  f"{lcs_fifo:8.3f} {lcs_lru:7.3f} | {row['fifo_minus_oracle_pp']:8.2f} "
                  f"{row['lru_minus_oracle_pp']:7.2f} {row['reinsert_bytes_copied'] / 1e6:11.0f} "
                  f"{row['inline_fallbacks']:8d}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    with open(out_dir / "hitrate.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, alphas, out_dir / "hitrate.png")
    print(f"wrote {out_dir / 'hitrate.csv'} and {out_dir / 'hitrate.png'}")


def plot(rows: list[dict[str, Any]], alphas: tuple[float, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(alphas), figsize=(4 * len(alphas), 3.6), sharey=True)
    axes = np.atleast_1d(axes)
    lines = [("shm_fifo", "shm-fifo", "-"), ("shm_reinsert", "shm-reinsert", "-"),
             ("lru", "lru (same budget)", "-"), ("lru_equal_ram", "lru (same total RAM)", "--"),
             ("libcachesim_fifo", "libCacheSim FIFO", ":"), ("libcachesim_lru", "libCacheSim LRU", ":")]
    for ax, alpha in zip(axes, alphas):
        sub = [r for r in rows if r["alpha"] == alpha]
        for field, label, style in lines:
            ax.plot([r["cache_pct"] for r in sub], [r[field] for r in sub], style, marker="o",
                    label=label, markersize=3)
        ax.set_title(f"Zipf alpha {alpha}")
        ax.set_xscale("log")
        ax.set_xticks(PERCENTS, [f"{p}%" for p in PERCENTS])
        ax.set_xlabel("cache size (% of working set)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("request hit ratio")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
