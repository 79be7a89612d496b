"""Shared fixtures: unique segment names, and a session check that nothing is left in /dev/shm."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator

import pytest

from shmstore._proc import pid_alive
from shmstore.shm._segment import MAGIC, SEGMENT_HEADER, SHM_DIR

# A shell starts a command it runs in the background with SIGINT ignored (nohup: SIGHUP), and
# every process the command starts inherits that: the tests that stop a program with Ctrl-C
# would see it carry on. A handler of our own is reset to the default in each program they
# start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise SIGHUP under nohup: the programs the tests kill with it must die of it
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# SHMSTORE_TEST_WITHOUT_VLLM=1: vLLM cannot be imported in this run, as where it is not
# installed (CI runs the engine-neutral core's tests so: tests/serving)
if os.environ.get("SHMSTORE_TEST_WITHOUT_VLLM") == "1":
    import sys

    sys.modules["vllm"] = None  # type: ignore[assignment]

# scripts/test.sh runs sessions beside each other (SHMSTORE_TEST_BESIDE=1: each counts only the
# segments named with its own prefix as its leaks), then one by itself that counts every
# shmstore segment of a dead writer made since the first of them began (SHMSTORE_TEST_SINCE_NS)
BESIDE = os.environ.get("SHMSTORE_TEST_BESIDE") == "1"
SESSION_START_NS = int(os.environ.get("SHMSTORE_TEST_SINCE_NS") or time.time_ns())
# One token per test session, inherited by the processes it spawns: the leak check below only
# ever removes this session's segments, never those of a run beside it.
SESSION = os.environ.setdefault("SHMSTORE_TEST_SESSION", secrets.token_hex(3))
# A writer's first create removes every dead writer's segments (the sweep): with the tests on
# two processes, one's sweep would take the dead segments another test made to look at. Off
# in the session (the tests of the sweep turn it on); `shmstore gc` and remove_stale still work
os.environ.setdefault("SHMSTORE_SWEEP", "0")
# the miss pool's default size follows the machine's cores: tests (and the servers they start)
# run without one unless they set it, so a machine with cores to spare runs the same suite
os.environ.setdefault("SHMSTORE_VLLM_POOL", "0")
NAME_PREFIX = f"shmstore-test-{SESSION}-"
# vLLM's ZMQ sockets (a file each, left in /tmp by every engine that is killed) go into one
# folder per session, removed at its end (tests/vllm/served.py gives each server its own)
if "VLLM_RPC_BASE_PATH" not in os.environ:
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix=f"vllm-rpc-{SESSION}-")
    RPC_DIR: str | None = os.environ["VLLM_RPC_BASE_PATH"]
else:
    RPC_DIR = None  # a session's worker process (xdist), or a folder chosen outside
WRITER_PID_FIELD = 7  # SEGMENT_HEADER: magic, version, kind, readers, data offset, capacity, total, pid


def new_name(tag: str = "t") -> str:
    return f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}"


@pytest.fixture
def name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique segment name; the test must clean it up (checked at session end)."""
    yield new_name(request.node.name[:20].replace("[", "-").replace("]", "").replace("/", "-"))


def leftover_segments() -> list[str]:
    """shmstore segments made during this session (or with its test prefix) still in /dev/shm.

    A segment under another name counts when it was made after the session started and its
    writer is gone (or is this process): a live writer elsewhere is another run's, not a leak.
    Beside another session (BESIDE) only the prefix counts: the other's writer may have died a
    moment ago, its tracker not done yet; the session run last by itself counts the others."""
    found = []
    for entry in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, entry)
        if entry.startswith(NAME_PREFIX) or entry.startswith("sem." + NAME_PREFIX):
            found.append(entry)
            continue
        if BESIDE:
            continue
        try:  # only regular files: opening a FIFO someone left here would block
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            with open(path, "rb") as f:
                head = f.read(SEGMENT_HEADER.size)
        except OSError:
            continue
        if len(head) == SEGMENT_HEADER.size and head[:8] == MAGIC:
            fields = SEGMENT_HEADER.unpack(head)
            writer_pid, created_ns = fields[WRITER_PID_FIELD], fields[9]
            if created_ns >= SESSION_START_NS and (writer_pid == os.getpid() or not pid_alive(writer_pid)):
                found.append(entry)
    return sorted(found)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The leak check runs after every other test, wherever its file sorts."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/test_leaks.py"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return
    if RPC_DIR is not None:
        shutil.rmtree(RPC_DIR, ignore_errors=True)
    left = leftover_segments()
    if left:
        from tests._shm import holders

        for entry in left:
            print(f"\n{holders(entry)}")
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
            except OSError:
                pass
        print(f"\nFAILED: the test session left shared-memory segments behind: {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


HANDOFFS = ["compiled", "python"]


@pytest.fixture(params=HANDOFFS)
def handoff(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Queues made in this test take the compiled hand-off or its Python twin (queue/_slots.py);
    "compiled" is skipped where _native/_atomic.c was not built (or SHMSTORE_ORDERING opts out)."""
    from shmstore.queue import _slots

    if request.param == "compiled" and _slots.COMPILED is None:
        pytest.skip("the compiled hand-off is not built here")
    monkeypatch.setattr(_slots, "SLOTS", _slots.COMPILED if request.param == "compiled"
                        else _slots.PythonSlots)
    return str(request.param)
