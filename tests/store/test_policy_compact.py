"""The adaptive policy with one LRU of keys for itself and its recency shadow decides exactly as
0.4.0's, which kept two (tests/store/_adaptive_reference.py): the same hit or miss on every
request, the same rule at every request, the same bytes copied, on every trace family of
bench/traces.py at the cache sizes bench/bench_policy_goal.py checks, and through clears."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shmstore.store._policy import AdaptivePolicy, RingReplay
from tests.store._adaptive_reference import ReferenceAdaptive, ReferenceRingReplay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from traces import FAMILIES, make_family

RING_OVERHEAD = 64  # a chunk's header, as hitsim adds it; equal for both sides


def _run(policy: object, trace: list[tuple[str, int]], capacity: int,
         clear_every: int = 0) -> tuple[list[bool], list[str], int, int]:
    """Replay `trace` through `policy` in a ring of `capacity` (0.4.0's ring for 0.4.0's
    policy), as cache/_hitsim.py does: hits, the rule after each request, bytes copied,
    evictions."""
    ring_class = ReferenceRingReplay if isinstance(policy, ReferenceAdaptive) else RingReplay
    ring = ring_class(policy, capacity)  # type: ignore[arg-type]
    hits, rules = [], []
    for i, (key, nbytes) in enumerate(trace, 1):
        hits.append(ring.request(key, nbytes + RING_OVERHEAD))
        rules.append(policy.rule)  # type: ignore[attr-defined]
        if clear_every and i % clear_every == 0:
            ring.clear()
    return hits, rules, ring.bytes_reinserted, ring.evictions


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_every_budget_decides_as_before(family: str) -> None:
    trace = make_family(family, 6_000, seed=1)
    largest: dict[str, int] = {}
    for key, nbytes in trace:
        largest[key] = max(nbytes, largest.get(key, 0))
    working_set = sum(n + RING_OVERHEAD for n in largest.values())
    applied: set[str] = set()
    for share in (0.01, 0.05, 0.10, 0.25):
        capacity = max(int(share * working_set), max(largest.values()) + RING_OVERHEAD)
        new = _run(AdaptivePolicy(), trace, capacity)
        old = _run(ReferenceAdaptive(), trace, capacity)
        assert new[0] == old[0], f"{family} at {share:.0%}: a request hit or missed otherwise"
        assert new[1:] == old[1:], f"{family} at {share:.0%}: rules or copies differ"
        applied |= set(new[1])
    assert applied == {"freq", "reinsert", "recency"}, applied  # every rule decided somewhere


def test_clears_keep_them_in_step() -> None:
    trace = make_family("chat", 4_000, seed=2)
    new = _run(AdaptivePolicy(), trace, 40 << 20, clear_every=700)
    old = _run(ReferenceAdaptive(), trace, 40 << 20, clear_every=700)
    assert new == old


def test_one_lru_of_keys_serves_both() -> None:
    policy = AdaptivePolicy()
    policy.start(1 << 20)
    assert policy._shadows[2].policy is policy._recency


def test_numpy_sizes_decide_as_python_ints() -> None:
    """`shmstore hitrate` reads sizes with numpy: the packed LRU takes them as ints."""
    import numpy as np

    trace = make_family("zipf-0.8", 3_000, seed=3)
    as_numpy = [(key, np.int64(nbytes)) for key, nbytes in trace]
    assert _run(AdaptivePolicy(), as_numpy, 30 << 20) == _run(AdaptivePolicy(), trace, 30 << 20)
