"""Several front ends (API servers): one shared cache against one cache per front end.

    OMP_NUM_THREADS=1 python bench/bench_frontends.py [--quick] [--frontends 2,4] [--out DIR]

Each family of bench/traces.py is replayed (shmstore.cache._hitsim) as N front ends that take
the requests in turn, as the kernel spreads connections over vLLM's API servers. Columns, at
each cache size (1, 5, 10, 25% of the working set, the budget B):

    shared           one shmstore store of B on the node (shm-adaptive, the default), every front end's hits
    separate         N adaptive rings of B/N, one per front end: the same memory, no sharing
    separate lru     N LRU caches of B/N: vLLM's processor caches at the same total memory
    lru N x B        N LRU caches of B each: vLLM's default (each API server gets the whole
                     mm_processor_cache_gb), N times the memory

Ratios, not times: nothing here depends on the machine. Writes frontends.csv.
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
from _hitratio import working_set_bytes, write_csv
from traces import FAMILIES, make_family

from shmstore.cache._hitsim import replay, replay_split

PERCENTS = (1, 5, 10, 25)
N_READERS = 2
MSGPACK_OVERHEAD = 64  # what serializing one tensor adds to its bytes, about


def run_family(family: str, n_requests: int, frontends: list[int], seed: int) -> list[dict[str, Any]]:
    trace = [(key, size + MSGPACK_OVERHEAD) for key, size in make_family(family, n_requests, seed)]
    ws = working_set_bytes(trace)
    budgets = [ws * pct // 100 for pct in PERCENTS]
    shared = replay(trace, ["shm-adaptive"], budgets, N_READERS)
    rows = []
    for n in frontends:
        turns = [i % n for i in range(len(trace))]
        split = replay_split(trace, turns, n, ["shm-adaptive", "lru"], budgets, N_READERS)
        whole = replay_split(trace, turns, n, ["lru"], [b * n for b in budgets], N_READERS)
        for i, pct in enumerate(PERCENTS):
            rows.append({"family": family, "seed": seed, "frontends": n, "cache_pct": pct,
                         "shared_adaptive": shared[i].hit_ratio,
                         "separate_adaptive": split[2 * i].hit_ratio,
                         "separate_lru": split[2 * i + 1].hit_ratio,
                         "lru_n_times_memory": whole[i].hit_ratio})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 requests per family")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--frontends", default="2,4")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    n_requests = args.requests or (5_000 if args.quick else 20_000)
    frontends = [int(n) for n in args.frontends.split(",") if n]
    if not frontends or min(frontends) < 2:
        parser.error("--frontends: two or more front ends each, e.g. 2,4")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"request hit ratio, {n_requests} requests per family (scan: 30,000), seed {args.seed}; "
          "front ends take requests in turn")
    print(f"{'family':>9} {'N':>2} {'size':>4} | {'shared adap':>11} {'separate adap':>13} "
          f"{'separate lru':>12} {'lru N x B':>9} | {'shared - separate lru':>21}")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for family in (f for f in args.families.split(",") if f):
        for row in run_family(family, n_requests, frontends, args.seed):
            rows.append(row)
            print(f"{family:>9} {row['frontends']:>2} {row['cache_pct']:>3}% | "
                  f"{row['shared_adaptive']:11.3f} {row['separate_adaptive']:13.3f} "
                  f"{row['separate_lru']:12.3f} {row['lru_n_times_memory']:9.3f} | "
                  f"{100 * (row['shared_adaptive'] - row['separate_lru']):+18.1f} pt", flush=True)
    write_csv(rows, out / "frontends.csv")
    print(f"({time.perf_counter() - t0:.0f} s) wrote {out / 'frontends.csv'}")


if __name__ == "__main__":
    main()
