"""The receiver, whatever the engine: one worker's reads of the hand-outs its engine gives it.

A worker counts each hand-out once per request: an engine may send a request it preempted
again as new (vLLM's V2 model runner does), and the second read must not take the read a later
hand-out of the same object is owed. Requests with several samples (n > 1) are one request
each, and the sender hands the item out once for each. Before reading, a hand-out is checked
against what it names: the item's key (its handle's key digest), a number the store has made,
and the object's origin (its id), so a damaged or replayed hand-out takes no read another
request still needs. A worker on node k of a TP group across nodes reads its relay's copy by
object id (serving/_nodes.py NodeFeed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..errors import CorruptObject, StaleHandle
from ..handle import HandOut, key_digest
from ..store._object_store import StoreReader
from ._log import log
from ._nodes import FEED_ERRORS, NodeFeed

__all__ = ["Receiver", "Unreadable", "READ_MEMORY"]

READ_MEMORY = 1 << 16  # (request, hand-out) pairs a worker remembers having read


class Unreadable(Exception):
    """A hand-out this worker cannot read (stale, damaged, another item's, or its node's
    relay failed): the engine must ask for the item again; the log line says why."""


class Receiver:
    """One worker's reads: `read(handout, key, request)` returns the stored value."""

    def __init__(self, attach: Callable[[], StoreReader], feed: NodeFeed | None = None, *,
                 pin_memory: bool = False) -> None:
        self._attach = attach  # this worker's reader, attached at first use
        self._reader: StoreReader | None = None
        self.feed = feed
        self._pin_memory = pin_memory
        self._read: OrderedDict[tuple[str | None, int], None] = OrderedDict()

    @property
    def reader(self) -> StoreReader:
        if self._reader is None:
            self._reader = self._attach()
        return self._reader

    def read(self, handout: HandOut, key: str | bytes, request: str | None) -> Any:
        """The value of `handout`, an item of `key` in `request` (None: not known), counted
        as read once per (request, hand-out). Unreadable: it cannot be read."""
        handle, number = handout.handle, handout.number
        if handle.key_digest != key_digest(key):
            log.warning("shmstore: item %s carries the handle of another item; asking for it "
                        "again", key)
            raise Unreadable("another item's handle")
        read = (request, number)
        count = read not in self._read
        try:
            if self.feed is not None:
                value = self.feed.get(handout.object_id)
            else:
                reader = self.reader
                if not 0 < number <= reader.handout_seq:
                    raise StaleHandle(f"hand-out number {number} was never made by the store "
                                      f"(its last is {reader.handout_seq})", handle)
                value = reader.get(handle, count=count, pin_memory=self._pin_memory,
                                   origin=handout.origin)
        except (StaleHandle, CorruptObject, *FEED_ERRORS) as exc:
            log.warning("shmstore: item %s cannot be read (%s); asking for it again", key, exc)
            raise Unreadable(str(exc)) from None
        if count:
            self._read[read] = None
            if len(self._read) > READ_MEMORY:
                self._read.popitem(last=False)
        return value

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self.feed is not None:
            self.feed.close()
