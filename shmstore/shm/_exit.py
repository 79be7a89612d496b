"""Names this process created in /dev/shm, unlinked when it exits without having unlinked them.

A script that ends without `close()`, or on an uncaught exception, would otherwise leave its
whole reserved segment in tmpfs (CPython's SharedMemory leans on its resource tracker for the
same). Each owner registers a name when it creates it and drops it when it unlinks it; at
interpreter exit the names still registered are unlinked, if they still lead to the file this
process created (same inode: a name another writer took over since is left alone). A forked
child never unlinks its parent's names. Not covered: SIGKILL, os._exit and a crash, where no
exit handler runs; the next create of the name, or `shmstore gc`, reclaims those.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Callable

__all__ = ["own", "disown"]

_OWNED: dict[str, tuple[int, int, Callable[[], None]]] = {}  # path -> (pid, inode, unlink)
_LOCK = threading.Lock()
_registered = False


def own(path: str, unlink: Callable[[], None]) -> None:
    """`unlink()` (which removes `path`) runs at this process's exit unless disown(path) ran."""
    global _registered
    try:
        inode = os.stat(path).st_ino
    except OSError:  # kept elsewhere on this system: nothing to check it by, left alone
        return
    with _LOCK:
        _OWNED[path] = (os.getpid(), inode, unlink)
        if not _registered:
            atexit.register(_unlink_owned)
            _registered = True


def disown(path: str) -> None:
    """`path` was unlinked by its owner (or handed on): nothing to do at exit."""
    with _LOCK:
        _OWNED.pop(path, None)


def _unlink_owned() -> None:
    pid = os.getpid()
    with _LOCK:
        owned = [(path, inode, unlink) for path, (owner, inode, unlink) in _OWNED.items()
                 if owner == pid]
        _OWNED.clear()
    for path, inode, unlink in owned:
        try:
            if os.stat(path).st_ino != inode:
                continue  # another writer's now
        except OSError:
            continue
        with contextlib.suppress(Exception):
            unlink()
