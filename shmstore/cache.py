"""Multimodal processor caches: one interface, three kinds, chosen by name.

The sender (P0, the frontend) calls `process(key, make_value)` for every multimodal item of every
request; `make_value` (the expensive preprocessing) runs only on a miss. What it returns, the
payload, goes to every worker with the request. Each worker calls `resolve(payload)` (or
`resolve_view`) and gets the value back, whichever path it took.

Kinds (all take the same byte budget, `capacity_bytes`):

    shm-fifo      one shared ObjectStore ring, FIFO eviction: the payload is a Handle (40 bytes).
                  A value above max_object_size, or a store whose oldest object is still owed to
                  a worker, is sent inline instead (counted as an inline fallback). Memory: one
                  copy of the budget, shared by all workers.
    shm-reinsert  the same ring with FIFO-reinsertion: an object hit since it was written is
                  copied forward instead of dropped (bytes copied are reported).
    lru           mirrored LRU: the sender keeps keys and sizes in an LRU with the budget and sends
                  only the key on a hit; every worker keeps the values in its own process memory
                  in an LRU of the same budget, fed by the misses, so the mirrors stay in step.
                  Memory: n_readers copies of the budget.

Payloads are tuples that shmstore's serializer and queue carry: ("h", Handle), ("v", value),
("k", key) and ("p", key, nbytes, value).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ._closeable import Closeable
from .errors import CorruptObject, InvalidKey, ObjectTooLarge, StoreFull
from .serde import encode
from .store import ObjectStore, StoreReader, StoreWriter

__all__ = ["CACHE_KINDS", "CacheStats", "ReceiverCache", "SenderCache", "make_cache"]

CACHE_KINDS = ("shm-fifo", "shm-reinsert", "lru")


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Sender-side counters of one cache; memory is summed over every process."""

    kind: str
    requests: int
    hits: int
    hit_ratio: float
    bytes_requested: int
    bytes_hit: int
    byte_hit_ratio: float
    evictions: int
    inline_fallbacks: int
    bytes_reinserted: int
    memory_bytes: int  # shm kinds: the reserved segment; lru: n_readers mirrors, as filled now
    capacity_bytes: int
    n_readers: int


