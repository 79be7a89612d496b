"""A request as vLLM meets it in two contexts, and what each holds.

    processing     vLLM processes a request's items (its processor's cached path): the
                   processor hook opens a RequestScope and passes it on explicitly, inside the
                   sender view it puts in vLLM's ProcessorInputs in place of the sender
                   (vllm/_sender.py `Processing`); every cache call of that processing carries
                   it to the sender: the fingerprint records are written and read with, the
                   request's lazy images not decoded yet (`pending`)
    the server's   render_async (the server's task for one request) keeps the hand-outs
    task           rendered for it (`rendering`); the task's context holds them (one
                   ContextVar: vLLM's _process_tokens_async, where the hand-outs appear, is
                   called inside the task and takes no argument of ours), and the ledger
                   learns of those no request claimed when the task ends

vLLM runs the processing on a thread of its own, which does not share the task's context: the
two are separate objects. Outside both (a processor path without the cache) nothing is
fingerprinted, pending or rendered.
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["RequestScope", "Rendered", "rendering", "rendered"]


class RequestScope:
    """One request's processing: `fingerprint`, what records are written and read with (None:
    no records); `pending`, its lazy images not decoded yet, by item hash (vllm/_accel)."""

    __slots__ = ("fingerprint", "pending")

    def __init__(self, fingerprint: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self.pending: dict[str, list[Any]] = {}


class Rendered:
    """The hand-out numbers rendered in one server task (`numbers`)."""

    __slots__ = ("__weakref__", "numbers")

    def __init__(self) -> None:
        self.numbers: list[int] = []


_RENDERED: contextvars.ContextVar[Rendered | None] = contextvars.ContextVar(
    "shmstore_rendered", default=None)


def rendering() -> Rendered:
    """A new Rendered for the server task running now, held for the rest of the task (its
    context ends with it)."""
    held = Rendered()
    _RENDERED.set(held)
    return held


def rendered() -> Rendered | None:
    """The Rendered of the server task running now; None outside one."""
    return _RENDERED.get()
