"""Two processes write one store: the writer's process serves it with a WriterHost, and a
second process (say, a second API server) puts through a RemoteWriter.

    python examples/writer_host.py

The second process copies its tensors straight into a chunk of the ring that the host lent it,
so its put costs one copy, as a local put does. A worker process reads both objects in place,
and a hit on the second process's key, taken in the writer's process, needs no copy at all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import numpy as np

from shmstore import Handle, ObjectStore
from shmstore.lowlevel import RemoteWriter, WriterHost


def second_writer(name: str, handles: mp.Queue) -> None:
    with RemoteWriter(name) as remote:  # finds the host through the store's name
        handle = remote.put("image-b", {"pixel_values": np.full((3, 336, 336), 2, np.float32)})
        handles.put(handle.pack())  # 40 bytes; a real server sends it with the request


def worker(name: str, handles: mp.Queue) -> None:
    with ObjectStore.attach(name, reader=0) as reader:
        for item in ("image-a", "image-b", "image-b again"):
            handle = Handle.unpack(handles.get(timeout=60))
            with reader.view(handle) as value:  # arrays that point into shared memory
                # one write ("\n" inside): this process shares stdout with the writer
                print(f"worker: {item} mean {float(value['pixel_values'].mean()):.1f}\n", end="",
                      flush=True)


def main() -> None:
    name = f"example-host-{os.getpid()}"
    ctx = mp.get_context("spawn")
    handles: mp.Queue = ctx.Queue()
    with ObjectStore.create(name, n_readers=1, capacity_bytes=64 << 20) as writer:
        lock = threading.Lock()  # every thread of this process that calls the writer holds it
        with WriterHost(writer, lock):
            with lock:
                handles.put(writer.put("image-a", {
                    "pixel_values": np.ones((3, 336, 336), np.float32)}).pack())
            other = ctx.Process(target=second_writer, args=(name, handles))
            other.start()
            other.join(timeout=60)
            assert other.exitcode == 0, other.exitcode
            with lock:
                handles.put(writer.get_cached("image-b").pack())  # a hit on the other's put
            reading = ctx.Process(target=worker, args=(name, handles))
            reading.start()
            reading.join(timeout=60)
            assert reading.exitcode == 0, reading.exitcode
        print(f"writer: {writer.stats().puts} puts, {writer.stats().hits} hit")


if __name__ == "__main__":
    main()
