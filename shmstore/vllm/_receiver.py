"""The plugin's receiver cache, in each vLLM worker.

Receiver (each worker), attached lazily with the worker's local rank; n_readers is the number
of workers on the node. A TP group across nodes (`--nnodes`): see vllm/_nodes.py. A handle item
is read with `get` (owned tensors: the worker keeps them across steps) and turned back into
vLLM's MultiModalKwargsItem. A handle that is stale or damaged raises vLLM's
MultiModalCacheMissError with a log line saying why. (vLLM 0.32 retries that error only where
the engine core raises it; in a worker the step fails, as with vLLM's own shm cache.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from ..errors import (
    CorruptObject,
    StaleHandle,
)
from ..handle import key_digest
from ..store._object_store import ObjectStore, StoreReader
from ._deployment import Deployment, local_rank
from ._env import LOG_NAME
from ._items import (
    handout_from_item,
    value_to_item,
)
from ._nodes import FEED_ERRORS, NodeFeed
from ._vllm import BaseMultiModalReceiverCache, MultiModalCacheMissError

__all__ = ["ShmstoreReceiverCache"]

log = logging.getLogger(LOG_NAME)

READ_MEMORY = 1 << 16  # (request, hand-out) pairs a worker remembers having read


class ShmstoreReceiverCache(BaseMultiModalReceiverCache):  # type: ignore[misc]
    """vLLM's cache in each worker: resolves handle items from the shared store.

    A worker counts each hand-out once per request: vLLM may send a request it preempted
    again as new (its V2 model runner does), and the second read must not take the read a
    later hand-out of the same object is owed. Requests with several samples (n > 1) are one
    request each, and the sender hands the item out once for each."""

    def __init__(self, vllm_config: Any, shared_worker_lock: Any = None) -> None:
        super().__init__()  # shared_worker_lock: accepted, not needed (no cross-process lock)
        d = self._deployment = Deployment.read(vllm_config)
        self._name = d.name
        import torch

        # with CUDA, tensors land in page-locked memory: vLLM's copy to the device then needs
        # no staging copy of its own
        self._pin_memory = bool(torch.cuda.is_available())
        self._reader: StoreReader | None = None
        self._feed: NodeFeed | None = None
        self._request: str | None = None  # the request whose items are being resolved
        self._read: OrderedDict[tuple[str | None, int], None] = OrderedDict()
        if d.nodes > 1 and d.node_rank > 0:  # fed by this node's relay: attach before any request
            self._feed = NodeFeed(self._name, d.per_engine, d.wait_s)
        elif d.nodes > 1:
            self._name = f"{self._name}.store"  # the head's channel's store

    @property
    def feed(self) -> NodeFeed | None:
        """On a node other than the head: what reads this node's relay channel, else None."""
        return self._feed

    @property
    def reader(self) -> StoreReader:
        """This worker's reader, attached at first use with the worker's local rank."""
        if self._reader is None:
            first = self._deployment.first_reader(self._name)
            self._reader = ObjectStore.attach(self._name, first + local_rank(), prefault=False)
        return self._reader

    def features_of_request(self, request_id: str, mm_features: list[Any]) -> list[Any]:
        """get_and_update_features for the features of one request (the worker hook)."""
        self._request = request_id
        try:
            return self.get_and_update_features(mm_features)
        finally:
            self._request = None

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        if self._feed is not None:
            self._feed.poll()  # handles that came, and a relay that ended or was replaced
        with_data = [f for f in mm_features if f.data is not None]
        super().get_and_update_features(with_data)
        return mm_features

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        handout = handout_from_item(mm_item)
        if handout is None:
            return mm_item
        handle, number = handout.handle, handout.number
        if handle.key_digest != key_digest(mm_hash):
            log.warning("shmstore: item %s carries the handle of another item; asking for it "
                        "again", mm_hash)
            raise MultiModalCacheMissError([mm_hash])
        read = (self._request, number)
        count = read not in self._read
        try:
            if self._feed is not None:
                value = self._feed.get(handout.object_id)
            else:
                if not 0 < number <= self.reader.handout_seq:
                    raise StaleHandle(f"hand-out number {number} was never made by the store "
                                      f"(its last is {self.reader.handout_seq})", handle)
                value = self.reader.get(handle, count=count, pin_memory=self._pin_memory,
                                        origin=handout.origin)
        except (StaleHandle, CorruptObject, *FEED_ERRORS) as exc:
            log.warning("shmstore: item %s cannot be read (%s); asking for it again", mm_hash, exc)
            raise MultiModalCacheMissError([mm_hash]) from None
        if count:
            self._read[read] = None
            if len(self._read) > READ_MEMORY:
                self._read.popitem(last=False)
        return value_to_item(value)

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        return None  # the sender's hand-out already keeps the object until this worker reads it

    def clear_cache(self) -> None:
        return None  # the sender's clear() keeps what requests in flight still need

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._feed is not None:
            self._feed.close()
