"""Multimodal processor caches: one interface, a kind per eviction policy and a mirrored LRU.

The sender (P0, the frontend) calls `process(key, make_value)` for every multimodal item of every
request; `make_value` (the expensive preprocessing) runs only on a miss. What it returns, the
payload, goes to every worker with the request. Each worker calls `resolve(payload)` (or
`resolve_view`) and gets the value back, whichever path it took.

Kinds (all take the same byte budget, `capacity_bytes`):

    shm-fifo      one shared ObjectStore ring, FIFO eviction: the payload is a hand-out (its
                  Handle, number and object id: about 90 bytes).
                  A value above max_object_size, or a store whose oldest object is still owed to
                  a worker, is sent inline instead (counted as an inline fallback). Memory: one
                  copy of the budget, shared by all workers.
    shm-reinsert  the same ring with FIFO-reinsertion: an object hit since it was written is
                  copied forward instead of dropped (bytes copied are reported).
    shm-freq      the same ring with the `freq` policy: a 2-bit use count and a ghost list of
                  evicted keys decide what is copied forward.
    shm-recency   the same ring with the `recency` policy: what an LRU of 0.85 of the ring
                  would still hold is copied forward.
    shm-adaptive  the same ring with the `adaptive` policy (DEFAULT_KIND, recommended): freq, reinsert
                  and recency run as shadows on metadata, and the ring follows the one that has
                  hit most lately.
    lru           mirrored LRU: the sender keeps keys and sizes in an LRU with the budget and sends
                  only the key on a hit; every worker keeps the values in its own process memory
                  in an LRU of the same budget, fed by the misses, so the mirrors stay in step.
                  Memory: n_readers copies of the budget.

A hit hands the stored object out again, a miss is stored and handed out or, when the store
cannot take it, sent inline: StoreSender below is that logic, one for every sender. The shm
kinds use it as it is; the vLLM plugin's sender (serving/_sender.py) builds on it, adding the
requests its hand-outs follow (settled before its retry of a full store) and the other nodes.

Make the sender with `SenderCache.create(kind, ...)` and each receiver with
`ReceiverCache.attach(kind, ...)`. Payloads are tuples that shmstore's serializer and queue carry,
led by a PAYLOAD_* tag: (PAYLOAD_HANDLE, HandOut.to_words()), (PAYLOAD_VALUE, value),
(PAYLOAD_KEY, key) and (PAYLOAD_PUT, key, nbytes, value). A receiver reads a hand-out with
StoreReceiver below, as the vLLM plugin's workers do (serving/_receiver.py): checked against the
store first, and counted once however often its payload is resolved.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .._proc import int_arg
from ..errors import (
    CorruptObject,
    InvalidArgument,
    InvalidHandle,
    ObjectTooLarge,
    StaleHandle,
    StoreFull,
)
from ..handle import Handle, HandOut, check_key, key_digest
from ..serde._codec import encode, materialize
from ..shm._closeable import Closeable
from ..shm._segment import MAX_CAPACITY_BYTES
from ..store._api import WriterAPI
from ..store._object_store import ObjectStore, StoreReader, StoreWriter
from ..store._policy import DEFAULT_POLICY, POLICIES

__all__ = ["CACHE_KINDS", "DEFAULT_KIND", "CacheStats", "ReceiverCache", "SenderCache",
           "PAYLOAD_HANDLE", "PAYLOAD_VALUE", "PAYLOAD_KEY", "PAYLOAD_PUT", "StoreSender",
           "StoreReceiver", "READ_MEMORY"]
READ_MEMORY = 1 << 16  # (request, hand-out) pairs a receiver remembers having read

CACHE_KINDS = (*(f"shm-{policy}" for policy in POLICIES), "lru")  # one per eviction policy
DEFAULT_KIND = f"shm-{DEFAULT_POLICY}"  # the recommended kind
PAYLOAD_HANDLE = 1  # (PAYLOAD_HANDLE, a HandOut's words): read it from the store
PAYLOAD_VALUE = 2  # (PAYLOAD_VALUE, value): the value itself (not cached)
PAYLOAD_KEY = 3  # (PAYLOAD_KEY, key): lru hit, the receiver's mirror has it
PAYLOAD_PUT = 4  # (PAYLOAD_PUT, key, nbytes, value): lru miss, the mirror inserts it


class StoreSender:
    """A sender's hand-outs on one store (a StoreWriter, or a RemoteWriter of another process):

        take(key)            a kept touch of `key`, else a new hand-out of its cached object;
                             None: a miss
        store_new(key, v)    a miss stored and handed out; None (and why): send it inline (too
                             large, or the store is full after `make_room()` freed what it
                             could); KeyExists: another writer stored it meanwhile
        touch(keys, ...)     hits taken early, in one call, kept until taken or released;
                             `accept` may refuse one (given back at once)
        release()            give back every touch not taken, each by its number
        issued(key, h)       whether the store made hand-out `h` of what it caches under `key`

    Every step takes `lock` (the caller's, held around its own store calls too)."""

    def __init__(self, store: WriterAPI, lock: threading.RLock | None = None) -> None:
        self.store = store
        self.lock = lock if lock is not None else threading.RLock()
        self.touched: dict[str | bytes, HandOut] = {}

    def take(self, key: str | bytes, *, cached_here: bool = True) -> HandOut | None:
        """The hand-out of a hit on `key`: its kept touch, else (if the caller can use a hit
        on it: `cached_here`) a new hand-out of the cached object; None: a miss."""
        with self.lock:
            handout = self.touched.pop(key, None)
            if handout is not None:
                return self.renew(handout)
            return self.store.hand_out_cached([key])[0] if cached_here else None

    def renew(self, kept: HandOut) -> HandOut:
        """A touch kept a while, as it goes out (a sender that publishes hand-outs in order
        makes it anew: serving/_sender.py)."""
        return kept

    def store_new(self, key: str | bytes, value: Any,
                  make_room: Callable[[], bool] | None = None
                  ) -> tuple[HandOut | None, Exception | None]:
        """A miss: `value` (or a serde.Encoded) stored under `key` and handed out once,
        without waiting; (None, why) when it goes inline instead."""
        with self.lock:
            try:
                return self.store.hand_out_new(key, value, timeout=0), None
            except StoreFull as exc:
                if make_room is None or not make_room():
                    return None, exc
            except ObjectTooLarge as exc:
                return None, exc
            try:  # once more: make_room() freed space
                return self.store.hand_out_new(key, value, timeout=0), None
            except (StoreFull, ObjectTooLarge) as exc:
                return None, exc

    def touch(self, keys: Iterable[str | bytes], field: str | None = None,
              accept: Callable[[Any, HandOut], bool] | None = None) -> None:
        """Take the hand-outs of the cached `keys` not touched yet, in one call; keep those
        `accept` takes (all, without it), give the others back (posted: no round trip)."""
        with self.lock:
            want = list(dict.fromkeys(k for k in keys if k not in self.touched))
            found = self.store.hand_out_cached(want, field) if want else []
            for key, hit in zip(want, found, strict=True):
                if hit is None:
                    continue
                if accept is None or accept(key, hit):
                    self.touched[key] = hit
                else:
                    self.store.give_back(hit.handle, hit.number, wait=False)

    def touch_one(self, key: str | bytes) -> None:
        """Take one touch of `key` if it has none kept."""
        with self.lock:
            if key not in self.touched:
                hit = self.store.hand_out_cached([key])[0]
                if hit is not None:
                    self.touched[key] = hit

    def is_touched(self, handle: Handle) -> bool:
        return any(kept.handle == handle for kept in self.touched.values())

    def issued(self, key: str | bytes, handout: HandOut) -> bool:
        with self.lock:
            return self.store.issued(key, handout)

    def release(self) -> None:
        """Give back every touch not taken: that hand-out, not the object's last (another
        writer's, maybe narrowed)."""
        with self.lock:
            touched, self.touched = self.touched, {}
            for kept in touched.values():
                try:
                    self.store.give_back(kept.handle, kept.number)
                except StaleHandle:
                    pass  # cleared meanwhile: nothing to give back


class StoreReceiver:
    """A worker's reads of hand-outs on one store, whatever sends them (the shm kinds' payloads,
    the vLLM plugin's handle items: serving/_receiver.py builds on it). A hand-out is checked
    first against what it names: the item's key (its handle's key digest, where the key is
    known), a number the store has made, and the object's origin (its id), so a damaged or
    replayed one takes no read another request still needs. Each hand-out is counted once
    per request (an engine may send a request again; a payload may be resolved twice)."""

    def __init__(self, attach: Callable[[], StoreReader], *, pin_memory: bool = False) -> None:
        self._attach = attach  # this worker's reader, attached at first use
        self._reader: StoreReader | None = None
        self._pin_memory = pin_memory
        self._read: OrderedDict[tuple[str | None, int], None] = OrderedDict()

    @property
    def reader(self) -> StoreReader:
        if self._reader is None:
            self._reader = self._attach()
        return self._reader

    def check(self, handout: HandOut, key: str | bytes | None = None) -> None:
        """StaleHandle unless `handout` can be a hand-out of `key` that the store made."""
        handle, number = handout.handle, handout.number
        if key is not None and handle.key_digest != key_digest(key):
            raise StaleHandle(f"hand-out {number} names another key's object", handle)
        last = self.reader.handout_seq
        if type(number) is not int or not 0 < number <= last:
            raise StaleHandle(f"hand-out number {number} was never made by the store (its last "
                              f"is {last})", handle)

    def read(self, handout: HandOut, key: str | bytes | None = None,
             request: str | None = None) -> Any:
        """An owned copy of `handout`'s object, counted once per (request, hand-out).

        Raises:
            StaleHandle, CorruptObject: as StoreReader.get, and as check() says.
        """
        self.check(handout, key)
        read = (request, handout.number)
        count = read not in self._read
        value = self.reader.get(handout.handle, count=count, pin_memory=self._pin_memory,
                                origin=handout.origin)
        if count:
            self._read[read] = None
            if len(self._read) > READ_MEMORY:
                self._read.popitem(last=False)
        return value

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


def _check_kind(kind: Any) -> str:
    if kind not in CACHE_KINDS:
        raise InvalidArgument(f"unknown cache kind {kind!r}; choose one of {CACHE_KINDS}",
                              "kind", kind)
    return str(kind)


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

    @staticmethod
    def create(kind: str, *, capacity_bytes: int, n_readers: int = 1, name: str | None = None,
               max_object_bytes: int | None = None) -> SenderCache:
        """Make the sender of a cache of `kind` (one of CACHE_KINDS).

        Args:
            capacity_bytes: the byte budget (every lru receiver needs the same value).
            n_readers: workers that receive every payload.
            name: the shared segment of shm kinds (None: a random name; see `.name`).
            max_object_bytes: largest value the shm store holds; larger ones go inline.
        """
        if _check_kind(kind) == "lru":
            return LruSenderCache(capacity_bytes, n_readers)
        return ShmSenderCache(kind, name, capacity_bytes, n_readers, max_object_bytes)

    def __init__(self, capacity_bytes: int, n_readers: int) -> None:
        self.capacity_bytes = int_arg(capacity_bytes, "capacity_bytes", 1, MAX_CAPACITY_BYTES)
        self.n_readers = n_readers
        self._requests = self._hits = self._bytes_requested = self._bytes_hit = 0
        self._fallbacks = 0

    def process(self, key: str | bytes, make_value: Callable[[], Any]) -> Any:
        """Return the payload for `key`, calling make_value() only on a miss."""
        raise NotImplementedError

    def process_into(self, key: str | bytes, template: Any,
                     fill: Callable[[dict[Any, Any]], None]) -> Any:
        """process() for a value whose arrays are computed in place: `template` holds Blanks
        (see StoreWriter.reserve) and, on a miss only, `fill(arrays)` writes them. The shm
        kinds hand it the arrays' places in shared memory (nothing is copied); otherwise, and
        for values sent inline, arrays in this process's memory."""
        def make_value() -> Any:
            value, arrays = materialize(template)
            fill(arrays)
            return value

        return self.process(key, make_value)

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

    @staticmethod
    def attach(kind: str, *, capacity_bytes: int, name: str | None = None,
               reader: int = 0) -> ReceiverCache:
        """Make worker `reader`'s side of a cache of `kind`.

        Args:
            capacity_bytes: the sender's budget (the lru mirror must match it).
            name: the sender's `.name` (shm kinds).
        """
        if _check_kind(kind) == "lru":
            return LruReceiverCache(capacity_bytes)
        if name is None:
            raise InvalidArgument("a shm receiver needs the store's name (the sender's .name)",
                                  "name", name)
        return ShmReceiverCache(kind, name, reader)

    def resolve(self, payload: Any) -> Any:
        raise NotImplementedError

    @contextmanager
    def resolve_view(self, payload: Any) -> Iterator[Any]:
        """Yield the value; for shm kinds arrays point into shared memory inside the block."""
        yield self.resolve(payload)

    def close(self) -> None:
        """Release what the cache holds; idempotent."""



def _handle_payload(handout: HandOut) -> tuple[int, tuple[int, ...]]:
    return (PAYLOAD_HANDLE, handout.to_words())


def _bad_payload(payload: Any, kind: str) -> CorruptObject:
    return CorruptObject(f"{kind} cache got payload {payload!r:.80}, which no {kind} sender "
                         "makes: sender and receivers must use the same cache kind")


# -- shared-memory kinds ------------------------------------------------------------------------

class ShmSenderCache(SenderCache):
    """shm-* sender: the ObjectStore writer, with the policy the kind names."""

    def __init__(self, kind: str, name: str | None, capacity_bytes: int, n_readers: int,
                 max_object_bytes: int | None) -> None:
        super().__init__(capacity_bytes, n_readers)
        self.kind = kind
        self.store: StoreWriter = ObjectStore.create(
            name, capacity_bytes=capacity_bytes, n_readers=n_readers,
            max_object_bytes=max_object_bytes, policy=kind.removeprefix("shm-"))
        self._sender = StoreSender(self.store)
        self.name = self.store.name

    def process(self, key: str | bytes, make_value: Callable[[], Any]) -> Any:
        store = self.store
        hit = self._sender.take(key)
        if hit is not None:
            self._count(store.object_bytes(key), hit=True)
            return _handle_payload(hit)
        value = make_value()
        enc = encode(value)
        self._count(enc.nbytes, hit=False)
        made, _ = self._sender.store_new(key, enc)
        if made is None:
            self._fallbacks += 1
            return (PAYLOAD_VALUE, value)
        return _handle_payload(made)

    def process_into(self, key: str | bytes, template: Any,
                     fill: Callable[[dict[Any, Any]], None]) -> Any:
        store = self.store
        hit = self._sender.take(key)
        if hit is not None:
            self._count(store.object_bytes(key), hit=True)
            return _handle_payload(hit)
        filling = False
        try:
            with store.reserve(key, template, timeout=0) as reservation:
                filling = True
                fill(reservation.arrays)
        except (ObjectTooLarge, StoreFull):
            if filling:
                raise  # from fill itself, not from making room
            self._fallbacks += 1
            value, arrays = materialize(template)
            fill(arrays)
            self._count(encode(value).nbytes, hit=False)
            return (PAYLOAD_VALUE, value)
        self._count(store.object_bytes(key), hit=False)
        assert reservation.handout is not None  # set by a clean exit
        return _handle_payload(reservation.handout)

    def stats(self) -> CacheStats:
        s = self.store.stats()
        return self._stats(s.evictions, s.bytes_reinserted, self.store.segment_bytes)

    def close(self) -> None:
        self.store.close()


class ShmReceiverCache(ReceiverCache):
    """shm-* receiver: an ObjectStore reader."""

    def __init__(self, kind: str, name: str, reader: int) -> None:
        self.kind = kind
        self.store: StoreReader = ObjectStore.attach(name, reader)
        self._receiver = StoreReceiver(lambda: self.store)

    def resolve(self, payload: Any) -> Any:
        handout = self._handout(payload)
        if handout is not None:
            return self._receiver.read(handout)
        if type(payload) is tuple and len(payload) == 2 and payload[0] == PAYLOAD_VALUE:
            return payload[1]
        raise _bad_payload(payload, self.kind)

    @contextmanager
    def resolve_view(self, payload: Any) -> Iterator[Any]:
        handout = self._handout(payload)
        if handout is None:
            yield self.resolve(payload)
            return
        self._receiver.check(handout)
        with self.store.view(handout.handle) as value:
            yield value

    def _handout(self, payload: Any) -> HandOut | None:
        """The hand-out a PAYLOAD_HANDLE payload carries; None for another payload."""
        if not (type(payload) is tuple and len(payload) == 2 and payload[0] == PAYLOAD_HANDLE):
            return None
        try:
            return HandOut.from_words(payload[1])
        except InvalidHandle:
            raise _bad_payload(payload, self.kind) from None

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
        check_key(key)
        entry = self._lru.touch(key)
        if entry is not None:
            self._count(entry[0], hit=True)
            return (PAYLOAD_KEY, key)
        value = make_value()
        nbytes = encode(value).nbytes  # the size decides eviction in every mirror alike
        self._count(nbytes, hit=False)
        if nbytes > self.capacity_bytes:
            self._fallbacks += 1
            return (PAYLOAD_VALUE, value)
        self._lru.insert(key, nbytes, None)
        return (PAYLOAD_PUT, key, nbytes, value)

    def stats(self) -> CacheStats:
        return self._stats(self._lru.evictions, 0, self.n_readers * self._lru.used_bytes)


class LruReceiverCache(ReceiverCache):
    """lru receiver: a mirror that holds the values in this process's memory."""

    kind = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = _LruBytes(capacity_bytes)

    def resolve(self, payload: Any) -> Any:
        tag = payload[0] if type(payload) is tuple and payload else None
        if tag == PAYLOAD_KEY and len(payload) == 2:
            entry = self._lru.touch(payload[1])
            if entry is None:
                raise CorruptObject(
                    f"lru mirror has no value for key {payload[1]!r}: this receiver missed a "
                    "payload or has another capacity than the sender; give every receiver the "
                    "sender's capacity_bytes and every payload, in order")
            return entry[1]
        if tag == PAYLOAD_PUT and len(payload) == 4 and type(payload[2]) is int:
            _, key, nbytes, value = payload
            self._lru.insert(key, nbytes, value)
            return value
        if tag == PAYLOAD_VALUE and len(payload) == 2:
            return payload[1]
        raise _bad_payload(payload, self.kind)

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes
