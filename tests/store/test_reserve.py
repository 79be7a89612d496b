"""StoreWriter.reserve: the caller writes arrays straight into shared memory; all or nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tests._names import (
    Blank,
    KeyExists,
    NotSerializable,
    ObjectStore,
    ObjectTooLarge,
    StaleHandle,
    StoreFull,
)

torch = pytest.importorskip("torch")


@pytest.fixture
def store(name: str):
    w = ObjectStore.create(name, capacity_bytes=1 << 20, n_readers=1)
    r = ObjectStore.attach(name, 0)
    yield w, r
    r.close()
    w.close()


def test_filled_in_place_and_read_back_exactly(store) -> None:
    w, r = store
    template = {"pixel_values": Blank((2, 3, 16, 16), "float32"), "image_sizes": [[16, 16]] * 2,
                "meta": {"mask": Blank((4,), np.bool_), "name": "img"},
                "t": Blank((3, 5), "bfloat16", torch=True), "empty": Blank((0, 7), "<i8")}
    source = np.random.default_rng(0).random((2, 3, 16, 16), dtype=np.float32)
    with w.reserve("img", template) as res:
        np.copyto(res.arrays["pixel_values"], source)  # the only write of these bytes
        res.arrays[("meta", "mask")][:] = [True, False, True, True]  # blanks start undefined
        res.arrays["t"].copy_(torch.arange(15, dtype=torch.bfloat16).view(3, 5))
        assert res.handle is None
    got = r.get(res.handle)
    assert np.array_equal(got["pixel_values"], source)
    assert got["meta"]["name"] == "img" and got["meta"]["mask"].dtype == np.bool_
    assert got["meta"]["mask"].tolist() == [True, False, True, True]
    assert torch.equal(got["t"], torch.arange(15, dtype=torch.bfloat16).view(3, 5))
    assert got["empty"].shape == (0, 7) and got["image_sizes"] == [[16, 16], [16, 16]]
    assert not res.arrays["pixel_values"].flags.writeable  # published: no more writes
    assert w.is_cached("img") and w.get_cached("img") == res.handle
    r.get(res.handle)


def test_an_exception_in_the_block_leaves_the_store_as_if_nothing_happened(store) -> None:
    w, r = store
    before = w.stats()
    with pytest.raises(RuntimeError, match="preprocessing failed"):
        with w.reserve("bad", {"x": Blank((100_000,), "uint8")}) as res:
            res.arrays["x"][:10] = 1
            raise RuntimeError("preprocessing failed")
    assert res.handle is None and not w.is_cached("bad")
    after = w.stats()
    assert (after.puts, after.objects, w.handout_seq) == (before.puts, before.objects, 0)
    for i in range(40):  # the abandoned chunk's space comes back: many times the store
        r.get(w.put(f"k{i}", np.full(100_000, i, np.uint8)))
    with w.reserve("bad", {"x": Blank((10,), "uint8")}) as res:  # the key is free
        res.arrays["x"][:] = 7
    assert r.get(res.handle)["x"].tolist() == [7] * 10


def test_errors_are_the_ones_put_raises(store) -> None:
    w, _ = store
    w.put("taken", 1)
    with pytest.raises(KeyExists):
        with w.reserve("taken", {"x": Blank((1,), "uint8")}):
            pass
    with pytest.raises(ObjectTooLarge):
        with w.reserve("big", {"x": Blank((2 << 20,), "uint8")}):
            pass
    with pytest.raises(NotSerializable, match="Blank is a placeholder"):
        w.put("blank", {"x": Blank((1,), "uint8")})  # put needs the data
    for bad in [((-1,), "uint8"), (("a",), "uint8"), ((2,), "object"), ((2,), "U4")]:
        with pytest.raises(NotSerializable):
            Blank(*bad)
    with pytest.raises(NotSerializable):
        Blank((2,), "quint8", torch=True)


def test_a_put_inside_the_block_cannot_reclaim_the_chunk_being_filled(store) -> None:
    w, r = store
    with w.reserve("slow", {"x": Blank((300_000,), "uint8")}) as res:
        res.arrays["x"][:] = 5
        with pytest.raises(StoreFull, match="reserve"):
            for i in range(10):  # wraps the 1 MiB ring onto the reserved chunk
                r.get(w.put(f"k{i}", np.zeros(300_000, np.uint8)))
    assert r.get(res.handle)["x"].min() == 5


def test_clear_inside_the_block_keeps_the_reservation(store) -> None:
    w, r = store
    old = w.put("old", 1)
    with w.reserve("new", {"x": Blank((8,), "uint8")}) as res:
        w.clear()
        res.arrays["x"][:] = 3
    with pytest.raises(StaleHandle):
        r.get(old)
    assert r.get(res.handle)["x"].tolist() == [3] * 8


def test_a_channel_sends_a_reserved_value_or_nothing(name: str) -> None:
    from tests._names import Channel

    with Channel.create(name, n_readers=1, capacity_bytes=1 << 20) as ch, \
            Channel.attach(name, 0) as rd:
        with pytest.raises(ValueError, match="resize failed"):
            with ch.reserve({"px": Blank((64, 64), "float32")}, key="a") as res:
                raise ValueError("resize failed")
        assert not ch.store.is_cached("a")
        with ch.reserve({"px": Blank((64, 64), "float32"), "id": 7}, key="a") as res:
            res.arrays["px"][:] = 1.5
        ch.send(2)  # an inline value after it: order is kept
        got = rd.recv(timeout=1)
        assert got["id"] == 7 and float(got["px"].sum()) == 1.5 * 64 * 64
        assert rd.recv(timeout=1) == 2
        ch.send("again", key="a")  # a cached key: the reserved object is handed out again
        assert rd.recv(timeout=1)["id"] == 7
