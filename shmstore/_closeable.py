"""Closeable: the `with` protocol of every class that owns an OS resource."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

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
