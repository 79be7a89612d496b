"""The receiver, whatever the engine: one worker's reads of the hand-outs its engine gives it:
cache/_caches.py's StoreReceiver (each hand-out checked against what it names, then counted
once per request: an engine may send a request it preempted again as new, as vLLM's V2 model
runner does, and the second read must not take the read a later hand-out of the same object is
owed; requests with several samples are one request each, handed out once for each), and, on
node k of a TP group across nodes, its relay's copy read by object id (serving/_nodes.py
NodeFeed). What cannot be read is Unreadable, with a log line saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cache._caches import StoreReceiver
from ..errors import CorruptObject, StaleHandle
from ..handle import KEY_DIGEST_BYTES, HandOut, key_digest
from ..store._object_store import StoreReader
from ._log import log
from ._nodes import FEED_ERRORS, NodeFeed

__all__ = ["Receiver", "Unreadable"]


class Unreadable(Exception):
    """A hand-out this worker cannot read (stale, damaged, another item's, or its node's
    relay failed): the engine must ask for the item again; the log line says why."""


class Receiver(StoreReceiver):
    """One worker's reads: `read(handout, key, request)` returns the stored value."""

    def __init__(self, attach: Callable[[], StoreReader], feed: NodeFeed | None = None, *,
                 pin_memory: bool = False) -> None:
        super().__init__(attach, pin_memory=pin_memory)
        self.feed = feed

    def read(self, handout: HandOut, key: str | bytes | None = None,
             request: str | None = None) -> Any:
        """The value of `handout`, an item of `key` in `request`. Unreadable: it cannot be."""
        digest = handout.handle.key_digest
        if ((key is not None and digest != key_digest(key))
                or handout.object_id[:KEY_DIGEST_BYTES] != digest):  # a relay reads by the id
            log.warning("shmstore: item %s carries the handle or object id of another item; "
                        "asking for it again", key)
            raise Unreadable("another item's handle or object id")
        try:
            if self.feed is not None:
                return self.feed.get(handout.object_id)
            return super().read(handout, key, request)
        except (StaleHandle, CorruptObject, *FEED_ERRORS) as exc:
            log.warning("shmstore: item %s cannot be read (%s); asking for it again", key, exc)
            raise Unreadable(str(exc)) from None

    def close(self) -> None:
        super().close()
        if self.feed is not None:
            self.feed.close()
