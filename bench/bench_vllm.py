"""vLLM's own shm multimodal cache against shmstore's, through the same vLLM interfaces.

    OMP_NUM_THREADS=1 python bench/bench_vllm.py [--quick] [--engine] [--json PATH]

For each implementation (vLLM's ShmObjectStoreSenderCache/ReceiverCache, then shmstore's
plugin classes), R receiver processes are started (R = 1, 2, 4), each with the receiver cache of
that implementation. For each item size (real LLaVA-style pixel_values: 1.3, 4.8, 6.8, 24 MB)
the sender calls `get_and_update_item` and sends the resulting item, encoded by vLLM's own
MsgpackEncoder, to every receiver over a pipe; each receiver decodes it, calls its cache's
`get_and_update_item` and touches the tensor. Time per item: from the sender's call to the last
receiver holding its tensors, median over the items. "miss": a new hash each time (the item is
stored); "hit": the same hash again (only a handle is sent). Also the shared memory each left in
/dev/shm while running (allocated blocks of its segment). The two implementations run in the
same invocation; ratios are vLLM time / shmstore time.

--engine also runs the end-to-end engine workload of tests/vllm/test_vllm_engine.py (a tiny LLaVA,
6 image prompts) with vLLM's lru cache, vLLM's shm cache (SHMSTORE_VLLM=0) and shmstore's, and
reports generate() times: noisy on 2 cores, reported only.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MB = 1 << 20
SIZES_MB = [1.3, 4.8, 6.8, 24.0]
READERS = [1, 2, 4]
CACHE_GB = 1.0


def config(world_size: int) -> Any:
    mm = SimpleNamespace(mm_processor_cache_gb=CACHE_GB, mm_shm_cache_max_object_size_mb=64,
                         mm_processor_cache_type="shm")
    model = SimpleNamespace(get_multimodal_config=lambda: mm, supports_multimodal_inputs=True)
    parallel = SimpleNamespace(world_size=world_size, _api_process_count=1,
                               data_parallel_size=1, data_parallel_external_lb=False)
    return SimpleNamespace(model_config=model, parallel_config=parallel)


def make_item(nbytes: float, seed: int) -> Any:
    import torch
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalFieldElem, MultiModalKwargsItem

    side = int((nbytes / 12) ** 0.5)
    pixels = torch.randn(3, side, side, generator=torch.Generator().manual_seed(seed))
    batched = MultiModalFieldConfig.batched("image").field
    return MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(data=pixels, field=batched),
        "image_sizes": MultiModalFieldElem(data=torch.tensor([side, side]), field=batched),
    })


def receiver_main(impl: str, world_size: int, rank: int, lock: Any, conn: Any) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.v1.serial_utils import MsgpackDecoder

    if impl == "vllm":
        from vllm.multimodal.cache.shm import ShmObjectStoreReceiverCache as Receiver
    else:
        from shmstore.vllm._receiver import ShmstoreReceiverCache as Receiver
    decoder = MsgpackDecoder(MultiModalKwargsItem)
    receiver = Receiver(config(world_size), lock)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        frames, mm_hash = msg
        item = receiver.get_and_update_item(decoder.decode(frames), mm_hash)
        conn.send(float(item["pixel_values"].data.reshape(-1)[-1]))
    close = getattr(receiver, "close", None)
    if close is not None:
        close()


def allocated_bytes(name: str) -> int:
    try:
        return os.stat(f"/dev/shm/{name}").st_blocks * 512
    except FileNotFoundError:
        return 0


def run_impl(impl: str, world_size: int, sizes: list[float], repeats: int) -> dict[str, Any]:
    from vllm.v1.serial_utils import MsgpackEncoder

    name = f"bench-vllm-{impl}-{os.getpid()}"
    os.environ["VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME"] = name
    if impl == "vllm":
        from vllm.multimodal.cache.shm import ShmObjectStoreSenderCache as Sender
    else:
        from shmstore.vllm._sender import ShmstoreSenderCache as Sender
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    sender = Sender(config(world_size))
    encoder = MsgpackEncoder()
    pipes, procs = [], []
    results: dict[str, Any] = {}
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=receiver_main, args=(impl, world_size, rank, lock, child))
            p.start()
            pipes.append(parent)
            procs.append(p)
        for conn in pipes:
            if conn.recv() != "ready":
                raise RuntimeError("a receiver did not start")

        def one(item: Any, mm_hash: str) -> float:
            started = time.perf_counter()
            out, _ = sender.get_and_update_item(item, mm_hash)
            frames = [bytes(f) for f in encoder.encode(out)]
            for conn in pipes:
                conn.send((frames, mm_hash))
            for conn in pipes:
                conn.recv()
            return time.perf_counter() - started

        for size in sizes:
            item = make_item(size * MB, seed=int(size * 10))
            n = max(4, int(repeats * 4 / max(size, 1.0))) if size < 20 else repeats
            one((item, []), f"warm-{size}")
            misses = [one((item, []), f"miss-{size}-{i}") for i in range(n)]
            one((item, []), f"hit-{size}")
            hits = [one(None, f"hit-{size}") for _ in range(n)]
            results[str(size)] = {"miss_ms": statistics.median(misses) * 1e3,
                                  "hit_ms": statistics.median(hits) * 1e3, "n": n}
        results["shm_allocated_bytes"] = allocated_bytes(name)
    finally:
        for conn in pipes:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        sender.close()
    return results


def engine_runs() -> dict[str, float]:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from tests.vllm.tiny_llava import build

    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "model")
        for label, cache, extra in (("vLLM lru", "lru", {}), ("vLLM shm", "shm", {"SHMSTORE_VLLM": "0"}),
                                    ("shmstore shm", "shm", {})):
            env = {**os.environ, **extra, "PYTHONPATH": str(root),
                   "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": f"bench-engine-{os.getpid()}"}
            done = subprocess.run([sys.executable, str(root / "tests" / "vllm" / "vllm_engine_run.py"),
                                   str(model), cache, "1"], capture_output=True, text=True,
                                  timeout=600, env=env)
            line = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
            if done.returncode or not line:
                raise RuntimeError(f"{label}: {done.stderr[-3000:]}")
            times[label] = json.loads(line[-1][7:])["seconds"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, readers and items")
    parser.add_argument("--engine", action="store_true", help="also time the engine workload")
    parser.add_argument("--json", default="bench/results/bench_vllm.json")
    args = parser.parse_args()
    sizes = [1.3, 6.8] if args.quick else SIZES_MB
    readers = [1, 2] if args.quick else READERS
    repeats = 4 if args.quick else 8
    report: dict[str, Any] = {"sizes_mb": sizes, "readers": readers, "runs": {}}
    print("ms per item, sender's get_and_update_item to every receiver holding its tensors "
          "(ratio: vLLM / shmstore)")
    print(f"{'size':>8} {'R':>2} {'vLLM miss':>10} {'shmstore miss':>14} {'ratio':>6} "
          f"{'vLLM hit':>9} {'shmstore hit':>13} {'ratio':>6}")
    for r in readers:
        runs = {impl: run_impl(impl, r, sizes, repeats) for impl in ("vllm", "shmstore")}
        report["runs"][str(r)] = runs
        for size in sizes:
            v, s = runs["vllm"][str(size)], runs["shmstore"][str(size)]
            print(f"{size:>6.1f}MB {r:>2} {v['miss_ms']:>10.2f} {s['miss_ms']:>14.2f} "
                  f"{v['miss_ms'] / s['miss_ms']:>5.1f}x {v['hit_ms']:>9.2f} {s['hit_ms']:>13.2f} "
                  f"{v['hit_ms'] / s['hit_ms']:>5.1f}x")
        print(f"{'':>8} {r:>2} shared memory allocated: vLLM "
              f"{runs['vllm']['shm_allocated_bytes'] / MB:.0f} MiB, shmstore "
              f"{runs['shmstore']['shm_allocated_bytes'] / MB:.0f} MiB "
              f"(both sized {CACHE_GB:.0f} GiB)")
    if args.engine:
        report["engine_seconds"] = engine_runs()
        print("engine workload (tiny LLaVA, 6 image prompts, TP 1), generate() seconds:",
              ", ".join(f"{k} {v:.2f}" for k, v in report["engine_seconds"].items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
