"""The plugin's sender cache, in each vLLM API process.

Sender (API process, "P0"), one per engine::

    is_cached(hs)              one round trip: the hits are handed out (pinned) and, for an
                               item another API server processed, its prompt-update record
                               read from the store (vllm/_accel): no HF processor here
    is_cached_item(h)          store.is_cached: no side effect
    touch_sender_cache_item(h) a cached item is handed out now and the hand-out kept: it cannot
                               be evicted until get_and_update_item uses it or
                               release_sender_touches gives it back
    get_and_update_item        hit: (handle item, P0's prompt updates); miss: put the item's
                               tensors, return the handle item; an item above
                               mm_shm_cache_max_object_size_mb or a full store: the item itself
                               (inline, counted), never dropped, never an error
    validate_input_item        a handle item from a client must be this store's current handle
                               for that hash (ValueError otherwise)
    clear_cache                store.clear(): every earlier handle is stale

While vLLM processes one request, its processor calls these through `Processing`, the view the
processor hook passes in vLLM's ProcessorInputs in place of the sender: each call carries the
request's scope (vllm/_scope.py) to the sender explicitly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import InvalidArgument
from ..handle import HandOut
from ..serving._deployment import open_writer
from ..serving._nodes import HeadPublisher
from ..serving._sender import Beside, Queries, Sender, Unreachable
from ..store._api import WriterAPI
from ._accel import RECORD_FIELD, Acceleration, realize_misses
from ._accel._pool import open_pool_sender
from ._deployment import Deployment
from ._env import LOG_NAME, PUBLISH_ENV
from ._items import handle_item, handout_from_item, item_to_value
from ._metrics import export_metrics
from ._scope import RequestScope
from ._vllm import BaseMultiModalProcessorCache, CacheInfo, MultiModalCacheMissError, with_cache

__all__ = ["ShmstoreSenderCache", "Processing", "SENDERS"]

log = logging.getLogger(LOG_NAME)

SENDERS: list[ShmstoreSenderCache] = []  # this process's senders, for vLLM's request hooks


class ShmstoreSenderCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    """vLLM's P0 cache, backed by one shmstore ObjectStore (this process writes it).

    Its hand-outs follow vLLM's requests (serving/_requests.py): the hooks `install()` puts into
    vLLM's API process tell `ledger` when a request is added, refused or ends."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__()
        self.deployment = d = Deployment.read(vllm_config)
        self._lock = threading.RLock()  # around every call of the writer, the host's too
        self._writers = open_writer(d, self._lock, lambda make: _head(make, d))
        self.store: WriterAPI = self._writers.store
        self._core = Sender(self.store, self._lock, settle_s=d.settle_s, lease_s=d.lease_s,
                            head=self._writers.head)
        self.ledger, self.items = self._core.ledger, self._core.items
        self._updates = Beside(self.store)  # prompt updates stay on P0
        self.queries = Queries()  # vLLM's hit ratio
        self.accel = Acceleration(d.accelerate, d.processor_identity, d.vocab_size,
                                  self.ledger.lock)
        self.pool = open_pool_sender(d, self._writers, self.accel)
        self._unregister_metrics = export_metrics(self)
        SENDERS.append(self)
        d.log_layout(self._writers.role, self._writers.head is not None)

    def routed(self, request_id: str, engine: int) -> None:
        """The DP client sends `request_id` to engine `engine` (its DP rank): its hand-outs are
        owed by that engine's workers only."""
        d = self.deployment
        self._core.routed(request_id, engine, d.engines, d.per_engine)

    @property
    def publisher(self) -> Any:
        """The relay Publisher of a TP group across nodes (relay/_publisher.py), else None."""
        return None if self._writers.head is None else self._writers.head.publisher

    @contextmanager
    def processing(self, inputs: Any, hf_processor_mm_kwargs: Any, items: Any
                   ) -> Iterator[Any]:
        """vLLM processes one request in this block (the processor hook): `inputs` again, the
        sender in a `Processing` view carrying the request's scope to every cache call."""
        scope = RequestScope(self.accel.fingerprint(hf_processor_mm_kwargs))
        yield with_cache(inputs, Processing(self, scope))
        self.accel.processed(items)

    async def before_processing(self, renderer: Any, prompt: Any) -> None:
        """A request's media are loaded: its new images go to the miss pool first, if any."""
        if self.pool is not None:
            await self.pool.before_processing(renderer, prompt, self.accel.fingerprint,
                                              self._core.stored)

    def is_cached_item(self, mm_hash: str) -> bool:
        with self._lock:  # a hit needs both the object and P0's prompt updates
            return self._updates.usable(mm_hash)

    def is_cached(self, mm_hashes: list[str], scope: RequestScope | None = None) -> list[bool]:
        """Asked before a request's misses are processed: the hits' hand-outs are taken now, in
        one call (one round trip through another API server's host), pinned until touched or
        released. With the request's `scope`: a hit another API server processed is used
        through its record, and the misses' lazy images are decoded before this returns."""
        fingerprint = None if scope is None else scope.fingerprint

        def accept(mm_hash: str, hit: HandOut) -> bool:
            if mm_hash not in self._updates:
                assert fingerprint is not None  # only then is an unseen hash asked for
                updates = self.accel.updates(mm_hash, hit.record, fingerprint)
                if updates is None:  # the processor runs here, as in vLLM alone
                    return False
                self._updates[mm_hash] = updates
            return True

        with self._lock:
            asked = [h for h in mm_hashes if fingerprint is not None or h in self._updates]
            self._core.touch(asked, None if fingerprint is None else RECORD_FIELD, accept)
            cached = [h in self._core.touched for h in mm_hashes]
        if scope is not None:  # vLLM reads the misses' pixels next
            realize_misses(scope.pending, mm_hashes, cached)
        return cached

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        with self._lock:  # is_cached took the hits' hand-outs: this finds them there
            if mm_hash in self._updates:
                self._core.touch_one(mm_hash)

    def release_sender_touches(self) -> None:
        self._core.release()

    def get_and_update_item(self, mm_item: Any, mm_hash: str,
                            scope: RequestScope | None = None) -> tuple[Any, Sequence[Any]]:
        with self._lock:
            # an item the pool made for this request is new: a miss to vLLM's counters
            pooled = self.pool is not None and self.pool.claim(mm_hash)
            handout = self._core.hit(mm_hash, cached_here=mm_hash in self._updates,
                                     pooled=pooled)
            self.queries.count(handout is not None and not pooled)
            if handout is not None:
                return self._deliver(handout, mm_item, mm_hash), self._updates[mm_hash]
            if mm_item is None:
                raise MultiModalCacheMissError([mm_hash])
            item, prompt_updates = mm_item
            value = item_to_value(item)
            record = self.accel.record(prompt_updates, None if scope is None else scope.fingerprint)
            if record is not None:
                value[RECORD_FIELD] = record
            handout = self._core.store_or_share(mm_hash, value)
            if handout is None:
                return mm_item  # type: ignore[no-any-return]
            self._updates.add(mm_hash, prompt_updates)
            return self._deliver(handout, mm_item, mm_hash), prompt_updates

    def _deliver(self, handout: HandOut, mm_item: Any, mm_hash: str) -> Any:
        """The handle item for `handout`, or `mm_item`'s data (sent inline instead)."""
        try:
            delivered = self._core.deliver(handout, mm_hash, has_data=mm_item is not None)
        except Unreachable:
            raise MultiModalCacheMissError([mm_hash]) from None
        return mm_item[0] if delivered is None else handle_item(delivered)

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        handout = handout_from_item(mm_item)
        if handout is not None:
            self._core.check_issued(mm_hash, handout)

    def invalidate(self, mm_hash: str) -> None:
        with self._lock:
            self._updates.drop_if_gone(mm_hash)

    def clear_cache(self) -> None:
        """vLLM's reset_mm_cache: new requests find nothing; the hand-outs of requests in
        flight stay readable until their workers have read them."""
        with self._lock:
            self._core.clear()
            self._updates.clear()
            self.queries.reset()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        hits, total = self.queries.info(delta)
        return CacheInfo(hits=hits, total=total)

    def close(self) -> None:
        self._unregister_metrics()
        if self.pool is not None:
            self.pool.close()
        self.accel.close()
        self._core.close()
        with self._lock:
            if self in SENDERS:
                SENDERS.remove(self)
            self._writers.close()


class Processing:
    """The sender as vLLM's processor sees it while it processes one request: the calls vLLM's
    cached path makes, each carrying the request's `scope` to the sender; anything else is the
    sender's own."""

    __slots__ = ("scope", "sender")

    def __init__(self, sender: ShmstoreSenderCache, scope: RequestScope) -> None:
        self.sender, self.scope = sender, scope

    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        return self.sender.is_cached(mm_hashes, self.scope)

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> tuple[Any, Sequence[Any]]:
        return self.sender.get_and_update_item(mm_item, mm_hash, self.scope)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sender, name)


def _head(make_channel: Any, d: Deployment) -> HeadPublisher:
    """The head's Publisher of a TP group across nodes, once the address is set."""
    if not d.publish:
        raise InvalidArgument(
            f"this vLLM tensor-parallel group spans {d.nodes} nodes: shmstore needs a relay "
            f"per other node. Set {PUBLISH_ENV}=tcp://THIS_HOST:PORT here and run `shmstore "
            "relay connect tcp://THIS_HOST:PORT --name NAME --readers N` on each other node "
            "(see the README), or use --mm-processor-cache-type lru", PUBLISH_ENV, None)
    return HeadPublisher(make_channel, d)

