"""Cache kinds: one contract for every kind, then each kind's own eviction order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmstore.cache._caches import (
    CACHE_KINDS,
    PAYLOAD_HANDLE,
    PAYLOAD_VALUE,
    ReceiverCache,
    SenderCache,
)
from shmstore.handle import HANDOUT_WORDS, HandOut
from tests._names import CorruptObject, InvalidArgument, InvalidKey, StaleHandle

N_READERS = 2
OBJ_BYTES = 10_000
CAPACITY = 36_000  # three 10 kB objects fit (with headers), four do not


def obj(tag: int) -> dict[str, Any]:
    return {"pixel_values": np.full(OBJ_BYTES, tag, dtype=np.uint8), "tag": tag}


class Harness:
    """A sender and N receivers of one kind; deliver() resolves a payload at every receiver."""

    def __init__(self, kind: str, name: str, capacity: int = CAPACITY, **kwargs: Any) -> None:
        self.sender = SenderCache.create(kind, capacity_bytes=capacity, n_readers=N_READERS,
                                 name=None if kind == "lru" else name, **kwargs)
        self.receivers = [ReceiverCache.attach(kind, capacity_bytes=capacity, reader=i,
                                     name=getattr(self.sender, "name", None))
                          for i in range(N_READERS)]
        self.calls: list[int] = []

    def request(self, tag: int) -> list[Any]:
        def make() -> dict[str, Any]:
            self.calls.append(tag)
            return obj(tag)

        payload = self.sender.process(f"img-{tag}", make)
        return [r.resolve(payload) for r in self.receivers]

    def close(self) -> None:
        for r in self.receivers:
            r.close()
        self.sender.close()


@pytest.fixture(params=CACHE_KINDS)
def cache(request: pytest.FixtureRequest, name: str) -> Iterator[Harness]:
    h = Harness(request.param, name)
    yield h
    h.close()


# -- the contract every kind keeps --------------------------------------------------------------

def test_make_value_runs_only_on_a_miss(cache: Harness) -> None:
    for _ in range(3):
        values = cache.request(1)
        assert all(v["tag"] == 1 and v["pixel_values"][0] == 1 for v in values)
    assert cache.calls == [1]
    s = cache.sender.stats()
    assert (s.requests, s.hits, s.hit_ratio) == (3, 2, pytest.approx(2 / 3))
    assert s.byte_hit_ratio == pytest.approx(2 / 3) and s.bytes_requested > 3 * OBJ_BYTES


def test_view_gives_the_same_value(cache: Harness) -> None:
    payload = cache.sender.process("k", lambda: obj(7))
    for r in cache.receivers:
        with r.resolve_view(payload) as value:
            assert value["tag"] == 7 and int(value["pixel_values"].sum()) == 7 * OBJ_BYTES


def test_too_large_values_go_inline_and_nothing_is_dropped(cache: Harness) -> None:
    big = {"pixel_values": np.ones(2 * CAPACITY, dtype=np.uint8)}
    payload = cache.sender.process("big", lambda: big)
    assert payload[0] == PAYLOAD_VALUE
    for r in cache.receivers:
        assert r.resolve(payload)["pixel_values"].shape == (2 * CAPACITY,)
    assert cache.sender.stats().inline_fallbacks == 1


def test_process_into_fills_in_place_once_and_falls_back_inline(cache: Harness) -> None:
    from tests._names import Blank

    calls = []

    def fill(arrays: dict[Any, Any]) -> None:
        calls.append(1)
        arrays["pixel_values"].fill(9)  # the preprocessor's only write of these bytes

    template = {"pixel_values": Blank((OBJ_BYTES,), "uint8"), "tag": 9}
    for _ in range(3):
        payload = cache.sender.process_into("k9", template, fill)
        for r in cache.receivers:
            value = r.resolve(payload)
            assert value["tag"] == 9 and int(value["pixel_values"].sum()) == 9 * OBJ_BYTES
    assert len(calls) == 1
    assert cache.sender.stats().hits == 2
    big = {"pixel_values": Blank((2 * CAPACITY,), "uint8")}
    payload = cache.sender.process_into("big", big, lambda a: a["pixel_values"].fill(1))
    assert payload[0] == PAYLOAD_VALUE  # too large for any kind: inline, filled in memory
    for r in cache.receivers:
        assert int(r.resolve(payload)["pixel_values"].sum()) == 2 * CAPACITY
    assert cache.sender.stats().inline_fallbacks == 1


def test_many_requests_all_resolve(cache: Harness) -> None:
    rng = np.random.default_rng(0)
    for tag in rng.integers(0, 8, 200):
        values = cache.request(int(tag))
        assert all(v["tag"] == tag for v in values)
    s = cache.sender.stats()
    assert s.requests == 200 and s.hits + len(cache.calls) == 200 and s.evictions > 0


def test_memory_accounting(cache: Harness) -> None:
    cache.request(1)
    s = cache.sender.stats()
    if s.kind == "lru":
        assert s.memory_bytes == N_READERS * s.bytes_requested  # one mirror per reader
    else:
        assert CAPACITY <= s.memory_bytes <= CAPACITY + 4096  # one shared segment


def test_bad_payloads_and_keys(cache: Harness) -> None:
    for bad in [None, ("zz", 1), (PAYLOAD_HANDLE,), [1, 2], "h", (99, 1)]:
        with pytest.raises(CorruptObject, match="same cache kind"):
            cache.receivers[0].resolve(bad)
    with pytest.raises(InvalidKey):
        cache.sender.process(123, lambda: obj(0))


def test_unknown_kind_and_missing_name() -> None:
    with pytest.raises(InvalidArgument, match="shm-fifo") as info:
        SenderCache.create("arc", capacity_bytes=100)
    assert info.value.argument == "kind" and info.value.value == "arc"
    with pytest.raises(InvalidArgument, match="shm-fifo"):
        ReceiverCache.attach("arc", capacity_bytes=100)
    with pytest.raises(InvalidArgument, match=r"sender's \.name"):
        ReceiverCache.attach("shm-fifo", capacity_bytes=100)


# -- each kind's own eviction order -------------------------------------------------------------

def test_fifo_drops_the_oldest_even_when_hot(name: str) -> None:
    h = Harness("shm-fifo", name)
    try:
        for tag in (1, 2, 3, 1, 4):
            h.request(tag)
        assert not h.sender.store.is_cached("img-1")
        assert all(h.sender.store.is_cached(f"img-{t}") for t in (2, 3, 4))
    finally:
        h.close()


def test_reinsertion_keeps_the_hot_item_fifo_drops(name: str) -> None:
    h = Harness("shm-reinsert", name)
    try:
        for tag in (1, 2, 3, 1, 4):
            h.request(tag)
        store = h.sender.store
        assert store.is_cached("img-1") and not store.is_cached("img-2")
        s = h.sender.stats()
        assert s.bytes_reinserted > OBJ_BYTES and store.stats().reinsertions == 1
        assert h.request(1)[0]["pixel_values"][5] == 1  # the moved copy is intact
    finally:
        h.close()


def test_lru_drops_the_least_recently_used(name: str) -> None:
    h = Harness("lru", name)
    try:
        for tag in (1, 2, 3, 1, 4):
            h.request(tag)
        calls = len(h.calls)
        h.request(1)
        h.request(3)
        h.request(4)
        assert len(h.calls) == calls  # 1, 3, 4 still cached
        h.request(2)
        assert h.calls[-1] == 2  # 2 was evicted
    finally:
        h.close()


def test_shm_full_of_unread_objects_falls_back_inline(name: str) -> None:
    h = Harness("shm-fifo", name)
    try:
        payloads = [h.sender.process(f"k{i}", lambda i=i: obj(i)) for i in range(4)]
        # nobody read the first three
        assert [p[0] for p in payloads] == [PAYLOAD_HANDLE] * 3 + [PAYLOAD_VALUE]
        assert h.sender.stats().inline_fallbacks == 1
        for p in payloads:
            for r in h.receivers:
                r.resolve(p)
        assert h.sender.process("k9", lambda: obj(9))[0] == PAYLOAD_HANDLE
    finally:
        h.close()


def test_lru_mirror_out_of_step_is_reported(name: str) -> None:
    sender = SenderCache.create("lru", capacity_bytes=CAPACITY)
    receiver = ReceiverCache.attach("lru", capacity_bytes=CAPACITY)
    sender.process("a", lambda: obj(1))  # the receiver never sees this payload
    with pytest.raises(CorruptObject, match="missed a payload"):
        receiver.resolve(sender.process("a", lambda: obj(1)))


def test_process_into_whose_fill_raises_caches_nothing(cache: Harness) -> None:
    from tests._names import Blank

    def broken(arrays: dict[Any, Any]) -> None:
        raise OSError("cannot decode the image")

    with pytest.raises(OSError, match="cannot decode"):
        cache.sender.process_into("bad", {"x": Blank((64,), "uint8")}, broken)
    payload = cache.sender.process_into("bad", {"x": Blank((64,), "uint8")},
                                        lambda a: a["x"].fill(3))
    assert all(int(r.resolve(payload)["x"].sum()) == 3 * 64 for r in cache.receivers)
    assert cache.sender.stats().hits == 0  # the first attempt left nothing behind


def test_store_sender_hits_misses_and_touches_are_each_one_hand_out(name: str) -> None:
    """StoreSender, the logic every sender shares (the shm kinds', vLLM's): a touch is taken
    once and kept, a take uses it (else hands out anew), a refused touch and a released one
    go back by number, and a miss that the store cannot take comes back with why."""
    from shmstore import ObjectStore
    from shmstore.cache._caches import StoreSender
    from shmstore.errors import ObjectTooLarge as TooLarge

    with ObjectStore.create(name, capacity_bytes=1 << 20, n_readers=1,
                            max_object_bytes=64 << 10) as store:
        sender = StoreSender(store)
        made, why = sender.store_new("a", np.zeros(8))
        assert made is not None and why is None and store.unread(made.handle) == (1,)
        big, why = sender.store_new("big", np.zeros(1 << 17, np.uint8))
        assert big is None and isinstance(why, TooLarge) and not store.is_cached("big")
        sender.store_new("b", np.ones(8))
        refused = []
        sender.touch(["a", "b", "missing", "a"],
                     accept=lambda key, h: key == "a" or bool(refused.append(h)))
        assert set(sender.touched) == {"a"} and store.unread(made.handle) == (2,)
        assert len(refused) == 1 and store.unread(refused[0].handle) == (1,)  # given back
        kept = sender.touched["a"]
        assert sender.take("a") == kept and sender.touched == {}  # the touch, not a new one
        again = sender.take("a")
        assert again is not None and again.number > kept.number and store.unread(made.handle) == (3,)
        assert sender.take("missing") is None and sender.take("a", cached_here=False) is None
        sender.touch_one("b")
        sender.release()  # the touch of b goes back by its number
        assert store.unread(refused[0].handle) == (1,) and sender.touched == {}
        assert sender.issued("a", again) and not sender.issued("b", again)


def test_a_shm_receiver_checks_a_hand_out_and_counts_it_once(name: str) -> None:
    """A shm kind's payload is a hand-out; its receiver reads it as the vLLM plugin's workers
    do (StoreReceiver): a number the store never made, or a payload whose parts are not what
    they say, is refused before any read, and a payload resolved twice is one read."""
    h = Harness("shm-fifo", name)
    try:
        payload = h.sender.process("k", lambda: obj(1))
        assert payload[0] == PAYLOAD_HANDLE and len(payload) == 2
        made = HandOut.from_words(payload[1])
        store, handle = h.sender.store, made.handle

        def said(**changes: Any) -> tuple[int, tuple[int, ...]]:
            return (PAYLOAD_HANDLE, made._replace(**changes).to_words())

        forged = said(number=made.number + 1000)
        with pytest.raises(StaleHandle, match="never made"):
            h.receivers[0].resolve(forged)
        with pytest.raises(StaleHandle):
            with h.receivers[0].resolve_view(forged):
                pass
        number_at = HANDOUT_WORDS.index("number")
        for bad_words in ([*payload[1][:number_at], "2", *payload[1][number_at + 1:]],
                          payload[1][:-1], [*payload[1], 0]):
            with pytest.raises(CorruptObject, match="same cache kind"):
                h.receivers[0].resolve((PAYLOAD_HANDLE, bad_words))
        moved = said(object_id=handle.key_digest + b"\x09" * 8)
        with pytest.raises(StaleHandle):
            h.receivers[0].resolve(moved)  # another origin: not these bytes
        assert store.unread(handle) == (1,) * N_READERS  # nothing was read by the refusals
        for r in h.receivers:
            assert r.resolve(payload)["tag"] == 1 and r.resolve(payload)["tag"] == 1
        assert store.unread(handle) == (0,) * N_READERS  # twice resolved, once read
    finally:
        h.close()
