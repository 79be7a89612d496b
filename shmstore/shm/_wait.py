"""Waiting: one deadline type, one doorbell type, one spin-then-sleep loop.

Timeouts have one meaning everywhere in shmstore: `None` waits without limit, `0` checks once
and does not wait, `t > 0` waits at most t seconds (measured with time.monotonic).

`wait_until(ready, ...)` spins for `spin_s` (yielding the CPU), then sleeps in slices of at most
`slice_s` until `ready()` is true or the deadline passes. Between slices it calls `check()`,
which raises when the owner is being closed (CallGuard.check), so a close from another thread
or a signal handler ends the wait with SegmentClosed. Sleeping is on a Doorbell (a POSIX
semaphore another process posts) when one is given, else a plain sleep with backoff.

Doorbell handshake (Dekker): the sleeper swaps its `flag` word to 1 with a full barrier, checks
`ready()` again, then waits; the waker publishes, then (full barrier) swaps the flag to 0 and
posts only if it was 1. One of the two always sees the other. A post can still arrive late or
twice; both only cost a spurious wake-up, and every slice ends at `slice_s` anyway.

Signals: a semaphore wait interrupted by a signal whose handler returns (EINTR,
posix_ipc.SignalError) simply continues with the same deadline. A handler that raises ends the
wait with its exception, and the flag is reset on the way out, where the wait is a `sleep` (the
compiled queue hand-off) or a plain sleep. During a Doorbell's own wait posix_ipc runs the
handler and then replaces its exception with SignalError, so there the exception is lost and
the wait goes on to its deadline (tests/queue/test_handoff.py pins both).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from typing import Any

import posix_ipc

from .._proc import MAX_SECONDS, number_arg
from ..errors import SegmentExists, SegmentNotFound, SegmentPermissionError, ShmSpaceError
from . import _exit
from ._ordering import FULL_FENCE, Words
from ._tracker import unlink_if_same

__all__ = ["Deadline", "Doorbell", "wait_until", "checked_wait", "deadline_of", "SLICE_S", "sem_path",
           "SHM_DIR"]

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX semaphores (as sem.NAME)
SLICE_S = 0.05 if FULL_FENCE else 0.005  # longest single sleep: bounds a missed wake-up
_BACKOFF_S = (0.0002, 0.005)  # first and largest plain sleep when there is no doorbell


class Deadline:
    """When a wait must give up: None = never, 0 = now (check once), t = t seconds from now."""

    __slots__ = ("_end", "timeout_s")

    def __init__(self, timeout: float | None, argument: str = "timeout") -> None:
        self.timeout_s = number_arg(timeout, argument, allow_none=True)
        self._end = None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def remaining(self) -> float | None:
        """Seconds left (>= 0), or None without limit."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end


def checked_wait(timeout: Any) -> Deadline | float | None:
    """`timeout` unchanged once it is a valid timeout or a Deadline (InvalidArgument otherwise,
    as Deadline raises it). Calls that rarely wait check their timeout with this and make the
    Deadline only when they wait (`deadline_of`): its clock read is saved on every other call."""
    if timeout is None or isinstance(timeout, Deadline) or (
            type(timeout) in (int, float) and 0 <= timeout < MAX_SECONDS):
        return timeout  # type: ignore[no-any-return]
    return Deadline(timeout)  # raises, naming what is wrong with it


def deadline_of(wait: Deadline | float | None) -> Deadline:
    """The Deadline of a checked timeout (checked_wait), made now if it is not one yet."""
    return wait if isinstance(wait, Deadline) else Deadline(wait)


