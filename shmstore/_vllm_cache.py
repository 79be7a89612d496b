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

import atexit
import contextvars
import logging
import os
import time
import weakref
from collections import OrderedDict
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

from ._proc import env_seconds, pid_alive, proc_stat
from ._vllm_nodes import FEED_ERRORS, HeadPublisher, NodeFeed, node_layout
from ._vllm_requests import RequestLedger, numbers_in
from .errors import (
    CorruptObject,
    InvalidArgument,
    InvalidHandle,
    KeyExists,
    KeyNotCached,
    ObjectTooLarge,
    ShmStoreError,
    StaleHandle,
    StoreFull,
    Timeout,
)
from .handle import Handle, key_digest
from .policy import DEFAULT_POLICY
from .segment import Segment, peek_header
from .store import ObjectStore, StoreReader, StoreWriter
from .vllm_plugin import POLICY_ENV
from .writer_host import MAX_KEYS, RemoteWriter, WriterHost

__all__ = ["ShmstoreSenderCache", "ShmstoreReceiverCache", "install", "item_to_value",
           "value_to_item", "HANDLE_FIELD", "handle_from_item", "object_id_from_item"]

log = logging.getLogger("vllm.plugins.shmstore")  # vLLM's handlers print it with its own lines
HANDLE_FIELD = "shmstore_handle"
HANDLE_WORDS = 7  # address, seq, key digest (2 words), epoch, origin seq, hand-out number
SETTLE_ENV = "SHMSTORE_VLLM_SETTLE_S"  # after a request ends: when its unread hand-outs go
LEASE_ENV = "SHMSTORE_VLLM_LEASE_S"  # a hand-out no request claimed: when it goes
DEFAULT_SETTLE_S = 10.0  # covers the steps the engine may still run with an aborted request
DEFAULT_LEASE_S = 60.0  # rendering to add_request takes milliseconds; this is the backstop
PRUNE_UPDATES = 64  # prompt updates kept beyond twice those of cached items before a prune
READ_MEMORY = 1 << 16  # (request, hand-out) pairs a worker remembers having read
_FIELD_KINDS = {MultiModalFlatField: "flat", MultiModalSharedField: "shared",
                MultiModalBatchedField: "batched"}
_SENDERS: list[ShmstoreSenderCache] = []  # this process's senders, for vLLM's request hooks


class _Rendered:
    """The hand-outs rendered in one task of the OpenAI server (a request's), in its context."""

    __slots__ = ("__weakref__", "numbers")

    def __init__(self) -> None:
        self.numbers: list[int] = []


def _ledgers() -> list[RequestLedger]:
    """The request ledgers of this process's senders (a snapshot: hooks run on other threads)."""
    return [sender.ledger for sender in list(_SENDERS)]


def _render_ended(numbers: list[int]) -> None:
    for ledger in _ledgers():
        ledger.render_ended(numbers)


_RENDERED: contextvars.ContextVar[_Rendered | None] = contextvars.ContextVar(
    "shmstore_rendered", default=None)
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


def _engines(vllm_config: Any) -> int:
    """Engines on this node that share the store (API process): several with data parallelism
    behind vLLM's internal or hybrid load balancer, else one."""
    parallel = vllm_config.parallel_config
    if int(parallel.data_parallel_size) <= 1 or parallel.data_parallel_external_lb:
        return 1
    return int(parallel.data_parallel_size_local)


