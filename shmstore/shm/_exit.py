"""Names this process created in /dev/shm, unlinked when it ends without having unlinked them,
however it ends.

Two mechanisms, for two kinds of ending:
- An exit that runs exit handlers (a script that ends without `close()`, an uncaught
  exception, sys.exit): the names still registered are unlinked at interpreter exit, if they
  still lead to the file this process created (same inode: a name another writer took over
  since is left alone).
- An ending that runs none (SIGTERM or SIGHUP left at their default action, SIGKILL, os._exit,
  a crash): the tracker (_tracker.py), a process of the standard library alone that this one
  starts the first time it creates a name, reads every own/disown over a pipe and unlinks what
  is left once this process is gone. No signal handler is installed: the host application owns
  its signals, and the tracker needs none of them.
What kills the tracker together with its writer (SIGKILL to both) is reclaimed by the next
writer on the node (sweep_dead in _segment.py, at its first create) or `shmstore gc`. A forked
child never unlinks its parent's names and closes its copy of the parent's pipe at once.
Set SHMSTORE_TRACKER=0 to run without the tracker (exit handlers and the sweep remain).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading

from .._proc import env_switch

log = logging.getLogger("shmstore")

__all__ = ["prepare", "own", "own_beside", "disown"]

_OWNED: dict[str, tuple[int, int]] = {}  # path -> (pid, inode)
_LOCK = threading.Lock()
_registered = False
_TRACKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tracker.py")


class _Tracker:
    """This process's pipe to its tracker process (one per process; see _tracker.py)."""

    fd = -1
    _pipe_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the pipe: an fd number the host
    # closed and reused for a file of its own is never written to

    def __init__(self) -> None:
        read, write = os.pipe2(os.O_CLOEXEC)
        try:
            first = os.posix_spawn(
                sys.executable, [sys.executable, "-I", "-S", _TRACKER, str(os.getpid()),
                                 str(_start_time())],
                dict(os.environ), file_actions=[(os.POSIX_SPAWN_DUP2, read, 0)], setsid=True)
            # it forks the tracker and exits (_tracker.py says why): reaped in the background,
            # so the first create does not wait for an interpreter to start
            threading.Thread(target=_reap, args=(first,), name="shmstore-tracker-reap",
                             daemon=True).start()
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self.fd = write
        st = os.fstat(write)
        self._pipe_id = (st.st_dev, st.st_ino)

    def send(self, line: str) -> bool:
        """Write `line` (one line: one write()); False if the pipe is no longer ours or is
        broken."""
        try:
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) != self._pipe_id:
                return False
            data = line.encode()
            while data:  # one write() for a line; several for a process's every name at once
                data = data[os.write(self.fd, data):]
            return True
        except OSError:
            return False

    def forget(self) -> None:
        """In a forked child: close the parent's pipe (its tracker must see the parent's end)."""
        with contextlib.suppress(OSError):
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) == self._pipe_id:
                os.close(self.fd)
        self.fd = -1


def _start_time() -> int:
    """This process's start time (clock ticks after boot; with the pid, names it for good)."""
    with open("/proc/self/stat", "rb") as f:
        return int(f.read().rpartition(b")")[2].split()[19])


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # a host's SIGCHLD handler reaped it first
        os.waitpid(pid, 0)


_tracker: _Tracker | None = None
_tracker_failed = False  # off, or failed to start (said once): exit handlers and the sweep remain


def prepare() -> None:
    """Start this process's tracker now, before a name is created: what a signal cuts short
    between the create and own() is then one write() wide, not an interpreter's start."""
    with _LOCK:
        if _tracker is None:
            _track("")


def _track(line: str) -> None:
    """Tell this process's tracker `line`, starting it (or a new one, with every name this
    process owns) where needed. Called under _LOCK."""
    global _tracker, _tracker_failed
    if _tracker_failed:
        return
    if _tracker is not None and (not line or _tracker.send(line)):
        return
    try:
        if not env_switch("SHMSTORE_TRACKER", True):
            _tracker_failed = True
            return
        _tracker = _Tracker()
    except Exception as exc:  # no interpreter to start (embedded), no pipe: say so once
        _tracker_failed = True
        log.warning("shmstore: cannot start the tracker process (%s): a writer killed by a "
                    "signal leaves its segments until the next writer starts or `shmstore gc`",
                    exc)
        return
    pid = os.getpid()
    _tracker.send("".join(f"+{inode} {path}\n" for path, (owner, inode) in _OWNED.items()
                          if owner == pid))


def _after_fork_in_child() -> None:
    global _tracker, _tracker_failed
    if _tracker is not None:
        _tracker.forget()
    _tracker = None
    _tracker_failed = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def own(path: str) -> None:
    """`path` (a segment or a semaphore's file, just created) is unlinked when this process
    ends, unless disown(path) ran: at its exit, or by its tracker."""
    global _registered
    try:
        inode = os.stat(path).st_ino
    except OSError:  # kept elsewhere on this system: nothing to check it by, left alone
        return
    with _LOCK:
        _OWNED[path] = (os.getpid(), inode)
        _track(f"+{inode} {path}\n")
        if not _registered:
            atexit.register(_unlink_owned)
            _registered = True


def own_beside(segment: str, path: str) -> None:
    """`path` (a doorbell named after `segment`, which this process owns) is about to be
    created: should this process be killed before own(path), its tracker unlinks it with
    `segment`. Call before the create."""
    with _LOCK:
        _track(f"?{segment} {path}\n")


def disown(path: str) -> None:
    """`path` was unlinked by its owner (or handed on): nothing to do at exit."""
    with _LOCK:
        if _OWNED.pop(path, None) is not None:
            _track(f"-{path}\n")


def _unlink_owned() -> None:
    pid = os.getpid()
    with _LOCK:
        owned = [(path, inode) for path, (owner, inode) in _OWNED.items() if owner == pid]
        _OWNED.clear()
    for path, inode in owned:
        # No lock here (this process holds its segments' locks itself), and none is needed:
        # while this process lives, no other writer takes its names over
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            continue
