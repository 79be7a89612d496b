"""shmstore ls / rm / gc: list with owner and state, remove only what a dead writer left."""

from __future__ import annotations

import os
import subprocess
import sys

from tests._names import ObjectStore

from .conftest import new_name


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmstore", *args], capture_output=True,
                          text=True, timeout=60)


def leave_dead_segments(store: str, queue: str) -> None:
    code = ("import os; from shmstore import BroadcastQueue, ObjectStore; "
            f"ObjectStore.create({store!r}, capacity_bytes=1 << 20, n_readers=1); "
            f"BroadcastQueue.create({queue!r}, n_readers=2); os._exit(0)")  # dies without cleanup
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ls_rm_gc() -> None:
    dead_store, dead_queue, live = new_name("dead"), new_name("deadq"), new_name("live")
    leave_dead_segments(dead_store, dead_queue)
    assert os.path.exists(f"/dev/shm/sem.{dead_queue}.r1")
    with ObjectStore.create(live, capacity_bytes=1 << 20, n_readers=1):
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
        assert not os.path.exists(f"/dev/shm/sem.{dead_queue}.r1")
        assert os.path.exists(f"/dev/shm/{live}")  # never a live one
    assert live not in cli("ls").stdout
