"""Hit ratios of the cache kinds on every trace family, beside libCacheSim's policies.

    OMP_NUM_THREADS=1 python bench/bench_hitrate.py [--quick] [--requests N] [--out bench/results]

For each family of bench/traces.py and each cache size (1, 5, 10, 25% of the trace's working
set), the caches' decisions are replayed on metadata (shmstore.cache._hitsim: the store's own ring
placement and policy objects, and the lru kind's own LRU; tests/cache/test_hitsim.py checks request
by request that the replay and the real caches in shared memory agree). Kinds: shm-fifo,
shm-reinsert, shm-freq, shm-adaptive (the caches' default), lru at the same budget, and lru at
the same total RAM (its N_READERS mirrors share the budget).

libCacheSim is the independent oracle: its FIFO with the ring bytes a shm chunk takes (headers
and alignment included; what it cannot see is the ring's contiguity: when the next chunk does
not fit before the end, the tail is skipped, the expected FIFO gap) and its LRU with the
serialized sizes the lru kind charges; its S3FIFO (small queue 10% of the cache or the largest
object, whichever is larger), SIEVE, and the adaptive ARC and LeCaR run beside them on the ring
bytes.

Prints a table per family with the default policy's goal checked (adaptive >= lru - 0.5 points
and >= the better of reinsert and freq - 0.2 points; bench_policy_goal.py checks it on 4 seeds),
and writes hitrate.csv and hitrate.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hitratio import libcachesim_ratio, working_set_bytes, write_csv
from traces import FAMILIES, infinite_hit_ratio, make_family

from shmstore.cache._hitsim import SIM_KINDS, replay
from shmstore.store._object_store import ObjectStore

PERCENTS = (1, 5, 10, 25)
N_READERS = 2
MSGPACK_OVERHEAD = 64  # what serializing one tensor adds to its bytes, about


def run_family(family: str, n_requests: int) -> list[dict[str, Any]]:
    trace = make_family(family, n_requests)
    serialized = [(key, size + MSGPACK_OVERHEAD) for key, size in trace]
    ws = working_set_bytes(serialized)
    sizes = {size for _, size in serialized}
    ring_charged = {s: ObjectStore.ring_bytes_for(s, N_READERS) for s in sizes}
    plain = {s: s for s in sizes}
    keyed = [(key, size) for key, size in serialized]
    budgets = [ws * pct // 100 for pct in PERCENTS]
    kinds = list(SIM_KINDS)
    stats = replay(serialized, kinds, budgets, N_READERS)
    equal_ram = replay(serialized, ["lru"], [b // N_READERS for b in budgets], N_READERS)
    rows = []
    for i, pct in enumerate(PERCENTS):
        by_kind = {s.kind: s for s in stats[i * len(kinds):(i + 1) * len(kinds)]}
        lcs = {algo: libcachesim_ratio(algo, keyed, budgets[i],
                                       plain if algo == "LRU" else ring_charged)
               for algo in ("FIFO", "LRU", "S3FIFO", "Sieve", "ARC", "LeCaR")}
        freq, lru = by_kind["shm-freq"], by_kind["lru"]
        adaptive = by_kind["shm-adaptive"]
        best = max(freq.hit_ratio, by_kind["shm-reinsert"].hit_ratio)
        puts = freq.requests - freq.hits - freq.inline
        rows.append({
            "family": family, "cache_pct": pct, "requests": len(trace),
            "working_set_bytes": ws, "infinite": infinite_hit_ratio(trace),
            **{kind.replace("-", "_"): by_kind[kind].hit_ratio for kind in kinds},
            "lru_equal_ram": equal_ram[i].hit_ratio,
            **{f"libcachesim_{algo.lower()}": ratio for algo, ratio in lcs.items()},
            "freq_minus_lru_pp": 100 * (freq.hit_ratio - lru.hit_ratio),
            "adaptive_minus_lru_pp": 100 * (adaptive.hit_ratio - lru.hit_ratio),
            "adaptive_minus_best_pp": 100 * (adaptive.hit_ratio - best),
            "fifo_minus_oracle_pp": 100 * (by_kind["shm-fifo"].hit_ratio - lcs["FIFO"]),
            "lru_minus_oracle_pp": 100 * (lru.hit_ratio - lcs["LRU"]),
            "freq_copied_per_request": freq.bytes_reinserted / len(trace),
            "adaptive_copied_per_request": adaptive.bytes_reinserted / len(trace),
            "freq_copied_per_put_max_ratio": (freq.bytes_reinserted / puts / ws * len(
                {k for k, _ in trace}) if puts else 0.0),
            "freq_byte_hit_ratio": freq.byte_hit_ratio, "lru_byte_hit_ratio": lru.byte_hit_ratio,
        })
    return rows


def goal_met(row: dict[str, Any]) -> bool:
    return row["adaptive_minus_lru_pp"] >= -0.5 and row["adaptive_minus_best_pp"] >= -0.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 requests per family")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    n_requests = args.requests or (5_000 if args.quick else 20_000)
    families = [f for f in args.families.split(",") if f]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"hit ratio, {N_READERS} readers, {n_requests} requests per family (scan: 30,000)")
    print(f"{'family':>9} {'size':>4} {'inf':>5} | {'fifo':>5} {'reins':>5} {'freq':>5} "
          f"{'adapt':>5} {'lru':>5} {'lru@RAM':>7} | {'lcsFIFO':>7} {'lcsLRU':>6} {'S3FIFO':>6} "
          f"{'SIEVE':>5} {'ARC':>5} {'LeCaR':>5} | {'ad-lru':>6} {'goal':>4} {'copied/req':>10} "
          f"{'dFIFO':>6} {'dLRU':>5}")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for family in families:
        for row in run_family(family, n_requests):
            rows.append(row)
            print(f"{family:>9} {row['cache_pct']:>3}% {row['infinite']:5.3f} | "
                  f"{row['shm_fifo']:5.3f} {row['shm_reinsert']:5.3f} {row['shm_freq']:5.3f} "
                  f"{row['shm_adaptive']:5.3f} {row['lru']:5.3f} {row['lru_equal_ram']:7.3f} | "
                  f"{row['libcachesim_fifo']:7.3f} {row['libcachesim_lru']:6.3f} "
                  f"{row['libcachesim_s3fifo']:6.3f} {row['libcachesim_sieve']:5.3f} "
                  f"{row['libcachesim_arc']:5.3f} {row['libcachesim_lecar']:5.3f} | "
                  f"{row['adaptive_minus_lru_pp']:+6.2f} {'ok' if goal_met(row) else 'MISS':>4} "
                  f"{row['adaptive_copied_per_request'] / 1e6:8.2f}MB "
                  f"{row['fifo_minus_oracle_pp']:+6.2f} {row['lru_minus_oracle_pp']:+5.2f}",
                  flush=True)
    missed = [f"{r['family']} {r['cache_pct']}%" for r in rows if not goal_met(r)]
    print(f"({time.perf_counter() - t0:.0f} s) goal missed at: {', '.join(missed) or 'none'}")
    write_csv(rows, out_dir / "hitrate.csv")
    plot(rows, families, out_dir / "hitrate.png")
    print(f"wrote {out_dir / 'hitrate.csv'} and {out_dir / 'hitrate.png'}")


def plot(rows: list[dict[str, Any]], families: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    fig, axes = plt.subplots(-(-len(families) // cols), cols, figsize=(4 * cols, 3.4 * (
        -(-len(families) // cols))), squeeze=False)
    lines = [("shm_fifo", "shm-fifo", "-"), ("shm_reinsert", "shm-reinsert", "-"),
             ("shm_freq", "shm-freq", "-"), ("shm_adaptive", "shm-adaptive (default)", "-"),
             ("lru", "lru (same budget)", "-"),
             ("lru_equal_ram", "lru (same total RAM)", "--"),
             ("libcachesim_s3fifo", "libCacheSim S3FIFO", ":"),
             ("libcachesim_sieve", "libCacheSim SIEVE", ":"),
             ("libcachesim_arc", "libCacheSim ARC", ":")]
    for ax, family in zip(axes.flat, families):
        sub = [r for r in rows if r["family"] == family]
        for field, label, style in lines:
            ax.plot([r["cache_pct"] for r in sub], [r[field] for r in sub], style, marker="o",
                    label=label, markersize=3)
        ax.set_title(family)
        ax.set_xscale("log")
        ax.set_xticks(PERCENTS, [f"{p}%" for p in PERCENTS])
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(families):]:
        ax.axis("off")
    axes[0][0].set_ylabel("request hit ratio")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
