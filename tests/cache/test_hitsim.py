"""The freq policy, and the metadata replay against the real caches, request by request."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from shmstore.cache._hitsim import (
    SIM_KINDS,
    make_sim,
    real_hits,
    replay,
    replay_split,
    route_index,
    working_set_bytes,
)
from shmstore.store._policy import FreqPolicy, make_policy
from tests._names import InvalidArgument, ObjectStore, encode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from traces import make_family

KIB = 1024


def test_freq_counts_to_three_and_a_copy_takes_one_off() -> None:
    p = FreqPolicy()
    uses = p.admitted("a")
    assert uses == 0 and not p.keep(uses, 100, 10_000)  # never hit: dropped
    for _ in range(5):
        uses = p.hit(uses)
    assert uses == 3  # two bits
    for expected in (2, 1, 0):
        assert p.keep(uses, 100, 10_000)
        uses = p.kept(uses)
        assert uses == expected
    assert not p.keep(uses, 100, 10_000)
    assert not p.keep(3, 100, 99)  # the copy budget bounds it
    assert p.copy_budget(1000) == 4000


def test_freq_ghosts_give_returning_keys_a_head_start_and_forget_the_oldest() -> None:
    p = FreqPolicy()
    for i in range(20):
        p.evicted(f"k{i}", cached=3)
    assert p.ghosts == 13  # 4x as many as cached, plus one
    assert p.admitted("k0") == 0  # forgotten
    assert p.admitted("k6") == 0  # forgotten
    assert p.admitted("k7") == 2 and p.admitted("k7") == 0  # the oldest remembered, once
    assert p.admitted("k19") == 2
    p.clear()
    assert p.ghosts == 0 and p.admitted("k8") == 0
    with pytest.raises(InvalidArgument, match="choose one of"):
        make_policy("lfu")


def test_store_with_freq_keeps_a_hot_object_three_passes_then_lets_it_go(name: str) -> None:
    w = ObjectStore.create(name, capacity_bytes=40 * KIB, n_readers=0, policy="freq")
    try:
        w.put("hot", np.zeros(8 * KIB, np.uint8))
        for _ in range(4):
            w.get_cached("hot")
        passes = 0
        for i in range(40):  # a stream of one-time objects: each pass of the ring needs 4
            w.put(f"once-{i}", np.zeros(8 * KIB, np.uint8))
            passes = w.stats().reinsertions
            if not w.is_cached("hot"):
                break
        assert passes == 3 and not w.is_cached("hot")
        w.put("hot", np.zeros(8 * KIB, np.uint8))  # back from the ghost list: two more passes
        for i in range(40, 60):
            w.put(f"once-{i}", np.zeros(8 * KIB, np.uint8))
        assert w.stats().reinsertions == 5 and not w.is_cached("hot")
        w.put("hot", np.zeros(8 * KIB, np.uint8))
        w.clear()  # forgets the ghosts too
        w.put("hot", np.zeros(8 * KIB, np.uint8))
        for i in range(60, 70):
            w.put(f"once-{i}", np.zeros(8 * KIB, np.uint8))
        assert w.stats().reinsertions == 5
    finally:
        w.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["zipf-0.8", "models"])
@pytest.mark.parametrize("kind", SIM_KINDS)
def test_replay_agrees_with_the_real_cache_request_by_request(kind: str, family: str) -> None:
    scale = 2048  # MB-size items become KB-size: same geometry, small segments
    trace = [(k, max(1, n // scale)) for k, n in make_family(family, 1200)[:1200]]
    serialized = {n: encode(np.zeros(n, np.uint8)).nbytes for _, n in trace}
    for pct in (2, 10):
        capacity = working_set_bytes(trace) * pct // 100
        real = real_hits(kind, trace, capacity, n_readers=2)  # the real caches, bytes checked
        sim = make_sim(kind, capacity, n_readers=2)
        simulated = [sim.request(k, serialized[n]) for k, n in trace]
        first = next((i for i, (a, b) in enumerate(zip(real, simulated)) if a != b), None)
        assert first is None, f"{kind} at {pct}%: request {first} differs"
        assert 0 < sum(real) < len(trace)


def test_replay_counts_inline_items_and_bounds_copies() -> None:
    rng = np.random.default_rng(1)
    keys = (60 * rng.random(2000) ** 3).astype(int)  # skewed: low numbers are popular
    trace = [(f"k{k}", 50_000 if k % 7 == 3 else 3000) for k in keys]
    stats = replay(trace, SIM_KINDS, [40_000], n_readers=2)
    for s in stats:
        assert s.requests == 2000 and s.inline > 0  # 50 kB never fits 40 kB
        assert s.hits + s.inline <= s.requests
    freq = next(s for s in stats if s.kind == "shm-freq")
    fifo = next(s for s in stats if s.kind == "shm-fifo")
    assert freq.hit_ratio > fifo.hit_ratio and fifo.bytes_reinserted == 0
    puts = freq.requests - freq.hits - freq.inline
    assert 0 < freq.bytes_reinserted <= 4 * puts * 3200  # 4x each put's ring bytes at most
    seen: list[int] = []
    replay(trace, ["lru"], [10_000, 20_000], 1, progress=seen.append)
    assert sum(seen) == 2000


def test_replay_split_is_n_independent_caches_of_a_share_of_the_budget() -> None:
    trace = [(f"k{i % 37}", 1000 + 13 * (i % 5)) for i in range(3000)]
    budget = 12_000
    # one front end: the same as one cache
    assert replay_split(trace, [0] * len(trace), 1, ["shm-freq", "lru"], [budget], 2) == \
        replay(trace, ["shm-freq", "lru"], [budget], 2)
    # three: each front end's own requests through a cache of a third of the budget
    turns = [i % 3 for i in range(len(trace))]
    got = replay_split(trace, turns, 3, ["shm-fifo"], [budget], 2)[0]
    parts = [replay([r for r, f in zip(trace, turns) if f == k], ["shm-fifo"], [budget // 3], 2)[0]
             for k in range(3)]
    assert got.capacity_bytes == budget and got.requests == len(trace)
    assert got.hits == sum(p.hits for p in parts)
    assert got.evictions == sum(p.evictions for p in parts)


def test_replay_split_refuses_assignments_that_do_not_fit() -> None:
    trace = [("a", 10), ("b", 10)]
    with pytest.raises(InvalidArgument, match="1 front-end assignments for 2 requests"):
        replay_split(trace, [0], 2, ["lru"], [100], 2)
    with pytest.raises(InvalidArgument, match=r"front ends must be 0\.\.1"):
        replay_split(trace, [0, 2], 2, ["lru"], [100], 2)


def test_route_index_is_stable_and_in_range() -> None:
    assert [route_index(f"user-{i}", 4) for i in range(100)] == \
        [route_index(f"user-{i}", 4) for i in range(100)]
    assert {route_index(f"user-{i}", 4) for i in range(100)} == {0, 1, 2, 3}
    assert 0 <= route_index("\udcff-not-utf8", 3) < 3  # a route read with surrogateescape
