"""The demo: a frontend and N tensor-parallel workers sharing preprocessed images through a cache.

The frontend (this process) generates a stream of multimodal requests (synthetic Pillow images of
varied sizes, popular ones recurring, conversations resending theirs), hashes each image with
mm_hash, preprocesses it like a CLIP/LLaVA image processor on a miss, and sends each request's
cache payload to every worker through a Channel. Every worker resolves every payload and checks
the tensor against the frontend's checksum.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache._caches import CACHE_KINDS, DEFAULT_KIND, PAYLOAD_HANDLE, ReceiverCache, SenderCache
from ..cache._hashing import mm_hash
from ..cache._hitsim import make_sim, working_set_bytes
from ..errors import Closed
from ..queue._channel import Channel
from ..serde._codec import Blank

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
CROP = 336  # LLaVA-1.5's CLIP ViT-L/14-336 input
MODEL_ID = "llava-style-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--cache", choices=CACHE_KINDS, default=DEFAULT_KIND, help="cache kind")
    parser.add_argument("--cache-gb", type=float, default=0.25, help="cache budget in GB")
    parser.add_argument("--requests", type=int, default=400, help="requests to send")
    parser.add_argument("--images", type=int, default=120, help="distinct images in the stream")
    parser.add_argument("--processor", choices=("numpy", "hf"), default="numpy",
                        help="numpy (built in) or hf (transformers' CLIPImageProcessor)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- images and preprocessing -------------------------------------------------------------------

def synthetic_image(index: int) -> Any:
    """A deterministic RGB image of varied size (gradients and blocks)."""
    from PIL import Image

    rng = np.random.default_rng(index)
    width, height = int(rng.integers(240, 1400)), int(rng.integers(240, 1000))
    y, x = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 255, 3)
    pixels = np.stack([(x * (c + 1) + y * (3 - c) + base[c]) % 256 for c in range(3)], axis=-1)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
        pixels[y0:y0 + 40, x0:x0 + 40] = rng.integers(0, 255, 3)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def n_tiles(image: Any) -> int:
    """Tiles per image, as an anyres processor would cut a larger image (1 to 5)."""
    w, h = image.size
    return int(min(5, max(1, round(w * h / (CROP * CROP * 2)))))


def preprocess_numpy(image: Any, out: np.ndarray | None = None) -> np.ndarray:
    """CLIP-style: resize the short side to 336, center-crop, rescale, normalize; one crop per
    tile (the global view plus crops across the image). Returns (tiles, 3, 336, 336) float32,
    written into `out` when given (shared memory, through the cache's process_into)."""
    from PIL import Image

    tiles = n_tiles(image)
    w, h = image.size
    scale = CROP / min(w, h)
    resized = image.resize((max(CROP, round(w * scale)), max(CROP, round(h * scale))),
                           Image.Resampling.BICUBIC)
    rw, rh = resized.size
    if out is None:
        out = np.empty((tiles, 3, CROP, CROP), dtype=np.float32)
    for t in range(tiles):
        left = (rw - CROP) * (t + 1) // (tiles + 1) if tiles > 1 else (rw - CROP) // 2
        top = (rh - CROP) // 2
        crop = np.asarray(resized.crop((left, top, left + CROP, top + CROP)), dtype=np.float32)
        out[t] = ((crop / 255.0 - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1)
    return out


def make_hf_processor() -> Any:
    try:
        from transformers import CLIPImageProcessor
    except ImportError:
        raise SystemExit("--processor hf needs transformers: pip install transformers") from None
    proc = CLIPImageProcessor(size={"shortest_edge": CROP}, crop_size={"height": CROP, "width": CROP})
    return lambda image: proc(images=image, return_tensors="np")["pixel_values"].astype(np.float32)


def checksum(pixels: np.ndarray) -> str:
    from blake3 import blake3

    return str(blake3(np.ascontiguousarray(pixels).reshape(-1).view(np.uint8).data).hexdigest())


# -- request stream -----------------------------------------------------------------------------

def request_stream(n_requests: int, n_images: int, seed: int) -> list[int]:
    """Image index per request: Zipf-popular images, one-time ones, and conversation resends."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(n_images)]
    stream: list[int] = []
    pending: list[int] = []
    next_once = n_images
    while len(stream) < n_requests:
        if pending and rng.random() < 0.5:
            stream.append(pending.pop(0))
            continue
        if rng.random() < 0.15:
            index, next_once = next_once, next_once + 1  # seen once
        else:
            index = rng.choices(range(n_images), weights=weights)[0]
        stream.append(index)
        if rng.random() < 0.25:
            pending.extend([index] * rng.randint(1, 3))  # the next turns of a conversation
    return stream


# -- workers ------------------------------------------------------------------------------------

def worker_main(channel: str, kind: str, cache_name: str | None, capacity: int, index: int,
                results: Any) -> None:
    """Resolve every request's payload and check its tensor; report counts at the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides; it closes the channel
    os.environ["OMP_NUM_THREADS"] = "1"
    receiver = ReceiverCache.attach(kind, capacity_bytes=capacity, name=cache_name, reader=index)
    ch = Channel.attach(channel, reader=index)
    verified = mismatched = nbytes = 0
    error = None
    try:
        while True:
            try:
                msg = ch.recv(timeout=120)
            except Closed:
                break
            with receiver.resolve_view(msg["payload"]) as kwargs:
                pixels = kwargs["pixel_values"]
                nbytes += pixels.nbytes
                if checksum(pixels) == msg["checksum"]:
                    verified += 1
                else:
                    mismatched += 1
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        ch.close()
        receiver.close()
        results.put((index, verified, mismatched, nbytes, error))


# -- the frontend -------------------------------------------------------------------------------

@dataclass
class DemoResult:
    requests: int
    seconds: float
    verified: dict[int, int]
    mismatched: int
    errors: list[str]
    stats: Any
    bytes_to_shm: int
    bytes_resolved: int
    transport_bytes: int
    items: list[tuple[str, int]]  # (key, bytes) per request, for the comparison line
    capacity: int


def run_demo(args: argparse.Namespace) -> DemoResult:
    if args.workers < 1 or args.requests < 1 or args.images < 1 or args.cache_gb <= 0:
        raise SystemExit("--workers, --requests, --images and --cache-gb must be positive")
    preprocess = make_hf_processor() if args.processor == "hf" else preprocess_numpy
    capacity = int(args.cache_gb * 1e9) // 64 * 64
    tag = f"shmstore-demo-{os.getpid()}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    stream = request_stream(args.requests, args.images, args.seed)
    sender = SenderCache.create(args.cache, capacity_bytes=capacity, n_readers=args.workers,
                                name=None if args.cache == "lru" else f"{tag}-cache")
    procs: list[Any] = []
    try:
        with Channel.create(f"{tag}-ch", n_readers=args.workers, capacity_bytes=256 << 20) as ch:
            cache_name = getattr(sender, "name", None)
            procs = [ctx.Process(target=worker_main, daemon=True,
                                 args=(f"{tag}-ch", args.cache, cache_name, capacity, i, results))
                     for i in range(args.workers)]
            for p in procs:
                p.start()
            ch.wait_for_readers(timeout=120)
            sums: dict[str, str] = {}
            sizes: dict[str, int] = {}
            items: list[tuple[str, int]] = []
            bytes_to_shm = transport = 0
            progress = _progress(len(stream), args.no_progress)
            start = time.perf_counter()
            for request_id, index in enumerate(stream):
                image = synthetic_image(index)
                key = mm_hash(image, model=MODEL_ID, processor=args.processor, crop=CROP)
                made: list[np.ndarray] = []
                if args.processor == "hf":
                    def make(image: Any = image, made: list[np.ndarray] = made) -> dict[str, Any]:
                        made.append(preprocess(image))
                        return {"pixel_values": made[0], "image_size": image.size}

                    payload = sender.process(key, make)
                else:  # written straight into shared memory on a miss
                    def fill(arrays: dict[Any, Any], image: Any = image, key: str = key,
                             made: list[np.ndarray] = made) -> None:
                        made.append(preprocess_numpy(image, out=arrays["pixel_values"]))
                        sums[key] = checksum(made[0])  # while the bytes are certainly ours

                    template = {"pixel_values": Blank((n_tiles(image), 3, CROP, CROP), "float32"),
                                "image_size": image.size}
                    payload = sender.process_into(key, template, fill)
                if made:
                    sizes[key] = made[0].nbytes
                    if args.processor == "hf":
                        sums[key] = checksum(made[0])
                    if payload[0] == PAYLOAD_HANDLE:
                        bytes_to_shm += made[0].nbytes
                    else:
                        transport += made[0].nbytes
                items.append((key, sizes[key]))
                ch.send({"request_id": request_id, "payload": payload, "checksum": sums[key]},
                        timeout=120)
                progress.update(1)
            ch.end()  # workers drain what was sent, then see Closed
            reports = [results.get(timeout=300) for _ in procs]
            seconds = time.perf_counter() - start
            progress.close()
            stats = sender.stats()
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        sender.close()
    return DemoResult(
        requests=len(stream), seconds=seconds,
        verified={i: v for i, v, _, _, _ in reports},
        mismatched=sum(m for _, _, m, _, _ in reports),
        errors=[f"worker {i}: {e}" for i, _, _, _, e in reports if e],
        stats=stats, bytes_to_shm=bytes_to_shm,
        bytes_resolved=sum(b for _, _, _, b, _ in reports), transport_bytes=transport,
        items=items, capacity=capacity,
    )


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, disabled: bool) -> Any:
    if disabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="requests", file=sys.stderr)


