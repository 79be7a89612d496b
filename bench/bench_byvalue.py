"""What a cache hit costs vLLM's processor-only fallback that shmstore's handle does not: the
item sent by value from an API server process to an engine process, with vLLM's own
serializer and transport.

    OMP_NUM_THREADS=1 python bench/bench_byvalue.py [--sizes 336,672,1008] [--n 50] [--json OUT]

Two processes, a ZeroMQ PUSH/PULL pair over ipc:// each way, as between vLLM's API servers and
its engine core. Per image size: a bf16 `pixel_values` tensor of 3 x size x size (LLaVA's) is
encoded with vLLM's MsgpackEncoder (tensors as zero-copy frames), sent, decoded with its
MsgpackDecoder on the other side, and acknowledged; the same round trip with a handle-sized
message (what shmstore sends on a hit) is measured alike. Reported: the median round trip of
each and their difference, the time a hit under the fallback spends moving the item. At
tensor parallel size > 1 the engine core broadcasts the item again to its workers; that hop is
not measured here (so this is a lower bound).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def engine(addresses: tuple[str, str]) -> None:
    """The engine side: decode what arrives, answer with a byte."""
    import zmq
    from vllm.v1.serial_utils import MsgpackDecoder

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addresses[0])
    push.connect(addresses[1])
    decoder = MsgpackDecoder()
    while True:
        frames = pull.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            break
        decoder.decode(frames)
        push.send(b"k")
    pull.close()
    push.close()
    ctx.term()


def round_trips(push: Any, pull: Any, message: Any, n: int) -> list[float]:
    from vllm.v1.serial_utils import MsgpackEncoder

    encoder = MsgpackEncoder()
    times = []
    for _ in range(n + 3):
        start = time.perf_counter()
        push.send_multipart(encoder.encode(message), copy=False)
        pull.recv()
        times.append(time.perf_counter() - start)
    return times[3:]  # the first ones warm the sockets and allocators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="336,672,1008")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    import zmq

    with tempfile.TemporaryDirectory() as tmp:
        addresses = (f"ipc://{tmp}/to-engine", f"ipc://{tmp}/to-api")
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(addresses[0])
        pull.bind(addresses[1])
        other = mp.get_context("spawn").Process(target=engine, args=(addresses,))
        other.start()
        rows = []
        try:
            handle = {"handle": [0, 1, b"\0" * 16, 1, b"\0" * 24, 7]}  # a handle item's words
            for size in (int(s) for s in args.sizes.split(",")):
                item = {"pixel_values": torch.randn(3, size, size).to(torch.bfloat16)}
                by_value = statistics.median(round_trips(push, pull, item, args.n))
                by_handle = statistics.median(round_trips(push, pull, handle, args.n))
                rows.append({"image_px": size, "item_mb": item["pixel_values"].nbytes / 1e6,
                             "by_value_ms": 1e3 * by_value, "by_handle_ms": 1e3 * by_handle})
        finally:
            push.send(b"stop")
            other.join(30)
            push.close()
            pull.close()
            ctx.term()
    print("image px | item MB | round trip by value ms | by handle ms | a hit by value costs ms")
    for r in rows:
        print(f"{r['image_px']:8d} | {r['item_mb']:7.2f} | {r['by_value_ms']:22.2f} | "
              f"{r['by_handle_ms']:12.3f} | {r['by_value_ms'] - r['by_handle_ms']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
