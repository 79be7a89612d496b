"""The example runs end to end, verifies every tensor, and leaves nothing in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _shm
from tests._waiting import wait_for

pytestmark = pytest.mark.alone  # what a command left in /dev/shm: see pyproject.toml

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensor_exchange_example() -> None:
    before = _shm.entries()
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tensor_exchange.py"), "--items", "40"],
        capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "reader 0: 40/40 tensors verified" in out.stdout
    assert "reader 1: 40/40 tensors verified" in out.stdout
    assert not _shm.left_since(before)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["shm-fifo", "shm-reinsert", "lru"])
def test_cache_workers_example(kind: str) -> None:
    before = _shm.entries()
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mm_cache_workers.py"), kind],
        capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pixel_values (1, 3, 336, 336)") == 12  # 6 requests x 2 ranks
    assert f"kind='{kind}', requests=6, hits=3" in out.stdout
    assert not _shm.left_since(before)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_example_cleans_up_on_signals(sig: signal.Signals) -> None:
    before = _shm.entries()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "tensor_exchange.py"), "--items", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True)  # a signal to its process group, like Ctrl-C in a terminal
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _shm.made_by(proc.pid, before):
            time.sleep(0.1)
        time.sleep(2)
        os.killpg(proc.pid, sig)
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        wait_for(lambda: not _shm.left_since(before), 30, "the example's segments to be gone")
    finally:  # failed: leave no process, and no store for the session's leak check
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/shmstore-example-{proc.pid}")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("example, lines", [
    ("queue_broadcast.py", ["reader 0: requests [0, 1, 2, 3, 4]", "reader 1: requests [0, 1, 2, 3, 4]"]),
    ("channel_send.py", ["reader 0: {'done': True}", "reader 1: {'done': True}", "writer: 1 put, 1 hit"]),
    ("writer_host.py", ["worker: image-a mean 1.0", "worker: image-b mean 2.0",
                        "worker: image-b again mean 2.0", "writer: 2 puts, 1 hit"]),
])
def test_queue_channel_and_writer_host_examples(example: str, lines: list[str]) -> None:
    """Each runs its readers (and, for the host, a second writing process) as processes of
    their own, and its docs page links to it."""
    before = _shm.entries()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True,
                         text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    for line in lines:
        assert line in out.stdout.splitlines(), (line, out.stdout)
    if example.startswith("channel"):
        assert out.stdout.count("(1, 3, 336, 336) sum 338688.0") == 4  # 2 messages x 2 readers
    assert not _shm.left_since(before)
    assert f"examples/{example}" in (ROOT / "docs" / "api.md").read_text()
