"""The sender, whatever the engine: one API server's hand-outs of stored items.

An engine adapter (vLLM's: vllm/_sender.py) turns its cache calls into these steps and its
items into values; everything about hand-outs is here:

    touch(keys, field, accept)   hits taken early, in one call (one round trip through another
                                 API server's host): pinned from here, kept until used or
                                 released; `accept` may refuse a hit (its record), which is
                                 given back at once
    hit(key)                     a kept touch (renewed where hand-outs are published in order),
                                 else a hand-out of the cached object; None: a miss
    store(key, value)            a miss stored and handed out; a full store settles what ended
                                 requests held and tries once more; None: send it inline
    shared(key)                  a miss another API server stored meanwhile (KeyExists)
    deliver(handout, has_data)   the hand-out goes to the engine: published to the other nodes
                                 (a TP group across nodes) and recorded in the request ledger;
                                 None: send the data instead (given back)
    release()                    touches never used go back, each by its number
    issued(key, handout)         whether the store made a hand-out an engine input carries

Threads: every step takes `lock` (the adapter's, held around each of its store calls too);
the ledger (serving/_requests.py) shares it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..cache._caches import store_or_inline
from ..errors import StaleHandle, Timeout
from ..handle import Handle, HandOut
from ..store._api import WriterAPI
from ._log import log
from ._nodes import HeadPublisher
from ._requests import RequestLedger

__all__ = ["Sender", "Unreachable", "OUTCOMES"]

OUTCOMES = ("hit", "shared", "stored", "inline")  # Sender.items: what each item came to


class Unreachable(Exception):
    """A hit without data cannot reach every node (a relay is not connected): the engine must
    ask for the item again with its data."""


class Sender:
    """One API server's hand-outs: hits, misses, touches, and the request ledger they follow."""

    def __init__(self, store: WriterAPI, lock: threading.RLock, *, settle_s: float,
                 lease_s: float, head: HeadPublisher | None = None) -> None:
        self.store = store
        self.lock = lock
        self.head = head
        self.touched: dict[str, HandOut] = {}  # hand-outs taken early (touch), kept
        self.items = dict.fromkeys(OUTCOMES, 0)
        self.ledger = RequestLedger(store, settle_s, lease_s, self._is_touched, lock=lock)

    def _is_touched(self, handle: Handle) -> bool:
        return any(kept.handle == handle for kept in self.touched.values())

    def touch(self, keys: Iterable[str], field: str | None,
              accept: Callable[[str, HandOut], bool]) -> None:
        """Take the hand-outs of the cached `keys` not touched yet, in one call; keep those
        `accept` takes, give the others back (posted: no round trip)."""
        with self.lock:
            want = list(dict.fromkeys(k for k in keys if k not in self.touched))
            found = self.store.hand_out_cached(want, field) if want else []
            for key, hit in zip(want, found, strict=True):
                if hit is None:
                    continue
                if accept(key, hit):
                    self.touched[key] = hit
                else:
                    self.store.give_back(hit.handle, hit.number, wait=False)

    def touch_one(self, key: str) -> None:
        """Take one more touch of `key` if it has none kept (a hit vLLM touches again)."""
        with self.lock:
            if key not in self.touched:
                hit = self.store.hand_out_cached([key])[0]
                if hit is not None:
                    self.touched[key] = hit

    def hit(self, key: str, *, cached_here: bool) -> HandOut | None:
        """The hand-out of a hit on `key`: its kept touch, else (if the adapter can use a hit
        on it: `cached_here`) a new hand-out of the cached object; None: a miss."""
        with self.lock:
            handout = self.touched.pop(key, None)
            if handout is not None and self.head is not None:
                # published hand-outs go out in the order they are made: renew the kept one
                handout = self.head.renew(handout)
            if handout is None and cached_here:
                handout = self.store.hand_out_cached([key])[0]
            if handout is not None:
                self.items["hit"] += 1
            return handout

    def store_new(self, key: str, value: Any) -> HandOut | None:
        """Store a miss and hand it out; None: send it inline (too large, or the store is full
        even after withdrawing what only ended requests held). KeyExists: another API server
        stored it meanwhile (see shared)."""
        with self.lock:
            handout, why = store_or_inline(self.store, key, value,
                                           lambda: self.ledger.settle(full=True))
            if handout is None:
                self.items["inline"] += 1
                log.debug("shmstore: item %s sent inline (%s)", key, why)
                return None
            self.items["stored"] += 1
            return handout

    def shared(self, key: str) -> HandOut | None:
        """A hand-out of what another API server stored under `key`; None: evicted in between
        (send it inline, not worth a second try)."""
        with self.lock:
            handout = self.store.hand_out_cached([key])[0]
            self.items["shared" if handout is not None else "inline"] += 1
            return handout

    def deliver(self, handout: HandOut, key: str, *, has_data: bool) -> HandOut | None:
        """`handout` goes to the engine: on a TP group across nodes it is published first.
        None: send the data instead (a node's relay is not connected, or too slow to take it;
        the hand-out is given back). Unreachable: a hit without data cannot reach every node."""
        with self.lock:
            head = self.head
            if head is not None:
                why = "" if head.ready() else "a node's relay is not connected"
                if not why:
                    try:
                        head.publish(handout)
                    except Timeout:  # given back by publish
                        why = "the relays did not take it in time"
                else:
                    self.store.give_back(handout.handle, handout.number)
                if why:
                    if not has_data:
                        log.warning("shmstore: item %s cannot reach every node (%s)", key, why)
                        raise Unreachable(why)
                    self.items["inline"] += 1
                    log.debug("shmstore: item %s sent inline (%s)", key, why)
                    return None
            self.ledger.handed_out(handout.number, handout.handle, key)
            return handout

    def issued(self, key: str, handout: HandOut) -> bool:
        """Whether `handout` (from an engine input) is one the store made of `key` now."""
        with self.lock:
            return self.store.issued(key, handout)

    def release(self) -> None:
        """Give back every touch not used: that hand-out, not the object's last (another
        server's, maybe narrowed)."""
        with self.lock:
            touched, self.touched = self.touched, {}
            for kept in touched.values():
                try:
                    self.store.give_back(kept.handle, kept.number)
                except StaleHandle:
                    pass  # cleared meanwhile: nothing to give back

    def routed(self, request_id: str, engine: int, engines: int, per_engine: int) -> None:
        """The engine client sends `request_id` to engine `engine` of `engines`: its hand-outs
        are owed by that engine's `per_engine` workers only."""
        if engines > 1:
            first = engine % engines * per_engine
            self.ledger.routed(request_id, range(first, first + per_engine))

    def clear(self) -> None:
        """New requests find nothing; the hand-outs of requests in flight stay readable until
        their workers have read them."""
        with self.lock:
            self.release()
            self.store.clear(keep_handed_out=True)
            self.ledger.forget()

    def close(self) -> None:
        """Stop the ledger and give back what is kept (the store's writers are the caller's)."""
        self.ledger.close()
        with self.lock:
            if not self.store.closed:
                self.release()
