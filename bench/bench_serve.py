"""Real `vllm serve` runs (CPU build, tiny random LLaVA built offline) for each deployment shape,
vLLM's own caches against shmstore's.

    OMP_NUM_THREADS=1 python bench/bench_serve.py [--quick] [--image-size 336] [--repeats 1]
                                                  [--mixes 0%,100%,zipf,fill] [--n 24]
                                                  [--cache-gb 1] [--json PATH] [--plot PNG]
    python bench/bench_serve.py --from-json PATH [--plot PNG]   (a saved run, again)

Configurations (each a fresh server, run one after another, in rounds when --repeats > 1):

    api2-fallback   --api-server-count 2 --tensor-parallel-size 2, --mm-processor-cache-type shm
                    with SHMSTORE_VLLM=0: vLLM turns IPC caching off (processor_only)
    api2-shmstore   the same with shmstore: one shared store
    dp2-fallback    --data-parallel-size 2 (two API servers, two engines), SHMSTORE_VLLM=0
    dp2-shmstore    the same with shmstore
    one-lru         one API server, TP 2, vLLM's default lru cache
    one-vllm-shm    one API server, TP 2, vLLM's own shm cache (SHMSTORE_VLLM=0)
    one-shmstore    one API server, TP 2, shmstore

Workload cells: image hit mixes 0% (every image new), 100% (a few images, sent once before the
cell) and zipf (s = 1.1 over a pool: about 60% repeats), at concurrency 1 and 4; with --mixes
...,fill, last, new images at concurrency 4 until the cache of each of two API servers is full
(so the memory read after it is that of full caches); streaming chat
completions, 8 tokens each. Reported per cell: TTFT p50 and p99 (first streamed token), requests
per second, megabytes the server's processes serialized for each other per request
(bench/ipc_bytes: vLLM's MsgpackEncoder in every process, so every request and output between
API servers and engines, items by value included; not the engine core's broadcast to its
tensor-parallel workers); per server, after the cells: its memory, the PSS of every process of the server
(shared pages split among their users; /proc/PID/smaps_rollup) less their shared-memory pages,
plus every byte the server holds in /dev/shm (shmstore's store is reserved whole at start, so
no write can ever SIGBUS; vLLM's segments grow as they are written).
Ratios compare each shmstore configuration with the vLLM configuration of the same shape, in
the same run. Timings on a shared 2-core machine are noisy: compare ratios, not absolutes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.vllm.test_vllm_serve import Server, image  # noqa: E402
from tests.vllm.tiny_llava import build  # noqa: E402

API2 = ("--api-server-count", "2", "--tensor-parallel-size", "2")
DP2 = ("--data-parallel-size", "2")
ONE = ("--tensor-parallel-size", "2")
CONFIGS = {  # name: (arguments, cache type, shmstore on)
    "api2-fallback": (API2, "shm", False),
    "api2-shmstore": (API2, "shm", True),
    "dp2-fallback": (DP2, "shm", False),
    "dp2-shmstore": (DP2, "shm", True),
    "one-lru": (ONE, "lru", False),
    "one-vllm-shm": (ONE, "shm", False),
    "one-shmstore": (ONE, "shm", True),
}
PAIRS = [("api2-shmstore", "api2-fallback"), ("dp2-shmstore", "dp2-fallback"),
         ("one-shmstore", "one-vllm-shm"), ("one-shmstore", "one-lru")]
MIXES = ("0%", "100%", "zipf")
CONCURRENCY = (1, 4)
HOT = 4  # images of the 100% mix
API_SERVERS = 2  # of the api2 and dp2 shapes (the fill cell fills each one's cache)
POOL = 64  # images the zipf mix draws from


def ttft(server: Server, seed: int) -> float:
    """Seconds from sending a streaming chat request with image `seed` to its first token."""
    body = {"model": server.model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image(seed)}},
                {"type": "text", "text": "describe the image"}]}]}
    request = urllib.request.Request(f"{server.url}/v1/chat/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def seeds_for(mix: str, n: int, rng: random.Random, fresh: list[int]) -> list[int]:
    if mix == "0%":
        out = fresh[:n]
        del fresh[:n]
        return out
    if mix == "100%":
        return [10_000 + i % HOT for i in range(n)]
    weights = [1 / (k + 1) ** 1.1 for k in range(POOL)]
    return [20_000 + rng.choices(range(POOL), weights)[0] for _ in range(n)]


def ipc_bytes(directory: Path) -> int:
    """Bytes the server's processes have serialized for each other so far (ipc_bytes/)."""
    total = 0
    for path in directory.iterdir():
        try:
            total += int(path.read_text() or 0)
        except (OSError, ValueError):
            continue
    return total


