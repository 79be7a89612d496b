"""The miss pool (serving/_pool.py): misses processed by worker processes straight into the store,
one processing per key in flight, and every failure an outcome the caller falls back on."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from shmstore._proc import pid_alive
from shmstore.errors import InvalidArgument
from shmstore.serving._deployment import Writers
from shmstore.serving._outcome import FALLBACKS, STORED, Processor
from shmstore.serving._pool import MissPool, default_workers
from tests._names import ObjectStore
from tests._waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
KIB = 1024
TOY = "tests.workers:toy_processor"
READY_S = 60.0  # a spawned worker imports numpy and the store: seconds on a loaded machine


STORES: dict[str, Writers] = {}  # a hosted store's writer and lock, as open_writer makes them


@contextmanager
def hosted(name: str, *, capacity_bytes: int = 1024 * KIB, max_object_bytes: int | None = None
           ) -> Iterator[Any]:
    """A store of its own (its writer and lock, as API server 0 holds them, with no store host:
    a pool's workers write through their own pipes), for the pools of this block to fill
    (STORES[name])."""
    writer = ObjectStore.create(name, capacity_bytes=capacity_bytes, n_readers=1,
                                max_object_bytes=max_object_bytes or capacity_bytes // 2)
    STORES[name] = Writers(writer, writer, lock=threading.RLock())
    try:
        yield writer
    finally:
        del STORES[name]
        writer.close()


@contextmanager
def pool_of(name: str, workers: int, gate: str = "", store: Any = None, **kw: Any
            ) -> Iterator[MissPool]:
    pool = MissPool(store or STORES[name], Processor(TOY, (gate,)), workers=workers, **kw)
    try:
        wait_for(lambda: pool.stats().ready == workers, READY_S, "the pool's workers")
        yield pool
    finally:
        pool.close()


def started(gate: str) -> list[str]:
    return sorted(f for f in os.listdir(gate) if f.startswith("started-"))


def outcome(pool: MissPool, key: str, job: dict[str, Any]) -> str:
    return pool.submit(key, job).result(timeout=READY_S)


def test_a_miss_is_stored_by_a_worker_owed_by_no_reader_and_read_as_a_hit(name: str) -> None:
    with hosted(name) as writer, pool_of(name, 1) as pool:
        payload = bytes(range(256)) * 40
        assert outcome(pool, "k1", {"bytes": payload}) == STORED
        assert writer.cached(["k1"]) == [True]
        handout = writer.hand_out_cached(["k1"])[0]
        assert handout is not None
        with ObjectStore.attach(name, reader=0) as reader:
            value = reader.get(handout.handle)
        np.testing.assert_array_equal(value["data"], np.frombuffer(payload, np.uint8) ^ 0xFF)
        assert value["pid"] in pool.worker_pids()
        # the worker's own hand-out was given back as it was published: only ours was owed
        assert writer.unread(handout.handle) == (0,)
        stats = pool.stats()
        assert (stats.submitted, stats.stored, stats.waited) == (1, 1, 0)
        assert sum(stats.fallback.values()) == 0


def test_a_worker_keeps_a_jobs_freed_buffers_for_the_next_job(name: str) -> None:
    """A photo's buffers, freed at the end of its job, are not given back to the kernel to be
    faulted in again by the next job (glibc's malloc, as the worker sets it): a fresh process
    with glibc's defaults takes about 2,000 faults a job for the same work."""
    plain = subprocess.run(
        [sys.executable, "-c", "from tests.workers import churn; print([churn() for _ in "
         "range(4)])"], capture_output=True, text=True, timeout=READY_S, check=True)
    assert min(json.loads(plain.stdout)[1:]) > 1000, plain.stdout  # what is being saved
    with hosted(name, capacity_bytes=4096 * KIB) as writer, pool_of(name, 1) as pool:
        faults = []
        with ObjectStore.attach(name, reader=0) as reader:
            for i in range(4):
                assert outcome(pool, f"c{i}", {"bytes": b"photo", "churn": True}) == STORED
                handout = writer.hand_out_cached([f"c{i}"])[0]
                assert handout is not None
                faults.append(int(reader.get(handout.handle)["faults"]))
        assert max(faults[1:]) < 100, faults  # the first job grows the heap: the rest reuse it


def test_jobs_run_at_once_up_to_the_pools_size_and_the_rest_wait_their_turn(
        name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with hosted(name) as writer, pool_of(name, 2, gate) as pool:
        futures = [pool.submit(f"k{n}", {"bytes": b"x" * 64, "hold": True, "n": n})
                   for n in range(3)]
        wait_for(lambda: len(started(gate)) == 2, READY_S, "two jobs running at once")
        stats = pool.stats()
        assert (stats.busy, stats.queued) == (2, 1)
        assert len(started(gate)) == 2  # the third waits for a worker
        open(os.path.join(gate, "open"), "w").close()
        assert [f.result(timeout=READY_S) for f in futures] == [STORED] * 3
        assert len({name.rsplit("-", 1)[1] for name in started(gate)}) == 2  # two processes
        assert writer.cached(["k0", "k1", "k2"]) == [True] * 3


def test_a_key_in_flight_is_waited_for_not_processed_again(name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with hosted(name), pool_of(name, 2, gate) as pool:
        first = pool.submit("same", {"bytes": b"y" * 64, "hold": True})
        wait_for(lambda: len(started(gate)) == 1, READY_S, "the first job")
        again = [pool.submit("same", {"bytes": b"y" * 64, "hold": True}) for _ in range(4)]
        assert all(f is first for f in again)
        open(os.path.join(gate, "open"), "w").close()
        assert first.result(timeout=READY_S) == STORED
        assert len(started(gate)) == 1
        stats = pool.stats()
        assert (stats.submitted, stats.stored, stats.waited) == (1, 1, 4)


def test_a_worker_killed_mid_item_fails_that_item_only_and_is_started_again(
        name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with hosted(name) as writer, pool_of(name, 1, gate) as pool:
        first_pid = pool.worker_pids()[0]
        assert outcome(pool, "dies", {"bytes": b"z", "die": True}) == "died"
        assert not writer.cached(["dies"])[0]
        wait_for(lambda: pool.stats().ready == 1, READY_S, "the worker started again")
        assert pool.worker_pids() != [first_pid] and not pid_alive(first_pid)
        # the key is no longer in flight: a new job for it runs
        assert outcome(pool, "dies", {"bytes": b"z"}) == STORED
        stats = pool.stats()
        assert (stats.restarts, stats.fallback["died"], stats.stored) == (1, 1, 1)
        assert writer.stats().objects == 1


def test_a_worker_killed_with_a_chunk_lent_has_it_given_back_and_nothing_published(
        name: str, tmp_path: Any) -> None:
    """A worker that dies after the dispatcher lent it a chunk (half written): the item falls
    back ("died"), nothing is published under its key, and the chunk goes back to the ring
    (three times over a store that holds two such items: the ring frees them)."""
    with hosted(name, capacity_bytes=192 * KIB, max_object_bytes=96 * KIB) as writer, \
            pool_of(name, 1, str(tmp_path)) as pool:
        for n in range(3):
            wait_for(lambda: pool.stats().ready == 1, READY_S, "a worker")
            assert outcome(pool, "half", {"bytes": b"h" * (80 * KIB), "when_lent": "die",
                                          "n": n}) == "died"
            assert writer.cached(["half"]) == [False]
        wait_for(lambda: pool.stats().ready == 1, READY_S, "a worker")
        assert outcome(pool, "half", {"bytes": b"h" * (80 * KIB)}) == STORED
        handout = writer.hand_out_cached(["half"])[0]
        assert handout is not None
        with ObjectStore.attach(name, reader=0) as reader:
            value = reader.get(handout.handle)
        assert bytes(value["data"][:4]) == bytes([ord("h") ^ 0xFF]) * 4
        assert pool.stats().fallback["died"] == 3


def test_a_second_begin_before_a_done_is_refused_and_the_lent_chunk_given_back(
        name: str) -> None:
    """A worker that asks for a chunk while one is lent to it (our own child, yet never
    trusted): the second begin is refused, the job fails, and the first chunk goes back to
    the ring unpublished; the worker takes the next job."""
    with hosted(name, capacity_bytes=192 * KIB, max_object_bytes=96 * KIB) as writer, \
            pool_of(name, 1) as pool:
        for _ in range(3):  # each leaves a lent chunk behind if it is not given back
            future = pool.submit("twice", {"bytes": b"t" * (80 * KIB), "begin_twice": True})
            assert future.result(timeout=READY_S) == "failed"
        assert writer.cached(["twice"]) == [False] and writer.stats().objects == 0
        assert outcome(pool, "twice", {"bytes": b"t" * (80 * KIB)}) == STORED
        assert pool.stats().restarts == 0 and pool.stats().fallback["failed"] == 3


def test_a_key_put_while_its_chunk_is_written_ends_stored_with_the_first_copy(
        name: str, tmp_path: Any) -> None:
    """Another writer of the node puts the key between the chunk's lending and its
    publishing: the pool's copy is given back and the job ends STORED; the store keeps the
    first copy, owed by no one."""
    gate = str(tmp_path)
    with hosted(name) as writer, pool_of(name, 1, gate) as pool:
        racing = pool.submit("race", {"bytes": b"r" * 64, "when_lent": "wait"})
        wait_for(lambda: os.path.exists(os.path.join(gate, "lent")), READY_S, "the chunk lent")
        writer.put("race", {"data": np.zeros(8, np.uint8)})
        open(os.path.join(gate, "go"), "w").close()
        assert racing.result(timeout=READY_S) == STORED
        assert writer.stats().objects == 1
        handout = writer.hand_out_cached(["race"])[0]
        assert handout is not None
        with ObjectStore.attach(name, reader=0) as reader:
            assert "pid" not in reader.get(handout.handle)  # the put's, not the worker's
        assert outcome(pool, "next", {"bytes": b"n"}) == STORED  # the worker goes on


def test_a_processor_error_a_declined_job_and_an_item_over_the_store_are_fallbacks(
        name: str) -> None:
    with hosted(name, capacity_bytes=256 * KIB, max_object_bytes=32 * KIB) as writer, \
            pool_of(name, 1) as pool:
        assert outcome(pool, "bad", {"bytes": b"", "fail": "truncated JPEG"}) == "failed"
        assert outcome(pool, "no", {"bytes": b"a", "decline": True}) == "declined"
        assert outcome(pool, "big", {"bytes": b"b" * (64 * KIB)}) == "store_full"
        assert outcome(pool, "fine", {"bytes": b"c"}) == STORED  # the worker goes on
        assert writer.cached(["bad", "no", "big", "fine"]) == [False, False, False, True]
        fallback = pool.stats().fallback
        assert (fallback["failed"], fallback["declined"], fallback["store_full"]) == (1, 1, 1)
        assert pool.stats().restarts == 0


def test_a_full_pool_and_a_starting_pool_answer_at_once(name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with hosted(name):
        pool = MissPool(STORES[name], Processor(TOY, (gate,)), workers=1, max_waiting=1)
        try:  # a spawned worker takes far longer to say ready than this call
            assert pool.submit("early", {"bytes": b"e"}).result(timeout=0) == "starting"
            wait_for(lambda: pool.stats().ready == 1, READY_S, "the worker")
            busy = pool.submit("busy", {"bytes": b"b", "hold": True})
            wait_for(lambda: len(started(gate)) == 1, READY_S, "the first job")
            queued = pool.submit("queued", {"bytes": b"q"})
            assert pool.submit("over", {"bytes": b"o"}).result(timeout=0) == "full"
            open(os.path.join(gate, "open"), "w").close()
            assert (busy.result(READY_S), queued.result(READY_S)) == (STORED, STORED)
            fallback = pool.stats().fallback
            assert (fallback["starting"], fallback["full"]) == (1, 1)
        finally:
            pool.close()


def test_a_processor_that_cannot_be_built_makes_every_miss_fall_back(name: str) -> None:
    with hosted(name):
        with MissPool(STORES[name], Processor("tests.workers:broken_processor"), workers=2) as pool:
            wait_for(lambda: pool.broken != "", READY_S, "the pool to give up")
            assert "no such model: tiny-missing" in pool.broken
            assert pool.submit("k", {"bytes": b"k"}).result(timeout=0) == "unavailable"
            wait_for(lambda: pool.stats().workers == 0, READY_S, "the workers to exit")
            assert pool.stats().restarts == 0


def test_close_ends_running_jobs_and_leaves_no_process(name: str, tmp_path: Any) -> None:
    gate = str(tmp_path)
    with hosted(name):
        pool = MissPool(STORES[name], Processor(TOY, (gate,)), workers=2)
        wait_for(lambda: pool.stats().ready == 2, READY_S, "the workers")
        pids = pool.worker_pids()
        running = pool.submit("held", {"bytes": b"h", "hold": True})
        pool.close()
        pool.close()
        assert running.result(timeout=0) == "closed"
        assert not any(pid_alive(pid) for pid in pids)
        assert pool.submit("after", {"bytes": b"a"}).result(timeout=0) == "closed"


def test_a_job_that_is_not_msgpack_data_is_refused_with_what_to_do(name: str) -> None:
    with hosted(name), pool_of(name, 1) as pool:
        with pytest.raises(InvalidArgument, match="msgpack data"):
            pool.submit("k", {"bytes": object()})
        assert outcome(pool, "k", {"bytes": b"ok"}) == STORED  # not left in flight
        with pytest.raises(InvalidArgument, match="at least 1 worker"):
            MissPool(STORES[name], Processor(TOY), workers=0)


def _owner(name: str, gate: str, pids: Any) -> None:
    """A pool's owner that runs until killed; with a `gate`, its worker is inside a job that
    never ends then (a stuck processor)."""
    with hosted(name):
        pool = MissPool(STORES[name], Processor(TOY, (gate,)), workers=2)
        wait_for(lambda: pool.stats().ready == 2, READY_S, "the workers")
        if gate:
            pool.submit("held", {"bytes": b"h", "hold": True})
            wait_for(lambda: len(started(gate)) == 1, READY_S, "the held job")
        pids.put(pool.worker_pids())
        threading.Event().wait()  # until killed


@pytest.mark.parametrize("inside_a_job", [False, True])
def test_workers_exit_when_the_process_that_owns_the_pool_is_killed(
        name: str, tmp_path: Any, inside_a_job: bool) -> None:
    """Idle workers see their pipe close; one inside a job that never ends goes too, without
    reading its pipe (the kernel's parent-death signal: it once outlived its owner)."""
    gate = str(tmp_path) if inside_a_job else ""
    ctx = multiprocessing.get_context("spawn")
    pids: Any = ctx.Queue()
    owner = ctx.Process(target=_owner, args=(name, gate, pids))
    owner.start()
    try:
        workers = pids.get(timeout=READY_S)
        owner.kill()
        owner.join(READY_S)
        wait_for(lambda: not any(pid_alive(pid) for pid in workers), READY_S,
                 "the workers to die with their owner")
    finally:
        if gate:
            open(os.path.join(gate, "open"), "w").close()
        if owner.is_alive():
            owner.kill()
        owner.join()


def test_the_default_size_is_the_cores_the_server_leaves_free() -> None:
    # (cores, taken by API servers, engines and workers) -> workers
    cases = {(2, 4): 0, (4, 3): 0, (8, 4): 4, (16, 4): 8, (64, 10): 8, (5, 3): 2}
    assert {k: default_workers(cores=k[0], taken=k[1]) for k in cases} == cases
    assert default_workers(taken=0) == min(8, len(os.sched_getaffinity(0))) or \
        len(os.sched_getaffinity(0)) < 2
    assert "died" in FALLBACKS and STORED not in FALLBACKS


class Answering(Writers):
    """A store whose "stored?" answer is the test's (`answer`), the rest the real one's."""

    answer: Any = None

    def stored(self, key: str) -> bool:
        return bool(self.answer(key))


def answering(name: str, answer: Any) -> Answering:
    real = STORES[name]
    store = Answering(real.store, real.local, lock=real.lock)
    store.answer = answer
    return store


def test_a_key_stored_meanwhile_is_not_processed_again(name: str, tmp_path: Any) -> None:
    """Sent though another process stored it (the owner's "stored?" could not be had at once:
    its lock was held): the worker processes it, and the chunk it asks for is refused with
    STORED, the store keeping its first copy."""
    gate = str(tmp_path)
    with hosted(name) as writer, pool_of(name, 1, gate,
                                        store=answering(name, lambda key: False)) as pool:
        writer.put("pre", {"data": np.zeros(8, np.uint8)})
        assert outcome(pool, "pre", {"bytes": b"p", "n": 1}) == STORED
        assert outcome(pool, "new", {"bytes": b"n", "n": 2}) == STORED
        stats = pool.stats()
        assert (stats.submitted, stats.processed, stats.stored) == (2, 2, 2)
        assert writer.stats().objects == 2
        handout = writer.hand_out_cached(["pre"])[0]
        assert handout is not None
        with ObjectStore.attach(name, reader=0) as reader:
            assert "pid" not in reader.get(handout.handle)  # the first copy, not the worker's


def test_the_owners_stored_answer_is_asked_before_a_job_goes_to_a_worker_and_kept(
        name: str, tmp_path: Any) -> None:
    """The pool asks the writer in its own process "stored?" just before a job goes to a
    worker. Shown with an answer that lies both ways: a key it calls stored ends STORED with
    no worker run, and a key it calls new though stored is processed and ends STORED when the
    store refuses the second copy; an answer that fails is taken as "new"."""
    from shmstore.errors import SegmentClosed

    gate = str(tmp_path)
    asked: list[str] = []

    def stored(key: str) -> bool:
        asked.append(key)
        if key == "failing":
            raise SegmentClosed("the store is closing")
        return key == "lie"

    with hosted(name) as writer, pool_of(name, 1, gate, store=answering(name, stored)) as pool:
        writer.put("pre", {"data": np.zeros(8, np.uint8)})
        assert outcome(pool, "lie", {"bytes": b"l", "n": 1}) == STORED
        assert outcome(pool, "pre", {"bytes": b"p", "n": 2}) == STORED
        assert outcome(pool, "failing", {"bytes": b"f", "n": 3}) == STORED
        assert asked == ["lie", "pre", "failing"]
        assert writer.cached(["lie", "pre", "failing"]) == [False, True, True]
        ran = {f.split("-")[1] for f in started(gate)}
        assert ran == {"2", "3"}  # "lie" never reached a worker; "pre" did: nobody asked
        stats = pool.stats()
        assert (stats.submitted, stats.processed, stats.stored) == (3, 2, 3)


def test_a_hung_worker_never_blocks_the_pool(name: str) -> None:
    """A worker that stops answering (SIGSTOP: a library stuck in a loop) while a job larger
    than its pipe's buffer is sent to it: submit and stats still answer (jobs go through a
    sender thread per worker, never the dispatcher); once it is killed its item falls back
    ("died") and a new worker takes the queued job."""
    import signal

    with hosted(name, capacity_bytes=8 * 1024 * KIB) as writer, pool_of(name, 1) as pool:
        (pid,) = pool.worker_pids()
        os.kill(pid, signal.SIGSTOP)
        try:
            stuck = pool.submit("stuck", {"bytes": b"s" * (2 * 1024 * KIB)})
            wait_for(lambda: pool.stats().busy == 1, READY_S, "the job sent to the worker")
            queued = pool.submit("next", {"bytes": b"n"})
            assert pool.stats().queued == 1 and not stuck.done()
        finally:
            os.kill(pid, signal.SIGKILL)
        assert stuck.result(READY_S) == "died"
        assert queued.result(READY_S) == STORED
        assert pool.stats().restarts == 1
        assert writer.cached(["stuck", "next"]) == [False, True]


@pytest.mark.parametrize("job_bytes", [100, 2 * 1024 * KIB], ids=["small", "over-the-buffer"])
def test_a_stopped_worker_with_a_job_never_holds_up_the_other_workers(
        name: str, job_bytes: int) -> None:
    """A small job is written by the dispatcher itself (into the idle worker's empty socket),
    a larger one by the worker's sender thread: either way, a worker that stopped (SIGSTOP)
    before reading its job never stops the dispatcher, and the other worker takes the next
    job. With every frame written by the dispatcher, the large case hangs here."""
    import signal

    with hosted(name, capacity_bytes=8 * 1024 * KIB), pool_of(name, 2) as pool:
        stopped, _ = pool.worker_pids()  # the first job goes to the first ready, idle worker
        os.kill(stopped, signal.SIGSTOP)
        try:
            stuck = pool.submit("stuck", {"bytes": b"s" * job_bytes})
            wait_for(lambda: pool.stats().busy == 1, READY_S, "the job sent to the worker")
            assert outcome(pool, "next", {"bytes": b"n"}) == STORED
        finally:
            os.kill(stopped, signal.SIGKILL)
        assert stuck.result(READY_S) == "died"


def test_a_job_over_the_time_limit_stops_its_worker_and_falls_back(
        name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmstore.serving import _crew

    monkeypatch.setattr(_crew, "JOB_TIMEOUT_S", 0.5)
    with hosted(name), pool_of(name, 1, str(tmp_path)) as pool:
        (pid,) = pool.worker_pids()
        assert outcome(pool, "forever", {"bytes": b"f", "hold": True}) == "died"
        wait_for(lambda: not pid_alive(pid), READY_S, "the stuck worker to be gone")
        assert pool.stats().restarts == 1


def test_a_pool_made_on_a_thread_that_ends_keeps_its_workers(name: str) -> None:
    """Workers die with the thread that started them: the dispatcher starts them all, so a
    pool built on a short-lived thread (an executor's) keeps working after it ends."""
    made: list[MissPool] = []
    with hosted(name):
        maker = threading.Thread(target=lambda: made.append(MissPool(STORES[name], Processor(TOY),
                                                                     workers=1)))
        maker.start()
        maker.join()
        with made[0] as pool:
            wait_for(lambda: pool.stats().ready == 1, READY_S, "the worker")
            assert outcome(pool, "k", {"bytes": b"k"}) == STORED
            assert pool.stats().restarts == 0


def test_stopping_a_worker_whose_helper_holds_its_pipes_never_holds_up_the_pool(
        name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker over the time limit is killed, but a helper its processor forked still holds
    the worker's pipe (the sentinel join would wait on): its item falls back at once and the
    pool answers, whatever STOP_TIMEOUT_S is (the reap polls waitpid, outside the lock)."""
    import signal

    from shmstore.serving import _crew

    monkeypatch.setattr(_crew, "JOB_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_crew, "STOP_TIMEOUT_S", 600.0)
    gate = str(tmp_path)
    with hosted(name), pool_of(name, 1, gate) as pool:
        try:
            stuck = pool.submit("stuck", {"bytes": b"s", "hold": True, "helper": True})
            assert stuck.result(READY_S) == "died"
            wait_for(lambda: pool.stats().ready == 1, READY_S, "the new worker")
            assert outcome(pool, "next", {"bytes": b"n"}) == STORED
        finally:
            for f in os.listdir(gate):
                if f.startswith("helper-"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(f.split("-")[1]), signal.SIGKILL)


def test_an_idle_worker_that_dies_unseen_is_replaced_before_a_job_goes_to_it(
        name: str, tmp_path: Any) -> None:
    """A worker whose processor forked a helper (which holds the worker's socket and
    sentinel: neither says it died) is killed while idle: the dispatcher's sweep (waitpid
    on every worker each SWEEP_S, idle or not) replaces it with no job sent to it, so the
    next job is stored, never lost to a dead worker."""
    import signal

    gate = str(tmp_path)
    with hosted(name), pool_of(name, 1, gate) as pool:
        (pid,) = pool.worker_pids()
        try:
            assert outcome(pool, "with-helper", {"bytes": b"h", "helper": True}) == STORED
            wait_for(lambda: any(f.startswith("helper-") for f in os.listdir(gate)), READY_S,
                     "the helper")
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: pool.stats().restarts == 1 and pool.stats().ready == 1, READY_S,
                     "the dead idle worker replaced")
            assert outcome(pool, "next", {"bytes": b"n"}) == STORED
            assert pool.stats().fallback["died"] == 0
        finally:
            for f in os.listdir(gate):
                if f.startswith("helper-"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(f.split("-")[1]), signal.SIGKILL)


def test_a_job_a_worker_could_not_read_is_refused_where_it_is_submitted(name: str) -> None:
    """msgpack packs a map with int keys, but a worker reads maps with str keys only: such a
    job is refused at submit (it once killed the worker it reached)."""
    with hosted(name), pool_of(name, 1) as pool:
        (pid,) = pool.worker_pids()
        with pytest.raises(InvalidArgument, match="map keys must be str"):
            pool.submit("k", {"bytes": b"k", "kwargs": {1: "one"}})
        with pytest.raises(InvalidArgument, match="nests deeper"):
            deep: Any = b"x"
            for _ in range(40):
                deep = [deep]
            pool.submit("k", {"bytes": deep})
        assert outcome(pool, "k", {"bytes": b"ok"}) == STORED
        assert pool.worker_pids() == [pid] and pool.stats().restarts == 0


def test_a_workers_pipe_is_closed_only_once_its_sender_stopped_writing() -> None:
    """Closed under a send in progress, the pipe's descriptor could be reused by the
    replacement's new pipe and get the rest of the dead worker's job (seen once in CI: the
    replacement waited for ever on a message that never ended). release() leaves the close
    to the sender thread until its send is over."""
    import types

    from shmstore.serving._crew import Worker

    ours, theirs = multiprocessing.Pipe(duplex=True)
    worker = Worker(types.SimpleNamespace(pid=0), ours, None)
    try:
        worker.outbox.put(b"x" * (4 * 1024 * KIB))  # more than the pipe holds: the send blocks
        wait_for(lambda: theirs.poll(), READY_S, "the send to start")
        worker.release()
        assert not ours.closed  # the sender is still writing into it
        assert len(theirs.recv_bytes()) == 4 * 1024 * KIB  # the send ends
        wait_for(lambda: ours.closed, READY_S, "the sender to close the pipe")
    finally:
        theirs.close()


def test_what_a_worker_said_before_it_ended_is_read_whole_and_never_waited_for() -> None:
    """A worker that ended (its sentinel readable) may have left messages in its socket: the
    dispatcher reads all of them, then stops at the socket's end without waiting."""
    import types

    import msgpack

    from shmstore.serving._crew import Crew, Worker

    ours, theirs = multiprocessing.Pipe(duplex=True)
    worker = Worker(types.SimpleNamespace(pid=0), ours, None)
    try:
        theirs.send_bytes(msgpack.packb(["ready"]))
        theirs.send_bytes(msgpack.packb(["done", "stored", ""]))
        theirs.close()
        assert Crew.drain(worker) == [["ready"], ["done", "stored", ""]]
        assert Crew.drain(worker) == []  # at its end: nothing, at once
    finally:
        worker.release()
