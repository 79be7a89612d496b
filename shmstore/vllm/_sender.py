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

from ..errors import InvalidArgument, KeyExists
from ..handle import HandOut
from ..serving._deployment import open_pool, open_writer
from ..serving._nodes import HeadPublisher
from ..serving._sender import Sender, Unreachable
from ..store._api import WriterAPI
from ._accel import RECORD_FIELD, Acceleration, realize_misses
from ._accel._pool import PoolSender
from ._accel._pool import processor as pool_processor
from ._deployment import Deployment
from ._env import ACCELERATE_ENV, LOG_NAME, PUBLISH_ENV
from ._items import handle_item, handout_from_item, item_to_value
from ._metrics import export_metrics
from ._scope import RequestScope
from ._vllm import BaseMultiModalProcessorCache, CacheInfo, MultiModalCacheMissError, with_cache

__all__ = ["ShmstoreSenderCache", "Processing", "SENDERS"]

log = logging.getLogger(LOG_NAME)

PRUNE_UPDATES = 64  # prompt updates kept beyond twice those of cached items before a prune
SENDERS: list[ShmstoreSenderCache] = []  # this process's senders, for vLLM's request hooks


class ShmstoreSenderCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    """vLLM's P0 cache, backed by one shmstore ObjectStore (this process writes it).

    Its hand-outs follow vLLM's requests (serving/_requests.py): the hooks `install()` puts into
    vLLM's API process tell `ledger` when a request is added, refused or ends."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__()
        d = Deployment.read(vllm_config)
        self.deployment = d
        self.engines, self.readers_per_engine = d.engines, d.per_engine
        self._updates: dict[str, Sequence[Any]] = {}  # prompt updates stay on P0
        self._prune_at = PRUNE_UPDATES
        self._hits = self._total = 0
        self._last = CacheInfo(hits=0, total=0)
        self._lock = threading.RLock()  # around every call of the writer, the host's too
        pooled = bool(d.pool_workers) and d.accelerate and d.shape != "relay"
        self._writers = open_writer(d, self._lock, lambda make: _head(make, d), host=pooled)
        self._store: WriterAPI = self._writers.store
        self._core = Sender(self._store, self._lock, settle_s=d.settle_s, lease_s=d.lease_s,
                            head=self._writers.head)
        self.ledger = self._core.ledger
        self.items = self._core.items
        self.segment, self.api_server = d.name, d.api_rank
        self.accel = Acceleration(d.accelerate, d.processor_identity, d.vocab_size,
                                  self.ledger.lock)
        self.pool: PoolSender | None = None
        if self._writers.local is not None and d.shape != "relay":
            log.info("shmstore: miss pool of %d worker(s) (%s)%s", d.pool_workers, d.pool_why,
                     "" if d.accelerate or not d.pool_workers else
                     f"; off: it needs {ACCELERATE_ENV} on")
        if pooled and self.accel.lazy_images:
            node = open_pool(d, self._writers, pool_processor(d.model_config),
                             env={"OMP_NUM_THREADS": "1"})
            self.pool = None if node is None else PoolSender(node)
        if self.pool is None and d.api_servers == 1:
            self.accel.decode_new_photos_at_once()
        self._unregister_metrics = export_metrics(self)
        SENDERS.append(self)
        log.info("shmstore serves vLLM's shm multimodal cache: segment %r, %d bytes, policy %s; "
                 "layout: %d API server(s) (this is %d, %s), %d engine(s) x %d worker(s) = %d "
                 "reader(s)%s", d.name, d.capacity_bytes, d.policy, d.api_servers, d.api_rank,
                 self._writers.role, d.engines, d.per_engine, d.n_readers,
                 "" if self._writers.head is None else " on this node and the relay publisher")

    @property
    def inline_fallbacks(self) -> int:
        """Items sent inline (too large, store full, or a node's relay not connected)."""
        return self.items["inline"]

    @property
    def store(self) -> WriterAPI:
        return self._store

    def routed(self, request_id: str, engine: int) -> None:
        """The DP client sends `request_id` to engine `engine` (its DP rank): its hand-outs are
        owed by that engine's workers only."""
        self._core.routed(request_id, engine, self.engines, self.readers_per_engine)

    @property
    def publisher(self) -> Any:
        """The relay Publisher of a TP group across nodes (shmstore.relay._publisher.Publisher), else None."""
        head = self._writers.head
        return None if head is None else head.publisher

    @contextmanager
    def processing(self, inputs: Any, hf_processor_mm_kwargs: Any, items: Any
                   ) -> Iterator[Any]:
        """vLLM processes one request in this block (the processor hook): `inputs` (vLLM's
        ProcessorInputs) again, with this sender in a `Processing` view that carries the
        request's scope (the fingerprint of these kwargs) to every cache call."""
        scope = RequestScope(self.accel.fingerprint(hf_processor_mm_kwargs))
        yield with_cache(inputs, Processing(self, scope))
        self.accel.processed(items)

    async def before_processing(self, renderer: Any, prompt: Any) -> None:
        """A request's media are loaded and vLLM is about to process it: its new images go to
        the miss pool first (vllm/_accel/_pool.py), if this API server runs one."""
        if self.pool is not None:
            await self.pool.before_processing(renderer, prompt, self.accel.fingerprint,
                                              self._stored)

    def _stored(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return self._store.cached(keys)

    def is_cached_item(self, mm_hash: str) -> bool:
        # a hit needs both the object and P0's prompt updates
        with self._lock:
            return mm_hash in self._updates and self._store.cached([mm_hash])[0]

    def is_cached(self, mm_hashes: list[str], scope: RequestScope | None = None) -> list[bool]:
        """vLLM asks this before processing a request's misses, and touches its hits after:
        take the hits' hand-outs now, in one call (one round trip through another API
        server's host), so they are pinned from here on and the touches cost nothing. Hand-outs
        a request never uses (its processing failed) go back at the next release. With the
        request's `scope`: a hit another API server processed is used through its record,
        and the misses' lazy images are decoded before this returns."""
        fingerprint = None if scope is None else scope.fingerprint

        def accept(mm_hash: str, hit: HandOut) -> bool:
            if mm_hash in self._updates:
                return True
            assert fingerprint is not None  # only then is an unseen hash asked for
            updates = self.accel.updates(mm_hash, hit.record, fingerprint)
            if updates is None:  # the processor runs here, as in vLLM alone
                return False
            self._updates[mm_hash] = updates
            return True

        with self._lock:
            self._core.touch([h for h in mm_hashes if fingerprint is not None
                              or h in self._updates],
                             None if fingerprint is None else RECORD_FIELD, accept)
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
            return self._get_and_update_item(mm_item, mm_hash, scope)

    def _get_and_update_item(self, mm_item: Any, mm_hash: str,
                             scope: RequestScope | None) -> tuple[Any, Sequence[Any]]:
        self._total += 1
        core = self._core
        # an item the pool made for this request is new: counted as a miss by vLLM's counters
        pooled = self.pool is not None and self.pool.claim(mm_hash)
        handout = core.hit(mm_hash, cached_here=mm_hash in self._updates, pooled=pooled)
        if handout is not None:
            self._hits += not pooled
            out = self._deliver(handout, mm_item, mm_hash)
            return (mm_item if out is None else out), self._updates[mm_hash]
        if mm_item is None:
            raise MultiModalCacheMissError([mm_hash])
        item, prompt_updates = mm_item
        value = item_to_value(item)
        record = self.accel.record(prompt_updates, None if scope is None else scope.fingerprint)
        if record is not None:
            value[RECORD_FIELD] = record
        try:
            handout = core.store_miss(mm_hash, value)
        except KeyExists:  # stored (by another API server), but not its prompt updates here
            handout = core.shared(mm_hash)
        if handout is None:
            return mm_item  # type: ignore[no-any-return]
        if len(self._updates) >= self._prune_at:  # drop the updates of items gone from the store
            keys = list(self._updates)
            cached = self._store.cached(keys)
            self._updates = {k: self._updates[k] for k, c in zip(keys, cached, strict=True) if c}
            self._prune_at = 2 * len(self._updates) + PRUNE_UPDATES
        self._updates[mm_hash] = prompt_updates
        out = self._deliver(handout, mm_item, mm_hash)
        return (mm_item if out is None else (out, prompt_updates))

    def _deliver(self, handout: HandOut, mm_item: Any, mm_hash: str) -> Any:
        """The handle item for `handout`; None: give the data inline instead."""
        try:
            delivered = self._core.deliver(handout, mm_hash, has_data=mm_item is not None)
        except Unreachable:
            raise MultiModalCacheMissError([mm_hash]) from None
        return None if delivered is None else handle_item(delivered)

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        handout = handout_from_item(mm_item)
        if handout is not None and not self._core.issued(mm_hash, handout):
            # the worker's checks, made here first, by the store that made the hand-out
            raise ValueError(f"multimodal item {mm_hash!r} carries a shmstore handle that this "
                             "server did not issue for it (forged, stale or from another "
                             "server); send the data instead")

    def invalidate(self, mm_hash: str) -> None:
        with self._lock:
            if not self._store.cached([mm_hash])[0]:
                self._updates.pop(mm_hash, None)

    def clear_cache(self) -> None:
        """vLLM's reset_mm_cache: new requests find nothing; the hand-outs of requests in
        flight stay readable until their workers have read them."""
        with self._lock:
            self._core.clear()
            self._updates.clear()
            self._hits = self._total = 0
            self._last = CacheInfo(hits=0, total=0)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        info = CacheInfo(hits=self._hits, total=self._total)
        if delta:
            info, self._last = info - self._last, info
        return info

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

