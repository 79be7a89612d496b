"""One request's processing, as one object: what the hooks learn about it and the sender needs.

vLLM calls its processor's cached path (`cached_apply`, where the processor hook opens the
scope), which asks the cache which items are cached (`missing_items`, where the hook lists the
request's lazy images in the scope) and then stores and hands out the misses, on one thread.
The sender's calls in between (is_cached, get_and_update_item) take no argument of ours, so
they find the scope as the current one of their context: one ContextVar, set only while the
hook's block runs, holding everything per request. Outside a scope (a processor path without
the cache) nothing is fingerprinted and nothing is pending.

The hand-outs rendered in one task of the OpenAI server (vllm/_hooks.py `_Rendered`) live in
another scope: the asyncio task, which the processing thread does not share.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["RequestScope", "current", "opened", "within"]


class RequestScope:
    """`fingerprint`: what records are written and read with (None: no records); `pending`:
    the request's lazy images not decoded yet, by item hash (vllm/_images.py); `undecoded`:
    how many of its images were never decoded (set when processing ends)."""

    __slots__ = ("fingerprint", "pending", "undecoded")

    def __init__(self, fingerprint: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self.pending: dict[str, list[Any]] = {}
        self.undecoded = 0


_SCOPE: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar(
    "shmstore_request_scope", default=None)


def current() -> RequestScope | None:
    """The scope of the request being processed in this context, None outside one."""
    return _SCOPE.get()


@contextmanager
def opened(fingerprint: bytes | None) -> Iterator[RequestScope]:
    """A new scope, current for the block (nested scopes end in reverse order)."""
    scope = RequestScope(fingerprint)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


@contextmanager
def within() -> Iterator[RequestScope]:
    """The current scope, or a new one (no fingerprint) for the block."""
    scope = _SCOPE.get()
    if scope is not None:
        yield scope
        return
    with opened(None) as scope:
        yield scope
