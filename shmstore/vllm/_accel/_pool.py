"""The miss pool's vLLM side: a request's new images processed by the pool's workers before the
request reaches vLLM's one multimodal thread, so that there they are hits.

    API server (event loop)                          pool worker (spawned, serving/_pool.py)
      _process_tokens_async hook: the request's        make_processor(model_config): vLLM's
      media are loaded; its item hashes made as        processor for the model, built once
      vLLM's processor makes them; each lazy           process(job): vLLM's load_bytes of the
      image (a JPEG not decoded yet) that is           bytes (its decode, its errors), then the
      not stored goes to the pool: its bytes           processor's cached path on that one item
      by shared memory (serving/_photos.py),           (the per-item path vLLM's cache takes
      the request's kwargs, the record's               for a missing item); the item's tensors
      fingerprint; the request waits for them          and its prompt-update record are stored
      (bounded) and goes on to vLLM's thread,          under the hash vLLM's processor gave it,
      where they are hits (no decode, no HF            checked against the API server's
      processor); anything the pool did not
      store is processed there, as without it

Only lazy images go to the pool: an image vLLM loaded eagerly (PNG, rotated or grey JPEG) was
decoded already, and its processing stays where it is. An item whose prompt updates have no
record (a model's own closure) is declined: the API server processes it. Every fallback is
vLLM's own path, so outputs and errors are vLLM's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ...serving._deployment import NodePool, Writers, open_pool
from ...serving._outcome import Outcome, Processor
from ...serving._photos import read_photo
from .._env import LOG_NAME
from .._items import item_to_value
from .._vllm import (
    BaseMultiModalProcessorCache,
    CacheInfo,
    build_processor,
    items_data,
    load_image,
    process_items,
    prompt_kwargs,
    prompt_uuids,
    request_hashes,
)
from ._images import LazyImage
from ._records import RECORD_FIELD, write

__all__ = ["PoolSender", "open_pool_sender", "make_processor", "processor", "WAIT_S"]

log = logging.getLogger(LOG_NAME)
MAX_MADE = 4096  # keys kept as made by the pool until vLLM's thread meets them
WAIT_S = 120.0  # a request waits this long for its items from the pool, then processes them
MODALITY = "image"


class PoolSender:
    """One API server's way into the node's miss pool (serving/_deployment.py open_pool chose
    its role: the pool itself, or a client of it). `counts` are this API server's: items
    sent, stored, waited for (in flight on the node already) and each fallback reason."""

    def __init__(self, node: NodePool) -> None:
        self.node = node
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("sent", *(o.value for o in Outcome), "waited"), 0)
        # keys the pool stored for this API server's requests, not yet met by vLLM's thread:
        # there they are found stored, yet new (claim); oldest first, at most MAX_MADE
        self._made: OrderedDict[str, int] = OrderedDict()

    def submit(self, key: str, job: dict[str, Any], photo: bytes) -> Future[Outcome]:
        """Send one item's job to the node's pool, its photo by shared memory (NodePool.send);
        its outcome is counted when it comes."""
        future, waited = self.node.send(key, job, photo)
        with self._lock:
            self.counts["sent"] += 1
            self.counts["waited"] += waited
        future.add_done_callback(functools.partial(self._count, key=key))
        return future

    def _count(self, future: Future[Outcome], key: str) -> None:
        outcome = future.result()
        with self._lock:
            self.counts[outcome.value] += 1
            if outcome is Outcome.STORED:
                self._made[key] = self._made.get(key, 0) + 1
                self._made.move_to_end(key)
                while len(self._made) > MAX_MADE:  # requests that never reached vLLM's thread
                    self._made.popitem(last=False)

    def claim(self, key: str) -> bool:
        """Whether `key` was made by the pool for a request of this API server that has not
        met it yet (it is then new to that request, though stored); counts it met."""
        with self._lock:
            left = self._made.get(key, 0)
            if not left:
                return False
            if left == 1:
                del self._made[key]
            else:
                self._made[key] = left - 1
            return True

    def snapshot(self) -> dict[str, int]:
        """This API server's counts now (a client's waits as its answers said)."""
        with self._lock:
            counts = dict(self.counts)
        if self.node.client is not None:
            counts["waited"] = self.node.waited
        return counts

    def jobs(self, renderer: Any, prompt: Any, fingerprint: Callable[[Any], bytes | None],
             cached: Callable[[list[str]], list[bool]]) -> list[Future[Outcome]]:
        """Send the request's lazy images that are not stored to the pool; their futures."""
        found = request_hashes(renderer, prompt)
        if found is None:
            return []
        hashes, items = found
        keys = hashes.get(MODALITY) or []
        named = prompt_uuids(prompt, MODALITY)  # an item named by a uuid: the pool declines
        data = items_data(items.get(MODALITY))
        if not keys or not isinstance(data, list) or len(data) != len(keys):
            return []
        hf_kwargs, media_io_kwargs = prompt_kwargs(prompt)
        fp = fingerprint(hf_kwargs)
        if fp is None:
            return []
        futures = []
        stored = cached(keys)
        for i, (key, image, hit) in enumerate(zip(keys, data, stored, strict=True)):
            if (hit or not isinstance(image, LazyImage) or image.realized
                    or (i < len(named) and named[i] is not None)):
                continue
            mode, io_kwargs = image.settings
            job = {"key": key, "mode": mode, "io": io_kwargs, "kwargs": dict(hf_kwargs),
                   "media_io": dict(media_io_kwargs), "fingerprint": fp}
            try:
                futures.append(self.submit(key, job, image.original_bytes))
            except Exception as exc:  # kwargs msgpack cannot carry: processed where it is
                log.debug("shmstore: item %s not sent to the pool (%s)", key, exc)
        return futures

    async def before_processing(self, renderer: Any, prompt: Any,
                                fingerprint: Callable[[Any], bytes | None],
                                cached: Callable[[list[str]], list[bool]]) -> None:
        """Send the request's new images to the pool and wait (at most WAIT_S) for them."""
        futures = await asyncio.get_running_loop().run_in_executor(
            None, self.jobs, renderer, prompt, fingerprint, cached)
        if not futures:
            return
        _, pending = await asyncio.wait([asyncio.wrap_future(f) for f in futures],
                                        timeout=WAIT_S)
        if pending:
            with self._lock:
                self.counts[Outcome.TIMEOUT.value] += len(pending)

    def close(self) -> None:
        self.node.close()


