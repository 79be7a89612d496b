"""WriterAPI: what a store's writer offers the layers above, wherever the writer lives.

Two implementations meet it: StoreWriter (this process created the store) and RemoteWriter
(another process of the same user writes through the creator's WriterHost). The queue, the
caches and the vLLM plugin program against WriterAPI; mypy checks both classes against it
(_writer.py and _remote.py) and tests/store/test_writer_api.py compares their signatures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from ..handle import Handle

__all__ = ["WriterAPI"]


@runtime_checkable
class WriterAPI(Protocol):
    """The calls of a store writer that a cache or a plugin needs, local or remote. One thread
    at a time; handles stay valid as StoreWriter's docstring says."""

    name: str
    n_readers: int
    max_object_bytes: int

    @property
    def handout_seq(self) -> int:
        """The number of the last hand-out this writer made (put, get_cached, hand_out)."""

    @property
    def closed(self) -> bool:
        """Whether close() was called."""

    def put(self, key: str | bytes, obj: Any, timeout: float | None = 0) -> Handle:
        """Store `obj` under `key` and hand it out once."""

    def get_cached(self, key: str | bytes) -> Handle:
        """Hand the object of `key` out once more; KeyNotCached if it is not cached."""

    def hand_out_cached(self, keys: Iterable[str | bytes]) -> list[tuple[Handle, int] | None]:
        """get_cached for each cached key in one call: (handle, hand-out number) or None."""

    def peek_cached(self, keys: Iterable[str | bytes], field: str
                    ) -> list[tuple[Handle, int, bytes | None] | None]:
        """hand_out_cached, with the bytes under `field` of each object's top-level map."""

    def is_cached(self, key: str | bytes) -> bool:
        """Whether `key` is cached; no side effect."""

    def cached(self, keys: Iterable[str | bytes]) -> list[bool]:
        """is_cached for each of `keys`; no side effect."""

    def handle_of(self, key: str | bytes) -> Handle | None:
        """The handle of `key` without handing it out; None if it is not cached."""

    def object_id(self, key: str | bytes) -> bytes | None:
        """The 24-byte id of the bytes cached under `key`; None if it is not cached."""

    def give_back(self, handle: Handle, number: int | None = None, *, wait: bool = True) -> None:
        """Take back one hand-out of `handle` that no reader will read. wait=False: the call
        may be posted (a remote writer does not wait for it), and a handle gone meanwhile is
        not an error."""

    def hand_out(self, handle: Handle) -> Handle:
        """Hand the object of `handle` out once more (its number is then `handout_seq`)."""

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