class SenderCache(Closeable):
    """The frontend side. Only the process that made it may call it."""

    kind = ""

    def __init__(self, capacity_bytes: int, n_readers: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.n_readers = n_readers
        self._requests = self._hits = self._bytes_requested = self._bytes_hit = 0
        self._fallbacks = 0

    def process(self, key: str | bytes, make_value: Callable[[], Any]) -> Any:
        """Return the payload for `key`, calling make_value() only on a miss."""
        raise NotImplementedError

    def stats(self) -> CacheStats:
        raise NotImplementedError

    def _count(self, nbytes: int, hit: bool) -> None:
        self._requests += 1
        self._bytes_requested += nbytes
        if hit:
            self._hits += 1
            self._bytes_hit += nbytes

    def _stats(self, evictions: int, bytes_reinserted: int, memory_bytes: int) -> CacheStats:
        return CacheStats(
            kind=self.kind, requests=self._requests, hits=self._hits,
            hit_ratio=self._hits / self._requests if self._requests else 0.0,
            bytes_requested=self._bytes_requested, bytes_hit=self._bytes_hit,
            byte_hit_ratio=self._bytes_hit / self._bytes_requested if self._bytes_requested else 0.0,
            evictions=evictions, inline_fallbacks=self._fallbacks,
            bytes_reinserted=bytes_reinserted, memory_bytes=memory_bytes,
            capacity_bytes=self.capacity_bytes, n_readers=self.n_readers,
        )

    def close(self) -> None:
        """Release what the cache holds; idempotent."""



class ReceiverCache(Closeable):
    """One worker's side. `resolve` gives an owned value; `resolve_view` may give views."""

    kind = ""

    def resolve(self, payload: Any) -> Any:
        raise NotImplementedError

    @contextmanager
    def resolve_view(self, payload: Any) -> Iterator[Any]:
        """Yield the value; for shm kinds arrays point into shared memory inside the block."""
        yield self.resolve(payload)

    def close(self) -> None:
        """Release what the cache holds; idempotent."""



def _bad_payload(payload: Any, kind: str) -> CorruptObject:
    return CorruptObject(f"{kind} cache got payload {payload!r:.80}, which no {kind} sender "
                         "makes: sender and receivers must use the same cache kind")


# -- shared-memory kinds ------------------------------------------------------------------------

class ShmSenderCache(SenderCache):
    """shm-fifo / shm-reinsert sender: the ObjectStore writer."""

    def __init__(self, kind: str, name: str | None, capacity_bytes: int, n_readers: int,
                 max_object_size: int | None) -> None:
        super().__init__(capacity_bytes, n_readers)
        self.kind = kind
        self.store: StoreWriter = ObjectStore.create(
            name, capacity_bytes, n_readers, max_object_size,
            policy="fifo" if kind == "shm-fifo" else "reinsert")
        self.name = self.store.name

    def process(self, key: str | bytes, make_value: Callable[[], Any]) -> Any:
        store = self.store
        if store.is_cached(key):
            self._count(store.object_bytes(key), hit=True)
            return ("h", store.get_cached(key))
        value = make_value()
        try:
            handle = store.put(key, value, timeout=0)
        except (ObjectTooLarge, StoreFull):
            self._fallbacks += 1
            self._count(encode(value).nbytes, hit=False)
            return ("v", value)
        self._count(store.object_bytes(key), hit=False)
        return ("h", handle)

    def stats(self) -> CacheStats:
        s = self.store.stats()
        return self._stats(s.evictions, s.bytes_reinserted, self.store.ring.segment.total_bytes)

    def close(self) -> None:
        self.store.close()


class ShmReceiverCache(ReceiverCache):
    """shm-fifo / shm-reinsert receiver: an ObjectStore reader."""

    def __init__(self, kind: str, name: str, reader: int) -> None:
        self.kind = kind
        self.store: StoreReader = ObjectStore.attach(name, reader)

    def resolve(self, payload: Any) -> Any:
        tag = payload[0] if type(payload) is tuple and payload else None
        if tag == "h" and len(payload) == 2:
            return self.store.get(payload[1])
        if tag == "v" and len(payload) == 2:
            return payload[1]
        raise _bad_payload(payload, self.kind)

    @contextmanager
    def resolve_view(self, payload: Any) -> Iterator[Any]:
        if type(payload) is tuple and len(payload) == 2 and payload[0] == "h":
            with self.store.view(payload[1]) as value:
                yield value
        else:
            yield self.resolve(payload)

    def close(self) -> None:
        self.store.close()


# -- mirrored LRU -------------------------------------------------------------------------------

class _LruBytes:
    """An LRU of key -> (nbytes, value) bounded by total nbytes; the sender and every receiver
    run the same one, fed the same sequence, so they evict the same keys."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[str | bytes, tuple[int, Any]] = OrderedDict()
        self.used_bytes = 0
        self.evictions = 0

    def touch(self, key: str | bytes) -> tuple[int, Any] | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def insert(self, key: str | bytes, nbytes: int, value: Any) -> None:
        while self.entries and self.used_bytes + nbytes > self.capacity_bytes:
            _, (old_bytes, _) = self.entries.popitem(last=False)
            self.used_bytes -= old_bytes
            self.evictions += 1
        self.entries[key] = (nbytes, value)
        self.used_bytes += nbytes


class LruSenderCache(SenderCache):
    """lru sender: keys and sizes only."""

    kind = "lru"

    def __init__(self, capacity_bytes: int, n_readers: int) -> None:
        super().__init__(capacity_bytes, n_readers)
        self._lru = _LruBytes(capacity_bytes)

    def process(self, key: str | bytes, make_value: Callable[[], Any]) -> Any:
        if type(key) not in (str, bytes):
            raise InvalidKey(f"keys are str or bytes, got {type(key).__name__}")
        entry = self._lru.touch(key)
        if entry is not None:
            self._count(entry[0], hit=True)
            return ("k", key)
        value = make_value()
        nbytes = encode(value).nbytes
        self._count(nbytes, hit=False)
        if nbytes > self.capacity_bytes:
            self._fallbacks += 1
            return ("v", value)
        self._lru.insert(key, nbytes, None)
        return ("p", key, nbytes, value)

    def stats(self) -> CacheStats:
        return self._stats(self._lru.evictions, 0, self.n_readers * self._lru.used_bytes)


class LruReceiverCache(ReceiverCache):
    """lru receiver: a mirror that holds the values in this process's memory."""

    kind = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = _LruBytes(capacity_bytes)

    def resolve(self, payload: Any) -> Any:
        tag = payload[0] if type(payload) is tuple and payload else None
        if tag == "k" and len(payload) == 2:
            entry = self._lru.touch(payload[1])
            if entry is None:
                raise CorruptObject(
                    f"lru mirror has no value for key {payload[1]!r}: this receiver missed a "
                    "payload or has another capacity than the sender; give every receiver the "
                    "sender's capacity_bytes and every payload, in order")
            return entry[1]
        if tag == "p" and len(payload) == 4 and type(payload[2]) is int:
            _, key, nbytes, value = payload
            self._lru.insert(key, nbytes, value)
            return value
        if tag == "v" and len(payload) == 2:
            return payload[1]
        raise _bad_payload(payload, self.kind)

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes


# -- factory ------------------------------------------------------------------------------------

def make_cache(
    kind: str,
    side: str,
    *,
    capacity_bytes: int,
    n_readers: int = 1,
    name: str | None = None,
    reader: int = 0,
    max_object_size: int | None = None,
) -> Any:
    """Make one side of a cache of `kind` ("shm-fifo", "shm-reinsert" or "lru").

    Args:
        side: "sender" (one, in the frontend) or "receiver" (one per worker).
        capacity_bytes: the byte budget (every lru receiver needs the sender's value).
        n_readers: workers (sender side).
        name: the shared segment (shm kinds; the sender may leave it None and pass its `.name`).
        reader: this worker's index (shm receivers).
        max_object_size: largest value the shm store holds; larger ones go inline.

    Returns:
        A SenderCache or a ReceiverCache.
    """
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; choose one of {CACHE_KINDS}")
    if side == "sender":
        if kind == "lru":
            return LruSenderCache(capacity_bytes, n_readers)
        return ShmSenderCache(kind, name, capacity_bytes, n_readers, max_object_size)
    if side == "receiver":
        if kind == "lru":
            return LruReceiverCache(capacity_bytes)
        if name is None:
            raise ValueError("a shm receiver needs the store's name (the sender's .name)")
        return ShmReceiverCache(kind, name, reader)
    raise ValueError(f"side must be 'sender' or 'receiver', got {side!r}")
