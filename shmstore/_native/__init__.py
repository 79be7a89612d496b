"""The compiled boundary: the one C module, and the path every layer takes, chosen once here.

    _atomic.c    Words (ordered 8-byte words of a mapping) and Slots (the broadcast queue's
                 hand-off), built at install where a C compiler exists (setup.py: optional)

Each compiled type has a Python twin with the same methods, used where the module was not built
or SHMSTORE_ORDERING asks for a pure-Python path; tests/test_layers.py checks that the twins
offer what the compiled types do, and the shm and queue tests run every path:

    Words   shm/_ordering.py OrderedWords (libatomic through ctypes, or plain x86 words)
    Slots   queue/_slots.py PythonSlots

`ATOMIC` is the compiled module, or None where it was not built. `ORDERING` is the path:
"compiled" (the default where it was built), "libatomic" or "plain" (x86 only: its loads and
stores are already ordered); SHMSTORE_ORDERING=compiled|libatomic|plain forces one.

May import: errors.
"""

from __future__ import annotations

import os
import platform
from types import ModuleType

__all__ = ["ATOMIC", "ORDERING", "TWINS"]

_TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
TWINS = {"Words": "shmstore.shm._ordering.OrderedWords",
         "Slots": "shmstore.queue._slots.PythonSlots"}

ATOMIC: ModuleType | None
try:
    from . import _atomic as ATOMIC  # built at install where a C compiler exists
except ImportError:
    ATOMIC = None


def _choose() -> str:
    forced = os.environ.get("SHMSTORE_ORDERING", "")
    if forced == "compiled" and ATOMIC is None:
        raise ImportError("SHMSTORE_ORDERING=compiled, but shmstore._native._atomic was not "
                          "built: reinstall shmstore where a C compiler (gcc or clang) is "
                          "available, or unset SHMSTORE_ORDERING")
    if forced in ("plain", "libatomic", "compiled"):
        return forced
    if ATOMIC is not None:
        return "compiled"
    return "plain" if platform.machine().lower() in _TSO_MACHINES else "libatomic"


ORDERING = _choose()
