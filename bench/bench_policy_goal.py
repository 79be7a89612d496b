"""The default eviction policy's goal, checked cell by cell on every trace family and 4 seeds.

    OMP_NUM_THREADS=1 python bench/bench_policy_goal.py [--seeds 0,1,2,3] [--requests 20000]
                                                        [--families ...] [--out bench/results]

A cell is one family of bench/traces.py, one trace seed and one cache size (1, 5, 10 or 25% of
the trace's working set). In every cell the default policy (`adaptive`) must be at most 0.5
points below LRU at the same budget, and at most 0.2 points below the better of `reinsert` and
`freq`. The replay is shmstore.cache._hitsim's (the store's own ring and policy objects, checked
request by request against the real caches by tests/cache/test_hitsim.py), with 2 readers.

Prints one line per cell (the goal's two margins, the rule adaptive applied at the end, the
bytes it copied per request and the largest copy of one put as a multiple of that put's ring
bytes), the cells that miss, and a summary per policy; writes policy_goal.csv.

libCacheSim's ARC and LeCaR, the adaptive policies that learn recency against frequency without
a ring's constraint (they may evict any object), run on the same traces with the ring bytes each
chunk takes, and are held to the same goal in the summary: how far the best known peers are from it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hitratio import libcachesim_ratio, working_set_bytes, write_csv
from traces import FAMILIES, make_family

from shmstore.cache._hitsim import RingSim, make_sim
from shmstore.store._object_store import ObjectStore
from shmstore.store._policy import AdaptivePolicy

PERCENTS = (1, 5, 10, 25)
N_READERS = 2
MSGPACK_OVERHEAD = 64  # what serializing one tensor adds to its bytes, about (as bench_hitrate)
KINDS = ("shm-reinsert", "shm-freq", "shm-adaptive", "lru")
PEERS = ("ARC", "LeCaR")  # libCacheSim's adaptive policies, held to the same goal
BELOW_LRU_PP = 0.5  # the goal: never more than this many points below LRU
BELOW_BEST_PP = 0.2  # nor more than this below the better of reinsert and freq


def run_cell(trace: list[tuple[str, int]], budget: int) -> dict[str, Any]:
    sims = {kind: make_sim(kind, budget, N_READERS) for kind in KINDS}
    adaptive = sims["shm-adaptive"]
    assert isinstance(adaptive, RingSim)
    largest_copy = 0.0
    for key, nbytes in trace:
        for sim in sims.values():
            if sim is adaptive:
                before = adaptive.stats().bytes_reinserted
                adaptive.request(key, nbytes)
                copied = adaptive.stats().bytes_reinserted - before
                if copied:
                    largest_copy = max(largest_copy, copied / (nbytes + 4096))
            else:
                sim.request(key, nbytes)
    stats = {kind: sim.stats() for kind, sim in sims.items()}
    policy = adaptive.policy
    assert isinstance(policy, AdaptivePolicy)
    charged = {n: ObjectStore.ring_bytes_for(n, N_READERS) for n in {n for _, n in trace}}
    peers = {f"libcachesim_{algo.lower()}": libcachesim_ratio(algo, trace, budget, charged)
             for algo in PEERS}
    return {**{kind.replace("-", "_"): s.hit_ratio for kind, s in stats.items()}, **peers,
            "rule_at_end": policy.rule, "switches": policy.switches,
            "copied_per_request": stats["shm-adaptive"].bytes_reinserted / len(trace),
            "largest_copy_per_put": largest_copy}


def margins(row: dict[str, Any], kind: str) -> tuple[float, float]:
    """Points above LRU, and above the better of reinsert and freq, of `kind` in `row`."""
    ratio = row[kind]
    return (100 * (ratio - row["lru"]),
            100 * (ratio - max(row["shm_reinsert"], row["shm_freq"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    families = [f for f in args.families.split(",") if f]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"adaptive against lru and the better of reinsert/freq, {N_READERS} readers, "
          f"{args.requests} requests per trace (scan: at least 30,000)")
    print(f"{'family':>9} {'seed':>4} {'size':>4} | {'reins':>5} {'freq':>5} {'adapt':>5} "
          f"{'lru':>5} | {'vs lru':>6} {'vs best':>7} {'rule':>8} {'copied/req':>10} "
          f"{'max/put':>7} | {'ARC':>5} {'LeCaR':>5}")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for family in families:
        for seed in seeds:
            trace = [(k, n + MSGPACK_OVERHEAD) for k, n in
                     make_family(family, args.requests, seed)]
            ws = working_set_bytes(trace)
            for pct in PERCENTS:
                row = {"family": family, "seed": seed, "cache_pct": pct,
                       **run_cell(trace, ws * pct // 100)}
                rows.append(row)
                vs_lru, vs_best = margins(row, "shm_adaptive")
                print(f"{family:>9} {seed:>4} {pct:>3}% | {row['shm_reinsert']:5.3f} "
                      f"{row['shm_freq']:5.3f} {row['shm_adaptive']:5.3f} {row['lru']:5.3f} | "
                      f"{vs_lru:+6.2f} {vs_best:+7.2f} {row['rule_at_end']:>8} "
                      f"{row['copied_per_request'] / 1e6:8.2f}MB "
                      f"{row['largest_copy_per_put']:6.1f}x | {row['libcachesim_arc']:5.3f} "
                      f"{row['libcachesim_lecar']:5.3f}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    for kind in ("shm_adaptive", "shm_freq", "shm_reinsert",
                 *(f"libcachesim_{algo.lower()}" for algo in PEERS)):
        below_lru = [r for r in rows if margins(r, kind)[0] < -BELOW_LRU_PP]
        below_best = [r for r in rows if margins(r, kind)[1] < -BELOW_BEST_PP]
        worst_lru = min(margins(r, kind)[0] for r in rows)
        worst_best = min(margins(r, kind)[1] for r in rows)
        mean_lru = sum(margins(r, kind)[0] for r in rows) / len(rows)
        print(f"{kind}: {len(below_lru)} of {len(rows)} cells below lru - {BELOW_LRU_PP} "
              f"(worst {worst_lru:+.2f}), {len(below_best)} more than {BELOW_BEST_PP} below the "
              f"better of reinsert and freq (worst {worst_best:+.2f}), mean {mean_lru:+.2f} "
              "against lru")
        if kind == "shm_adaptive":
            for r in below_lru + below_best:
                vs_lru, vs_best = margins(r, kind)
                print(f"  missed: {r['family']} seed {r['seed']} at {r['cache_pct']}%: "
                      f"{vs_lru:+.2f} against lru, {vs_best:+.2f} against the better of two")
    write_csv(rows, out_dir / "policy_goal.csv")
    print(f"wrote {out_dir / 'policy_goal.csv'}")


if __name__ == "__main__":
    main()
