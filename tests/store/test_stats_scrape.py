"""stats() counts what each reader owes without walking every object, and its numbers equal a
full recount (Space.recount, the walk stats() made before) after any traffic: random puts,
hits, reads, discards, give-backs, narrowing, ended hand-outs, withdrawals, clears, reserves,
readers that close and attach again, a reader index never attached, and a scrape thread
running while the writer works."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest

from shmstore import Blank, ObjectStore
from shmstore.errors import ShmStoreError, StaleHandle


def _recount(writer: Any) -> tuple[list[int], int]:
    return writer._space.recount()


def _check(writer: Any) -> None:
    stats = writer.stats()
    lag, objects = _recount(writer)
    assert (list(stats.reader_lag), stats.objects) == (lag, objects)


class Traffic:
    """One writer, three reader indexes in this process, and a record of what was handed out."""

    def __init__(self, name: str, seed: int, attach: tuple[int, ...] = (0, 1, 2)) -> None:
        self.rng = random.Random(seed)
        self.writer = ObjectStore.create(name, n_readers=3, capacity_bytes=256 << 10,
                                         policy=self.rng.choice(["fifo", "adaptive", "recency"]))
        self.name = name
        self.readers: dict[int, Any] = {r: ObjectStore.attach(name, reader=r) for r in attach}
        self.handles: list[Any] = []  # (handle, number) of hand-outs made
        self.keys = 0

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.writer.close()

    def step(self) -> None:
        rng, writer = self.rng, self.writer
        op = rng.choice(["put", "put", "hit", "read", "read", "discard", "give_back", "narrow",
                         "end", "withdraw", "again", "reserve", "clear", "reattach"])
        try:
            if op == "put":
                self.keys += 1
                h = writer.put(f"k{self.keys}", {"a": np.full(rng.randint(1, 3000), 7, np.uint8)})
                self.handles.append((h, writer._handouts.seq))
            elif op == "hit" and self.keys:
                h = writer.get_cached(f"k{rng.randint(1, self.keys)}")
                self.handles.append((h, writer._handouts.seq))
            elif op in ("read", "discard") and self.handles and self.readers:
                h, _ = rng.choice(self.handles)
                reader = self.readers[rng.choice(list(self.readers))]
                if op == "read":
                    reader.get(h)
                else:
                    reader.discard(h)
            elif op == "give_back" and self.handles:
                writer.give_back(*self.handles.pop(rng.randrange(len(self.handles))))
            elif op == "narrow" and self.handles:
                h, n = rng.choice(self.handles)
                writer.narrow(h, n, rng.sample(range(3), rng.randint(1, 2)))
            elif op == "end" and self.handles:
                h, n = rng.choice(self.handles)
                writer.end_handouts([(h, [n])])
            elif op == "withdraw" and self.handles:
                writer.withdraw(rng.choice(self.handles)[0])
            elif op == "again" and self.handles:
                writer.hand_out_again(rng.choice(self.handles)[0])
            elif op == "reserve":
                self.keys += 1
                with writer.reserve(f"k{self.keys}", {"a": Blank((rng.randint(1, 2000),),
                                                                 "uint8")}) as r:
                    r.arrays["a"][:] = 3
                    if rng.random() < 0.2:
                        raise KeyError("the block fails: nothing stored")
                self.handles.append((r.handle, writer._handouts.seq))
            elif op == "clear" and rng.random() < 0.2:
                writer.clear(keep_handed_out=rng.random() < 0.5)
            elif op == "reattach" and self.readers:
                r = rng.choice(list(self.readers))
                self.readers.pop(r).close()
                self.readers[r] = ObjectStore.attach(self.name, reader=r)
        except KeyError:
            pass
        except (StaleHandle, ShmStoreError):
            pass  # a handle gone, a full store: what traffic meets; the counts must still agree


@pytest.mark.parametrize("seed", range(6))
def test_stats_equal_a_full_recount_after_random_traffic(name: str, seed: int) -> None:
    traffic = Traffic(name, seed)
    try:
        for i in range(400):
            traffic.step()
            if i % 7 == 0:
                _check(traffic.writer)
        _check(traffic.writer)
        assert traffic.writer.stats().objects > 0
    finally:
        traffic.close()


def test_a_reader_never_attached_owes_everything_and_then_only_what_comes_after(
        name: str) -> None:
    traffic = Traffic(name, 11, attach=(0, 1))
    try:
        h = traffic.writer.put("first", {"a": np.zeros(10, np.uint8)})
        traffic.readers[0].get(h)
        traffic.readers[1].get(h)
        assert traffic.writer.stats().reader_lag == (0, 0, 1)  # reader 2 owes it, unattached
        for _ in range(150):
            traffic.step()
            _check(traffic.writer)
        traffic.readers[2] = ObjectStore.attach(name, reader=2)
        for _ in range(150):
            traffic.step()
            _check(traffic.writer)
    finally:
        traffic.close()


def test_a_scrape_thread_beside_the_writer_never_loses_an_unread_hand_out(name: str) -> None:
    """Scrapes race with hand-outs; once the writer stops, a scrape equals the recount."""
    traffic = Traffic(name, 5)
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        while not stop.is_set():
            try:
                traffic.writer.stats()
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for _ in range(1500):
            traffic.step()
    finally:
        stop.set()
        thread.join(timeout=30)
    try:
        assert not errors, errors
        _check(traffic.writer)
    finally:
        traffic.close()


class Looks:
    """Counts the objects a scrape works out what readers owe on (ReaderLedger.owed calls)."""

    def __init__(self, writer: Any, monkeypatch: pytest.MonkeyPatch,
                 inside: Any = None) -> None:
        self.calls = 0
        ledger = writer._space.ledger
        original = ledger.owed

        def owed(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if inside is not None:
                inside(self.calls)
            return original(*args, **kwargs)
        monkeypatch.setattr(ledger, "owed", owed)

    def __call__(self, writer: Any) -> tuple[tuple[int, ...], int]:
        """stats() (checked against the full walk), and the objects it looked at."""
        before = self.calls
        stats = writer.stats()
        looked = self.calls - before
        assert (list(stats.reader_lag), stats.objects) == _recount(writer)
        return stats.reader_lag, looked


def test_a_scrape_looks_only_at_what_changed_whatever_the_readers_owe(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 objects owed by a reader that stopped and by one never attached: after the first
    scrape, one looks at nothing when nothing changed, at each object handed out or given back
    since, and, for a reader that read since, at what that reader owes."""
    n = 20_000
    writer = ObjectStore.create(name, n_readers=3, capacity_bytes=64 << 20)
    keeps_up, stopped = (ObjectStore.attach(name, reader=r) for r in range(2))
    try:
        handles = [writer.put(f"k{i}", b"x") for i in range(n)]
        for h in handles:
            keeps_up.get(h)
        stopped.get(handles[0])
        looks = Looks(writer, monkeypatch)
        assert looks(writer)[0] == (0, n - 1, n)  # the first walks every object once
        assert looks(writer) == ((0, n - 1, n), 0)  # nothing changed: nothing looked at
        again = [writer.get_cached(f"k{i}") for i in range(5)]
        assert looks(writer) == ((5, n + 4, n + 5), 5)  # the five handed out again
        writer.give_back(again[-1])  # from now on each scrape looks at it once more (Index.last)
        assert looks(writer) == ((4, n + 3, n + 4), 1)
        for h in again[:4]:
            keeps_up.get(h)
        assert looks(writer) == ((0, n + 3, n + 4), 4 + 1)  # what the reader that read owed
        stopped.get(handles[1])  # a lagging reader that reads: the n objects it owes on, once
        assert looks(writer) == ((0, n + 2, n + 4), n + 1)
        assert looks(writer) == ((0, n + 2, n + 4), 1)
    finally:
        keeps_up.close()
        stopped.close()
        writer.close()


