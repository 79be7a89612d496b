"""The plugin's sender cache, in each vLLM API process.

Sender (API process, "P0"), one per engine::

    is_cached(hs)              one round trip: the hits are handed out (pinned) and, for an
                               item another API server processed, its prompt-update record
                               read from the store (_records.py): no HF processor here
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
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import (
    KeyExists,
    ObjectTooLarge,
    StaleHandle,
    StoreFull,
    Timeout,
)
from ..handle import Handle, HandOut
from ..store._api import WriterAPI
from . import _images
from ._deployment import Deployment, open_writer
from ._env import LOG_NAME
from ._items import handle_item, handout_from_item, item_to_value
from ._nodes import HeadPublisher
from ._records import FINGERPRINT_BYTES, RECORD_FIELD, RecordRefused, read, write
from ._requests import RequestLedger
from ._vllm import (
    BaseMultiModalProcessorCache,
    CacheInfo,
    MultiModalCacheMissError,
    kwargs_digest,
)

__all__ = ["ShmstoreSenderCache", "SENDERS"]

log = logging.getLogger(LOG_NAME)

PRUNE_UPDATES = 64  # prompt updates kept beyond twice those of cached items before a prune
SENDERS: list[ShmstoreSenderCache] = []  # this process's senders, for vLLM's request hooks
REFUSALS = ("missing", "version", "fingerprint", "damaged")  # RecordRefused.reason
# the fingerprint of the request being processed in this context (set by the processor hook
# around vLLM's cached processing; None outside it: no record is written or read)
_FINGERPRINT: contextvars.ContextVar[bytes | None] = contextvars.ContextVar(
    "shmstore_fingerprint", default=None)


class ShmstoreSenderCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    """vLLM's P0 cache, backed by one shmstore ObjectStore (this process writes it).

    Its hand-outs follow vLLM's requests (vllm/_requests.py): the hooks `install()` puts into
    vLLM's API process tell `ledger` when a request is added, refused or ends."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__()
        d = Deployment.read(vllm_config)
        self.deployment = d
        self.engines, self.readers_per_engine = d.engines, d.per_engine
        self._updates: dict[str, Sequence[Any]] = {}  # prompt updates stay on P0
        self._prune_at = PRUNE_UPDATES
        self._touched: dict[str, HandOut] = {}  # hand-outs taken for vLLM's touches, kept
        self._hits = self._total = 0
        self._last = CacheInfo(hits=0, total=0)
        self._lock = threading.RLock()  # around every call of the writer, the host's too
        self._writers = open_writer(d, self._lock, lambda make: HeadPublisher(make, d))
        self._store: WriterAPI = self._writers.store
        self._head: HeadPublisher | None = self._writers.head
        self.ledger = RequestLedger(self._store, d.settle_s, d.lease_s, self._is_touched,
                                    lock=self._lock)
        self.segment, self.api_server = d.name, d.api_rank
        self.items = dict.fromkeys(("hit", "shared", "stored", "inline"), 0)
        self.skipped = dict.fromkeys(("decode", "processor"), 0)
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.lazy_images = d.lazy_images and _images.install()
        self._unregister_metrics = _export_metrics(self)
        SENDERS.append(self)
        log.info("shmstore serves vLLM's shm multimodal cache: segment %r, %d bytes, policy %s; "
                 "layout: %d API server(s) (this is %d, %s), %d engine(s) x %d worker(s) = %d "
                 "reader(s)%s", d.name, d.capacity_bytes, d.policy, d.api_servers, d.api_rank,
                 self._writers.role, d.engines, d.per_engine, d.n_readers,
                 "" if self._head is None else " on this node and the relay publisher")

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
        if self.engines > 1:
            first = engine % self.engines * self.readers_per_engine
            self.ledger.routed(request_id, range(first, first + self.readers_per_engine))

    @property
    def publisher(self) -> Any:
        """The relay Publisher of a TP group across nodes (shmstore.relay._publisher.Publisher), else None."""
        return None if self._head is None else self._head.publisher

    def _is_touched(self, handle: Handle) -> bool:
        return any(kept.handle == handle for kept in self._touched.values())

    def processing(self, hf_processor_mm_kwargs: Any) -> contextvars.Token[bytes | None]:
        """vLLM starts processing a request with these kwargs in this context: records are
        written and read with its fingerprint until `processed(token)`."""
        fingerprint = None
        if self.deployment.share_updates:
            try:
                fingerprint = blake3_16(self.deployment.processor_identity
                                        + kwargs_digest(hf_processor_mm_kwargs or {}))
            except Exception as exc:  # kwargs vLLM's hasher cannot take: nothing shared
                log.debug("shmstore: no prompt-update records for kwargs (%s)", exc)
        return _FINGERPRINT.set(fingerprint)

    def processed(self, token: contextvars.Token[bytes | None], undecoded: int) -> None:
        """The request's processing ended; `undecoded` of its images were never decoded."""
        _FINGERPRINT.reset(token)
        with self.ledger.lock:
            self.skipped["decode"] += undecoded

    def is_cached_item(self, mm_hash: str) -> bool:
        # a hit needs both the object and P0's prompt updates
        with self._lock:
            return mm_hash in self._updates and self._store.cached([mm_hash])[0]

    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        """vLLM asks this before processing a request's misses, and touches its hits after:
        take the hits' hand-outs now, in one call (one round trip through another API
        server's host), so they are pinned from here on and the touches cost nothing. Hand-outs
        a request never uses (its processing failed) go back at the next release."""
        with self._lock:
            fingerprint = _FINGERPRINT.get()
            want = list(dict.fromkeys(h for h in mm_hashes if h not in self._touched and (
                fingerprint is not None or h in self._updates)))
            field = None if fingerprint is None else RECORD_FIELD
            found = self._store.hand_out_cached(want, field) if want else []
            for mm_hash, hit in zip(want, found, strict=True):
                if hit is None:
                    continue
                if mm_hash not in self._updates:
                    assert fingerprint is not None  # only then is an unseen hash asked for
                    try:
                        self._updates[mm_hash] = read(hit.record, fingerprint,
                                                      self.deployment.vocab_size)
                    except Exception as exc:  # today's path: the processor runs here
                        reason = exc.reason if isinstance(exc, RecordRefused) else "damaged"
                        (log.debug if isinstance(exc, RecordRefused) else log.warning)(
                            "shmstore: record of %s refused (%s)", mm_hash, exc)
                        self._store.give_back(hit.handle, hit.number, wait=False)
                        with self.ledger.lock:
                            self.refused[reason] += 1
                        continue
                    with self.ledger.lock:
                        self.skipped["processor"] += 1
                self._touched[mm_hash] = hit
            cached = [h in self._touched for h in mm_hashes]
        _images.realize_misses(mm_hashes, cached)  # vLLM reads the misses' pixels next
        return cached

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        with self._lock:  # is_cached took the hits' hand-outs: this finds them there
            if mm_hash not in self._touched and mm_hash in self._updates:
                hit = self._store.hand_out_cached([mm_hash])[0]
                if hit is not None:
                    self._touched[mm_hash] = hit

    def release_sender_touches(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
            for kept in touched.values():
                try:  # that hand-out, not the object's last (another server's, maybe narrowed)
                    self._store.give_back(kept.handle, kept.number)
                except StaleHandle:
                    pass  # cleared meanwhile: nothing to give back

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> tuple[Any, Sequence[Any]]:
        with self._lock:
            return self._get_and_update_item(mm_item, mm_hash)

    def _get_and_update_item(self, mm_item: Any, mm_hash: str) -> tuple[Any, Sequence[Any]]:
        self._total += 1
        handout = self._touched.pop(mm_hash, None)
        if handout is not None and self._head is not None:
            # published hand-outs go out in the order they are made: renew the kept one
            handout = self._head.renew(handout)
        if handout is None and mm_hash in self._updates:
            handout = self._store.hand_out_cached([mm_hash])[0]
        if handout is not None:
            self._hits += 1
            self.items["hit"] += 1
            out = self._hand_out(handout, mm_item, mm_hash)
            return (mm_item if out is None else out), self._updates[mm_hash]
        if mm_item is None:
            raise MultiModalCacheMissError([mm_hash])
        item, prompt_updates = mm_item
        try:
            handout = self._put(mm_hash, item, prompt_updates)
        except KeyExists:  # stored (by another API server), but not its prompt updates here
            handout = self._store.hand_out_cached([mm_hash])[0]
            if handout is None:  # evicted in between: not worth a second try
                self.items["inline"] += 1
                return mm_item  # type: ignore[no-any-return]
            self.items["shared"] += 1
        else:
            if handout is None:
                return mm_item  # type: ignore[no-any-return]
            self.items["stored"] += 1
        if len(self._updates) >= self._prune_at:  # drop the updates of items gone from the store
            keys = list(self._updates)
            cached = self._store.cached(keys)
            self._updates = {k: self._updates[k] for k, c in zip(keys, cached, strict=True) if c}
            self._prune_at = 2 * len(self._updates) + PRUNE_UPDATES
        self._updates[mm_hash] = prompt_updates
        out = self._hand_out(handout, mm_item, mm_hash)
        return (mm_item if out is None else (out, prompt_updates))

    def _put(self, mm_hash: str, item: Any, prompt_updates: Sequence[Any]) -> HandOut | None:
        """Store a miss, with the record of its prompt updates where they have one; None:
        send it inline (too large, or the store is full even after withdrawing what only
        ended requests held)."""
        value = item_to_value(item)
        fingerprint = _FINGERPRINT.get()
        record = None if fingerprint is None else write(prompt_updates, fingerprint)
        if record is not None:
            value[RECORD_FIELD] = record
        for attempt in range(2):
            try:
                return self._store.hand_out_new(mm_hash, value, timeout=0)
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

    def _hand_out(self, handout: HandOut, mm_item: Any, mm_hash: str) -> Any:
        """The handle item for `handout`, just made; on a TP group across nodes, also sent to
        the other nodes. None: give the data inline instead (a node's relay is not connected,
        or too slow to take it); the hand-out is given back."""
        head = self._head
        if head is not None:
            why = "" if head.ready() else "a node's relay is not connected"
            if not why:
                try:
                    head.publish(handout)
                except Timeout:  # given back by publish
                    why = "the relays did not take it in time"
            else:
                self._store.give_back(handout.handle, handout.number)
            if why:
                if mm_item is None:  # a hit without data: nothing to send inline
                    log.warning("shmstore: item %s cannot reach every node (%s)", mm_hash, why)
                    raise MultiModalCacheMissError([mm_hash])
                self.items["inline"] += 1
                log.debug("shmstore: item %s sent inline (%s)", mm_hash, why)
                return None
        self.ledger.handed_out(handout.number, handout.handle, mm_hash)
        return handle_item(handout)

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        handout = handout_from_item(mm_item)
        if handout is None:
            return
        with self._lock:  # the worker's checks, made here first, by the store that made it
            issued = self._store.issued(mm_hash, handout)
        if not issued:
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
            if self in SENDERS:
                SENDERS.remove(self)
            if not self._store.closed:
                self.release_sender_touches()
            self._writers.close()



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
            skipped, refused = dict(sender.skipped), dict(sender.refused)
        for name, doc, label, values in (
                ("shmstore_vllm_items", "Items by outcome: hit (stored, prompt updates here), "
                 "shared (processed here, stored already: no second copy), stored, inline",
                 "outcome", items),
                ("shmstore_vllm_skipped", "Work this API server skipped: decode (an image "
                 "never decoded: a hit), processor (a hit on an item another API server "
                 "processed: its prompt-update record used, no HF processor run here)",
                 "what", skipped),
                ("shmstore_vllm_records_refused", "Prompt-update records not used (the "
                 "processor ran), by reason: missing, version, fingerprint, damaged",
                 "reason", refused),
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
    try:  # vLLM ships prometheus_client; another embedder may not: then no metrics, no error
        import prometheus_client  # noqa: F401  (metrics.py imports it only when it exports)
    except ImportError:
        log.info("shmstore: prometheus_client is not installed: no shmstore_* metrics")
        return lambda: None
    from ..metrics import StoreCollector, mirror_to_multiprocess, register_collector
    sources: list[Any] = [_SenderCollector(sender)]
    local = sender._writers.local
    if local is not None:  # the API server that writes the store reports it
        sources.append(StoreCollector(local, publisher=sender.publisher, lock=sender.ledger.lock))
    if sender.deployment.metrics_multiprocess:
        stops = [mirror_to_multiprocess(source) for source in sources]
    else:
        stops = [register_collector(source) for source in sources]

    def stop() -> None:
        for each in stops:
            each()
    return stop


def blake3_16(data: bytes) -> bytes:
    import blake3

    return blake3.blake3(data).digest()[:FINGERPRINT_BYTES]
