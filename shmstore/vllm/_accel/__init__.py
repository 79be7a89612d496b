"""The acceleration: the work shmstore saves an API server beyond what vLLM's cache saves, in a
room of its own behind one switch (SHMSTORE_VLLM_ACCELERATE, on unless set to 0). Off, a
request is processed as vLLM alone processes it with the cache on: every image decoded as it
arrives, the HF processor run in each API server for each item it has not processed itself.

    _images.py     lazy images: a JPEG is decoded only when the processor needs it, so a hit
                   never decodes its image
    _records.py    an item's resolved prompt updates as a record stored beside its tensors, so
                   that a hit on an item another API server processed skips the HF processor
    _pool.py       the miss pool's vLLM side (SHMSTORE_VLLM_POOL): a request's new images
                   processed by the node's pool workers before vLLM's one multimodal thread
                   reaches them, where they are then hits

The sender holds one Acceleration and calls it at three places of a request's processing
(`fingerprint` when it begins, `record` for each miss it stores, `updates` for each hit it
did not process itself); the hooks call `pending`, `realize_misses`, `realize` and
`unrealized` for the lazy images. Nothing else of the plugin reads what is in here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from .._env import LOG_NAME
from .._vllm import kwargs_digest
from ._images import (
    LazyImage,
    decode_new_at_once,
    install,
    pending,
    realize,
    realize_misses,
    release,
    unrealized,
)
from ._records import FINGERPRINT_BYTES, RECORD_FIELD, RecordRefused, read, write

__all__ = ["Acceleration", "LazyImage", "RECORD_FIELD", "REFUSALS", "pending", "realize",
           "realize_misses", "unrealized"]

log = logging.getLogger(LOG_NAME)
REFUSALS = ("missing", "version", "fingerprint", "damaged")  # RecordRefused.reason


class Acceleration:
    """What one sender does beyond vLLM's cache, or (`on` False) nothing at all.

    `skipped` counts the work it saved (decode: an image never decoded; processor: a hit on an
    item another API server processed), `refused` the records it could not use, by reason;
    both change under `lock` (the sender's metrics read them under it)."""

    def __init__(self, on: bool, processor_identity: bytes, vocab_size: int,
                 lock: threading.Lock | threading.RLock) -> None:
        self.on = on
        self.lazy_images = on and install()  # False where this vLLM's loader cannot be hooked
        self.new_at_once = False  # photos this process has not loaded decoded as they come
        self._identity, self._vocab_size, self._lock = processor_identity, vocab_size, lock
        self.skipped = dict.fromkeys(("decode", "processor"), 0)
        self.refused = dict.fromkeys(REFUSALS, 0)

    def fingerprint(self, hf_processor_mm_kwargs: Any) -> bytes | None:
        """What a request processed with these kwargs writes and reads records with; None:
        no records (acceleration off, or kwargs vLLM's hasher cannot take)."""
        if not self.on:
            return None
        try:
            digest = kwargs_digest(hf_processor_mm_kwargs or {})
        except Exception as exc:
            log.debug("shmstore: no prompt-update records for kwargs (%s)", exc)
            return None
        import blake3

        return blake3.blake3(self._identity + digest).digest()[:FINGERPRINT_BYTES]

    @staticmethod
    def record(prompt_updates: Sequence[Any], fingerprint: bytes | None) -> bytes | None:
        """The record to store beside a miss's tensors; None: the item is not shared (no
        fingerprint, or an update not made by vLLM's factories)."""
        return None if fingerprint is None else write(prompt_updates, fingerprint)

    def updates(self, key: str, record: bytes | None, fingerprint: bytes) -> Sequence[Any] | None:
        """The prompt updates of hit `key`, which this API server did not process, from its record
        (counted as a processor run skipped); None: the record cannot be used (counted by
        reason) and the processor runs here, as in vLLM alone."""
        try:
            updates = read(record, fingerprint, self._vocab_size)
        except Exception as exc:
            refused = isinstance(exc, RecordRefused)
            reason = exc.reason if isinstance(exc, RecordRefused) else "damaged"
            (log.debug if refused else log.warning)("shmstore: record of %s refused (%s)", key, exc)
            with self._lock:
                self.refused[reason] += 1
            return None
        with self._lock:
            self.skipped["processor"] += 1
        return updates

    def decode_new_photos_at_once(self) -> None:
        """No miss pool, and one API server: a photo this process has not loaded is new (this
        server stores every photo of the store), decoded as it comes on vLLM's media threads,
        not later on its one multimodal thread; photos loaded before stay lazy."""
        if self.lazy_images and not self.new_at_once:
            self.new_at_once = True
            decode_new_at_once(True)

    def close(self) -> None:
        """The sender closes: its lazy loading ends (vLLM's own, once no sender wants it)."""
        if self.new_at_once:
            self.new_at_once = False
            decode_new_at_once(False)
        if self.lazy_images:
            self.lazy_images = False
            release()

    def processed(self, items: Any) -> None:
        """A request's processing ended: count its images that were never decoded."""
        undecoded = unrealized(items)
        if undecoded:
            with self._lock:
                self.skipped["decode"] += undecoded
