"""A writer whose process exits without close(), normally or on an uncaught exception, leaves
nothing in /dev/shm; a forked child never unlinks its parent's names; a name another writer
took over is left alone; SIGKILL still leaves the segment, which `Segment.remove_stale` (as
`shmstore gc` and the next create do) reclaims. Each writer runs in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._names import Segment

pytestmark = pytest.mark.timeout(120)
SHM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[2]
MAKE = {  # how a script makes a writer of each kind under NAME
    "store": "from shmstore import ObjectStore\n"
             "w = ObjectStore.create(NAME, capacity_bytes=1 << 20, n_readers=1)\n"
             "w.put('k', b'v' * 100)",
    "queue": "from shmstore import BroadcastQueue\n"
             "w = BroadcastQueue.create(NAME, n_readers=2)",
    "channel": "from shmstore import Channel\n"
               "w = Channel.create(NAME, n_readers=1, capacity_bytes=1 << 20)",
}
ENDINGS = {
    "returns": "",
    "raises": "raise RuntimeError('an uncaught exception')",
    "sys.exit": "sys.exit(3)",
}


def left(name: str) -> list[str]:
    """What of `name` is in /dev/shm: segments and semaphores."""
    return sorted(p.name for p in SHM.iterdir() if name in p.name)


def run(name: str, body: str) -> subprocess.CompletedProcess[str]:
    script = f"import os, sys, time\nNAME = {name!r}\n{textwrap.dedent(body)}\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("kind", list(MAKE))
def test_a_writer_that_exits_without_close_leaves_nothing(name: str, kind: str,
                                                           ending: str) -> None:
    done = run(name, f"{MAKE[kind]}\nassert os.path.exists('/dev/shm/' + NAME + "
                     f"('.store' if {kind!r} == 'channel' else ''))\n{ENDINGS[ending]}")
    assert done.returncode == {"returns": 0, "raises": 1, "sys.exit": 3}[ending], done.stderr
    assert left(name) == []


def test_a_forked_child_never_unlinks_its_parents_names(name: str) -> None:
    done = run(name, f"""
        {MAKE['store'].replace(chr(10), chr(10) + '        ')}
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the child's exit handlers run: the parent's store must stay
        os.waitpid(pid, 0)
        assert os.path.exists('/dev/shm/' + NAME), 'the child unlinked it'
        print(w.get_cached('k').seq)
    """)
    assert done.returncode == 0, done.stderr
    assert left(name) == []  # and the parent's own exit unlinked it


def test_a_name_another_writer_took_over_is_left_alone(name: str) -> None:
    done = run(name, f"""
        {MAKE['store'].replace(chr(10), chr(10) + '        ')}
        os.unlink('/dev/shm/' + NAME)  # as a takeover does; then someone else's file
        with open('/dev/shm/' + NAME, 'w') as f:
            f.write('not ours')
    """)
    try:
        assert done.returncode == 0, done.stderr
        assert (SHM / name).read_text() == "not ours"
    finally:
        (SHM / name).unlink(missing_ok=True)


def test_sigkill_leaves_the_segment_for_gc_to_reclaim(name: str) -> None:
    script = (f"import sys, time\nNAME = {name!r}\n{MAKE['store']}\n"
              "print('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert left(name) == [name]  # no exit handler ran
        deadline = time.monotonic() + 10
        while not Segment.remove_stale(name) and time.monotonic() < deadline:
            time.sleep(0.05)  # the dead writer's pid is gone once it is reaped
        assert left(name) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