def test_marks_stay_as_few_as_the_live_objects_when_nobody_scrapes(name: str) -> None:
    """Puts that evict all the time, no stats(): what the writer marks for a scrape is bounded
    by the live objects (a dropped object nobody scraped leaves no mark)."""
    with ObjectStore.create(name, n_readers=1, capacity_bytes=64 << 10) as writer, \
            ObjectStore.attach(name, reader=0) as reader:
        for i in range(5_000):
            writer.give_back(writer.put(f"k{i}", b"x" * 500))
        index = writer._index
        assert len(index.changed) <= len(index.by_seq) and not index.kept
        owed = [writer.put(f"owed{i}", b"x" * 500) for i in range(3)]
        assert writer.stats().reader_lag == (3,) and len(index.kept) == 3
        for h in owed:
            reader.get(h)
        for i in range(5_000, 10_000):
            writer.give_back(writer.put(f"k{i}", b"x" * 500))
        assert len(index.changed) <= len(index.by_seq) + 3  # and the kept ones, let go
        _check(writer)
        assert not index.kept and not index.changed


def test_a_scrape_inside_a_scrape_and_one_cut_short_stay_exact(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler's stats() while the same thread is inside one walks every object
    without touching what the outer keeps; a scrape an exception cuts short leaves the next
    to walk every object again."""
    traffic = Traffic(name, 3)
    try:
        for _ in range(200):
            traffic.step()
        inner: list[Any] = []

        def nested(calls: int) -> None:
            if calls == 2 and not inner:
                inner.append(traffic.writer.stats())
                assert (list(inner[0].reader_lag), inner[0].objects) == _recount(traffic.writer)
        looks = Looks(traffic.writer, monkeypatch, nested)
        writer = traffic.writer
        writer._space.scrape._valid = False  # the next call walks (and meets the handler)
        looks(writer)
        assert inner
        for _ in range(100):
            traffic.step()
            looks(writer)

        armed = [False]

        def interrupt(calls: int) -> None:
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
        monkeypatch.undo()
        Looks(writer, monkeypatch, interrupt)
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            for _ in range(200):  # until a scrape looks at something, and is cut there
                traffic.step()
                writer.stats()
        assert not writer._space.scrape._valid
        _check(writer)
        for _ in range(100):
            traffic.step()
            _check(writer)
    finally:
        traffic.close()


def test_narrowing_a_read_hand_out_to_more_readers_shows_in_the_next_scrape(name: str) -> None:
    """A scrape that found a narrowed hand-out read by its one reader unlists the entry; a
    later narrow to more readers makes it owed again, and the next scrape must say so (it
    said (0, 0) while unread() and a put's wait said (0, 1))."""
    with ObjectStore.create(name, n_readers=2, capacity_bytes=64 << 10) as writer, \
            ObjectStore.attach(name, reader=0) as reader, \
            ObjectStore.attach(name, reader=1):  # attached: no recount for a reader never seen
        handle = writer.put("k", b"x" * 100)
        number = writer._handouts.seq
        writer.narrow(handle, number, [0])
        reader.get(handle)
        assert writer.stats().reader_lag == (0, 0)  # read: unlisted
        writer.narrow(handle, number, [0, 1])
        assert writer.unread(handle) == (0, 1)
        assert writer.stats().reader_lag == (0, 1)
        _check(writer)


def test_a_scrape_run_in_the_writers_thread_between_a_mark_and_its_change_stays_exact(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler (here a hook on Index.handed_out's return) runs stats() in the writer's own
    thread after a hand-out's entry is marked and before the hand-out is recorded: it must not
    take the mark, or reader_lag stays short of the walk until the object changes again."""
    with ObjectStore.create(name, n_readers=2, capacity_bytes=1 << 16) as writer:
        writer.put("a", {"x": np.zeros(8, np.uint8)})
        _check(writer)  # the first scrape's walk is behind us: the next looks at marks only
        index_type = type(writer._space.index)
        original = index_type.handed_out
        scraped = []

        def handed_out(index: Any, entry: Any) -> None:
            original(index, entry)
            if not scraped:  # the handler, between the mark and the change
                scraped.append(writer.stats().reader_lag)
        monkeypatch.setattr(index_type, "handed_out", handed_out)
        writer.get_cached("a")
        assert scraped == [(1, 1)]  # what the readers owed then: the change was not made yet
        _check(writer)  # and once it is: (2, 2), as the walk says
        assert writer.stats().reader_lag == (2, 2)
