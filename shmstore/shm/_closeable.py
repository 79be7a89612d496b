"""Closeable (the `with` protocol) and CallGuard (close while calls are in flight).

A blocking call holds the mapping and, for a queue, a semaphore. If another thread, or a signal
handler in the same thread, closed them under it, its next atomic access would hit unmapped
memory (a crash, not an exception). So every call that touches shared memory runs inside
`guard.enter()` / `guard.leave()`, and `close()` hands the actual release to the guard: it runs
at once when no call is in flight, else when the last call leaves. Calls that see the guard
closing raise SegmentClosed; blocked calls check it between waits (close also rings their
doorbell), so they wake within one wait slice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from .._proc import fork_generation
from ..errors import SegmentClosed, WrongProcess

__all__ = ["Closeable", "CallGuard"]

_Self = TypeVar("_Self", bound="Closeable")


class Closeable:
    """`with obj:` closes it on exit; `close()` is each owner's own and idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CallGuard:
    """Counts calls in flight on one owner; runs the owner's release after the last one.

    The fast path takes no lock: entering appends to a list and leaving pops from it, each one
    atomic under the GIL, so a call's count is visible before it reads `_closing`, and close()
    sets `_closing` before it counts calls. Whichever of a leaving call and close() looks last
    sees the other and runs the release, once (taken out under the lock).
    """

    __slots__ = ("_calls", "_closing", "_fork_generation", "_lock", "_pid", "_release", "_what")

    def __init__(self, what: str, pid: int) -> None:
        self._lock = threading.RLock()  # re-entrant: a signal handler may close mid-call
        self._calls: list[None] = []
        self._closing = False
        self._release: Callable[[], None] | None = None
        self._what = what
        self._pid = pid
        self._fork_generation = fork_generation()

    @property
    def closing(self) -> bool:
        return self._closing

    def enter(self) -> None:
        """Start a call; raise SegmentClosed once close() began, WrongProcess after a fork."""
        if self._fork_generation != fork_generation():
            raise self._forked_error()
        self._calls.append(None)
        if self._closing:
            self.leave()
            raise self.closed_error()

    def leave(self) -> None:
        """End a call; the last call out after close() runs the release."""
        self._calls.pop()
        if self._closing:
            self._release_if_idle()

    def close(self, release: Callable[[], None]) -> None:
        """Mark closing; run `release` now, or when the calls in flight have left. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._release = release
            self._closing = True
            self._release_if_idle()

    def _release_if_idle(self) -> None:
        with self._lock:
            if not self._calls and self._release is not None:
                release, self._release = self._release, None
                release()

    def check(self) -> None:
        """Raise SegmentClosed if close() began, WrongProcess in a forked child."""
        if self._fork_generation != fork_generation():
            raise self._forked_error()
        if self._closing:
            raise self.closed_error()

    def _forked_error(self) -> WrongProcess:
        pid = os.getpid()
        return WrongProcess(
            f"{self._what} was opened by process {self._pid}; this process ({pid}) is a fork of "
            "it and may not use it: create or attach a new one in the child", self._pid, pid)

    def closed_error(self) -> SegmentClosed:
        return SegmentClosed(f"{self._what} is closed (close() was called); open it again to "
                             "use it")

    @property
    def forked(self) -> bool:
        """True in a child forked after this guard was made."""
        return self._fork_generation != fork_generation()
