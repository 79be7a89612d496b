"""Segments are owner-only unless asked otherwise; another user's attach fails clearly."""

from __future__ import annotations

import os
import stat

import pytest

from shmstore.shm._segment import SHM_DIR
from tests._names import ObjectStore

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def attach_as_nobody(name: str) -> str:
    """Fork, become user nobody, attach; return what the child saw. (The interpreter's files
    may not be readable by nobody, so the child reuses this process's imported modules.)"""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            ObjectStore.attach(name, reader=0).close()
            result = "attached"
        except BaseException as exc:
            result = f"{type(exc).__name__}: {exc}"
        os.write(write_end, result.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        result = f.read().decode()
    os.waitpid(pid, 0)
    return result


def test_default_mode_is_owner_only(name: str) -> None:
    with ObjectStore.create(name, capacity_bytes=4096, n_readers=1):
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o600


@needs_root
def test_another_user_cannot_attach_an_owner_only_store(name: str) -> None:
    with ObjectStore.create(name, capacity_bytes=4096, n_readers=1):
        result = attach_as_nobody(name)
    assert result.startswith("SegmentPermissionError") and "another user" in result


@needs_root
def test_a_wider_mode_lets_another_user_attach(name: str) -> None:
    with ObjectStore.create(name, capacity_bytes=4096, n_readers=1, mode=0o666):
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o666
        result = attach_as_nobody(name)
    assert result == "attached"
