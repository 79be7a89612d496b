"""shmstore ls / rm / gc: list with owner and state, remove only what a dead writer left."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._names import ObjectStore
from tests.conftest import new_name

pytestmark = pytest.mark.alone  # ls, rm and gc see (and gc removes) every dead writer's segments


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmstore", *args], capture_output=True,
                          text=True, timeout=60)


def leave_dead_segments(store: str, queue: str) -> None:
    code = ("import os; from shmstore import BroadcastQueue, ObjectStore; "
            f"ObjectStore.create({store!r}, capacity_bytes=1 << 20, n_readers=1); "
            f"BroadcastQueue.create({queue!r}, n_readers=2); os._exit(0)")  # dies without cleanup
    # the tracker off: as if it was killed together with its writer (gc's case)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "SHMSTORE_TRACKER": "0"})


def test_ls_rm_gc() -> None:
    dead_store, dead_queue, live = new_name("dead"), new_name("deadq"), new_name("live")
    with ObjectStore.create(live, capacity_bytes=1 << 20, n_readers=1):
        # made after this process's first create, whose sweep would have removed them
        leave_dead_segments(dead_store, dead_queue)
        assert os.path.exists(f"/dev/shm/sem.{dead_queue}@r1")
        listing = cli("ls").stdout
        rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
        assert "dead" in rows[dead_store] and "object store" in rows[dead_store]
        assert "broadcast queue" in rows[dead_queue]
        assert f"{os.getpid()}" in rows[live] and "alive" in rows[live]

        refused = cli("rm", live)
        assert refused.returncode == 1 and "is alive" in refused.stdout
        assert os.path.exists(f"/dev/shm/{live}")

        removed = cli("rm", dead_store)
        assert removed.returncode == 0 and "removed (1.0 MiB)" in removed.stdout
        assert cli("rm", dead_store).returncode == 1  # gone already

        gc = cli("gc")
        assert f"{dead_queue}: removed" in gc.stdout and "3 semaphores" in gc.stdout
        assert not os.path.exists(f"/dev/shm/{dead_queue}")
        assert not os.path.exists(f"/dev/shm/sem.{dead_queue}@r1")
        assert os.path.exists(f"/dev/shm/{live}")  # never a live one
    assert live not in cli("ls").stdout


def test_a_fifo_in_dev_shm_blocks_nothing_and_is_never_taken_for_a_segment() -> None:
    """Any user can make a FIFO in /dev/shm; opening it to read would block for ever."""
    import pytest

    from tests._names import SegmentExists

    fifo = new_name("fifo")
    path = f"/dev/shm/{fifo}"
    os.mkfifo(path)
    try:
        for args in (("ls",), ("rm", fifo), ("gc",)):
            done = cli(*args)  # each within the 60 s timeout, or it raises
            assert "Traceback" not in done.stderr, (args, done.stderr)
        assert fifo not in cli("ls").stdout
        assert "no shmstore segment" in cli("rm", fifo).stdout
        with pytest.raises(SegmentExists, match="not a shared-memory object") as info:
            ObjectStore.create(fifo, capacity_bytes=1 << 20, n_readers=1)
        assert info.value.name == fifo
        assert os.path.exists(path)  # not ours: left where it was
    finally:
        os.unlink(path)


def test_relay_options_of_zero_are_refused_not_replaced_by_defaults() -> None:
    serve = ("relay", "serve", new_name("nochan"), "--reader", "0", "--bind",
             "tcp://127.0.0.1:1")
    for option, named in (("--window", "window"), ("--peer-timeout", "peer_timeout_s"),
                          ("--heartbeat", "heartbeat_s")):
        done = cli(*serve, option, "0")
        assert done.returncode == 2 and named in done.stderr, (option, done.stderr)
    done = cli("relay", "connect", "tcp://127.0.0.1:1", "--name", new_name("x"), "--readers", "1",
               "--peer-timeout", "0")
    assert done.returncode == 2 and "peer_timeout_s" in done.stderr, done.stderr


def test_rm_of_a_segment_whose_writer_lives_after_all_removes_nothing_and_says_why(
        monkeypatch) -> None:
    """rm read a dead writer, but by the time it removes, a live writer owns the name: it
    removes neither the segment nor the queue's semaphores, and says so (no traceback)."""
    import dataclasses

    from shmstore import BroadcastQueue
    from shmstore.cli import _commands

    name = new_name("rmrace")
    with BroadcastQueue.create(name, n_readers=1, n_slots=4) as q:
        real = _commands.list_segments
        monkeypatch.setattr(_commands, "list_segments", lambda: [
            dataclasses.replace(i, writer_alive=False) for i in real() if i.name == name])
        removed, message = _commands.remove(name)
        assert not removed and "not removed" in message and "live writer" in message
        assert _commands.cmd_rm([name]) == 1
        with BroadcastQueue.attach(name, 0) as r:  # segment and semaphores intact
            q.put({"x": 1})
            assert r.get(timeout=5) == {"x": 1}


def test_version_is_the_packages() -> None:
    import shmstore
    from shmstore._native import ORDERING

    done = cli("--version")
    assert done.returncode == 0 and done.stdout.startswith(f"shmstore {shmstore.__version__} (")
    if ORDERING == "compiled":  # CI's machines have a compiler: the module is built there
        assert done.stdout.strip().endswith("(compiled words and queue hand-off)")


def test_version_says_when_the_python_twins_run(monkeypatch) -> None:
    monkeypatch.setenv("SHMSTORE_ORDERING", "plain")
    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip().endswith(
        "(Python twins, plain ordering: SHMSTORE_ORDERING)")
