"""P0 preprocesses and caches images, N workers resolve them. Usage: [shm-fifo|shm-reinsert|lru]"""

import multiprocessing as mp
import os
import signal
import sys

import numpy as np

from shmstore import Channel, Closed, ReceiverCache, SenderCache, mm_hash

N_WORKERS, BUDGET = 2, 64 << 20


def preprocess(image: bytes) -> dict:  # stands in for a HF image processor
    seed = int.from_bytes(image[:4], "little")
    return {"pixel_values": np.random.default_rng(seed).random((1, 3, 336, 336), np.float32)}


def worker(rank: int, kind: str, cache_name: str, channel: str) -> None:
    with ReceiverCache.attach(kind, capacity_bytes=BUDGET, name=cache_name, reader=rank) as cache, \
         Channel.attach(channel, reader=rank) as requests:
        while True:
            try:
                request = requests.recv()
            except Closed:
                break
            with cache.resolve_view(request["mm_payload"]) as kwargs:  # zero copy for shm kinds
                # one write per line ("\n" inside): the ranks share stdout
                print(f"rank {rank}: request {request['id']} pixel_values "
                      f"{kwargs['pixel_values'].shape} mean {kwargs['pixel_values'].mean():.4f}\n",
                      end="", flush=True)


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "shm-fifo"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind the with-blocks: they unlink
    tag = f"example-{os.getpid()}"
    with SenderCache.create(kind, capacity_bytes=BUDGET, n_readers=N_WORKERS,
                    name=f"{tag}-cache" if kind != "lru" else None) as cache, \
         Channel.create(f"{tag}-requests", n_readers=N_WORKERS) as requests:
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=worker, args=(r, kind, getattr(cache, "name", None),
                                                     f"{tag}-requests")) for r in range(N_WORKERS)]
        for w in workers:
            w.start()
        requests.wait_for_readers(timeout=60)
        images = [bytes([i]) * 1000 for i in (1, 2, 1, 3, 1, 2)]  # users resend images
        for i, image in enumerate(images):
            key = mm_hash(image, model="llava-1.5-7b", size=336)
            payload = cache.process(key, lambda image=image: preprocess(image))
            requests.send({"id": i, "mm_payload": payload})
        requests.end()
        for w in workers:
            w.join(timeout=60)
        print(cache.stats())


if __name__ == "__main__":
    main()
