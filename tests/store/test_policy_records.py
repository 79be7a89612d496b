"""Rings that share one dict of records (adaptive's three shadows) replay exactly as rings
alone do, every record fits its field, and an exception inside one shadow leaves all three
working."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmstore.store._policy import (
    _COUNT_MASK,
    _SINCE_BIT,
    _TICK_MASK,
    POLICIES,
    AdaptivePolicy,
    EvictionPolicy,
    RecencyPolicy,
    RingReplay,
    _pack,
    make_policy,
)
from tests.store._adaptive_reference import ReferenceAdaptive, ReferenceRingReplay
from tests.store._stop import Stop, stop_at_call

KIB = 1024
RIVALS = ("recency", "freq", "reinsert")  # adaptive's layout: recency's long record lowest


def test_every_policys_largest_record_fits_its_field() -> None:
    for name, cls in POLICIES.items():
        largest = (_pack(cls.max_uses, _SINCE_BIT, _TICK_MASK)
                   if issubclass(cls, RecencyPolicy) or cls is AdaptivePolicy else cls.max_uses)
        assert largest < 1 << (cls.record_bits - 1), name  # the lowest bit says "held"
    assert RecencyPolicy.max_uses <= _COUNT_MASK


def _state(ring: RingReplay, keys: list[str]) -> tuple[object, ...]:
    return (ring.chunks(), sorted(map(str, ring.keys())), [ring.uses_of(k) for k in keys],
            ring.evictions, ring.bytes_reinserted)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([700, 1000, 1500, 2600])),
                min_size=1, max_size=400),
       st.integers(6 * KIB, 14 * KIB))
def test_rings_on_one_dict_of_records_replay_as_rings_alone(
        trace: list[tuple[int, int]], capacity: int) -> None:
    records: dict[object, int] = {}
    shared, alone, shift = [], [], 0
    for name in RIVALS:
        policy = make_policy(name)
        shared.append(RingReplay(policy, capacity, records, shift))
        alone.append(RingReplay(make_policy(name), capacity))
        shift += policy.record_bits
    keys = sorted({f"k{k}" for k, _ in trace})
    for step, (k, nbytes) in enumerate(trace):
        for together, apart in zip(shared, alone):
            assert together.request(f"k{k}", nbytes) == apart.request(f"k{k}", nbytes), step
        if step % 50 == 0 or step == len(trace) - 1:
            for together, apart in zip(shared, alone):
                assert _state(together, keys) == _state(apart, keys), step
    # a key keeps an entry while some ring holds it, and no longer
    assert set(records) == set().union(*(ring.keys() for ring in shared))


# reinsert's hit() is not called here: this trace's hot keys are in all three rings whenever
# in reinsert's, and a hit in all three takes one step that does not call it
@pytest.mark.parametrize("shadow, where", [
    (shadow, where) for shadow in (0, 1, 2) for where in ("admitted", "keep", "kept", "evicted", "hit")
    if (shadow, where) != (1, "hit")])
def test_a_shadow_stopped_at_any_policy_call_leaves_all_three_working(
        shadow: int, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's exception inside one shadow's step (a store's put or hit) leaves its
    records and its rivals' in one int per key: later requests neither raise nor let a ring
    outgrow its capacity or hold a record of a key it has no chunk of."""
    policy = AdaptivePolicy()
    policy.start(10 * KIB)
    ring = policy._shadows[shadow]
    if where in ("admitted", "evicted") and getattr(type(ring.policy), where) is getattr(
            EvictionPolicy, where):
        # the base's (reinsert's admitted(), reinsert's and recency's evicted()): not called
        assert not {"admitted": ring._admits, "evicted": ring._evicts}[where]
        return
    calls = stop_at_call(monkeypatch, ring.policy, where, 5)
    stopped = 0
    for i in range(600):
        key = f"k{i % 7}" if i % 3 else f"once{i}"
        try:
            policy.requested(key, KIB)
        except Stop:
            stopped += 1
    assert stopped == 1 and calls[0] > 5
    for each in policy._shadows:
        chunk_keys = {key for _, _, key in each.chunks()}
        assert sum(size for _, size, _ in each.chunks()) <= each.capacity_bytes
        assert set(each.keys()) <= chunk_keys
    assert set(policy._records) == set().union(*(each.keys() for each in policy._shadows))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from([700, 1000, 2600])),
                min_size=1, max_size=500),
       st.integers(5 * KIB, 16 * KIB))
def test_adaptive_on_one_dict_decides_as_the_reference_on_random_traces(
        trace: list[tuple[int, int]], capacity: int) -> None:
    """Every hit, rule and copy as the reference (three dicts, no one-step hit), on short
    random traces that hit in some shadows and not others."""
    new, old = AdaptivePolicy(), ReferenceAdaptive()
    new_ring, old_ring = RingReplay(new, capacity), ReferenceRingReplay(old, capacity)
    for step, (k, nbytes) in enumerate(trace):
        assert new_ring.request(f"k{k}", nbytes) == old_ring.request(f"k{k}", nbytes), step
        assert new.rule == old.rule and new._scores == old._scores, step
        assert [shadow.uses_of(f"k{k}") for shadow in new._shadows] == [
            shadow._uses.get(f"k{k}") for shadow in old._shadows], step
    assert (new_ring.evictions, new_ring.bytes_reinserted) == (old_ring.evictions,
                                                               old_ring.bytes_reinserted)


@pytest.mark.parametrize("capacity", [(4 << 30) - 4096, 6 << 30])
def test_a_ring_keeps_addresses_and_sizes_on_either_side_of_4_gib(capacity: int) -> None:
    """Below 4 GiB the chunk buffers hold 4-byte ints, above 8-byte: the largest address and
    size each can meet round the ring, through growth of the buffers."""
    ring = RingReplay(make_policy("freq"), capacity)
    size = capacity // 40  # 40 chunks a pass: the buffers grow twice
    for i in range(130):
        ring.request(f"k{i % 90}", size + i % 3)
    chunks = ring.chunks()
    assert all(0 <= address and address + nbytes <= capacity for address, nbytes, _ in chunks)
    assert max(address + nbytes for address, nbytes, _ in chunks) > capacity - 3 * size
    assert ring._buffers[0].itemsize == (4 if capacity < 1 << 32 else 8)


@pytest.mark.parametrize("args, argument", [
    ((-1,), "capacity_bytes"), ((1.5,), "capacity_bytes"), ((True,), "capacity_bytes"),
    ((1 << 52,), "capacity_bytes"), ((KIB, [], 0), "records"), ((KIB, None, -3), "shift"),
    ((KIB, {}, 2.0), "shift"), ((KIB, {}, 1 << 20), "shift")])
def test_a_ring_refuses_what_it_cannot_replay_on(args: tuple[object, ...], argument: str) -> None:
    from shmstore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=argument):
        RingReplay(make_policy("freq"), *args)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["freq", "adaptive"])
def test_a_chunk_larger_than_the_ring_is_refused_and_the_ring_goes_on(policy: str) -> None:
    from shmstore.errors import InvalidArgument

    ring = RingReplay(make_policy(policy), 4 * KIB)
    assert not ring.request("a", KIB)
    for bad in (4 * KIB + 1, 0, -KIB):
        with pytest.raises(InvalidArgument, match="chunk"):
            ring.request("b", bad)
    assert ring.request("a", KIB) and [key for _, _, key in ring.chunks()] == ["a"]
