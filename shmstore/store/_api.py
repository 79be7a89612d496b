"""WriterAPI: what a store's writer offers the layers above, wherever the writer lives.

Two implementations meet it: StoreWriter (this process created the store) and RemoteWriter
(another process of the same user writes through the creator's WriterHost). The queue, the
caches and the vLLM plugin program against WriterAPI; mypy checks both classes against it
(_writer.py and _remote.py) and tests/store/test_writer_api.py compares their signatures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from ..errors import KeyNotCached
from ..handle import Handle, HandOut

__all__ = ["WriterAPI", "HandleVerbs", "must_be_cached"]


@runtime_checkable
class WriterAPI(Protocol):
    """What a store's writer does, for the layers above: hand objects out (as HandOut values,
    whatever the number of keys: a remote writer batches them itself), take hand-outs back or
    narrow them, and drop objects. One thread at a time; handles stay valid as StoreWriter's
    docstring says. Every writer also has HandleVerbs' conveniences (put and get_cached,
    returning a bare Handle); StoreWriter offers more (reserve, stats) for code that holds it
    directly."""

    name: str
    n_readers: int
    max_object_bytes: int

    @property
    def closed(self) -> bool:
        """Whether close() was called."""

    def hand_out_new(self, key: str | bytes, obj: Any, timeout: float | None = 0) -> HandOut:
        """Store `obj` (or a serde.Encoded) under `key` and hand it out once."""

    def store(self, key: str | bytes, obj: Any) -> Handle:
        """Store `obj` under `key`, owed by no reader (cached for whoever asks next): what a
        process that stores for others needs (a miss pool's worker). Raises as hand_out_new."""

    def hand_out_cached(self, keys: Iterable[str | bytes], field: str | None = None
                        ) -> list[HandOut | None]:
        """Hand each cached key's object out once more (None for a key not cached); with
        `field`, HandOut.record holds the bytes under it."""

    def hand_out(self, handle: Handle) -> HandOut:
        """Hand the object of `handle` out once more."""

    def cached(self, keys: Iterable[str | bytes]) -> list[bool]:
        """Whether each of `keys` is cached; no side effect."""

    def issued(self, key: str | bytes, handout: HandOut) -> bool:
        """Whether `handout` is one this store made of what it caches under `key` now."""

    def give_back(self, handle: Handle, number: int | None = None, *, wait: bool = True) -> None:
        """Take back one hand-out of `handle` that no reader will read. wait=False: the call
        may be posted (a remote writer does not wait for it), and a handle gone meanwhile is
        not an error."""

    def narrow(self, handle: Handle, number: int, readers: Iterable[int], *,
               wait: bool = True) -> None:
        """Owe hand-out `number` of `handle` only by `readers`; wait=False as in give_back."""

    def end_handouts(self, groups: Iterable[tuple[Handle, Iterable[int]]]) -> list[bool]:
        """Say that the hand-outs of each (handle, numbers) are over."""

    def unread(self, handle: Handle) -> tuple[int, ...]:
        """Reads each reader still owes on the object of `handle`."""

    def withdraw(self, handle: Handle) -> bool:
        """Drop the object of `handle` now; False if it is gone already."""

    def clear(self, *, keep_handed_out: bool = False) -> None:
        """Forget every key."""

    def __len__(self) -> int:
        """Objects cached now."""

    def close(self) -> None:
        """Release what this writer holds; idempotent."""


class HandleVerbs:
    """The bare-Handle verbs every writer has, each a thin turn of a HandOut verb, for code
    that never names a hand-out (a reader reads by the Handle alone)."""

    def put(self: WriterAPI, key: str | bytes, obj: Any, timeout: float | None = 0) -> Handle:
        """hand_out_new(key, obj, timeout).handle: store `obj` under `key`, handed out once.
        Raises as hand_out_new (KeyExists: `key` is cached, use get_cached)."""
        return self.hand_out_new(key, obj, timeout).handle

    def get_cached(self: WriterAPI, key: str | bytes) -> Handle:
        """hand_out_cached([key])[0].handle: the object of `key` handed out once more.

        Raises:
            KeyNotCached: the key was never put or has been evicted (put it again).
            InvalidKey: `key` is not a non-empty str or bytes.
        """
        return must_be_cached(self, key, self.hand_out_cached([key])[0]).handle


def must_be_cached(writer: WriterAPI, key: str | bytes, found: HandOut | None) -> HandOut:
    """`found`, the hand-out of `key`; KeyNotCached if it is None (not cached)."""
    if found is None:
        raise KeyNotCached(f"key {key!r} is not in store {writer.name!r} (never put, evicted "
                           "or cleared): put it again", key)
    return found
