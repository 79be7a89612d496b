"""What the hit-ratio benches (bench_hitrate, bench_frontends, bench_policy_goal) share: the
one working set (shmstore's own: every distinct item at its largest size), csv output as
`shmstore hitrate` writes it, and libCacheSim's caches as an independent oracle."""

from __future__ import annotations

from shmstore.cache._hitsim import working_set_bytes, write_csv

__all__ = ["working_set_bytes", "write_csv", "libcachesim_ratio"]


def libcachesim_ratio(algo: str, trace: list[tuple[str, int]], capacity: int,
                      charged: dict[int, int]) -> float:
    import libcachesim as lcs

    if algo == "S3FIFO":
        small = max(0.1, max(charged.values()) / capacity)
        cache = lcs.S3FIFO(cache_size=capacity, small_size_ratio=min(small, 0.9))
    else:
        cache = getattr(lcs, algo)(cache_size=capacity)
    ids: dict[str, int] = {}
    hits = 0
    for key, size in trace:
        obj_id = ids.setdefault(key, len(ids) + 1)
        hits += bool(cache.get(lcs.Request(obj_size=charged[size], obj_id=obj_id)))
    return hits / len(trace)
