"""The sender, whatever the engine: one API server's hand-outs of stored items.

An engine adapter (vLLM's: vllm/_sender.py) turns its cache calls into these steps and its
items into values; everything about hand-outs is here, on cache/_caches.py's StoreSender (the
same hits, misses and touches the caches' shm kinds use):

    touch(keys, field, accept)   hits taken early, in one call (one round trip through another
                                 API server's host): pinned from here, kept until used or
                                 released; `accept` may refuse a hit (its record), which is
                                 given back at once
    hit(key)                     a kept touch (renewed where hand-outs are published in order),
                                 else a hand-out of the cached object; None: a miss
    store_miss(key, value)       a miss stored and handed out; a full store settles what ended
                                 requests held and tries once more; None: send it inline
    shared(key)                  a miss another API server stored meanwhile (KeyExists)
    store_or_share(key, value)   store_miss, else shared
    deliver(handout, has_data)   the hand-out goes to the engine: published to the other nodes
                                 (a TP group across nodes) and recorded in the request ledger;
                                 None: send the data instead (given back)
    release()                    touches never used go back, each by its number
    issued(key, handout)         whether the store made a hand-out an engine input carries
    check_issued(key, handout)   the same, refused with InvalidArgument (a ValueError)

Threads: every step takes `lock` (the adapter's, held around each of its store calls too);
the ledger (serving/_requests.py) shares it.
"""

from __future__ import annotations

import threading
from typing import Any

from ..cache._caches import StoreSender
from ..errors import InvalidArgument, KeyExists, Timeout
from ..handle import HandOut
from ..store._api import WriterAPI
from ._log import log
from ._nodes import HeadPublisher
from ._requests import RequestLedger

__all__ = ["Sender", "Unreachable", "OUTCOMES", "Beside", "Queries"]

OUTCOMES = ("hit", "pooled", "shared", "stored", "inline")  # Sender.items: what each item
# came to ("pooled": found stored because the node's miss pool made it for this request: new)


PRUNE_BESIDE = 64  # values kept beyond twice those of stored keys before Beside prunes


class Unreachable(Exception):
    """A hit without data cannot reach every node (a relay is not connected): the engine must
    ask for the item again with its data."""


class Sender(StoreSender):
    """One API server's hand-outs: StoreSender's hits, misses and touches (cache/_caches.py),
    the request ledger they follow, and the other nodes of a TP group across nodes."""

    def __init__(self, store: WriterAPI, lock: threading.RLock, *, settle_s: float,
                 lease_s: float, head: HeadPublisher | None = None) -> None:
        super().__init__(store, lock)
        self.head = head
        self.items = dict.fromkeys(OUTCOMES, 0)
        self.ledger = RequestLedger(store, settle_s, lease_s, self.is_touched, lock=lock)

    def hit(self, key: str, *, cached_here: bool, pooled: bool = False) -> HandOut | None:
        """StoreSender.take, renewed where hand-outs are published in order, and counted: as
        "pooled" where the node's miss pool stored it for this request (a new item, found
        stored), else as a hit."""
        with self.lock:
            handout = self.take(key, cached_here=cached_here)
            if handout is not None:
                self.items["pooled" if pooled else "hit"] += 1
            return handout

    def renew(self, kept: HandOut) -> HandOut:
        """Published hand-outs go out in the order they are made: a kept touch is made anew."""
        return kept if self.head is None else self.head.renew(kept)

    def store_miss(self, key: str, value: Any) -> HandOut | None:
        """StoreSender.store_new, retried once after settling what ended requests held; None:
        send it inline. KeyExists: another API server stored it meanwhile (see shared)."""
        with self.lock:
            handout, why = self.store_new(key, value, lambda: self.ledger.settle(full=True))
            if handout is None:
                self.items["inline"] += 1
                log.debug("shmstore: item %s sent inline (%s)", key, why)
                return None
            self.items["stored"] += 1
            return handout

    def store_or_share(self, key: str, value: Any) -> HandOut | None:
        """store_miss, or (another API server stored `key` meanwhile) shared: None, inline."""
        try:
            return self.store_miss(key, value)
        except KeyExists:
            return self.shared(key)

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

    def stored(self, keys: list[str]) -> list[bool]:
        """Which of `keys` the store holds (no hand-out, no side effect)."""
        with self.lock:
            return self.store.cached(keys)

    def check_issued(self, key: str, handout: HandOut) -> None:
        """An engine input carries `handout` for `key`: InvalidArgument (a ValueError) unless
        this store made it for that key and it is current (the workers' checks, made first)."""
        if not self.issued(key, handout):
            raise InvalidArgument(f"item {key!r} carries a shmstore handle that this server did "
                                  "not issue for it (forged, stale or from another server); "
                                  "send the data instead", "handout", handout)

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


class Beside:
    """What this API server keeps beside the store's objects, by key (an engine's per-item
    data that never goes to the store: vLLM's prompt updates). A key is usable only while
    both this table and the store have it; values of keys gone from the store are dropped
    once the table has grown by PRUNE_BESIDE beyond twice what survived the last prune.
    The caller holds the sender's lock around every call."""

    def __init__(self, store: WriterAPI) -> None:
        self._store = store
        self._values: dict[str, Any] = {}
        self._prune_at = PRUNE_BESIDE

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        """Keep `value` without a prune (inside a store call: no second one)."""
        self._values[key] = value

    def usable(self, key: str) -> bool:
        """Both here and in the store (a hit needs both)."""
        return key in self._values and self._store.cached([key])[0]

    def add(self, key: str, value: Any) -> None:
        """Keep `value`, first dropping the values of keys gone from the store if due."""
        if len(self._values) >= self._prune_at:
            keys = list(self._values)
            kept = self._store.cached(keys)
            self._values = {k: self._values[k] for k, c in zip(keys, kept, strict=True) if c}
            self._prune_at = 2 * len(self._values) + PRUNE_BESIDE
        self._values[key] = value

    def drop_if_gone(self, key: str) -> None:
        """Forget `key`'s value if the store no longer has it (an engine's invalidation)."""
        if not self._store.cached([key])[0]:
            self._values.pop(key, None)

    def clear(self) -> None:
        self._values.clear()


class Queries:
    """An engine's own hit counter (vLLM's hit ratio): queries and true hits since the last
    reset, and `delta()` since the last delta. An item the pool made for this request is a
    query, not a hit."""

    def __init__(self) -> None:
        self.hits = self.total = 0
        self._last = (0, 0)

    def count(self, hit: bool) -> None:
        self.total += 1
        self.hits += hit

    def info(self, delta: bool = False) -> tuple[int, int]:
        """(hits, queries) since the last reset, or (delta) since the last delta."""
        return self.delta() if delta else (self.hits, self.total)

    def delta(self) -> tuple[int, int]:
        """(hits, queries) since the last delta."""
        now = (self.hits, self.total)
        then, self._last = self._last, now
        return now[0] - then[0], now[1] - then[1]

    def reset(self) -> None:
        self.hits = self.total = 0
        self._last = (0, 0)