class Doorbell:
    """One named POSIX semaphore that a sleeping side waits on and the other side posts.

    `create` makes it (the owner, who unlinks it on close); `open` attaches to it.
    """

    _sem: Any = None
    owner = False
    _unlinked = False

    def __init__(self, name: str, sem: Any, owner: bool) -> None:
        self.name = name
        self._sem = sem
        self.owner = owner

    @classmethod
    def create(cls, name: str, mode: int, beside: str | None = None) -> Doorbell:
        """Create `name` (replacing a stale one: the caller owns the name now) with `mode`;
        `beside`: the name of the segment it goes with (its tracker then unlinks it with the
        segment, even if this process is killed before it has listed the doorbell)."""
        if beside is not None:
            _exit.own_beside(os.path.join(SHM_DIR, beside.lstrip("/")), sem_path(name))
        try:
            try:
                sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=mode)
            except posix_ipc.ExistentialError:
                # a dead writer's: share a count with nobody. Unlinked under the lock its
                # tracker takes to remove it too, so that neither unlinks the other's new one
                if unlink_if_same(sem_path(name)) is None:
                    if os.path.lexists(sem_path(name)):  # another user's, or held: not ours
                        raise SegmentExists(
                            f"semaphore {name!r} exists and is not a dead writer's of this "
                            f"user ({sem_path(name)}): stop the process that holds it, or "
                            "choose another name", name, None, True) from None
                    _unlink_semaphore(name)  # kept elsewhere on this system: by name
                sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=mode)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmSpaceError(
                    f"cannot create semaphore {name!r}: {SHM_DIR} is full; remove leftover "
                    "segments (shmstore gc) or give the container more shared memory",
                    0, None) from exc
            raise
        except posix_ipc.PermissionsError as exc:
            raise SegmentPermissionError(f"cannot create semaphore {name!r}: {exc}",
                                         name) from None
        self = cls(name, sem, owner=True)
        _exit.own(sem_path(name))
        try:
            # sem_open applies the umask; others need read and write to use it
            os.chmod(sem_path(name), stat.S_IMODE(mode))
        except FileNotFoundError:  # a system that keeps semaphores elsewhere: keep the umask's
            pass
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def open(cls, name: str) -> Doorbell:
        """Attach to an existing doorbell."""
        try:
            return cls(name, posix_ipc.Semaphore(name), owner=False)
        except posix_ipc.ExistentialError:
            raise SegmentNotFound(f"semaphore {name!r} does not exist: its queue's writer is gone "
                                  "or still starting; attach once it has created the queue",
                                  name) from None
        except posix_ipc.PermissionsError:
            raise SegmentPermissionError(
                f"no permission to open semaphore {name!r}: its writer created it for another "
                "user; run as the writer's user, or create the queue with a wider mode", name
            ) from None

    def ring(self) -> None:
        if self._sem is not None:
            self._sem.release()

    def wait(self, seconds: float) -> None:
        """Sleep until posted or `seconds` pass; a signal ends it early (the caller loops)."""
        try:
            self._sem.acquire(seconds)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            pass

    def unlink(self) -> None:
        """Remove the name (owner only); idempotent. Open handles keep working."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            _exit.disown(sem_path(self.name))
            _unlink_semaphore(self.name)

    def close(self) -> None:
        """Close this handle; the owner also unlinks the name. Idempotent."""
        if self._sem is None:
            return
        sem, self._sem = self._sem, None
        sem.close()
        self.unlink()


def wait_until(
    ready: Callable[[], bool],
    deadline: Deadline,
    *,
    check: Callable[[], None],
    spin_s: float = 0.0,
    bell: Doorbell | None = None,
    words: Words | None = None,
    flag: int = 0,
    sleep: Callable[[float], bool] | None = None,
) -> bool:
    """Wait until `ready()`; return False if the deadline passed first.

    `check()` runs before every sleep and may raise (closed). With a `bell`, `words`/`flag` name
    the sleeper's flag word for the doorbell handshake described in the module docstring.
    `sleep(seconds)` instead makes the whole handshake in one call and says whether what is
    awaited arrived (the compiled queue hand-off, queue/_layout.py).
    """
    if ready():
        return True
    now = time.monotonic()
    remaining = deadline.remaining()
    spin_until = now + (spin_s if remaining is None else min(spin_s, remaining))
    while now < spin_until:
        os.sched_yield()
        if ready():
            return True
        now = time.monotonic()
    pause = _BACKOFF_S[0]
    while True:
        check()
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            return ready()
        slice_s = SLICE_S if remaining is None else min(SLICE_S, remaining)
        if sleep is not None:
            if sleep(slice_s):
                return True
        elif bell is None or words is None:
            time.sleep(min(pause, slice_s))
            pause = min(pause * 2, _BACKOFF_S[1])
        else:
            words.exchange(flag, 1)  # "I am asleep", with a full barrier before the re-check
            try:
                if ready():
                    return True
                bell.wait(slice_s)
            finally:
                words.exchange(flag, 0)
        if ready():
            return True


def sem_path(name: str) -> str:
    """Where Linux keeps the named semaphore `name`."""
    return os.path.join(SHM_DIR, "sem." + name.lstrip("/"))


def _unlink_semaphore(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass
