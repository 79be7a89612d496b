"""A Channel sends small values inline and large ones through its store, to two readers.

    python examples/channel_send.py

The writer sends a request whose tensor is 1.3 MB (stored once in shared memory; only its
40-byte Handle travels), then the same image again (its key is cached: the Handle is sent
again, nothing is copied), then a small message that fits a queue slot. Each reader reads the
stored tensors in place with `recv_view`.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np

from shmstore import Channel, Closed

N_READERS = 2


def reader(name: str, index: int) -> None:
    with Channel.attach(name, reader=index) as channel:
        while True:
            try:
                with channel.recv_view(timeout=60) as msg:  # zero copy for stored values
                    if "pixel_values" in msg:
                        pixels = msg["pixel_values"]
                        # each line in one write ("\n" inside): the readers share stdout
                        print(f"reader {index}: {msg['image']} {tuple(pixels.shape)} "
                              f"sum {float(pixels.sum()):.1f}\n", end="", flush=True)
                    else:
                        print(f"reader {index}: {msg}\n", end="", flush=True)
            except Closed:
                break


def main() -> None:
    name = f"example-channel-{os.getpid()}"
    with Channel.create(name, n_readers=N_READERS, capacity_bytes=64 << 20,
                        inline_threshold=64 << 10) as channel:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=reader, args=(name, i)) for i in range(N_READERS)]
        for p in procs:
            p.start()
        channel.wait_for_readers(timeout=60)
        pixels = np.ones((1, 3, 336, 336), np.float32)
        channel.send({"image": "cat.jpg", "pixel_values": pixels}, key="hash-of-cat.jpg")
        channel.send({"image": "cat.jpg", "pixel_values": pixels}, key="hash-of-cat.jpg")
        channel.send({"done": True})  # small: travels inline in a queue slot
        channel.end()  # readers get Closed after the last message
        for p in procs:
            p.join(timeout=60)
        stats = channel.store.stats()
        print(f"writer: {stats.puts} put, {stats.hits} hit")
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


if __name__ == "__main__":
    main()