def print_summary(args: argparse.Namespace, r: DemoResult) -> None:
    s = r.stats
    ok = not r.errors and r.mismatched == 0 and all(v == r.requests for v in r.verified.values())
    rows = [
        ("cache", f"{args.cache}, {args.cache_gb:g} GB budget, {args.workers} workers"),
        ("requests", f"{r.requests} in {r.seconds:.2f} s = {r.requests / r.seconds:.1f} requests/s"),
        ("hit ratio", f"{s.hit_ratio:.3f} of requests, {s.byte_hit_ratio:.3f} of bytes "
                      f"({s.hits} hits, {s.evictions} evictions)"),
        ("inline fallbacks", str(s.inline_fallbacks)),
        ("MB written into the cache", f"{r.bytes_to_shm / 1e6:.1f}"
                                      + (f" (+{s.bytes_reinserted / 1e6:.1f} reinserted)"
                                         if s.bytes_reinserted else "")),
        ("MB sent by value", f"{r.transport_bytes / 1e6:.1f} (cache misses of lru, fallbacks)"),
        ("MB resolved by workers", f"{r.bytes_resolved / 1e6:.1f}"),
        ("cache memory, all processes", f"{s.memory_bytes / 1e6:.1f} MB"),
        ("verification", ("OK: " if ok else "FAILED: ") + ", ".join(
            f"worker {i} {v}/{r.requests}" for i, v in sorted(r.verified.items()))),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for e in r.errors:
        print(e)
    if ok:
        print(compare(args, r))


def compare(args: argparse.Namespace, r: DemoResult) -> str:
    """One line: this run's bytes sent by value and cache memory against the other side's
    (vLLM's default mirrored LRU, or shm-adaptive for an lru run), the other replayed on these
    requests at the same budget (cache/_hitsim.py, the replay `shmstore hitrate` checks)."""
    other = "lru" if args.cache != "lru" else DEFAULT_KIND
    sim = make_sim(other, r.capacity, args.workers)
    for key, nbytes in r.items:
        sim.request(key, nbytes)
    st = sim.stats()
    held = min(r.capacity, working_set_bytes(r.items))
    by_value = st.bytes_requested - st.bytes_hit if other == "lru" else 0  # lru's misses
    memory = held * args.workers if other == "lru" else r.capacity
    mine = (f"{r.transport_bytes / 1e6:.0f} MB sent by value, "
            f"{r.stats.memory_bytes / 1e6:.0f} MB of cache memory")
    theirs = f"{by_value / 1e6:.0f} MB and up to {memory / 1e6:.0f} MB"
    name = "vLLM's default, a mirrored LRU" if other == "lru" else f"shmstore's {other}"
    return (f"result: every tensor verified; {args.cache}: {mine}; {name} at the same budget, "
            f"replayed on these requests: {theirs}")


def missing_extra(args: argparse.Namespace) -> str | None:
    """The hint to print when a package the demo needs is not installed, else None."""
    needed = ["PIL"] + ([] if args.no_progress else ["tqdm"])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"shmstore demo needs {' and '.join('Pillow' if m == 'PIL' else m for m in missing)}: "
            "pip install '.[demo]' in the checkout, or run scripts/demo.sh, which installs it")


def main(args: argparse.Namespace) -> int:
    """Run the demo; return the exit status (0 when every tensor was verified)."""
    hint = missing_extra(args)
    if hint is not None:
        print(hint, file=sys.stderr)
        return 2
    stopped_by = [signal.SIGINT]

    def terminate(signum: int, frame: Any) -> None:
        stopped_by[0] = signal.SIGTERM
        raise KeyboardInterrupt

    previous_term = signal.signal(signal.SIGTERM, terminate)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if inherited ignored
    try:
        result = run_demo(args)
    except KeyboardInterrupt:
        how = "terminated" if stopped_by[0] == signal.SIGTERM else "interrupted"
        print(f"\n{how}; shared memory cleaned up", file=sys.stderr)
        return 128 + stopped_by[0]  # as a shell reports the signal: 130 for SIGINT, 143 SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)
    print_summary(args, result)
    ok = not result.errors and result.mismatched == 0 and all(
        v == result.requests for v in result.verified.values())
    return 0 if ok else 1
