"""One writer broadcasts small messages to two reader processes through a BroadcastQueue.

    python examples/queue_broadcast.py

Every reader gets every message, in order; after the writer closes, each reader's next `get`
raises `Closed`. Messages are msgpack values (dicts, lists, numbers, bytes, small arrays).
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np

from shmstore import BroadcastQueue, Closed

N_READERS, N_MESSAGES = 2, 5


def reader(name: str, index: int) -> None:
    with BroadcastQueue.attach(name, reader=index) as queue:
        received = []
        while True:
            try:
                msg = queue.get(timeout=60)  # sleeps on its own semaphore when idle
            except Closed:  # the writer closed: everything it sent was received
                break
            assert msg["sizes"].tolist() == [336, 336]
            received.append(msg["request"])
        # one write ("\n" inside): the readers share stdout, and unbuffered (PYTHONUNBUFFERED)
        # a print's text and its newline are two writes another reader's line can come between
        print(f"reader {index}: requests {received}\n", end="", flush=True)


def main() -> None:
    name = f"example-queue-{os.getpid()}"
    with BroadcastQueue.create(name, n_readers=N_READERS, slot_bytes=4096, n_slots=64) as queue:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=reader, args=(name, i)) for i in range(N_READERS)]
        for p in procs:
            p.start()
        queue.wait_for_readers(timeout=60)  # a reader receives what is sent after it attached
        for request in range(N_MESSAGES):
            queue.put({"request": request, "sizes": np.array([336, 336], np.int32)})
    # leaving the block closed the queue (readers get Closed) and unlinked its segment
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


if __name__ == "__main__":
    main()
