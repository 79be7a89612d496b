"""The tracker: a small process that unlinks what its writer process left in /dev/shm when that
process ends without unlinking it, however it ends (SIGTERM, SIGHUP, SIGKILL, os._exit, a
crash, a failed start).

_exit.py starts one per writer process, the first time the process creates a name, as
`python -I -S _tracker.py WRITER_PID WRITER_START` with the read end of a pipe as its stdin; this file imports
the standard library only (no shmstore, no site-packages), so it starts in milliseconds. It
forks once and the first process exits (the writer reaps it in a thread): the tracker is then no child of
its writer, so a host that kills its own process tree on shutdown (vLLM's kill_process_tree
sends SIGKILL to every descendant) does not kill the tracker with it. The writer writes one
line per change, each in one write() (a pipe writes up to PIPE_BUF bytes whole, so a line is
never torn by a signal):

    +INODE PATH      PATH (a segment or a semaphore's file) was created with inode INODE
    -PATH            PATH was unlinked by its owner, or handed on: forget it
    ?SEGMENT PATH    PATH (a queue's doorbell) is about to be created, named after SEGMENT
                     (listed already): a writer killed between the create and its +INODE line
                     leaves it, so it goes with SEGMENT (unlinked first, under SEGMENT's lock)

The pipe ends when every copy of its write end is closed: at the writer's exit, whatever ends
it (a forked child closes its inherited copy at once). The tracker then waits until its writer
is really gone (its pid and the start time it gave, so a reused pid cannot fool it; a writer
that closed the pipe by mistake keeps its names until it exits; a writer gone while a process
forked from it outside Python still holds the pipe is seen gone within WRITER_POLL_S), and
unlinks every name still listed whose file is still the one the writer created (same inode: a
name another writer took over since is left alone); a file whose lock a live process still
holds is tried again for up to HELD_WAIT_S, then left with the holders named. It says what it
removed, and what it left, on stderr, which it shares with its writer (a server's log).

It runs in a session of its own and ignores SIGINT, SIGTERM and SIGHUP, so the signals that stop
its writer's process group (Ctrl-C, a terminal hang-up, `kill -- -PGID`, systemd's first
SIGTERM to a service's processes) do not stop it before it has cleaned up; it exits as soon as
it has. Only what kills it together with its writer (SIGKILL to both) leaves names behind: the
next writer on the node removes those (sweep_dead in _segment.py) and `shmstore gc` does on demand.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Callable

WRITER_POLL_S = 0.2  # how often a tracker whose pipe ended checks that its writer is gone
HELD_WAIT_S = 60.0  # how long a tracker tries again a file whose lock a live process holds
HELD_RETRY_S = 0.25


def _start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), None if it is gone or a
    zombie (a process killed and not yet reaped holds nothing). A leader that is a zombie
    while other threads of its process run or still exit is not gone: they hold its files
    and its lock until the last of them ends (_proc.threads_left, which this script cannot
    import)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        if fields[0] in (b"Z", b"X") and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
            return None
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _parse(line: bytes, owned: dict[bytes, int], beside: dict[bytes, set[bytes]]) -> None:
    """Apply one line of the pipe to `owned` (path -> inode) and `beside` (segment -> paths
    named after it); ignore what is not a line."""
    line = line.rstrip(b"\n")
    if line.startswith(b"+"):
        inode, _, path = line[1:].partition(b" ")
        if inode.isdigit() and path.startswith(b"/"):
            owned[path] = int(inode)
    elif line.startswith(b"-"):
        owned.pop(line[1:], None)
        for paths in beside.values():
            paths.discard(line[1:])
    elif line.startswith(b"?"):
        segment, _, path = line[1:].partition(b" ")
        if segment.startswith(b"/") and path.startswith(b"/"):
            beside.setdefault(segment, set()).add(path)


LOCK_TRIES = 20  # a remover's lock is held for microseconds, a writer's for its life
LOCK_RETRY_S = 0.005  # so 20 tries 5 ms apart tell the two apart


class Held(Exception):
    """The file is locked by a process that holds it for its life (a live writer's segment)."""


class _Refused(Exception):
    """What a check raised, carried past locked_unlink's own OSError handling."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


def _ask(check: Callable[[int], bool] | None, fd: int) -> bool:
    try:
        return check is None or check(fd)
    except Exception as exc:
        raise _Refused(exc) from exc


def locked_unlink(path: str | bytes, inode: int | None = None,
                  beside: frozenset[bytes] = frozenset(),
                  check: Callable[[int], bool] | None = None) -> int | None:
    """The one way a dead writer's file is removed (the tracker, the next writer's sweep and
    takeover, `shmstore gc`, a queue's doorbells, the vLLM launcher hook): unlink `path` if it
    still leads to the regular file of `inode` (the file there now, if None), owned by this
    user, for which check(fd) says yes before and again under the lock; return the file's size
    if it was unlinked, None if not. `beside`: names that go with it (whatever file they lead
    to), unlinked first under its lock.

    The check and the unlink hold an exclusive flock on that file, taken without blocking
    (LOCK_TRIES): of two removers of one file one unlinks it, a name a new writer made
    meanwhile (another file) is never unlinked, another user's file is never touched (root
    included), and a file that a live process holds locked is never waited for (Held). A new
    writer makes a segment's doorbells only once it holds the segment's name, so none of
    them is among `beside`.

    Raises:
        Held: the file stays locked (a live writer holds it).
        whatever `check` raises.
    """
    try:  # O_NONBLOCK: whatever is there now, opening it never waits (a FIFO)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        held = os.fstat(fd)
        if (not stat.S_ISREG(held.st_mode) or held.st_uid != os.getuid()
                or (inode is not None and held.st_ino != inode)):
            return None
        if not _ask(check, fd):
            return None
        for _ in range(LOCK_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(LOCK_RETRY_S)
        else:
            raise Held(os.fsdecode(path))
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return None
        if not _ask(check, fd):
            return None
        for name in beside:
            try:
                os.unlink(name)
                sys.stderr.write(f"shmstore: removed {os.fsdecode(name)}, made beside "
                                 f"{os.fsdecode(path)} and never listed\n")
            except OSError:
                pass  # unlinked by its owner, or listed and gone: nothing was left
        os.unlink(path)
        return held.st_size
    except _Refused as refused:
        raise refused.exc from None
    except OSError:
        return None
    finally:
        os.close(fd)


def unlink_if_same(path: str | bytes, inode: int | None = None,
                   beside: frozenset[bytes] = frozenset()) -> int | None:
    """locked_unlink, None where the file stays locked by a live process."""
    try:
        return locked_unlink(path, inode, beside)
    except Held:
        return None


def _unlink_left(owned: dict[bytes, int], beside: dict[bytes, set[bytes]],
                 writer: int) -> None:
    """Unlink what the dead writer left. A file still locked (Held: another remover at it, or
    a process forked from the writer, outside Python, that still shares its lock and dies
    with the server a moment later) is tried again every HELD_RETRY_S for HELD_WAIT_S, then
    left, with a line that says so (the next writer's sweep or `shmstore gc` removes it)."""
    left = dict(owned)
    deadline = time.monotonic() + HELD_WAIT_S
    while True:
        for path, inode in list(left.items()):
            unlisted = frozenset(p for p in beside.get(path, ()) if p not in owned)
            try:
                size = locked_unlink(path, inode, unlisted)
            except Held:
                continue
            del left[path]
            if size is not None:
                sys.stderr.write(f"shmstore: writer pid {writer} ended without unlinking "
                                 f"{os.fsdecode(path)} ({size} bytes): removed\n")
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(HELD_RETRY_S)
    for path in left:
        sys.stderr.write(f"shmstore: writer pid {writer} ended without unlinking "
                         f"{os.fsdecode(path)}, and a live process still holds its lock after "
                         f"{HELD_WAIT_S:g} s ({_holding(path) or 'one forked from the writer?'})"
                         ": left; `shmstore gc` removes it once that process is gone\n")
    sys.stderr.flush()


def _holding(path: bytes) -> str:
    """The processes that have `path` open ("pid N (name)", comma-separated), as /proc shows
    those this user may look at."""
    found = []
    for pid in opened_by(path):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                found.append(f"pid {pid} ({comm.read().strip()})")
        except OSError:
            continue
    return ", ".join(found)


def opened_by(path: bytes | str) -> list[int]:
    """The pids of the processes that have `path` open, of those /proc lets this user see
    (a process whose leader has exited while its other threads still run, or still exit,
    through those threads: its own fd folder is empty then)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        base = f"/proc/{pid}"
        try:
            places = ([base] if os.listdir(f"{base}/fd") else
                      [f"{base}/task/{tid}" for tid in os.listdir(f"{base}/task") if tid != pid])
        except OSError:
            continue
        if any(_has_open(place, path) for place in places):
            found.append(int(pid))
    return found


def _has_open(proc: str, path: bytes | str) -> bool:
    """Whether the process or thread at /proc path `proc` has `path` open."""
    try:
        return any(os.readlink(f"{proc}/fd/{fd}") == os.fsdecode(path)
                   for fd in os.listdir(f"{proc}/fd"))
    except OSError:
        return False


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    writer, started = int(argv[1]), int(argv[2])
    if os.fork():
        os._exit(0)  # reaped by the writer; the tracker goes on, no longer its child
    owned: dict[bytes, int] = {}
    beside: dict[bytes, set[bytes]] = {}
    pending = b""
    while True:
        try:
            if not select.select([0], [], [], WRITER_POLL_S)[0]:
                if _start_time(writer) != started:
                    break  # gone, though its pipe lives on (in a process forked from it)
                continue
            data = os.read(0, 65536)
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
        except OSError:
            break
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            _parse(line, owned, beside)
    while _start_time(writer) == started:
        time.sleep(WRITER_POLL_S)  # the pipe closed, but its writer lives on
    _unlink_left(owned, beside, writer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
