"""shmstore as vLLM's `shm` multimodal processor cache (imported only by vllm_plugin.register).

Sender (API process, "P0"), one per engine::

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

Receiver (each worker), attached lazily with the worker's local rank; n_readers is the number
of workers on the node. A TP group across nodes (`--nnodes`): see _vllm_nodes.py. A handle item
is read with `get` (owned tensors: the worker keeps them across steps) and turned back into
vLLM's MultiModalKwargsItem. A handle that is stale or damaged raises vLLM's
MultiModalCacheMissError with a log line saying why. (vLLM 0.32 retries that error only where
the engine core raises it; in a worker the step fails, as with vLLM's own shm cache.)

The handle item carries an `address` field (vLLM keeps items with one when prefix caching strips
covered data, so every hand-out reaches the workers and is counted) and `shmstore_handle`, the
Handle's fields and the object's origin seq as six ints (they survive vLLM's msgpack round
trip; the origin seq lets a worker on another node find its relay's copy).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from vllm.multimodal.cache import factories
from vllm.multimodal.cache.base import (
    BaseMultiModalProcessorCache,
    BaseMultiModalReceiverCache,
    MultiModalCacheMissError,
)
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)
from vllm.utils.cache import CacheInfo

from ._vllm_nodes import FEED_ERRORS, HeadPublisher, NodeFeed, node_layout
from .errors import (
    CorruptObject,
    InvalidArgument,
    InvalidHandle,
    ObjectTooLarge,
    StaleHandle,
    StoreFull,
    Timeout,
)
from .handle import Handle
from .policy import DEFAULT_POLICY
from .store import ObjectStore, StoreReader, StoreWriter
from .vllm_plugin import POLICY_ENV

__all__ = ["ShmstoreSenderCache", "ShmstoreReceiverCache", "install", "item_to_value",
           "value_to_item", "HANDLE_FIELD", "handle_from_item", "object_id_from_item"]

log = logging.getLogger("vllm.plugins.shmstore")  # vLLM's handlers print it with its own lines
HANDLE_FIELD = "shmstore_handle"
_FIELD_KINDS = {MultiModalFlatField: "flat", MultiModalSharedField: "shared",
                MultiModalBatchedField: "batched"}
_GIB = 1 << 30
_MIB = 1 << 20


def _settings(vllm_config: Any) -> tuple[str, int, int]:
    """(name, capacity_bytes, max_object_bytes) from vLLM's own configuration."""
    mm_config = vllm_config.model_config.get_multimodal_config()
    capacity = int(mm_config.mm_processor_cache_gb * _GIB)
    max_object = min(int(mm_config.mm_shm_cache_max_object_size_mb * _MIB), capacity)
    import vllm.envs as envs

    # vLLM's own: the variable if set, else a fresh name per process tree (set in the
    # environment, so the workers it starts find the same segment)
    name = envs.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME
    return name, capacity, max_object


# -- vLLM items <-> values shmstore's serializer carries -----------------------------------------

def _slices_out(slices: Any) -> Any:
    if isinstance(slices, slice):
        return [slices.start, slices.stop, slices.step]
    return [_slices_out(s) for s in slices]


def _slices_in(obj: Any) -> Any:
    if obj and not isinstance(obj[0], list):
        return slice(*obj)
    return [_slices_in(s) for s in obj]


def item_to_value(item: MultiModalKwargsItem) -> dict[str, Any]:
    """A MultiModalKwargsItem as plain values and tensors (no pickle)."""
    fields = {}
    for key, elem in item.items():
        field = elem.field
        kind = _FIELD_KINDS.get(type(field))
        if kind is None:
            raise TypeError(f"field {key!r} of type {type(field).__name__} is not supported")
        options: dict[str, Any] = {"keep_on_cpu": bool(field.keep_on_cpu)}
        if kind == "flat":
            options["slices"] = _slices_out(field.slices)
            options["dim"] = int(field.dim)
        elif kind == "shared":
            options["batch_size"] = int(field.batch_size)
        fields[key] = [kind, options, elem.data]
    return {"fields": fields}


