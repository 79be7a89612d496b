"""Publish/consume ordering for 8-byte counters that cross processes.

Two places need ordering between plain memory accesses and one 8-byte word in shared memory:

* a reader finishes reading an object's bytes, THEN stores its release counter (store-release);
  the writer loads that counter, THEN overwrites the bytes (load-acquire);
* (queue) the writer fills a slot, THEN stores the flag that publishes it, and a reader loads the
  flag, THEN reads the slot.

x86-64 is TSO: a store is never reordered with an earlier load or store, and a load never with a
later load or store, so an aligned 8-byte `mov` already has release (store) and acquire (load)
semantics. The C compiler cannot move the interpreter's accesses across one another either,
because each Python statement runs as separate opaque calls. So on x86-64 a plain aligned 8-byte
store/load through a memoryview is enough.

ARM (and every other weakly ordered CPU) may reorder those accesses, so there the word is accessed
through libatomic's `__atomic_store_8` / `__atomic_load_8` with `__ATOMIC_RELEASE` /
`__ATOMIC_ACQUIRE` (stlr / ldar on aarch64). If libatomic cannot be loaded the import fails with
a message saying to install it (it ships with gcc, package libatomic1 on Debian/Ubuntu).

Where the optional compiled module _native/_atomic.c was built at install (a C compiler was
there), every word goes through it instead (the default; _native/__init__.py chooses, once):
the same orders from GCC's `__atomic` builtins, one C call each, with every offset
bounds-checked. A ctypes call costs about 1 us warm and tens of microseconds right after an
idle period, when every page it touches misses the caches; the compiled call is several times
cheaper in both cases (docs/performance.md).

`SHMSTORE_ORDERING=libatomic` (or `plain`, on x86) forces a pure-Python path (the tests run
each); `compiled` insists on the module. Without the module the default is the pure-Python path.

A sleeping reader and a waking writer need more: a store followed by a load of another word
(Dekker's pattern: "I am asleep" then "is there a message?", against "here is a message" then
"is anyone asleep?"). Even x86 reorders a store with a later load, so `exchange` is a
sequentially consistent atomic exchange (`__atomic_exchange_8`, a locked `xchg` on x86, a full
barrier). Where libatomic is missing, `FULL_FENCE` is False and sleepers wake on a short timeout
instead of relying on the handshake alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
from typing import Any, Protocol

from .._native import ATOMIC, ORDERING

__all__ = ["Words", "OrderedWords", "ordered_words", "ORDERING", "FULL_FENCE"]

_ATOMIC_ACQUIRE = 2  # __ATOMIC_ACQUIRE
_ATOMIC_RELEASE = 3  # __ATOMIC_RELEASE
_ATOMIC_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_U64_MASK = (1 << 64) - 1  # values wrap: a counter loaded from damaged memory may be 2**64 - 1


_compiled = ATOMIC  # the compiled module (_native/_atomic.c), or None
_libatomic: ctypes.CDLL | None = None
_atomic_load: Any = None  # __atomic_load_8(ptr, order); a module-level name: no class mangling
_atomic_store: Any = None  # __atomic_store_8(ptr, value, order)
_atomic_exchange: Any = None  # __atomic_exchange_8(ptr, value, order) -> old
_atomic_cas: Any = None  # __atomic_compare_exchange_8(ptr, expected_ptr, desired, succ, fail)
_path = ctypes.util.find_library("atomic")
if _path is not None:
    _libatomic = ctypes.CDLL(_path)
    _atomic_exchange = _libatomic["__atomic_exchange_8"]
    _atomic_exchange.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    _atomic_exchange.restype = ctypes.c_uint64
    _atomic_cas = _libatomic["__atomic_compare_exchange_8"]
    _atomic_cas.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                            ctypes.c_int]
    _atomic_cas.restype = ctypes.c_bool
if ORDERING == "libatomic":
    if _libatomic is None:
        raise ImportError(
            f"shmstore needs libatomic on {platform.machine()} for cross-process memory ordering; "
            "install it (Debian/Ubuntu: apt install libatomic1)"
        )
    _atomic_load = _libatomic["__atomic_load_8"]
    _atomic_load.argtypes = [ctypes.c_void_p, ctypes.c_int]
    _atomic_load.restype = ctypes.c_uint64
    _atomic_store = _libatomic["__atomic_store_8"]
    _atomic_store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    _atomic_store.restype = None
FULL_FENCE = ORDERING == "compiled" or _atomic_exchange is not None


class Words(Protocol):
    """Aligned 8-byte words of one mapping, read with acquire and written with release order:
    OrderedWords below, or the compiled _native/_atomic.c Words. Made by `ordered_words`, owned by
    the Segment that owns the mapping; `release()` must run before the mapping closes."""

    def load_acquire(self, offset: int, /) -> int: ...
    def store_release(self, offset: int, value: int, /) -> None: ...
    def exchange(self, offset: int, value: int, /) -> int: ...
    def compare_exchange(self, offset: int, expected: int, value: int, /) -> bool: ...
    def release(self) -> None: ...


def ordered_words(mapping: mmap.mmap) -> Words:
    """Words of `mapping` through the compiled module where ORDERING says so, else Python."""
    if _compiled is not None and ORDERING == "compiled":
        words: Words = _compiled.Words(mapping)
        return words
    return OrderedWords(mapping)


class OrderedWords:
    """The pure-Python Words: ctypes calls into libatomic, or plain loads and stores (x86)."""

    _words: memoryview | None = None
    _anchor: ctypes.Array[ctypes.c_char] | None = None
    _base_address = 0

    def __init__(self, mapping: mmap.mmap) -> None:
        whole = memoryview(mapping)
        self._words = whole[:len(whole) - len(whole) % 8].cast("Q")
        whole.release()
        if _libatomic is not None:  # raw addresses for libatomic
            self._anchor = (ctypes.c_char * len(mapping)).from_buffer(mapping)
            self._base_address = ctypes.addressof(self._anchor)

    def load_acquire(self, offset: int) -> int:
        """Return the u64 at byte `offset` (a multiple of 8); later reads happen after it."""
        if _atomic_load is not None:
            return int(_atomic_load(self._base_address + offset, _ATOMIC_ACQUIRE))
        return int(self._words[offset >> 3])  # type: ignore[index]

    def store_release(self, offset: int, value: int) -> None:
        """Store `value` (mod 2**64) at byte `offset` (a multiple of 8) after all earlier
        accesses."""
        if _atomic_store is not None:
            _atomic_store(self._base_address + offset, value & _U64_MASK, _ATOMIC_RELEASE)
            return
        self._words[offset >> 3] = value & _U64_MASK  # type: ignore[index]

    def exchange(self, offset: int, value: int) -> int:
        """Atomically swap in `value` at byte `offset` with a full barrier; return the old value.

        Without libatomic this is a plain load and store (no barrier; see FULL_FENCE).
        """
        if _atomic_exchange is not None:
            return int(_atomic_exchange(self._base_address + offset, value & _U64_MASK,
                                        _ATOMIC_SEQ_CST))
        old = int(self._words[offset >> 3])  # type: ignore[index]
        self._words[offset >> 3] = value & _U64_MASK  # type: ignore[index]
        return old

    def compare_exchange(self, offset: int, expected: int, value: int) -> bool:
        """Store `value` at byte `offset` if it holds `expected` (seq_cst); say whether it did.

        Without libatomic this is a plain compare then store (not atomic; see FULL_FENCE).
        """
        if _atomic_cas is not None:
            slot = ctypes.c_uint64(expected)
            return bool(_atomic_cas(self._base_address + offset, ctypes.byref(slot),
                                    value & _U64_MASK, _ATOMIC_SEQ_CST, _ATOMIC_SEQ_CST))
        if int(self._words[offset >> 3]) != expected:  # type: ignore[index]
            return False
        self._words[offset >> 3] = value & _U64_MASK  # type: ignore[index]
        return True

    def release(self) -> None:
        """Drop the exports of the mapping so that it can be closed."""
        if self._words is not None:
            self._words.release()
            self._words = None
        self._anchor = None
        self._base_address = 0
