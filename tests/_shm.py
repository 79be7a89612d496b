"""What a test left in /dev/shm, on a machine other runs share: entries that appeared since a
snapshot and that no live process owns. A segment whose writer lives (another suite, another
CI job) is that writer's, not this test's leftover; a queue's semaphore goes with its segment."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from shmstore._proc import pid_alive, proc_stat
from shmstore.shm._header import peek_header
from shmstore.shm._tracker import opened_by

SHM = "/dev/shm"


def entries() -> set[str]:
    """Everything in /dev/shm now, less multiprocessing's own semaphores."""
    return {e for e in os.listdir(SHM) if not e.startswith("sem.mp-")}


def _writer(entry: str) -> int | None:
    """The writer pid of the shmstore segment `entry` names (a semaphore: its queue's)."""
    name = entry
    if entry.startswith("sem."):
        name = entry[4:].rpartition("@")[0]
    header = peek_header(name)
    return None if header is None else header[2]


def left_since(before: set[str]) -> list[str]:
    """Entries made since `before` that no live writer holds: what a test left behind."""
    left = []
    for entry in sorted(entries() - before):
        writer = _writer(entry)
        if writer is not None and writer != os.getpid() and pid_alive(writer):
            continue  # a live process's, elsewhere on this machine
        left.append(entry)
    return left


def made_by(root: int, before: set[str]) -> list[str]:
    """shmstore segments made since `before` whose writer is `root` or a child of it."""
    found = []
    for entry in entries() - before:
        writer = _writer(entry)
        if writer is not None and not entry.startswith("sem.") and (
                writer == root or (proc_stat(writer) or ("", 0))[1] == root):
            found.append(entry)
    return found


def holders(entry: str) -> str:
    """Who keeps the /dev/shm file `entry` (a failed wait's story): its writer (the header's
    pid, and its state), every process with it open or mapped, with its state and parent, and
    every tracker process running."""
    path = os.path.join(SHM, entry)
    header = peek_header(entry)
    lines = [f"{path}: writer pid {header[2]} state {proc_stat(header[2])}" if header
             else f"{path}: no shmstore header"]
    opened = set(opened_by(path))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        how = ["open"] if int(pid) in opened else []
        try:
            with open(f"/proc/{pid}/maps") as maps:
                how += ["mapped"] if any(line.rstrip().endswith(path) for line in maps) else []
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if how or "_tracker.py" in cmd:  # and every tracker (the writer's pid in its words)
            lines.append(f"  pid {pid} {proc_stat(int(pid))} ({', '.join(how) or 'tracker'}):"
                         f" {cmd}")
    return "\n".join(lines)


def wait_removed(prefix: str, timeout_s: float, story: str = "") -> None:
    """Wait until no /dev/shm entry starts with `prefix`; if one stays, AssertionError with
    who holds each one left (holders) and `story` (a server's log)."""
    from tests._waiting import wait_for

    def left() -> list[str]:
        return [e for e in os.listdir(SHM) if e.startswith(prefix)]

    try:
        wait_for(lambda: not left(), timeout_s, f"{prefix} to be removed")
    except AssertionError as exc:
        raise AssertionError("\n".join([str(exc), *map(holders, left()), story])) from None


# A process whose leader thread ends (pthread_exit) while another of its threads holds `path`
# open and waits for its stdin to close: what /proc shows of a SIGKILLed server while it tears
# down, for as long as the test wants.
_LEADER_GONE = """
import ctypes, sys, threading
held = open(sys.argv[1], "rb")
threading.Thread(target=sys.stdin.read).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


@contextlib.contextmanager
def leader_gone(path: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose leader is a zombie while a thread of it holds `path` open; it ends once
    the block closes its stdin (`proc.stdin.close()`) and is reaped at the block's end."""
    from tests._waiting import wait_for

    proc = subprocess.Popen([sys.executable, "-c", _LEADER_GONE, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        wait_for(lambda: (proc_stat(proc.pid) or ("",))[0] == "Z", 30, "its leader to end")
        yield proc
    finally:
        proc.kill()
        proc.wait(30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