def open_pool_sender(d: Any, writers: Writers, accel: Any) -> PoolSender | None:
    """This API server's way into the node's miss pool (open_pool decides its role), where
    the deployment has one and images load lazily; without one, and with one API server, a
    photo not loaded before is decoded as it arrives (Acceleration.decode_new_photos_at_once)."""
    if writers.local is not None:
        d.log_pool()
    pool = None
    if d.pooled and accel.lazy_images:
        node = open_pool(d, writers, processor(d.model_config), env={"OMP_NUM_THREADS": "1"})
        pool = None if node is None else PoolSender(node)
    if pool is None and d.api_servers == 1:
        accel.decode_new_photos_at_once()
    return pool


def processor(model_config: Any) -> Processor:
    """How the pool's workers process one item of this model (make_processor, in each)."""
    return Processor(f"{__name__}:make_processor", (model_config,))


# -- in a pool worker ---------------------------------------------------------------------------

class _Capture(BaseMultiModalProcessorCache):  # type: ignore[misc]
    """The cache a worker's processor runs with: nothing is cached; the item it processes is
    kept with its prompt updates."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[tuple[str, Any, Sequence[Any]]] = []

    def is_cached_item(self, mm_hash: str) -> bool:
        return False

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        item, updates = mm_item
        self.items.append((mm_hash, item, updates))
        return mm_item

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        pass

    def clear_cache(self) -> None:
        self.items.clear()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        return CacheInfo(hits=0, total=0)


def make_processor(model_config: Any) -> Callable[[dict[str, Any]], Any]:
    """A pool worker's processor (serving/_pool.py Processor): vLLM's processor of the model;
    process(job) -> the item's value with its record, None if it has no record."""
    processor = build_processor(model_config)

    def process(job: dict[str, Any]) -> Any:
        data = read_photo(job["photo"]) if "photo" in job else job["bytes"]
        media = load_image(data, job["mode"], job["io"])
        capture = _Capture()
        process_items(processor, [media], job["kwargs"], job["media_io"], capture)
        if len(capture.items) != 1:
            raise RuntimeError(f"the processor gave {len(capture.items)} items for one image")
        mm_hash, item, updates = capture.items[0]
        if mm_hash != job["key"]:  # not the API server's item (its uuids, or another model)
            return None
        record = write(updates, job["fingerprint"])
        if record is None:
            return None
        value = item_to_value(item)
        value[RECORD_FIELD] = record
        return value
    return process