def value_to_item(value: Any) -> MultiModalKwargsItem:
    """The inverse of item_to_value; CorruptObject if `value` is not what it makes."""
    try:
        elems = {}
        for key, (kind, options, data) in value["fields"].items():
            if kind not in ("flat", "shared", "batched") or not isinstance(options, dict):
                raise ValueError(f"field kind {kind!r}")
            options = dict(options)
            if kind == "flat":
                options["slices"] = _slices_in(options["slices"])
            field = getattr(MultiModalFieldConfig, kind)("", **options).field
            elems[key] = MultiModalFieldElem(data=data, field=field)
        return MultiModalKwargsItem(elems)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptObject(f"stored vLLM item is not valid: {type(exc).__name__}: {exc}") from None


def handle_item(handle: Handle, object_id: bytes) -> MultiModalKwargsItem:
    words = [handle.address, handle.seq, int.from_bytes(handle.key_digest[:8], "little"),
             int.from_bytes(handle.key_digest[8:], "little"), handle.epoch,
             int.from_bytes(object_id[16:], "little")]
    batched = MultiModalBatchedField()
    return MultiModalKwargsItem({
        "address": MultiModalFieldElem(data=handle.address, field=batched),
        HANDLE_FIELD: MultiModalFieldElem(data=words, field=batched),
    })


def _words(item: Any) -> list[int] | None:
    if item is None or HANDLE_FIELD not in item:
        return None
    words = item[HANDLE_FIELD].data
    if (not isinstance(words, (list, tuple)) or len(words) != 6
            or any(type(w) is not int or not 0 <= w < 1 << 64 for w in words)):
        raise ValueError("malformed shmstore handle item: expected six unsigned 64-bit ints")
    return list(words)


def object_id_from_item(item: Any) -> bytes | None:
    """The object id (key digest + origin seq) a handle item names, None for an item with
    data; ValueError if it is malformed."""
    words = _words(item)
    if words is None:
        return None
    return b"".join(w.to_bytes(8, "little") for w in (words[2], words[3], words[5]))


def handle_from_item(item: Any) -> Handle | None:
    """The Handle an item carries, None for an item with data; ValueError if it is malformed."""
    words = _words(item)
    if words is None:
        return None
    address, seq, low, high, epoch, _ = words
    try:
        return Handle(address, seq, low.to_bytes(8, "little") + high.to_bytes(8, "little"), epoch)
    except (InvalidHandle, ValueError, TypeError) as exc:
        raise ValueError(f"malformed shmstore handle item: {exc}") from None


# -- the two caches -------------------------------------------------------------------------------

class ShmstoreSenderCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    """vLLM's P0 cache, backed by one shmstore ObjectStore (this process writes it)."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__()
        name, capacity, max_object = _settings(vllm_config)
        nodes, _, n_readers = node_layout(vllm_config)
        policy = os.environ.get(POLICY_ENV, DEFAULT_POLICY).strip() or DEFAULT_POLICY

        def make(create: Any) -> Any:
            try:
                return create(capacity_bytes=capacity, max_object_bytes=max_object, policy=policy)
            except InvalidArgument as exc:
                if exc.argument != "max_object_bytes":
                    raise
                # the limit is about the whole cache: what fits
                return create(capacity_bytes=capacity, policy=policy)

        self._head: HeadPublisher | None = None
        if nodes > 1:
            self._head = HeadPublisher(make, name, n_readers, nodes - 1)
            self._store: StoreWriter = self._head.channel.store
        else:
            self._store = make(lambda **kw: ObjectStore.create(name, n_readers=n_readers, **kw))
        self._updates: dict[str, Sequence[Any]] = {}  # prompt updates stay on P0
        self._touched: dict[str, Handle] = {}  # hand-outs kept by touch, not yet used
        self._hits = self._total = self.inline_fallbacks = 0
        self._last = CacheInfo(hits=0, total=0)
        self._unregister_metrics = _export_metrics(self._store, lambda: self.inline_fallbacks,
                                                   self.publisher)
        log.info("shmstore serves vLLM's shm multimodal cache: segment %r, %d bytes, policy %s, "
                 "%d readers%s", name, capacity, policy, n_readers,
                 "" if self._head is None else " on this node and the relay publisher")

    @property
    def store(self) -> StoreWriter:
        return self._store

    @property
    def publisher(self) -> Any:
        """The relay Publisher of a TP group across nodes (shmstore.relay.Publisher), else None."""
        return None if self._head is None else self._head.publisher

    def is_cached_item(self, mm_hash: str) -> bool:
        # a hit needs both the object and P0's prompt updates
        return mm_hash in self._updates and self._store.is_cached(mm_hash)

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        if mm_hash not in self._touched and self.is_cached_item(mm_hash):
            self._touched[mm_hash] = self._store.get_cached(mm_hash)

    def release_sender_touches(self) -> None:
        touched, self._touched = self._touched, {}
        for handle in touched.values():
            try:
                self._store.give_back(handle)
            except StaleHandle:
                pass  # cleared meanwhile: nothing to give back

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> tuple[Any, Sequence[Any]]:
        self._total += 1
        handle = self._touched.pop(mm_hash, None)
        if handle is not None and self._head is not None:
            # published hand-outs go out in the order they are made: renew the kept one
            handle = self._store.hand_out_again(handle)
        if handle is None and self.is_cached_item(mm_hash):
            handle = self._store.get_cached(mm_hash)
        if handle is not None:
            self._hits += 1
            out = self._hand_out(handle, mm_item, mm_hash)
            return (mm_item if out is None else out), self._updates[mm_hash]
        if mm_item is None:
            raise MultiModalCacheMissError([mm_hash])
        item, prompt_updates = mm_item
        if self._store.is_cached(mm_hash):  # stored, but its prompt updates were dropped
            handle = self._store.get_cached(mm_hash)
        else:
            try:
                handle = self._store.put(mm_hash, item_to_value(item), timeout=0)
            except (ObjectTooLarge, StoreFull) as exc:
                self.inline_fallbacks += 1
                log.debug("shmstore: item %s sent inline (%s)", mm_hash, exc)
                return mm_item  # type: ignore[no-any-return]
        if len(self._updates) >= 2 * len(self._store) + 64:
            self._updates = {h: u for h, u in self._updates.items() if self._store.is_cached(h)}
        self._updates[mm_hash] = prompt_updates
        out = self._hand_out(handle, mm_item, mm_hash)
        return (mm_item if out is None else (out, prompt_updates))

    def _hand_out(self, handle: Handle, mm_item: Any, mm_hash: str) -> Any:
        """The handle item for a hand-out just made; on a TP group across nodes, also sent to
        the other nodes. None: give the data inline instead (a node's relay is not connected,
        or too slow to take it); the hand-out is given back."""
        head = self._head
        if head is not None:
            why = "" if head.ready() else "a node's relay is not connected"
            if not why:
                try:
                    head.publish(handle)
                except Timeout:  # given back by publish
                    why = "the relays did not take it in time"
            else:
                self._store.give_back(handle)
            if why:
                if mm_item is None:  # a hit without data: nothing to send inline
                    log.warning("shmstore: item %s cannot reach every node (%s)", mm_hash, why)
                    raise MultiModalCacheMissError([mm_hash])
                self.inline_fallbacks += 1
                log.debug("shmstore: item %s sent inline (%s)", mm_hash, why)
                return None
        object_id = self._store.object_id(mm_hash)
        assert object_id is not None  # handed out just now: cached
        return handle_item(handle, object_id)

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        handle = handle_from_item(mm_item)
        if handle is None:
            return
        if (handle != self._store.handle_of(mm_hash)
                or object_id_from_item(mm_item) != self._store.object_id(mm_hash)):
            raise ValueError(f"multimodal item {mm_hash!r} carries a shmstore handle that this "
                             "server did not issue for it (forged, stale or from another "
                             "server); send the data instead")

    def invalidate(self, mm_hash: str) -> None:
        if not self._store.is_cached(mm_hash):
            self._updates.pop(mm_hash, None)

    def clear_cache(self) -> None:
        self.release_sender_touches()
        self._store.clear()
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
        if not self._store.closed:
            self.release_sender_touches()
        if self._head is not None:
            self._head.close()
        self._store.close()


class ShmstoreReceiverCache(BaseMultiModalReceiverCache):  # type: ignore[misc]
    """vLLM's cache in each worker: resolves handle items from the shared store."""

    def __init__(self, vllm_config: Any, shared_worker_lock: Any = None) -> None:
        super().__init__()  # shared_worker_lock: accepted, not needed (no cross-process lock)
        self._name, _, _ = _settings(vllm_config)
        nodes, node_rank, n_local = node_layout(vllm_config)
        self._reader: StoreReader | None = None
        self._feed: NodeFeed | None = None
        if nodes > 1 and node_rank > 0:  # fed by this node's relay: attach before any request
            self._feed = NodeFeed(self._name, n_local)
        elif nodes > 1:
            self._name = f"{self._name}.store"  # the head's channel's store

    @property
    def feed(self) -> NodeFeed | None:
        """On a node other than the head: what reads this node's relay channel, else None."""
        return self._feed

    @property
    def reader(self) -> StoreReader:
        """This worker's reader, attached at first use with the worker's local rank."""
        if self._reader is None:
            self._reader = ObjectStore.attach(self._name, _local_rank())
        return self._reader

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        if self._feed is not None:
            self._feed.poll()  # handles that came, and a relay that ended or was replaced
        with_data = [f for f in mm_features if f.data is not None]
        super().get_and_update_features(with_data)
        return mm_features

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        handle = handle_from_item(mm_item)
        if handle is None:
            return mm_item
        try:
            if self._feed is not None:
                object_id = object_id_from_item(mm_item)
                assert object_id is not None  # it carries a handle
                return value_to_item(self._feed.get(object_id))
            return value_to_item(self.reader.get(handle))
        except (StaleHandle, CorruptObject, *FEED_ERRORS) as exc:
            log.warning("shmstore: item %s cannot be read (%s); asking for it again", mm_hash, exc)
            raise MultiModalCacheMissError([mm_hash]) from None

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        return None  # the sender's hand-out already keeps the object until this worker reads it

    def clear_cache(self) -> None:
        return None  # the sender's clear() makes every earlier handle stale

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._feed is not None:
            self._feed.close()


