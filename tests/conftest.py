"""Shared fixtures: unique segment names, and a session check that nothing is left in /dev/shm."""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Iterator

import pytest

from shmstore.segment import MAGIC, SEGMENT_HEADER, SHM_DIR

SESSION_START_NS = time.time_ns()
NAME_PREFIX = "shmstore-test-"


def new_name(tag: str = "t") -> str:
    return f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}"


@pytest.fixture
def name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique segment name; the test must clean it up (checked at session end)."""
    yield new_name(request.node.name[:20].replace("[", "-").replace("]", "").replace("/", "-"))


def leftover_segments() -> list[str]:
    """shmstore segments made during this session (or with the test prefix) still in /dev/shm."""
    found = []
    for entry in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, entry)
        if entry.startswith(NAME_PREFIX) or entry.startswith("sem." + NAME_PREFIX):
            found.append(entry)
            continue
        try:  # only regular files: opening a FIFO someone left here would block
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            with open(path, "rb") as f:
                head = f.read(SEGMENT_HEADER.size)
        except OSError:
            continue
        if len(head) == SEGMENT_HEADER.size and head[:8] == MAGIC:
            created_ns = SEGMENT_HEADER.unpack(head)[9]
            if created_ns >= SESSION_START_NS:
                found.append(entry)
    return sorted(found)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return
    left = leftover_segments()
    if left:
        for entry in left:
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
            except OSError:
                pass
        print(f"\nFAILED: the test session left shared-memory segments behind: {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
