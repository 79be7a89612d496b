"""Hit ratios from metadata alone: the caches' decisions replayed without their bytes.

A cache's hits depend on keys, sizes and the order of requests, never on the bytes. RingSim
replays the shm store's ring (the same placement rule, `ring.place_chunk`, and the same policy
objects, `store/_policy.py`) as the store runs it when every reader is done with each object before
the next request; LruSim replays the mirrored LRU with the cache's own LRU. `replay` runs
both on one trace at several budgets. `tests/test_hitsim.py` and `shmstore hitrate --verify`
check request by request that they agree with the real caches.

    sizes     the serialized size of each item (what the caches charge); RingSim adds the
              chunk header, object header and read counters, rounded to cache lines
    inline    an item larger than the store's max_object_bytes (or the LRU's budget) is sent
              inline and never cached: a miss each time
"""

from __future__ import annotations

import csv
import zlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._proc import int_arg
from ..errors import CorruptObject, InvalidArgument
from ..shm._ring import RingWriter
from ..shm._segment import ALIGN_BYTES, MAX_CAPACITY_BYTES, align_up
from ..store._layout import object_header_bytes
from ..store._policy import EvictionPolicy, RingReplay, make_policy
from ._caches import CACHE_KINDS, ReceiverCache, SenderCache, _LruBytes

__all__ = ["SimStats", "RingSim", "LruSim", "make_sim", "replay", "replay_split", "route_index",
           "real_hits", "SIM_KINDS", "one_size_per_key", "working_set_bytes", "write_csv"]

SIM_KINDS = CACHE_KINDS  # every cache kind replays


@dataclass(frozen=True, slots=True)
class SimStats:
    """What one replay counted."""

    kind: str
    capacity_bytes: int
    requests: int
    hits: int
    bytes_requested: int
    bytes_hit: int
    evictions: int
    inline: int  # requests whose item was too large to cache
    bytes_reinserted: int  # ring bytes copied forward by the policy

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def byte_hit_ratio(self) -> float:
        return self.bytes_hit / self.bytes_requested if self.bytes_requested else 0.0


class _Sim:
    kind = ""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int_arg(capacity_bytes, "capacity_bytes", 1, MAX_CAPACITY_BYTES)
        self.requests = self.hits = self.bytes_requested = self.bytes_hit = 0
        self.inline = 0

    def request(self, key: Hashable, nbytes: int) -> bool:
        """One request for `key`, whose value is `nbytes` serialized; True on a hit."""
        raise NotImplementedError

    def _count(self, nbytes: int, hit: bool) -> bool:
        self.requests += 1
        self.bytes_requested += nbytes
        if hit:
            self.hits += 1
            self.bytes_hit += nbytes
        return hit

    def stats(self) -> SimStats:
        raise NotImplementedError


class LruSim(_Sim):
    """The `lru` cache kind: one LRU of serialized sizes (every mirror runs the same one)."""

    kind = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._lru = _LruBytes(self.capacity_bytes)

    def request(self, key: Hashable, nbytes: int) -> bool:
        if self._lru.touch(key) is not None:  # type: ignore[arg-type]
            return self._count(nbytes, True)
        if nbytes > self.capacity_bytes:
            self.inline += 1
        else:
            self._lru.insert(key, nbytes, None)  # type: ignore[arg-type]
        return self._count(nbytes, False)

    def stats(self) -> SimStats:
        return SimStats(self.kind, self.capacity_bytes, self.requests, self.hits,
                        self.bytes_requested, self.bytes_hit, self._lru.evictions, self.inline, 0)


class RingSim(_Sim):
    """An shm cache kind: the store's ring and policy, every object read before the next
    request (so nothing is owed or pinned when space is needed)."""

    def __init__(self, policy: str, capacity_bytes: int, n_readers: int,
                 max_object_bytes: int | None = None) -> None:
        super().__init__(capacity_bytes)
        self.kind = f"shm-{policy}"
        end = align_up(self.capacity_bytes)
        self._ring = RingReplay(make_policy(policy), end)
        self._header = object_header_bytes(n_readers)
        largest = end - ALIGN_BYTES - self._header
        self.max_object_bytes = largest if max_object_bytes is None else min(max_object_bytes,
                                                                             largest)

    @property
    def policy(self) -> EvictionPolicy:
        """The policy object this replay runs (its state, e.g. adaptive's rule, is readable)."""
        return self._ring.policy

    def request(self, key: Hashable, nbytes: int) -> bool:
        if key not in self._ring and nbytes > self.max_object_bytes:
            self.inline += 1
            return self._count(nbytes, False)
        hit = self._ring.request(key, RingWriter.chunk_bytes_for(self._header + nbytes))
        return self._count(nbytes, hit)

    def stats(self) -> SimStats:
        ring = self._ring
        return SimStats(self.kind, self.capacity_bytes, self.requests, self.hits,
                        self.bytes_requested, self.bytes_hit, ring.evictions, self.inline,
                        ring.bytes_reinserted)


def make_sim(kind: str, capacity_bytes: int, n_readers: int) -> RingSim | LruSim:
    """The replay of cache kind `kind` (one of SIM_KINDS) with a budget of `capacity_bytes`."""
    if kind == "lru":
        return LruSim(capacity_bytes)
    if kind not in SIM_KINDS:
        raise InvalidArgument(f"unknown cache kind {kind!r}; choose one of {SIM_KINDS}", "kind",
                              kind)
    return RingSim(kind.removeprefix("shm-"), capacity_bytes, n_readers)


def replay(trace: Iterable[tuple[Hashable, int]], kinds: Iterable[str],
           budgets: Iterable[int], n_readers: int,
           progress: Callable[[int], None] | None = None) -> list[SimStats]:
    """Replay `trace` ((key, serialized bytes) per request) through every kind at every budget
    in one pass; `progress(n)` is called after every 4,096 requests with n = 4,096."""
    sims = [make_sim(kind, budget, n_readers) for budget in budgets for kind in kinds]
    calls = [sim.request for sim in sims]
    n = 0
    for key, nbytes in trace:
        for call in calls:
            call(key, nbytes)
        n += 1
        if progress is not None and n % 4096 == 0:
            progress(4096)
    if progress is not None and n % 4096:
        progress(n % 4096)
    return [sim.stats() for sim in sims]


_SUMMED = ("requests", "hits", "bytes_requested", "bytes_hit", "evictions", "inline",
           "bytes_reinserted")  # what replay_split adds up over the front ends


def route_index(route: str, n_frontends: int) -> int:
    """The front end (0..n-1) a request with route value `route` goes to: a stable hash, as a
    load balancer that keeps a session on one server does."""
    return zlib.crc32(route.encode("utf-8", "surrogateescape")) % n_frontends


def replay_split(trace: Sequence[tuple[Hashable, int]], frontends: Sequence[int],
                 n_frontends: int, kinds: Iterable[str], budgets: Iterable[int], n_readers: int,
                 progress: Callable[[int], None] | None = None) -> list[SimStats]:
    """Replay `trace` as `n_frontends` front ends with a cache each, request i going to front
    end `frontends[i]`: every budget is split into n equal caches (the same total memory as
    one shared cache of that budget). One SimStats per (budget, kind), in replay()'s order,
    summing the front ends' caches; its capacity_bytes is the total."""
    if len(frontends) != len(trace):
        raise InvalidArgument(f"{len(frontends)} front-end assignments for {len(trace)} requests: "
                              "give one per request", "frontends", len(frontends))
    if n_frontends < 1 or any(not 0 <= f < n_frontends for f in frontends):
        raise InvalidArgument(f"front ends must be 0..{n_frontends - 1} (n_frontends "
                              f"{n_frontends}): number them from 0", "frontends", n_frontends)
    budgets = list(budgets)
    kinds = list(kinds)
    sims = [[make_sim(kind, budget // n_frontends, n_readers) for _ in range(n_frontends)]
            for budget in budgets for kind in kinds]
    by_frontend = [[group[f].request for group in sims] for f in range(n_frontends)]
    for n, ((key, nbytes), frontend) in enumerate(zip(trace, frontends), 1):
        for call in by_frontend[frontend]:
            call(key, nbytes)
        if progress is not None and n % 4096 == 0:
            progress(4096)
    if progress is not None and len(trace) % 4096:
        progress(len(trace) % 4096)
    totals = []
    for group, budget in zip(sims, [b for b in budgets for _ in kinds]):
        parts = [sim.stats() for sim in group]
        totals.append(SimStats(parts[0].kind, budget,
                               *(sum(getattr(s, f) for s in parts) for f in _SUMMED)))
    return totals



def real_hits(kind: str, trace: Iterable[tuple[str, int]], capacity_bytes: int,
              n_readers: int) -> list[bool]:
    """Hit or miss per request of the real cache `kind` in shared memory: each request's value
    is `bytes` of uint8, resolved (and checked) by `n_readers` receivers before the next."""
    import numpy as np

    sender: Any = SenderCache.create(kind, capacity_bytes=capacity_bytes, n_readers=n_readers)
    receivers: list[Any] = []
    hits = []
    try:
        for r in range(n_readers):
            receivers.append(ReceiverCache.attach(kind, capacity_bytes=capacity_bytes, reader=r,
                                                  name=getattr(sender, "name", None)))
        made: dict[str, int] = {}  # key -> the size of the value its last miss made

        def make(key: str, nbytes: int) -> Any:
            made[key] = nbytes
            return np.full(nbytes, nbytes % 251, np.uint8)

        for key, nbytes in trace:
            before = sender.stats().hits
            payload = sender.process(key, lambda k=key, n=nbytes: make(k, n))
            for receiver in receivers:  # a hit is the value stored, whatever size asked now
                with receiver.resolve_view(payload) as value:
                    if len(value) != made[key] or value[-1] != made[key] % 251:
                        raise CorruptObject(f"the {kind} cache returned wrong bytes for {key!r} "
                                            "in the check against the real caches: report it")
            hits.append(sender.stats().hits > before)
    finally:
        for receiver in receivers:
            receiver.close()
        sender.close()
    return hits


def working_set_bytes(trace: Iterable[tuple[Hashable, int]]) -> int:
    """The bytes of every distinct item at its largest size in the trace."""
    return sum(_largest(trace).values())


def _largest(trace: Iterable[tuple[Hashable, int]]) -> dict[Hashable, int]:
    largest: dict[Hashable, int] = {}
    for key, nbytes in trace:
        if nbytes > largest.get(key, -1):
            largest[key] = nbytes
    return largest


def one_size_per_key(trace: list[tuple[Hashable, int]]) -> tuple[list[tuple[Hashable, int]], int]:
    """(the trace with each key at its largest size, how many keys had more than one size).

    A key names one content, so a cache hit is the value stored whatever size a trace gives
    it now; a trace whose sizes vary for a key (rounding, a log of another field) is replayed
    at one size per key, so that the replay and the real caches charge the same bytes."""
    largest = _largest(trace)
    changed = {key for key, nbytes in trace if nbytes != largest[key]}
    if not changed:
        return trace, 0
    return [(key, largest[key]) for key, _ in trace], len(changed)


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write `rows` (dicts with the same keys, in the first row's order) to `path` as csv."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