def _first_reader(name: str, engine: int, per_engine: int) -> int:
    """The first reader index of DP engine `engine` (its DP rank) in store `name`: the engines
    of a node take per_engine readers each, in rank order. (A DP engine of a dense model no
    longer knows how many engines the node has: the store's reader count says.)"""
    header = peek_header(name)
    engines = max(1, header[1] // per_engine) if header is not None else 1
    return engine % engines * per_engine


def servable(vllm_config: Any) -> str | None:
    """Why shmstore cannot serve this deployment's `shm` cache, None if it can: every engine
    the API servers send to must be on this node (DP engines on other nodes behind the
    internal load balancer are not), and several API servers do not mix with a TP group
    across nodes."""
    parallel = vllm_config.parallel_config
    nodes, _, _ = node_layout(vllm_config)
    dp = int(parallel.data_parallel_size)
    if (dp > 1 and not parallel.data_parallel_external_lb
            and int(parallel.data_parallel_size_local) != dp
            and not parallel.data_parallel_hybrid_lb):
        return "data-parallel engines on other nodes behind the internal load balancer"
    if nodes > 1 and (int(parallel._api_process_count) > 1 or _engines(vllm_config) > 1):
        return "several API servers or engines with a tensor-parallel group across nodes"
    return None


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


def handle_item(handle: Handle, object_id: bytes, number: int) -> MultiModalKwargsItem:
    """The item a worker gets instead of the data: `handle`, the object's id, and the number of
    this hand-out (a worker counts each hand-out it reads for a request once)."""
    words = [handle.address, handle.seq, int.from_bytes(handle.key_digest[:8], "little"),
             int.from_bytes(handle.key_digest[8:], "little"), handle.epoch,
             int.from_bytes(object_id[16:], "little"), number]
    batched = MultiModalBatchedField()
    return MultiModalKwargsItem({
        "address": MultiModalFieldElem(data=handle.address, field=batched),
        HANDLE_FIELD: MultiModalFieldElem(data=words, field=batched),
    })


def _words(item: Any) -> list[int] | None:
    if item is None or HANDLE_FIELD not in item:
        return None
    words = item[HANDLE_FIELD].data
    if (not isinstance(words, (list, tuple)) or len(words) != HANDLE_WORDS
            or any(type(w) is not int or not 0 <= w < 1 << 64 for w in words)):
        raise ValueError(f"malformed shmstore handle item: expected {HANDLE_WORDS} unsigned "
                         "64-bit ints")
    return list(words)


def handout_number(item: Any) -> int | None:
    """The hand-out number a handle item carries, None for an item with data or anything that
    is not a well-formed handle item."""
    try:
        words = _words(item) if isinstance(item, MultiModalKwargsItem) else None
    except ValueError:
        return None
    return None if words is None else words[6]


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
    address, seq, low, high, epoch, _, _ = words
    try:
        return Handle(address, seq, low.to_bytes(8, "little") + high.to_bytes(8, "little"), epoch)
    except (InvalidHandle, ValueError, TypeError) as exc:
        raise ValueError(f"malformed shmstore handle item: {exc}") from None


# -- the two caches -------------------------------------------------------------------------------

class ShmstoreSenderCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    """vLLM's P0 cache, backed by one shmstore ObjectStore (this process writes it).

    Its hand-outs follow vLLM's requests (_vllm_requests.py): the hooks `install()` puts into
    vLLM's API process tell `ledger` when a request is added, refused or ends."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__()
        name, capacity, max_object = _settings(vllm_config)
        nodes, _, per_engine = node_layout(vllm_config)
        self.engines = _engines(vllm_config)
        self.readers_per_engine = per_engine
        n_readers = self.engines * per_engine
        parallel = vllm_config.parallel_config
        api_servers = int(getattr(parallel, "_api_process_count", 1))
        api_rank = int(getattr(parallel, "_api_process_rank", 0))
        policy = os.environ.get(POLICY_ENV, DEFAULT_POLICY).strip() or DEFAULT_POLICY
        settle_s = env_seconds(SETTLE_ENV, DEFAULT_SETTLE_S)
        lease_s = env_seconds(LEASE_ENV, DEFAULT_LEASE_S)

        def make(create: Any) -> Any:
            try:
                return create(capacity_bytes=capacity, max_object_bytes=max_object, policy=policy)
            except InvalidArgument as exc:
                if exc.argument != "max_object_bytes":
                    raise
                # the limit is about the whole cache: what fits
                return create(capacity_bytes=capacity, policy=policy)

        self._head: HeadPublisher | None = None
        self._host: WriterHost | None = None
        self._store: StoreWriter | RemoteWriter
        if nodes > 1:
            self._head = HeadPublisher(make, name, n_readers, nodes - 1)
            self._store = self._head.channel.store
        elif api_servers > 1 and api_rank > 0:  # API server 0 writes; this one through it
            self._store = RemoteWriter(name)
        else:
            # pages are taken as the ring fills, not all at start (vLLM's default capacity is
            # 4 GiB; a server that sees few images should not hold all of it)
            self._store = make(lambda **kw: ObjectStore.create(name, n_readers=n_readers,
                                                               prefault=False, **kw))
        self._updates: dict[str, Sequence[Any]] = {}  # prompt updates stay on P0
        self._prune_at = PRUNE_UPDATES
        self._touched: dict[str, tuple[Handle, int]] = {}  # kept hand-outs (and their numbers)
        self._hits = self._total = 0
        self._last = CacheInfo(hits=0, total=0)
        self.ledger = RequestLedger(self._store, settle_s, lease_s, self._is_touched)
        self._lock = self.ledger.lock
        if api_servers > 1 and isinstance(self._store, StoreWriter):
            try:
                self._host = WriterHost(self._store, self._lock)
            except BaseException:
                self._store.close()
                raise
        self.segment, self.api_server = name, api_rank
        self.items = dict.fromkeys(("hit", "shared", "stored", "inline"), 0)
        self._unregister_metrics = _export_metrics(self)
        _SENDERS.append(self)
        role = ("writes it" if isinstance(self._store, StoreWriter) else
                "writes it through API server 0")
        log.info("shmstore serves vLLM's shm multimodal cache: segment %r, %d bytes, policy %s; "
                 "layout: %d API server(s) (this is %d, %s), %d engine(s) x %d worker(s) = %d "
                 "reader(s)%s", name, capacity, policy, api_servers, api_rank, role,
                 self.engines, per_engine, n_readers,
                 "" if self._head is None else " on this node and the relay publisher")

    @property
    def inline_fallbacks(self) -> int:
        """Items sent inline (too large, store full, or a node's relay not connected)."""
        return self.items["inline"]

    @property
    def store(self) -> StoreWriter | RemoteWriter:
        return self._store

    def routed(self, request_id: str, engine: int) -> None:
        """The DP client sends `request_id` to engine `engine` (its DP rank): its hand-outs are
        owed by that engine's workers only."""
        if self.engines > 1:
            first = engine % self.engines * self.readers_per_engine
            self.ledger.routed(request_id, range(first, first + self.readers_per_engine))

    @property
    def publisher(self) -> Any:
        """The relay Publisher of a TP group across nodes (shmstore.relay.Publisher), else None."""
        return None if self._head is None else self._head.publisher

    def _is_touched(self, handle: Handle) -> bool:
        return any(kept == handle for kept, _ in self._touched.values())

    def is_cached_item(self, mm_hash: str) -> bool:
        # a hit needs both the object and P0's prompt updates
        with self._lock:
            return mm_hash in self._updates and self._store.is_cached(mm_hash)

    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        """vLLM asks this before processing a request's misses, and touches its hits after:
        take the hits' hand-outs now, in one call (one round trip through another API
        server's host), so they are pinned from here on and the touches cost nothing. Hand-outs
        a request never uses (its processing failed) go back at the next release."""
        with self._lock:
            want = list(dict.fromkeys(h for h in mm_hashes
                                      if h in self._updates and h not in self._touched))
            if want:
                store = self._store
                if isinstance(store, RemoteWriter):
                    found = [f for i in range(0, len(want), MAX_KEYS)
                             for f in store.hand_out_cached(want[i:i + MAX_KEYS])]
                else:
                    found = [self._hand_out_one(h) for h in want]
                for mm_hash, hit in zip(want, found, strict=True):
                    if hit is not None:
                        self._touched[mm_hash] = hit
            return [h in self._touched for h in mm_hashes]

    def _hand_out_one(self, mm_hash: str) -> tuple[Handle, int] | None:
        try:
            return self._store.get_cached(mm_hash), self._store.handout_seq
        except KeyNotCached:
            return None

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        with self._lock:  # is_cached took the hits' hand-outs: this finds them there
            if mm_hash not in self._touched and mm_hash in self._updates:
                hit = self._hand_out_one(mm_hash)
                if hit is not None:
                    self._touched[mm_hash] = hit

    def release_sender_touches(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
            for handle, _ in touched.values():
                try:
                    self._store.give_back(handle)
                except StaleHandle:
                    pass  # cleared meanwhile: nothing to give back

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> tuple[Any, Sequence[Any]]:
        with self._lock:
            return self._get_and_update_item(mm_item, mm_hash)

    def _get_and_update_item(self, mm_item: Any, mm_hash: str) -> tuple[Any, Sequence[Any]]:
        self._total += 1
        kept = self._touched.pop(mm_hash, None)
        handle = number = None
        if kept is not None:
            handle, number = kept
            if self._head is not None:
                # published hand-outs go out in the order they are made: renew the kept one
                handle = self._head.channel.store.hand_out_again(handle)
                number = self._store.handout_seq
        if handle is None and self.is_cached_item(mm_hash):
            handle, number = self._store.get_cached(mm_hash), self._store.handout_seq
        if handle is not None and number is not None:
            self._hits += 1
            self.items["hit"] += 1
            out = self._hand_out(handle, number, mm_item, mm_hash)
            return (mm_item if out is None else out), self._updates[mm_hash]
        if mm_item is None:
            raise MultiModalCacheMissError([mm_hash])
        item, prompt_updates = mm_item
        try:
            handle = self._put(mm_hash, item)
        except KeyExists:  # stored (by another API server), but not its prompt updates here
            try:
                handle = self._store.get_cached(mm_hash)
            except KeyNotCached:  # evicted in between: not worth a second try
                self.items["inline"] += 1
                return mm_item  # type: ignore[no-any-return]
            self.items["shared"] += 1
        else:
            if handle is None:
                return mm_item  # type: ignore[no-any-return]
            self.items["stored"] += 1
        number = self._store.handout_seq
        if len(self._updates) >= self._prune_at:  # drop the updates of items gone from the store
            keys = list(self._updates)
            cached = (self._store.cached(keys) if isinstance(self._store, RemoteWriter)
                      else [self._store.is_cached(k) for k in keys])
            self._updates = {k: self._updates[k] for k, c in zip(keys, cached, strict=True) if c}
            self._prune_at = 2 * len(self._updates) + PRUNE_UPDATES
        self._updates[mm_hash] = prompt_updates
        out = self._hand_out(handle, number, mm_item, mm_hash)
        return (mm_item if out is None else (out, prompt_updates))

    def _put(self, mm_hash: str, item: Any) -> Handle | None:
        """Store a miss; None: send it inline (too large, or the store is full even after
        withdrawing what only ended requests held)."""
        value = item_to_value(item)
        for attempt in range(2):
            try:
                return self._store.put(mm_hash, value, timeout=0)
            except StoreFull as exc:
                if attempt == 0 and self.ledger.settle(full=True):
                    continue
                why: Exception = exc
            except ObjectTooLarge as exc:
                why = exc
            self.items["inline"] += 1
            log.debug("shmstore: item %s sent inline (%s)", mm_hash, why)
            return None
        return None  # not reached: the loop returns on its last attempt

    def _hand_out(self, handle: Handle, number: int, mm_item: Any, mm_hash: str) -> Any:
        """The handle item for hand-out `number` just made; on a TP group across nodes, also
        sent to the other nodes. None: give the data inline instead (a node's relay is not
        connected, or too slow to take it); the hand-out is given back."""
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
                self.items["inline"] += 1
                log.debug("shmstore: item %s sent inline (%s)", mm_hash, why)
                return None
        object_id = self._store.object_id(mm_hash)
        if object_id is None:  # not reached: a hand-out just made is of a cached key
            self._store.give_back(handle)
            raise MultiModalCacheMissError([mm_hash])
        self.ledger.handed_out(number, handle, mm_hash)
        return handle_item(handle, object_id, number)

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        handle = handle_from_item(mm_item)
        if handle is None:
            return
        with self._lock:
            issued = (handle == self._store.handle_of(mm_hash)
                      and object_id_from_item(mm_item) == self._store.object_id(mm_hash))
        if not issued:
            raise ValueError(f"multimodal item {mm_hash!r} carries a shmstore handle that this "
                             "server did not issue for it (forged, stale or from another "
                             "server); send the data instead")

    def invalidate(self, mm_hash: str) -> None:
        with self._lock:
            if not self._store.is_cached(mm_hash):
                self._updates.pop(mm_hash, None)

    def clear_cache(self) -> None:
        """vLLM's reset_mm_cache: new requests find nothing; the hand-outs of requests in
        flight stay readable until their workers have read them."""
        with self._lock:
            self.release_sender_touches()
            self._store.clear(keep_handed_out=True)
            self.ledger.forget()
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
        self.ledger.close()
        with self._lock:
            if self in _SENDERS:
                _SENDERS.remove(self)
            if not self._store.closed:
                self.release_sender_touches()
            if self._head is not None:
                self._head.close()
            if self._host is not None:
                self._host.close()
            self._store.close()


class ShmstoreReceiverCache(BaseMultiModalReceiverCache):  # type: ignore[misc]
    """vLLM's cache in each worker: resolves handle items from the shared store.

    A worker counts each hand-out once per request: vLLM may send a request it preempted
    again as new (its V2 model runner does), and the second read must not take the read a
    later hand-out of the same object is owed. Requests with several samples (n > 1) are one
    request each, and the sender hands the item out once for each."""

    def __init__(self, vllm_config: Any, shared_worker_lock: Any = None) -> None:
        super().__init__()  # shared_worker_lock: accepted, not needed (no cross-process lock)
        self._name, _, _ = _settings(vllm_config)
        nodes, node_rank, n_local = node_layout(vllm_config)
        self._engine = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        self._per_engine = n_local
        import torch

        # with CUDA, tensors land in page-locked memory: vLLM's copy to the device then needs
        # no staging copy of its own
        self._pin_memory = bool(torch.cuda.is_available())
        self._reader: StoreReader | None = None
        self._feed: NodeFeed | None = None
        self._request: str | None = None  # the request whose items are being resolved
        self._read: OrderedDict[tuple[str | None, int], None] = OrderedDict()
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
            first = _first_reader(self._name, self._engine, self._per_engine)
            self._reader = ObjectStore.attach(self._name, first + _local_rank(), prefault=False)
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
        handle = handle_from_item(mm_item)
        if handle is None:
            return mm_item
        if handle.key_digest != key_digest(mm_hash):
            log.warning("shmstore: item %s carries the handle of another item; asking for it "
                        "again", mm_hash)
            raise MultiModalCacheMissError([mm_hash])
        read = (self._request, mm_item[HANDLE_FIELD].data[6])
        count = read not in self._read
        try:
            if self._feed is not None:
                object_id = object_id_from_item(mm_item)
                assert object_id is not None  # it carries a handle
                value = self._feed.get(object_id)
            else:
                value = self.reader.get(handle, count=count, pin_memory=self._pin_memory)
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


class _SenderCollector:
    """One API server's own counters (prometheus_client collector), labelled by segment and
    api_server: items by outcome, inline fallbacks, hand-outs settled unread by reason."""

    def __init__(self, sender: ShmstoreSenderCache) -> None:
        self._sender = sender

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        sender = self._sender
        labels = [sender.segment, str(sender.api_server)]
        with sender.ledger.lock:
            items, settled = dict(sender.items), dict(sender.ledger.settled)
        for name, doc, label, values in (
                ("shmstore_vllm_items", "Items by outcome: hit (stored, prompt updates here), "
                 "shared (processed here, stored already: no second copy), stored, inline",
                 "outcome", items),
                ("shmstore_vllm_settled", "Hand-outs settled without being read, by reason",
                 "reason", settled)):
            family = CounterMetricFamily(name, doc, labels=["segment", "api_server", label])
            for key, count in values.items():
                family.add_metric([*labels, key], count)
            yield family
        family = CounterMetricFamily("shmstore_inline_fallbacks",
                                     "Values sent inline because too large or store full",
                                     labels=["segment", "api_server"])
        family.add_metric(labels, items["inline"])
        yield family


def _export_metrics(sender: ShmstoreSenderCache) -> Any:
    """shmstore_* metrics for vLLM's /metrics: the store's (from the API server that writes
    it) and each API server's own. With several API servers vLLM serves /metrics from
    prometheus_client's multiprocess files: the values are mirrored into them."""
    try:
        from .metrics import StoreCollector, mirror_to_multiprocess, register_collector
    except ImportError:
        return lambda: None
    sources: list[Any] = [_SenderCollector(sender)]
    store = sender.store
    if isinstance(store, StoreWriter):
        sources.append(StoreCollector(store, publisher=sender.publisher, lock=sender.ledger.lock))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        stops = [mirror_to_multiprocess(source) for source in sources]
    else:
        stops = [register_collector(source) for source in sources]

    def stop() -> None:
        for each in stops:
            each()
    return stop


def _local_rank() -> int:
    """This worker's rank on its node: vLLM's world group once it exists, else LOCAL_RANK."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except (ImportError, AssertionError, AttributeError):
        return int(os.environ.get("LOCAL_RANK", "0"))


_REMOVE_AT_EXIT: list[str] = []
EXIT_WAIT_S = 2.0  # how long a parent waits at exit for the writer it killed to be gone


def _remove_if_orphaned(name: str) -> None:
    """The store `name`, if its writer is dead, is unlinked (a live writer's is left alone,
    and so is anything of that name that is not a shmstore segment: vLLM's own)."""
    header = peek_header(name)
    if header is None:
        return
    writer = header[2]
    stat = proc_stat(writer)
    if stat is not None and stat[1] == os.getpid():  # we just killed it (vLLM's launcher)
        deadline = time.monotonic() + EXIT_WAIT_S
        while pid_alive(writer) and time.monotonic() < deadline:
            time.sleep(0.01)
    if pid_alive(writer):
        return
    try:
        if Segment.remove_stale(name):
            log.info("shmstore: removed store %r, whose writer was killed", name)
    except (ShmStoreError, OSError):
        pass  # its writer lives (it unlinks it), or it is not a shmstore segment


def install() -> None:
    """Route vLLM's `shm` cache type to shmstore, where vLLM's factories are bound."""
    import importlib

    original_sender = factories.processor_cache_from_config
    original_receiver = factories.worker_receiver_cache_from_config
    original_type = factories._get_cache_type

    def get_cache_type(vllm_config: Any) -> Any:
        # vLLM turns IPC caching off for several API servers and for DP behind its internal
        # load balancer; one shared store serves those, so `shm` stays `shm` where it can
        cache_type = original_type(vllm_config)
        if (cache_type == "processor_only" and vllm_config.model_config
                .get_multimodal_config().mm_processor_cache_type == "shm"):
            why = servable(vllm_config)
            if why is None:
                return "shm"
            log.warning("shmstore: vLLM's processor-only cache stays (%s)", why)
        return cache_type

    if not getattr(original_type, "_shmstore_hook", False):  # install() may run again
        get_cache_type._shmstore_hook = True  # type: ignore[attr-defined]
        factories._get_cache_type = get_cache_type
    # vLLM names the segment when a process first asks, and sets the name in its environment:
    # ask now, so every process started from here (several API servers, DP engines) shares it
    import vllm.envs as envs

    name = envs.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME
    if not _REMOVE_AT_EXIT:
        # vLLM's launcher SIGKILLs its API servers at shutdown, often before the writer can
        # unlink the store: whichever process of the server exits after it removes it
        _REMOVE_AT_EXIT.append(name)
        atexit.register(_remove_if_orphaned, name)

    def processor_cache_from_config(vllm_config: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return ShmstoreSenderCache(vllm_config)
        return original_sender(vllm_config)

    def worker_receiver_cache_from_config(vllm_config: Any, shared_worker_lock: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return ShmstoreReceiverCache(vllm_config, shared_worker_lock)
        return original_receiver(vllm_config, shared_worker_lock)

    _install_request_hooks()
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


# -- hand-outs follow requests: hooks in vLLM's API process and workers ---------------------------

def _feature_numbers(request: Any) -> list[int]:
    return [n for f in (getattr(request, "mm_features", None) or [])
            if (n := handout_number(getattr(f, "data", None))) is not None]


def _install_request_hooks() -> None:
    """Wrap the vLLM methods where a request is added, refused, finished or aborted (API
    process) and where a worker resolves a new request's items; a method this vLLM lacks is
    named in a warning, and the lease settles what it would have."""
    import functools
    import importlib

    def add_request(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request, *args, **kwargs)
            numbers = _feature_numbers(request)
            if numbers:
                for ledger in _ledgers():
                    ledger.request_added(request.request_id, numbers)
            return result
        return wrapper

    def finish_request(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, req_state: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, req_state, *args, **kwargs)
            for ledger in _ledgers():
                ledger.request_ended(req_state.request_id, aborted=False)
            return result
        return wrapper

    def abort_requests(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            aborted = original(self, *args, **kwargs)
            for ledger in _ledgers():
                for request_id in aborted or ():
                    ledger.request_ended(request_id, aborted=True)
            return aborted
        return wrapper

    def process_inputs(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, request_id: Any, prompt: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, request_id, prompt, *args, **kwargs)
            except BaseException:
                ledgers = _ledgers()
                numbers = numbers_in(prompt, handout_number) if ledgers else []
                for ledger in ledgers:
                    ledger.refused(numbers)
                raise
        return wrapper

    def apply_mm_cache(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, scheduler_output: Any) -> Any:
            cache = getattr(self, "mm_receiver_cache", None)
            if not isinstance(cache, ShmstoreReceiverCache):
                return original(self, scheduler_output)
            for req_data in scheduler_output.scheduled_new_reqs:
                req_data.mm_features = cache.features_of_request(req_data.req_id,
                                                                 req_data.mm_features)
            return None
        return wrapper

    def render_async(original: Any) -> Any:
        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            # the list lives as long as the server's task for this request (its context):
            # what it lists and no request claimed by then was never sent
            rendered = _Rendered()
            weakref.finalize(rendered, _render_ended, rendered.numbers)
            _RENDERED.set(rendered)
            try:
                return await original(*args, **kwargs)
            except BaseException:  # refused while rendering: never sent
                for ledger in _ledgers():
                    ledger.refused(rendered.numbers)
                rendered.numbers.clear()
                raise
        return wrapper

    def process_tokens_async(original: Any) -> Any:
        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            engine_input = await original(*args, **kwargs)
            rendered = _RENDERED.get()
            if rendered is not None and _SENDERS:
                rendered.numbers.extend(numbers_in(engine_input, handout_number))
            return engine_input
        return wrapper

    def engine_for_request(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            engine = original(self, request, *args, **kwargs)
            for sender in list(_SENDERS):
                sender.routed(request.request_id, int.from_bytes(engine, "little"))
            return engine
        return wrapper

    hooks = (("vllm.v1.engine.output_processor", "OutputProcessor", "add_request", add_request),
             # DP: the client picks the engine after rendering; only its workers owe the reads
             ("vllm.v1.engine.core_client", "DPAsyncMPClient", "get_core_engine_for_request",
              engine_for_request),
             ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "get_core_engine_for_request",
              engine_for_request),
             # the OpenAI server renders first: a request refused while rendering (a prompt
             # over max_model_len once its image tokens count) never reaches process_inputs
             ("vllm.renderers.base", "BaseRenderer", "render_chat_async", render_async),
             ("vllm.renderers.base", "BaseRenderer", "render_cmpl_async", render_async),
             ("vllm.renderers.base", "BaseRenderer", "_process_tokens_async",
              process_tokens_async),
             ("vllm.v1.engine.output_processor", "OutputProcessor", "_finish_request",
              finish_request),
             ("vllm.v1.engine.output_processor", "OutputProcessor", "abort_requests",
              abort_requests),
             ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs",
              process_inputs),
             ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "_apply_mm_cache",
              apply_mm_cache))
    for module_name, class_name, method, wrap in hooks:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            original = getattr(cls, method)
        except (ImportError, AttributeError) as exc:
            log.warning("shmstore vLLM plugin: no %s.%s.%s in this vLLM (%s); hand-outs it "
                        "would settle are settled by the lease (%s)", module_name, class_name,
                        method, exc, LEASE_ENV)
            continue
        if not getattr(original, "_shmstore_hook", False):
            wrapped = wrap(original)
            wrapped._shmstore_hook = True
            setattr(cls, method, wrapped)