def run_cell(server: Server, seeds: list[int], concurrency: int,
             counts: Path) -> dict[str, float]:
    times: list[float] = []
    time.sleep(0.5)  # the counts of what came before are written
    serialized = ipc_bytes(counts)
    lock = threading.Lock()
    queue = list(seeds)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                seed = queue.pop(0)
            took = ttft(server, seed)
            with lock:
                times.append(took)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    time.sleep(0.5)
    serialized = ipc_bytes(counts) - serialized
    times.sort()
    return {"ttft_p50_ms": 1e3 * statistics.median(times),
            "ttft_p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
            "requests_per_s": len(times) / wall, "n": len(times),
            "ipc_mb_per_request": serialized / len(times) / 1e6}


def pss_bytes(pgid: int) -> int:
    """PSS of every process in the process group (the server and all it started), less the
    shared-memory pages they map (those are counted whole, in /dev/shm)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            for line in (entry / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                elif line.startswith("Pss_Shmem:"):
                    total -= int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def shm_bytes() -> int:
    total = 0
    for path in Path("/dev/shm").iterdir():
        try:
            total += path.stat().st_blocks * 512
        except OSError:
            continue
    return total


def run_config(name: str, model: Path, n: int, log_dir: Path, image_size: int,
               mixes: list[str], cache_gb: str = "1") -> dict[str, Any]:
    arguments, cache_type, shmstore = CONFIGS[name]
    counts = log_dir / f"{name}-ipc"
    counts.mkdir(exist_ok=True)
    for old in counts.iterdir():
        old.unlink()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "SHMSTORE_VLLM": "1" if shmstore else "0",
           "PYTHONPATH": f"{ROOT / 'bench' / 'ipc_bytes'}:{ROOT}",
           "SHMSTORE_BENCH_BYTES_DIR": str(counts)}
    shm_before = shm_bytes()
    max_len = max(1024, 2 * (image_size // 14) ** 2)  # two prompts' worth of image tokens
    server = Server(model, f"bench-serve-{os.getpid()}", log_dir / f"{name}.log", *arguments,
                    "--max-num-seqs", "4", "--max-model-len", str(max_len),
                    cache_type=cache_type, cache_gb=cache_gb, env=env)
    try:
        for seed in range(10_000, 10_000 + HOT):  # the 100% mix's images, once
            ttft(server, seed)
        rng = random.Random(0)
        fresh = list(range(30_000, 30_000 + 2 * n * len(CONCURRENCY)))
        cells = {}
        for mix in mixes:
            if mix == "fill":  # new images until every API server's cache is full
                item_bytes = 3 * image_size**2 * 2  # bf16 pixel_values
                count = math.ceil(1.1 * API_SERVERS * float(cache_gb) * 2**30 / item_bytes)
                cells["fill c4"] = run_cell(server, list(range(50_000, 50_000 + count)), 4,
                                            counts)
                continue
            for concurrency in CONCURRENCY:
                cells[f"{mix} c{concurrency}"] = run_cell(
                    server, seeds_for(mix, n, rng, fresh), concurrency, counts)
        return {"cells": cells, "pss_bytes": pss_bytes(server.proc.pid),
                "shm_bytes": shm_bytes() - shm_before}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 requests per cell")
    parser.add_argument("--n", type=int, default=24, help="requests per cell")
    parser.add_argument("--cache-gb", default="1", help="--mm-processor-cache-gb of each server")
    parser.add_argument("--image-size", type=int, default=336)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--mixes", default=",".join(MIXES), help="hit mixes to run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="a PNG of TTFT p50 per cell and configuration")
    parser.add_argument("--from-json", type=Path, help="report (and plot) a saved --json run")
    args = parser.parse_args()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        report(result)
        if args.plot:
            plot(result, args.plot)
        return
    n = 6 if args.quick else args.n
    names = [c for c in args.configs.split(",") if c]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in names}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "model", image_size=args.image_size)
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(run_config(name, model, n, Path(tmp), args.image_size,
                                             args.mixes.split(","), args.cache_gb))
                print(f"{name}: done", file=sys.stderr, flush=True)
    result = summarize(runs)
    result["image_size"] = args.image_size
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the repeats, per configuration and cell."""
    out: dict[str, Any] = {"configs": {}}
    for name, reps in runs.items():
        cells = {}
        for cell in reps[0]["cells"]:
            cells[cell] = {k: statistics.median(r["cells"][cell][k] for r in reps)
                           for k in reps[0]["cells"][cell]}
        pss = statistics.median(r["pss_bytes"] for r in reps) / 2**20
        shm = statistics.median(r["shm_bytes"] for r in reps) / 2**20
        out["configs"][name] = {"cells": cells, "pss_mb": pss, "shm_mb": shm,
                                "memory_mb": pss + shm}
    return out


