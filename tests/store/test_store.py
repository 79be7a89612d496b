"""ObjectStore in one process: the vLLM-known behaviours, delivery accounting, every bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shmstore.handle import key_digest
from shmstore.store._layout import (
    OBJECT_HEADER,
    ROW_ATTACH_HANDOUT,
    ROW_CORRUPT_READS,
    ROW_DONE_THROUGH,
    ROW_PIN_MASK,
    ROW_PINS,
    ROW_TOTAL_READS,
    STORE_META,
    STORE_ROW,
)
from tests._names import (
    CorruptObject,
    Handle,
    InvalidArgument,
    InvalidHandle,
    InvalidKey,
    KeyExists,
    KeyNotCached,
    ObjectStore,
    ObjectTooLarge,
    ReaderIndexError,
    ReaderSlotBusy,
    SegmentClosed,
    SegmentExists,
    StaleHandle,
    StoreFull,
    StoreReader,
    StoreWriter,
    WrongThread,
)

KIB = 1024


@pytest.fixture
def store(name: str):
    w = ObjectStore.create(name, capacity_bytes=256 * KIB, n_readers=2, max_object_bytes=64 * KIB)
    readers = [ObjectStore.attach(name, reader=i) for i in range(2)]
    yield w, readers
    for r in readers:
        r.close()
    w.close()


def blob(i: int, nbytes: int = 40 * KIB) -> np.ndarray:
    return np.full(nbytes, i % 256, dtype=np.uint8)


def read_all(readers: list[StoreReader], handle: Handle) -> None:
    for r in readers:
        r.get(handle)


def test_layout_offsets() -> None:
    assert STORE_META.size == OBJECT_HEADER.size == 64 and STORE_ROW.size == 128
    raw = OBJECT_HEADER.pack(b"d" * 16, 7, 9, 11)
    assert raw[:16] == b"d" * 16 and int.from_bytes(raw[16:24], "little") == 7
    assert int.from_bytes(raw[24:28], "little") == 9
    assert int.from_bytes(raw[32:40], "little") == 11
    raw = STORE_ROW.pack(1, 2, 3, 4, 5, 6, 7, *range(10, 18))
    offsets = (0, 8, 16, 24, 32, 40, 48, *range(64, 128, 8))
    assert [int.from_bytes(raw[o:o + 8], "little") for o in offsets] == [1, 2, 3, 4, 5, 6, 7,
                                                                         *range(10, 18)]
    assert (ROW_ATTACH_HANDOUT, ROW_TOTAL_READS, ROW_CORRUPT_READS, ROW_PIN_MASK,
            ROW_DONE_THROUGH, ROW_PINS) == (16, 24, 32, 40, 48, 64)
    raw = STORE_META.pack(1, 2, 3)
    assert int.from_bytes(raw[8:12], "little") == 2 and int.from_bytes(raw[16:24], "little") == 3


def test_put_get_view_roundtrip_numpy_and_torch(store) -> None:
    w, (r0, r1) = store
    obj = {"pixel_values": torch.randn(1, 3, 16, 16).to(torch.bfloat16),
           "image_sizes": np.array([[336, 336]]), "prompt": "describe"}
    h = w.put("img-1", obj)
    got = r0.get(h)
    assert torch.equal(got["pixel_values"], obj["pixel_values"]) and got["prompt"] == "describe"
    with r1.view(h) as v:
        assert np.array_equal(v["image_sizes"], obj["image_sizes"])
        assert not v["image_sizes"].flags.writeable
        assert torch.equal(v["pixel_values"], obj["pixel_values"])
    s = w.stats()
    assert (s.puts, s.hits, s.objects, s.reader_lag) == (1, 0, 1, (0, 0))


def test_handle_is_small_and_roundtrips_through_msgpack(store) -> None:
    import msgpack

    w, _ = store
    h = w.put(b"\x01" * 32, 1)
    assert len(msgpack.packb(h.pack())) <= 48
    assert Handle.unpack(msgpack.unpackb(msgpack.packb(h.pack()))) == h


def test_a_hand_outs_words_round_trip_through_msgpack_and_refuse_anything_else(store) -> None:
    import msgpack

    from shmstore.handle import HANDOUT_WORDS, HandOut

    w, _ = store
    made = w.hand_out_new("k", 1)
    again = w.hand_out_cached(["k"], field="absent")[0]
    assert again is not None
    for handout in (made, again, made._replace(record=b"r")):
        words = handout.to_words()
        assert len(words) == len(HANDOUT_WORDS) and all(0 <= x < 1 << 64 for x in words)
        back = HandOut.from_words(msgpack.unpackb(msgpack.packb(words)), handout.record)
        assert back == handout and w.issued("k", back)  # the record travels beside the words
    words = list(made.to_words())
    for bad in (None, "words", words[:-1], [*words, 0], [*words[:-1], -1],
                [*words[:-1], 1 << 64], [*words[:-1], True], [*words[:-1], 1.0]):
        with pytest.raises(InvalidHandle, match="unsigned 64-bit"):
            HandOut.from_words(bad)
    for wrong in (made._replace(number=-1), made._replace(number=1.0),
                  made._replace(object_id=b"short"), made._replace(object_id="x" * 24)):
        with pytest.raises(InvalidHandle):
            wrong.to_words()


def test_duplicate_key_is_refused(store) -> None:
    w, _ = store
    w.put("k", 1)
    with pytest.raises(KeyExists, match="get_cached"):
        w.put("k", 2)


def test_oversize_object_names_both_sizes(store) -> None:
    w, _ = store
    pattern = r"\d+ bytes serialized, \d+ bytes above the max_object_bytes .* \(65536\)"
    with pytest.raises(ObjectTooLarge, match=pattern) as e:
        w.put("big", np.zeros(70 * KIB, np.uint8))
    assert e.value.max_object_bytes == 64 * KIB and e.value.object_bytes > 70 * KIB


def test_unread_oldest_blocks_reclamation_until_read(store) -> None:
    w, readers = store
    handles = [w.put(f"k{i}", blob(i)) for i in range(6)]  # 6 x 40 KiB in a 256 KiB ring
    with pytest.raises(StoreFull, match=r"owed to reader\(s\) \[0, 1\]") as info:
        w.put("next", blob(9))
    assert info.value.lagging_readers == (0, 1)
    readers[1].get(handles[0])
    with pytest.raises(StoreFull, match=r"reader\(s\) \[0\]"):
        w.put("next", blob(9))
    readers[0].get(handles[0])
    w.put("next", blob(9))  # reclamation resumes
    s = w.stats()
    assert s.evictions == 1 and s.full_events == 2 and not w.is_cached("k0")


def test_overwritten_handle_raises_stale(store) -> None:
    w, readers = store
    first = w.put("k0", blob(0))
    read_all(readers, first)
    for i in range(1, 12):
        read_all(readers, w.put(f"k{i}", blob(i)))
    with pytest.raises(StaleHandle):
        readers[0].get(first)


def test_get_cached_counts_another_delivery(store) -> None:
    w, (r0, r1) = store
    h = w.put("k", blob(1))
    assert w.is_cached("k") and not w.is_cached("other")
    assert w.get_cached("k") == h
    for r in (r0, r1):
        r.get(h)
    assert w.stats().reader_lag == (1, 1)
    for i in range(2, 7):  # fill the ring; k is still owed once by each reader
        w.put(f"k{i}", blob(i), timeout=0)
        read_all([r0, r1], w.get_cached(f"k{i}"))
        read_all([r0, r1], w.handle_of(f"k{i}"))
    with pytest.raises(StoreFull):
        w.put("x", blob(0))
    read_all([r0, r1], h)
    w.put("x", blob(0))
    assert w.stats().hits == 6


def test_get_cached_unknown_key(store) -> None:
    w, _ = store
    with pytest.raises(KeyNotCached, match="put it again"):
        w.get_cached("nope")


def test_release_gives_back_an_aborted_handout(store) -> None:
    w, readers = store
    h = w.put("aborted", blob(0))
    w.give_back(h)
    with pytest.raises(StaleHandle, match="no hand-out left"):
        w.give_back(h)
    for i in range(1, 7):
        read_all(readers, w.put(f"k{i}", blob(i)))  # "aborted" is reclaimed without any read
    assert not w.is_cached("aborted") and w.stats().give_backs == 1


def test_hand_out_again_renews_a_kept_handout_without_a_second_read(store) -> None:
    w, readers = store
    h = w.put("kept", blob(0))
    first = w.handout_seq
    read_all(readers, w.put("other", blob(1)))
    again = w.hand_out_again(h)
    assert again.handle == h and again.number == first + 2 == w.handout_seq  # a new, later one
    assert (w.stats().hits, w.stats().give_backs) == (0, 0)
    read_all(readers, h)  # one read each settles it: the kept hand-out is not owed as well
    for i in range(2, 8):
        read_all(readers, w.put(f"k{i}", blob(i)))
    assert not w.is_cached("kept")
    with pytest.raises(StaleHandle):
        w.hand_out_again(h)


def test_view_counts_on_exit_even_when_the_block_raises(store) -> None:
    w, (r0, _) = store
    h = w.put("k", blob(3))
    with pytest.raises(RuntimeError, match="boom"):
        with r0.view(h):
            raise RuntimeError("boom")
    assert w.stats().reader_lag == (0, 1)


def test_clear_makes_every_handle_stale(store) -> None:
    w, (r0, _) = store
    h = w.put("k", blob(1))
    w.clear()
    assert not w.is_cached("k") and w.stats().reader_lag == (0, 0)
    h2 = w.put("k", blob(2))
    assert h2.address == h.address and h2.seq > h.seq
    with pytest.raises(StaleHandle):
        r0.get(h)
    assert r0.get(h2)[0] == 2


def test_foreign_and_forged_handles(store, name: str) -> None:
    w, (r0, _) = store
    h = w.put("k", blob(1))
    with pytest.raises(StaleHandle, match="another store"):
        r0.get(Handle(h.address, h.seq, h.key_digest, h.epoch ^ 1))
    with pytest.raises(StaleHandle, match="does not match the key"):
        r0.get(Handle(h.address, h.seq, key_digest("other"), h.epoch))
    with pytest.raises(StaleHandle):
        r0.get(Handle(h.address, h.seq + 5, h.key_digest, h.epoch))
    with pytest.raises(CorruptObject):
        r0.get(Handle(h.address + 8, h.seq, h.key_digest, h.epoch))
    with pytest.raises(CorruptObject):
        r0.get(Handle(10**15, h.seq, h.key_digest, h.epoch))
    with pytest.raises(InvalidHandle):
        r0.get((h.address, h.seq))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [(-1, 1, b"k" * 16, 1), (True, 1, b"k" * 16, 1), (1, 2**64, b"k" * 16, 1), (1, 1, b"short", 1),
     (1, 1, "k" * 16, 1), (1.0, 1, b"k" * 16, 1)],
)
def test_malformed_handles(fields: tuple) -> None:
    with pytest.raises(InvalidHandle):
        Handle(*fields)


def test_unpack_rejects_wrong_lengths() -> None:
    with pytest.raises(InvalidHandle, match="40 bytes"):
        Handle.unpack(b"\0" * 39)
    with pytest.raises(InvalidHandle):
        Handle.unpack("x" * 40)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [1, None, 1.5, ("a",), "", b""])
def test_wrong_key_types(store, key: object) -> None:
    w, _ = store
    with pytest.raises(InvalidKey):
        w.put(key, 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey):
        w.is_cached(key)  # type: ignore[arg-type]


def test_str_and_bytes_keys_are_distinct(store) -> None:
    w, (r0, _) = store
    a, b = w.put("abc", 1), w.put(b"abc", 2)
    assert a.key_digest != b.key_digest and r0.get(a) == 1 and r0.get(b) == 2


@pytest.mark.parametrize("reader", [-1, 2, 100, True])
def test_reader_index_out_of_range(store, reader: object, name: str) -> None:
    with pytest.raises(ReaderIndexError, match=r"use an int in 0\.\.1"):
        ObjectStore.attach(name, reader=reader)  # type: ignore[arg-type]


def test_reader_slot_of_a_live_process_is_refused(store, name: str) -> None:
    w, (r0, _) = store
    r0.close()
    row = w._table.row(0)
    w._buf[row:row + 8] = (1 << 32 | 1).to_bytes(8, "little")  # pid 1 is alive and not us
    with pytest.raises(ReaderSlotBusy, match="held by live process 1"):
        ObjectStore.attach(name, reader=0)
    w._buf[row:row + 8] = bytes(8)


def test_second_writer_on_a_live_name(store, name: str) -> None:
    with pytest.raises(SegmentExists, match="live writer"):
        ObjectStore.create(name, capacity_bytes=4096, n_readers=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"capacity_bytes": 10, "n_readers": 1}, "capacity"),
     ({"capacity_bytes": 4096, "n_readers": -1}, "n_readers"),
     ({"capacity_bytes": 4096, "n_readers": 1, "max_object_bytes": 10**9}, "max_object_bytes"),
     ({"capacity_bytes": 4096, "n_readers": 1, "policy": "lfu"}, "policy")],
)
def test_bad_create_arguments(name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ObjectStore.create(name, **kwargs)


def test_closed_store_stays_closed(name: str) -> None:
    w = ObjectStore.create(name, capacity_bytes=4096, n_readers=1)
    r = ObjectStore.attach(name, reader=0)
    h = w.put("k", 1)
    r.close()
    r.close()
    with pytest.raises(SegmentClosed):
        r.get(h)
    w.close()
    w.close()
    with pytest.raises(SegmentClosed):
        w.put("k2", 1)
    assert isinstance(w, StoreWriter)


def test_reader_slot_is_freed_on_close_and_reusable(store, name: str) -> None:
    w, (r0, _) = store
    r0.close()
    assert w.stats().reader_pids[0] == 0
    again = ObjectStore.attach(name, reader=0)
    again.close()


def test_zero_readers_reclaims_at_once(name: str) -> None:
    with ObjectStore.create(name, capacity_bytes=64 * KIB, n_readers=0) as w:
        for i in range(20):
            w.put(f"k{i}", blob(i, 20 * KIB))
        assert w.stats().evictions > 0


def test_put_timeout_waits_then_names_the_reader(store) -> None:
    w, (r0, r1) = store
    for i in range(6):
        h = w.put(f"k{i}", blob(i))
        r0.get(h)
    with pytest.raises(StoreFull, match=r"after waiting 0.05 s.*reader\(s\) \[1\]"):
        w.put("x", blob(0), timeout=0.05)


def test_unread_says_what_each_reader_owes_and_withdraw_frees_an_owed_object(store) -> None:
    w, readers = store
    h = w.put("owed", blob(0))
    w.get_cached("owed")
    assert w.unread(h) == (2, 2)
    readers[0].get(h)
    assert w.unread(h) == (1, 2)
    # nobody will read the rest (their requests ended): the store would stay full without it
    for i in range(1, 6):  # six fit
        read_all(readers, w.put(f"k{i}", blob(i)))
    with pytest.raises(StoreFull, match="still owed"):
        w.put("k6", blob(6))
    assert w.withdraw(h) is True and not w.is_cached("owed")
    assert w.withdraw(h) is False  # gone already: nothing to do
    with pytest.raises(StaleHandle):
        w.unread(h)
    with pytest.raises(StaleHandle):
        w.give_back(h)
    read_all(readers, w.put("k6", blob(6)))  # the space came back
    with pytest.raises(StaleHandle):  # a late read fails loudly, never other data
        readers[1].get(h)
    assert w.stats().withdrawn == 1


def test_withdraw_waits_for_a_reader_inside_the_object(store) -> None:
    w, readers = store
    h = w.put("inside", blob(7))
    with readers[0].view(h) as arr:
        assert w.withdraw(h)
        for i in range(1, 6):
            read_all(readers, w.put(f"k{i}", blob(i)))
        with pytest.raises(StoreFull):  # the viewed bytes stay put while the view is open
            w.put("k6", blob(6))
        assert (arr == 7).all()
    read_all(readers, w.put("k6", blob(6)))


def test_a_second_read_that_is_not_counted_leaves_the_hand_out_owed(store) -> None:
    w, readers = store
    h = w.put("twice", blob(3))
    w.get_cached("twice")
    readers[0].get(h)
    assert (readers[0].get(h, count=False) == 3).all()
    assert w.unread(h) == (1, 2)  # the second hand-out is still owed to reader 0


def test_clear_keeping_hand_outs_keeps_owed_objects_readable_until_read(store) -> None:
    w, readers = store
    owed = w.put("owed", blob(1))
    done = w.put("done", blob(2))
    read_all(readers, done)
    w.clear(keep_handed_out=True)
    assert not w.is_cached("owed") and not w.is_cached("done") and len(w) == 0
    with pytest.raises(StaleHandle):
        readers[0].get(done)  # nobody owed it: gone
    fresh = w.put("owed", blob(9))  # the key names a new object from now on
    assert fresh != owed and w.unread(owed) == (1, 1)
    for r in readers:
        assert (r.get(owed) == 1).all()  # the in-flight hand-out still reads its own bytes
        assert (r.get(fresh) == 9).all()
    for i in range(3, 12):  # once read, the kept object goes like any other, never copied
        read_all(readers, w.put(f"k{i}", blob(i)))
    with pytest.raises(StaleHandle):
        readers[0].get(owed)
    assert w.stats().reinsertions == 0


def test_clear_keeping_hand_outs_still_lets_give_back_and_withdraw_settle_them(store) -> None:
    w, readers = store
    a, b = w.put("a", blob(1)), w.put("b", blob(2))
    w.clear(keep_handed_out=True)
    w.give_back(a)
    assert w.withdraw(b)
    for i in range(3, 12):
        read_all(readers, w.put(f"k{i}", blob(i)))  # neither blocks the ring
    for h in (a, b):
        with pytest.raises(StaleHandle):
            readers[0].get(h)


def test_hand_out_adds_one_read_per_reader_also_for_a_kept_object(store) -> None:
    w, readers = store
    h = w.put("twice", blob(4))
    w.clear(keep_handed_out=True)
    assert w.hand_out(h).handle == h and w.unread(h) == (2, 2)
    assert w.stats().hits == 0  # not a hit: nobody asked by key
    read_all(readers, h)
    read_all(readers, h)
    assert w.unread(h) == (0, 0)
    for i in range(1, 8):
        read_all(readers, w.put(f"k{i}", blob(i)))
    with pytest.raises(StaleHandle):
        w.hand_out(h)


def test_pinned_copies_need_cuda(store) -> None:
    w, readers = store
    h = w.put("t", {"x": torch.arange(1000, dtype=torch.float32)})
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="CUDA"):
            readers[0].get(h, pin_memory=True)
        got = readers[0].get(h)  # nothing was counted by the refused call
        assert not got["x"].is_pinned()
        assert w.unread(h) == (0, 1)
        return
    got = readers[0].get(h, pin_memory=True)
    assert got["x"].is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_copies_with_cuda_are_page_locked_and_equal(store) -> None:
    w, readers = store
    h = w.put("t", {"x": torch.arange(1000, dtype=torch.bfloat16), "n": np.arange(3)})
    got = readers[1].get(h, pin_memory=True)
    assert got["x"].is_pinned() and torch.equal(got["x"], torch.arange(1000, dtype=torch.bfloat16))
    assert got["n"].tolist() == [0, 1, 2]  # numpy arrays are left as they are


def test_a_second_thread_inside_the_writer_is_refused_loudly(store) -> None:
    """The writer is for one thread at a time: a call from a second thread while one is inside
    raises WrongThread (naming both) instead of corrupting the index; stats() is allowed."""
    import threading

    w, readers = store
    h = w.put("a", blob(1))
    inside = threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:  # a put that waits for space, i.e. stays inside the writer
        for i in range(2, 7):
            w.put(f"k{i}", blob(i))
        inside.set()
        try:
            w.put("waits", blob(9), timeout=5)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(10)
    time.sleep(0.2)
    for call in (lambda: w.put("x", blob(0)), lambda: w.get_cached("a"),
                 lambda: w.is_cached("a"), lambda: w.give_back(h), lambda: w.unread(h),
                 lambda: w.end_handouts([(h, [1])]), lambda: w.clear()):
        with pytest.raises(WrongThread, match="one thread at a time") as refused:
            call()
        assert refused.value.thread == threading.get_ident() != refused.value.owner_thread
    assert w.stats().puts == 6  # from any thread
    read_all(readers, h)  # the oldest is read: the waiting put goes through
    t.join(10)
    assert not errors and w.is_cached("waits") and w.is_cached("a") is False
    read_all(readers, w.get_cached("k2"))  # the writer is whole and usable from this thread


@pytest.mark.parametrize("policy", ["fifo", "reinsert", "freq"])
def test_an_object_is_not_copied_forward_into_the_room_a_blocked_put_needs(
        name: str, policy: str) -> None:
    """The oldest object was hit (a policy that keeps hit objects would copy it forward), but
    the next one is still owed: copying it would take the only room the put can get, and the
    put would fail anyway. Every policy stores the put, as FIFO does, dropping the oldest."""
    size = 100_000
    with ObjectStore.create(name, capacity_bytes=2 * size + size // 2, n_readers=1,
                            policy=policy) as writer, ObjectStore.attach(name, reader=0) as reader:
        a = writer.put("a", np.full(size - 1024, 1, dtype=np.uint8))
        reader.get(a)
        reader.get(writer.get_cached("a"))  # hit and read: a copy-forward candidate
        writer.put("b", np.full(size - 1024, 2, dtype=np.uint8))  # handed out, not read
        c = writer.put("c", np.full(size - 1024, 3, dtype=np.uint8))  # no StoreFull
        assert not writer.is_cached("a") and writer.is_cached("b")
        assert reader.get(c)[0] == 3 and writer.stats().reinsertions == 0


def test_an_object_is_still_copied_forward_when_the_next_is_free(name: str) -> None:
    size = 100_000
    with ObjectStore.create(name, capacity_bytes=2 * size + size // 2, n_readers=1,
                            policy="freq") as writer, ObjectStore.attach(name, reader=0) as reader:
        a = writer.put("a", np.full(size - 1024, 1, dtype=np.uint8))
        reader.get(a)
        reader.get(writer.get_cached("a"))
        reader.get(writer.put("b", np.full(size - 1024, 2, dtype=np.uint8)))  # read: free
        reader.get(writer.put("c", np.full(size - 1024, 3, dtype=np.uint8)))
        assert writer.is_cached("a") and not writer.is_cached("b")  # a kept, b dropped
        assert writer.stats().reinsertions == 1


def test_discard_refuses_a_handle_of_another_key(name: str) -> None:
    """A handle whose digest names another key takes no read from the object at its address
    (get refuses it too)."""
    with ObjectStore.create(name, capacity_bytes=1 << 20, n_readers=1) as w, \
            ObjectStore.attach(name, reader=0) as r:
        h = w.put("a", np.zeros(8))
        forged = Handle(h.address, h.seq, key_digest("b"), h.epoch)
        with pytest.raises(StaleHandle, match="nothing discarded"):
            r.discard(forged)
        with pytest.raises(StaleHandle):
            r.get(forged)
        assert w.unread(h) == (1,)  # still owed to the reader
        r.discard(h)
        assert w.unread(h) == (0,)


def test_a_reader_of_a_store_made_anew_is_told_its_attachment_is_stale(name: str) -> None:
    """After a writer restart, a handle of the new store read through a reader still attached
    to the old one blames the reader's attachment (attach again), not the handle."""
    old = ObjectStore.create(name, n_readers=1, capacity_bytes=1 << 20)
    reader = ObjectStore.attach(name, reader=0)
    old.close()
    try:
        with ObjectStore.create(name, n_readers=1, capacity_bytes=1 << 20) as new:
            handle = new.put("k", b"v")
            with pytest.raises(StaleHandle, match=r"this reader is attached to an earlier "
                                                  r"incarnation .* attach again") as info:
                reader.get(handle)
            assert info.value.handle == handle
            other = ObjectStore.create(name + "-x", n_readers=1, capacity_bytes=1 << 20)
            with other, pytest.raises(StaleHandle, match="belongs to another store"):
                reader.get(other.put("k", b"v"))  # not the store's: the handle is to blame
            reader.close()
            with ObjectStore.attach(name, reader=0) as again:
                assert again.get(handle) == b"v"
    finally:
        reader.close()
