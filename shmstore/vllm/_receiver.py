"""The plugin's receiver cache, in each vLLM worker.

Receiver (each worker; serving/_receiver.py), attached lazily with the worker's local rank;
n_readers is the number of workers on the node. A TP group across nodes (`--nnodes`): see
serving/_nodes.py. A handle item is read with `get` (owned tensors: the worker keeps them
across steps) and turned back into vLLM's MultiModalKwargsItem. A handle that is stale or
damaged raises vLLM's MultiModalCacheMissError with a log line saying why. (vLLM 0.32 retries
that error only where the engine core raises it; in a worker the step fails, as with vLLM's own
shm cache.)
"""

from __future__ import annotations

from typing import Any

from ..serving._nodes import NodeFeed
from ..serving._receiver import Receiver, Unreadable
from ..store._object_store import ObjectStore, StoreReader
from ._deployment import Deployment, local_rank
from ._items import handout_from_item, value_to_item
from ._vllm import BaseMultiModalReceiverCache, MultiModalCacheMissError, features_with_data

__all__ = ["ShmstoreReceiverCache"]


class ShmstoreReceiverCache(BaseMultiModalReceiverCache):  # type: ignore[misc]
    """vLLM's cache in each worker: resolves handle items through serving/_receiver.py's
    Receiver (each hand-out read once per request, checked against its item first)."""

    def __init__(self, vllm_config: Any, shared_worker_lock: Any = None) -> None:
        super().__init__()  # shared_worker_lock: accepted, not needed (no cross-process lock)
        d = self._deployment = Deployment.read(vllm_config)
        name = d.name
        import torch

        feed = None
        if d.nodes > 1 and d.node_rank > 0:  # fed by this node's relay: attach before any request
            feed = NodeFeed(name, d.per_engine, d.wait_s)
        elif d.nodes > 1:
            name = f"{name}.store"  # the head's channel's store

        def attach() -> StoreReader:  # with the worker's local rank, at first use
            first = d.first_reader(name)
            return ObjectStore.attach(name, first + local_rank(), prefault=False)

        # with CUDA, tensors land in page-locked memory: vLLM's copy to the device then needs
        # no staging copy of its own
        self._core = Receiver(attach, feed, pin_memory=bool(torch.cuda.is_available()))
        self._request: str | None = None  # the request whose items are being resolved

    @property
    def feed(self) -> NodeFeed | None:
        """On a node other than the head: what reads this node's relay channel, else None."""
        return self._core.feed

    @property
    def reader(self) -> StoreReader:
        """This worker's reader, attached at first use with the worker's local rank."""
        return self._core.reader

    def features_of_request(self, request_id: str, mm_features: list[Any]) -> list[Any]:
        """get_and_update_features for the features of one request (the worker hook)."""
        self._request = request_id
        try:
            return self.get_and_update_features(mm_features)
        finally:
            self._request = None

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        if self._core.feed is not None:
            self._core.feed.poll()  # handles that came, and a relay that ended or was replaced
        super().get_and_update_features(features_with_data(mm_features))
        return mm_features

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        handout = handout_from_item(mm_item)
        if handout is None:
            return mm_item
        try:
            value = self._core.read(handout, mm_hash, self._request)
        except Unreadable:
            raise MultiModalCacheMissError([mm_hash]) from None
        return value_to_item(value)

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        return None  # the sender's hand-out already keeps the object until this worker reads it

    def clear_cache(self) -> None:
        return None  # the sender's clear() keeps what requests in flight still need

    def close(self) -> None:
        self._core.close()