def report(result: dict[str, Any]) -> None:
    configs = result["configs"]
    print(f"image {result.get('image_size', '?')} px; TTFT p50 / p99 ms, requests/s")
    for name, data in configs.items():
        print(f"\n{name}: memory {data['memory_mb']:.0f} MB (processes {data['pss_mb']:.0f}, "
              f"/dev/shm {data['shm_mb']:.1f})")
        for cell, v in data["cells"].items():
            ipc = v.get("ipc_mb_per_request")  # absent from runs saved before it was counted
            print(f"  {cell:10s} {v['ttft_p50_ms']:7.1f} {v['ttft_p99_ms']:7.1f} "
                  f"{v['requests_per_s']:6.2f}/s"
                  + ("" if ipc is None else f" {ipc:7.3f} MB serialized"))
    print("\nratios (shmstore / vLLM, same run): TTFT p50, TTFT p99, requests/s, MB "
          "serialized between the server's processes per request; memory")
    for mine, theirs in PAIRS:
        if mine not in configs or theirs not in configs:
            continue
        a, b = configs[mine], configs[theirs]
        print(f"{mine} / {theirs}: memory {a['memory_mb'] / b['memory_mb']:.2f}")
        for cell in a["cells"]:
            x, y = a["cells"][cell], b["cells"][cell]
            print(f"  {cell:10s} {x['ttft_p50_ms'] / y['ttft_p50_ms']:5.2f} "
                  f"{x['ttft_p99_ms'] / y['ttft_p99_ms']:5.2f} "
                  f"{x['requests_per_s'] / y['requests_per_s']:5.2f}"
                  + ("" if "ipc_mb_per_request" not in x else
                     f" {x['ipc_mb_per_request'] / max(y['ipc_mb_per_request'], 1e-9):7.4f}"))


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT p50 per cell: each shmstore configuration beside the vLLM one it is compared with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    pairs = [(a, b) for a, b in PAIRS if a in configs and b in configs]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 3.8), squeeze=False)
    for ax, (mine, theirs) in zip(axes[0], pairs, strict=True):
        cells = list(configs[mine]["cells"])
        x = range(len(cells))
        for offset, name in ((-0.2, theirs), (0.2, mine)):
            ax.bar([i + offset for i in x], [configs[name]["cells"][c]["ttft_p50_ms"]
                                              for c in cells], 0.4, label=name)
        ax.set_xticks(list(x), cells, rotation=30)
        ax.set_ylabel("TTFT p50, ms")
        ax.set_title(f"{mine} vs {theirs}")
        ax.legend(fontsize=8)
    fig.suptitle(f"real vllm serve, {result.get('image_size', '?')} px images, one run "
                 "(2-core machine: compare bars in one panel)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
