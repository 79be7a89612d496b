"""vLLM's own shared-memory transport, as its shm multimodal cache uses it: the writer puts each
value into a SingleWriterShmObjectStorage (vLLM's ring, msgpack serde) and broadcasts the
signed (key, address, id) over a MessageQueue (vLLM's shared-memory broadcast queue); each reader
dequeues it and gets the value from the storage. Used by bench_pipeline.py as a baseline.

Importing vLLM takes seconds; `available()` says whether it is installed.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any

MIB = 1 << 20


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _quiet() -> None:
    for name in ("vllm", "vllm.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Writer:
    """Storage (when `capacity_bytes`) and queue, created in the writer process."""

    def __init__(self, n_readers: int, capacity_bytes: int = 0, max_object_bytes: int = 0,
                 lock: Any = None) -> None:
        _quiet()
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        from vllm.distributed.device_communicators.shm_object_storage import (
            SingleWriterShmObjectStorage,
            SingleWriterShmRingBuffer,
        )

        self.storage: Any = None
        if capacity_bytes:
            ring = SingleWriterShmRingBuffer(data_buffer_size=capacity_bytes, create=True)
            self.storage = SingleWriterShmObjectStorage(
                max_object_size=max_object_bytes, n_readers=n_readers, ring_buffer=ring,
                reader_lock=lock)
        self.queue: Any = MessageQueue(n_readers, n_readers)
        self._n = 0

    def handles(self) -> tuple[Any, Any]:
        return (self.storage.handle() if self.storage else None), self.queue.export_handle()

    def wait_until_ready(self) -> None:
        self.queue.wait_until_ready()

    def send(self, value: Any, timeout: float) -> None:
        """Store `value` under a new key (waiting while the ring is full of unread values,
        as vLLM's sender would have to) and broadcast its handle."""
        self._n += 1
        key = f"item-{self._n}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                address, monotonic_id = self.storage.put(key, value)
                break
            except MemoryError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.0001)
        self.queue.enqueue((key, address, monotonic_id, self.storage.get_signature(key)))

    def put(self, message: Any) -> None:
        self.queue.enqueue(message)

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()  # the writer's storage unlinks its segment
        self.queue = None  # the queue's buffer unlinks its segment when collected


class Reader:
    """One reader, made in its own process from the writer's handles."""

    def __init__(self, handles: tuple[Any, Any], rank: int) -> None:
        _quiet()
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        from vllm.distributed.device_communicators.shm_object_storage import (
            SingleWriterShmObjectStorage,
        )

        storage_handle, queue_handle = handles
        self.storage = (SingleWriterShmObjectStorage.create_from_handle(storage_handle)
                        if storage_handle is not None else None)
        self.queue = MessageQueue.create_from_handle(queue_handle, rank)

    def wait_until_ready(self) -> None:
        self.queue.wait_until_ready()

    def recv(self, timeout: float) -> Any:
        key, address, monotonic_id, signature = self.queue.dequeue(timeout=timeout)
        return self.storage.get(address, monotonic_id, signature, key)

    def get(self, timeout: float) -> Any:
        return self.queue.dequeue(timeout=timeout)

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()
