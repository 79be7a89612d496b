"""A request, as one object per context: what the hooks learn about it and the sender needs.

vLLM meets a request in two contexts, and each holds its own RequestScope as the current one
(one ContextVar; the sender's calls take no argument of ours, so they find it there):

    the server's task   render_async opens a scope for the task that renders the request
                        (`rendering`): the hand-outs rendered for it (`rendered`), which the
                        ledger learns of when the task's scope goes, unless a request claimed
                        them
    the processing      the processor's cached path (`cached_apply`, where the processor hook
                        opens a scope, `opened`) asks the cache which items are cached
                        (`missing_items`, where the hook lists the request's lazy images in
                        the scope) and stores and hands out the misses, on one thread: the
                        records' `fingerprint`, the `pending` images, how many stayed
                        `undecoded`

vLLM runs the processing on a thread of its own, which does not share the task's context, so
the two are two objects; a processing scope opened inside a task's ends with its block and
the task's is current again. Outside both (a processor path without the cache) nothing is
fingerprinted, pending or rendered.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["RequestScope", "current", "opened", "within", "rendering"]


class RequestScope:
    """`fingerprint`: what records are written and read with (None: no records); `pending`:
    the request's lazy images not decoded yet, by item hash (vllm/_images.py); `undecoded`:
    how many of its images were never decoded (set when processing ends); `rendered`: the
    hand-out numbers rendered in a server task's scope (None in a processing scope)."""

    __slots__ = ("__weakref__", "fingerprint", "pending", "rendered", "undecoded")

    def __init__(self, fingerprint: bytes | None = None,
                 rendered: list[int] | None = None) -> None:
        self.fingerprint = fingerprint
        self.pending: dict[str, list[Any]] = {}
        self.undecoded = 0
        self.rendered = rendered


_SCOPE: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar(
    "shmstore_request_scope", default=None)


def current() -> RequestScope | None:
    """The scope of the request being processed in this context, None outside one."""
    return _SCOPE.get()


def rendering() -> RequestScope:
    """A new scope for the server task running now, current for the rest of the task (its
    context ends with it): the hand-outs rendered for its request go in `rendered`."""
    scope = RequestScope(rendered=[])
    _SCOPE.set(scope)
    return scope


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