def _export_metrics(store: StoreWriter, inline_fallbacks: Any, publisher: Any) -> Any:
    """shmstore_* metrics on prometheus_client's default registry (vLLM's /metrics)."""
    try:
        from .metrics import register_store_metrics

        return register_store_metrics(store, inline_fallbacks=inline_fallbacks,
                                      publisher=publisher)
    except ImportError:
        return lambda: None


def _local_rank() -> int:
    """This worker's rank on its node: vLLM's world group once it exists, else LOCAL_RANK."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except (ImportError, AssertionError, AttributeError):
        return int(os.environ.get("LOCAL_RANK", "0"))


def install() -> None:
    """Route vLLM's `shm` cache type to shmstore, where vLLM's factories are bound."""
    import importlib

    original_sender = factories.processor_cache_from_config
    original_receiver = factories.worker_receiver_cache_from_config

    def processor_cache_from_config(vllm_config: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return ShmstoreSenderCache(vllm_config)
        return original_sender(vllm_config)

    def worker_receiver_cache_from_config(vllm_config: Any, shared_worker_lock: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return ShmstoreReceiverCache(vllm_config, shared_worker_lock)
        return original_receiver(vllm_config, shared_worker_lock)

    patches = {"processor_cache_from_config": processor_cache_from_config,
               "worker_receiver_cache_from_config": worker_receiver_cache_from_config}
    for module_name in ("vllm.multimodal.cache.factories", "vllm.multimodal.cache",
                        "vllm.renderers.base", "vllm.v1.worker.worker_base"):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # another vLLM layout: say so, patch what exists
            log.warning("shmstore vLLM plugin: cannot import %s (%s)", module_name, exc)
            continue
        for attr, replacement in patches.items():
            if hasattr(module, attr):
                setattr(module, attr, replacement)
