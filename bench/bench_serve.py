"""Real `vllm serve` runs (CPU build, tiny random LLaVA built offline) for each deployment shape,
vLLM's own caches against shmstore's.

    OMP_NUM_THREADS=1 python bench/bench_serve.py [--quick] [--image-size 336] [--repeats 1]
                                                  [--mixes 0%,100%,zipf,fill] [--n 24]
                                                  [--photo-mp 3] [--source data|url]
                                                  [--cache-gb 1] [--threads] [--timeline]
                                                  [--stalls DIR]
                                                  [--dump-after SECONDS DIR]
                                                  [--json PATH] [--plot PNG]
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
    one-pool        one-shmstore with the node's miss pool of 1 worker (SHMSTORE_VLLM_POOL=1)
    one-pool2       the same with 2 workers: two processing processes, as api2-fallback has
    api2-pool       api2-shmstore with a miss pool of 1 worker (the pool configurations run
                    only when named in --configs)
    api4-fallback   --api-server-count 4 --tensor-parallel-size 2, processor_only (not run
    api4-shmstore   unless named in --configs: six processes of vLLM on two cores)

Images: random 64x64 PNGs by default (--photo-mp 0), or, with --photo-mp MP, JPEG photos of MP
megapixels as a client sends them: a real photo (matplotlib's sample grace_hopper.jpg), each
seed a different crop, flip and tint, resized to MP megapixels at 4:3, quality 90. --source
data sends them as base64 data URLs, --source url as URLs of an HTTP server on 127.0.0.1
(every image made before its cell starts: the clients' cost is not timed).

Workload cells: image hit mixes 0% (every image new), 100% (a few images, sent once before the
cell) and zipf (s = 1.1 over a pool: about 60% repeats), at concurrency 1 and 4; with --mixes
...,fill, last, new images at concurrency 4 until the cache of each of two API servers is full
(so the memory read after it is that of full caches); streaming chat
completions, 8 tokens each. Reported per cell: TTFT p50 and p99 (first streamed token), requests
per second, CPU milliseconds per request of the API server processes and of every process
of the server (utime + stime from /proc, before and after the cell: stable where wall times
are not), megabytes the server's processes serialized for each other per request
(bench/ipc_bytes: vLLM's MsgpackEncoder in every process, so every request and output between
API servers and engines, items by value included; not the engine core's broadcast to its
tensor-parallel workers); per server, after the cells: its memory, the PSS of every process of the server
(shared pages split among their users; /proc/PID/smaps_rollup) less their shared-memory pages,
plus every byte the server holds in /dev/shm (shmstore's store is reserved whole at start, so
no write can ever SIGBUS; vLLM's segments grow as they are written).
Ratios compare each shmstore configuration with the vLLM configuration of the same shape, in
the same run; with --repeats, configurations are interleaved round by round, each number is
the median over the rounds and TTFT p50 also shows its spread (min-max). Timings on a shared
2-core machine are noisy: compare ratios, not absolutes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import base64
import functools
import io
import json
import math
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.vllm.served import MediaServer, Server, image  # noqa: E402
from tests.vllm.tiny_llava import build  # noqa: E402

API2 = ("--api-server-count", "2", "--tensor-parallel-size", "2")
API4 = ("--api-server-count", "4", "--tensor-parallel-size", "2")
DP2 = ("--data-parallel-size", "2")
ONE = ("--tensor-parallel-size", "2")
POOL1, POOL2 = {"SHMSTORE_VLLM_POOL": "1"}, {"SHMSTORE_VLLM_POOL": "2"}
CONFIGS: dict[str, tuple[tuple[str, ...], str, bool, dict[str, str]]] = {
    # name: (arguments, cache type, shmstore on, environment)
    "api2-fallback": (API2, "shm", False, {}),
    "api2-shmstore": (API2, "shm", True, {}),
    "api2-pool": (API2, "shm", True, POOL1),
    "dp2-fallback": (DP2, "shm", False, {}),
    "dp2-shmstore": (DP2, "shm", True, {}),
    "one-lru": (ONE, "lru", False, {}),
    "one-vllm-shm": (ONE, "shm", False, {}),
    "one-shmstore": (ONE, "shm", True, {}),
    "one-pool": (ONE, "shm", True, POOL1),
    "one-pool2": (ONE, "shm", True, POOL2),
    "api4-fallback": (API4, "shm", False, {}),
    "api4-shmstore": (API4, "shm", True, {}),
}
DEFAULT_CONFIGS = [c for c in CONFIGS if not c.startswith("api4") and "pool" not in c]
PAIRS = [("api2-shmstore", "api2-fallback"), ("api4-shmstore", "api4-fallback"),
         ("dp2-shmstore", "dp2-fallback"),
         ("one-shmstore", "one-vllm-shm"), ("one-shmstore", "one-lru"),
         ("one-pool", "one-vllm-shm"), ("one-pool", "one-shmstore"),
         ("api2-pool", "api2-fallback"),
         ("one-pool2", "api2-fallback")]  # two processing processes each, at equal CPU
MIXES = ("0%", "100%", "zipf")
CONCURRENCY = [1, 4]  # --concurrency
HOT = 4  # images of the 100% mix
API_SERVERS = 2  # of the api2 and dp2 shapes (the fill cell fills each one's cache)
POOL = 64  # images the zipf mix draws from
MODEL = ["llava"]  # --model
THREADS = False  # --threads
TIMELINE = False  # --timeline
DUMPS: list[Any] = []  # --dump-after S DIR: [seconds, folder]
STALLS: list[Path] = []  # --stalls DIR: each server's processes say where they stalled
# ([DIR, the running server's folder])


class Images:
    """The URL a client sends for image `seed`: a 64x64 PNG data URL (photo_mp 0), or a JPEG
    photo of photo_mp megapixels as a data URL or from an HTTP server on 127.0.0.1."""

    def __init__(self, photo_mp: float = 0, source: str = "data") -> None:
        self.photo_mp, self.source = photo_mp, source
        self._urls: dict[int, str] = {}
        self._jpegs: dict[int, bytes] = {}
        self._http = MediaServer(self._jpegs.get) if photo_mp and source == "url" else None

    def prepare(self, seeds: list[int]) -> None:
        """Make every image of a cell before it starts."""
        for seed in seeds:
            self.url(seed)

    def url(self, seed: int) -> str:
        if seed not in self._urls:
            if not self.photo_mp:
                self._urls[seed] = image(seed)
            else:
                data = photo(seed, self.photo_mp)
                if self._http is not None:
                    self._jpegs[seed] = data
                    self._urls[seed] = f"{self._http.url}/img/{seed}.jpg"
                else:
                    self._urls[seed] = ("data:image/jpeg;base64,"
                                        + base64.b64encode(data).decode())
        return self._urls[seed]

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


@functools.lru_cache(maxsize=1)
def _sample_photo() -> Any:
    import matplotlib.cbook
    from PIL import Image

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        return Image.open(f).convert("RGB")


def photo(seed: int, megapixels: float) -> bytes:
    """A JPEG photo of `megapixels` at 4:3: the sample photo cropped, flipped and tinted by
    `seed` (every seed a different image, as different clients' photos are)."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    base = _sample_photo()
    w, h = base.size
    cw, ch = int(w * rng.uniform(0.7, 1.0)), int(h * rng.uniform(0.7, 1.0))
    x, y = rng.randrange(w - cw + 1), rng.randrange(h - ch + 1)
    crop = base.crop((x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    width = round((megapixels * 1e6 * 4 / 3) ** 0.5)
    big = np.asarray(crop.resize((width, width * 3 // 4), Image.Resampling.BICUBIC),
                     dtype=np.float32)
    tint = np.array([rng.uniform(0.85, 1.15) for _ in range(3)], dtype=np.float32)
    out = io.BytesIO()
    Image.fromarray(np.clip(big * tint, 0, 255).astype(np.uint8)).save(out, format="JPEG",
                                                                      quality=90)
    return out.getvalue()


IMAGES = Images()  # main() sets the run's


def ttft(server: Server, seed: int) -> float:
    """Seconds from sending a streaming chat request with image `seed` to its first token."""
    body = {"model": server.model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": IMAGES.url(seed)}},
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


def group_processes(pgid: int) -> list[Path]:
    """/proc/PID of every process in the process group (the server and all it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid:
                found.append(entry)
        except OSError:  # gone meanwhile
            continue
    return found


def cpu_seconds(pgid: int) -> tuple[float, float, float, dict[str, float]]:
    """CPU seconds (user + system) so far of the server's API server processes, of all its
    processes, and of its miss pool's workers. vLLM titles its API servers APIServer_N when it
    runs several; with one, the server's first process (pid = pgid) is the API server. A pool
    worker names itself shmstore-pool (/proc/PID/comm). A pool worker that exits between two
    reads takes its seconds with it: compare cells, not single numbers. Last, the seconds by
    process name (/proc/PID/comm: vLLM names its engine core and workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    api = total = first = pool = 0.0
    by_name: dict[str, float] = {}
    for entry in group_processes(pgid):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick
            title = (entry / "cmdline").read_bytes()
            comm = (entry / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
        total += seconds
        by_name[comm] = by_name.get(comm, 0.0) + seconds
        if b"APIServer" in title:
            api += seconds
        if comm == "shmstore-pool":
            pool += seconds
        if int(entry.name) == pgid:
            first = seconds
    return api or first, total, pool, by_name


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of process `pid`, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            found[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError):
            continue
    return found


def py_spy() -> str | None:
    """py-spy's path (on PATH or beside this Python), None where it is not installed."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def thread_names(pid: int) -> dict[int, str]:
    """Python's names of the threads of process `pid` (py-spy's dump; Python 3.11 gives the
    kernel none), a pool's workers under their pool's name ("ThreadPoolExecutor-1"); {} without
    py-spy."""
    spy = py_spy()
    if spy is None:
        return {}
    dump = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"],
                          capture_output=True, text=True, timeout=60).stdout
    return {int(m.group(1)): re.sub(r"_\d+$", "", m.group(2))
            for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]*)"', dump)}


def dump_waiting(server: Server, seed: int, sent: float) -> None:
    """The stacks of every thread of the server's processes (py-spy dump, without stopping
    them), written to DUMPS[1] while request `seed` (sent at `sent`) waits for its first
    token: the first process (with one API server, the API server) and its descendants."""
    spy = py_spy()
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    out = [f"request image {seed}, waiting {time.time() - sent:.3f} s at {time.time():.3f}"]
    for pid in pids:
        out.append(f"===== pid {pid}")
        if spy is None:
            out.append("no stacks: py-spy is not installed (pip install py-spy)")
            continue
        dump = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"],
                              capture_output=True, text=True, timeout=60)
        out += [dump.stdout, dump.stderr]
    out.append(f"done at {time.time():.3f}")
    (DUMPS[1] / f"{sent:.3f}-{seed}.txt").write_text("\n".join(out))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (/proc's children lists)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
            kids = {int(c) for t in tasks
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()}
        except (OSError, ValueError):
            continue
        found += sorted(kids)
        todo += sorted(kids)
    return found


def by_thread(pid: int, before: dict[int, float], n: int) -> dict[str, float]:
    """CPU ms per request of process `pid`'s threads since `before`, summed by Python name
    (the threads Python did not start, or all without py-spy: "other threads")."""
    names = thread_names(pid)
    found: dict[str, float] = {}
    for tid, seconds in thread_seconds(pid).items():
        name = names.get(tid, "other threads")
        found[name] = found.get(name, 0.0) + 1e3 * (seconds - before.get(tid, 0.0)) / n
    return found


def run_cell(server: Server, seeds: list[int], concurrency: int,
             counts: Path) -> dict[str, Any]:
    times: list[float] = []
    IMAGES.prepare(seeds)
    time.sleep(0.5)  # the counts of what came before are written
    serialized = ipc_bytes(counts)
    cpu_before = cpu_seconds(server.proc.pid)
    threads_before = thread_seconds(server.proc.pid) if THREADS else {}
    lock = threading.Lock()
    queue = list(seeds)
    timeline: list[tuple[float, float, int]] = []  # (sent, TTFT, image) of each request

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                seed = queue.pop(0)
            sent = time.time()
            timer = None
            if DUMPS:  # still without a first token after DUMPS[0] s: where the server is
                timer = threading.Timer(DUMPS[0], dump_waiting, args=(server, seed, sent))
                timer.start()
            took = ttft(server, seed)
            if timer is not None:
                timer.cancel()
            with lock:
                times.append(took)
                timeline.append((sent, took, seed))

    phases = engine_phases(server) if TIMELINE else {}
    start, began = time.perf_counter(), time.time()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    time.sleep(0.5)
    serialized = ipc_bytes(counts) - serialized
    cpu_after = cpu_seconds(server.proc.pid)
    times.sort()
    found: dict[str, Any] = {}
    if TIMELINE:
        print_timeline(timeline, concurrency)
        print_phases(phases, engine_phases(server))
    if STALLS:  # the cell's wall-clock span, to place the stalls the processes wrote
        with (STALLS[-1] / "timed").open("a") as spans:
            spans.write(f"{began} {began + wall}\n")
    if THREADS:  # one API server: the server's first process
        found["api_cpu_ms_per_request_by_thread"] = by_thread(server.proc.pid, threads_before,
                                                              len(times))
    return found | {"ttft_p50_ms": 1e3 * statistics.median(times),
            "ttft_p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
            "requests_per_s": len(times) / wall, "n": len(times),
            "ipc_mb_per_request": serialized / len(times) / 1e6,
            "api_cpu_ms_per_request": 1e3 * (cpu_after[0] - cpu_before[0]) / len(times),
            "server_cpu_ms_per_request": 1e3 * (cpu_after[1] - cpu_before[1]) / len(times),
            "pool_cpu_ms_per_request": 1e3 * (cpu_after[2] - cpu_before[2]) / len(times),
            "cpu_ms_per_request_by_process": {
                name: 1e3 * (seconds - cpu_before[3].get(name, 0.0)) / len(times)
                for name, seconds in sorted(cpu_after[3].items())}}


def pss_bytes(pgid: int) -> int:
    """PSS of every process in the process group (the server and all it started), less the
    shared-memory pages they map (those are counted whole, in /dev/shm)."""
    total = 0
    for entry in group_processes(pgid):
        try:
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
    arguments, cache_type, shmstore, extra_env = CONFIGS[name]
    counts = log_dir / f"{name}-ipc"
    counts.mkdir(exist_ok=True)
    for old in counts.iterdir():
        old.unlink()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "SHMSTORE_VLLM": "1" if shmstore else "0",
           "PYTHONPATH": f"{ROOT / 'bench' / 'ipc_bytes'}:{ROOT}",
           "SHMSTORE_BENCH_BYTES_DIR": str(counts), **extra_env}
    if STALLS:  # a folder per server: one file per process (bench/ipc_bytes/sitecustomize.py)
        stalls = STALLS[0] / f"{name}-{time.strftime('%H%M%S')}"
        stalls.mkdir(parents=True)
        env["SHMSTORE_BENCH_STALL_DIR"] = str(stalls)
        STALLS[1:] = [stalls]  # this server's: where run_cell writes its cells' spans
    shm_before = shm_bytes()
    # two prompts' worth of image tokens (LLaVA-NeXT: up to five crops' and their newlines)
    max_len = max(1024, (2 if MODEL[0] == "llava" else 6) * (image_size // 14) ** 2)
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
    parser.add_argument("--model", choices=("llava", "llava_next"), default="llava",
                        help="the tiny LLaVA-1.5, or the tiny LLaVA-NeXT (anyres tiles)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--photo-mp", type=float, default=0,
                        help="JPEG photos of this many megapixels (0: 64x64 PNGs)")
    parser.add_argument("--source", choices=("data", "url"), default="data",
                        help="photos as base64 data URLs or from an HTTP server on 127.0.0.1")
    parser.add_argument("--mixes", default=",".join(MIXES), help="hit mixes to run")
    parser.add_argument("--concurrency", default="1,4", help="clients of each cell")
    parser.add_argument("--threads", action="store_true",
                        help="also the API server's CPU per request by thread (configurations "
                        "with one API server; thread names need py-spy: pip install py-spy)")
    parser.add_argument("--timeline", action="store_true",
                        help="print each timed request: when sent, its TTFT, when its first "
                        "token came (stderr)")
    parser.add_argument("--stalls", type=Path,
                        help="a folder where every process of each server writes the stacks "
                        "of its threads whenever none of them could run for 0.3 s, and when")
    parser.add_argument("--dump-after", nargs=2, metavar=("SECONDS", "DIR"),
                        help="a request still without its first token after SECONDS: the "
                        "stacks of every thread of the server's processes (py-spy dump) "
                        "written to DIR")
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
    CONCURRENCY[:] = [int(c) for c in args.concurrency.split(",")]
    MODEL[0] = args.model
    global IMAGES, THREADS, TIMELINE
    THREADS = args.threads
    TIMELINE = args.timeline
    if args.stalls:
        STALLS.append(args.stalls.resolve())
    if args.dump_after:
        DUMPS[:] = [float(args.dump_after[0]), Path(args.dump_after[1]).resolve()]
        DUMPS[1].mkdir(parents=True, exist_ok=True)
    IMAGES = Images(args.photo_mp, args.source)
    names = [c for c in args.configs.split(",") if c]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in names}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "model", image_size=args.image_size, kind=args.model)
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(run_config(name, model, n, Path(tmp), args.image_size,
                                             args.mixes.split(","), args.cache_gb))
                print(f"{name}: done", file=sys.stderr, flush=True)
    IMAGES.close()
    if STALLS:
        stall_report(STALLS[0])
    result = summarize(runs)
    result["image_size"] = args.image_size
    result["repeats"] = args.repeats
    result["model"] = args.model
    result["photo_mp"], result["source"] = args.photo_mp, args.source
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


def print_timeline(timeline: list[tuple[float, float, int]], concurrency: int) -> None:
    """Each request of a cell in the order sent: when it was sent and when its first token
    came, from the cell's start (which request waited while later ones went through)."""
    t0 = min(sent for sent, _, _ in timeline)
    print(f"timeline, c{concurrency}: sent s, TTFT s, first token s, image", file=sys.stderr)
    for sent, took, seed in sorted(timeline):
        print(f"  {sent - t0:7.3f} {took:7.3f} {sent - t0 + took:7.3f}  {seed}", file=sys.stderr)


PHASES = ("queue", "prefill")  # vLLM's histograms vllm:request_{phase}_time_seconds


def engine_phases(server: Server) -> dict[tuple[str, str], float]:
    """vLLM's own histograms of the time its engine kept requests waiting (queue) and in
    prefill, bucket by bucket (cumulative counts), summed over every label set."""
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    found: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        for phase in PHASES:
            head = f"vllm:request_{phase}_time_seconds_bucket{{"
            if line.startswith(head) and 'le="' in line:
                le = line.split('le="', 1)[1].split('"', 1)[0]
                found[phase, le] = found.get((phase, le), 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def print_phases(before: dict[tuple[str, str], float],
                 after: dict[tuple[str, str], float]) -> None:
    """How many of the cell's requests the engine kept over each bucket's bound, per phase."""
    for phase in PHASES:
        bounds = sorted((float(le), le) for p, le in after if p == phase and le != "+Inf")
        total = after.get((phase, "+Inf"), 0.0) - before.get((phase, "+Inf"), 0.0)
        over = [f">{b:g}s {total - (after[phase, le] - before.get((phase, le), 0.0)):.0f}"
                for b, le in bounds if 0.2 <= b <= 2.5]
        print(f"  engine {phase} time, requests over: " + ", ".join(over) + f" (of {total:.0f})",
              file=sys.stderr)


def stall_report(root: Path) -> None:
    """The stalls (bench/ipc_bytes/sitecustomize.py) that fell inside a timed cell, per server
    and process: when, how long, and the stacks its threads stood in."""
    for server in sorted(p for p in root.iterdir() if p.is_dir()):
        timed = server / "timed"
        spans = ([tuple(map(float, line.split())) for line in timed.read_text().splitlines()]
                 if timed.exists() else [])
        found = 0
        for log in sorted(p for p in server.iterdir() if p.name.isdigit()):
            lines = log.read_text(errors="replace").splitlines()
            start = 0
            for i, line in enumerate(lines):
                if not line.startswith("stalled: "):
                    continue
                late, woke = float(line.split()[1]), float(line.rsplit(" ", 1)[1])
                if any(a <= woke and woke - late <= b for a, b in spans):
                    found += 1
                    print(f"{server.name}: {lines[0]}\n  {line}")
                    print("\n".join("    " + x for x in lines[start:i][-40:]))
                start = i + 1
        print(f"{server.name}: {found} stall(s) of over 0.3 s inside its timed cells")


def _median(values: Any) -> Any:
    """The median of numbers, or of dicts of numbers key by key (a key missing counts 0)."""
    values = list(values)
    if values and isinstance(values[0], dict):
        keys = sorted({k for v in values for k in v})
        return {k: statistics.median(v.get(k, 0.0) for v in values) for k in keys}
    return statistics.median(values)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the repeats, per configuration and cell."""
    out: dict[str, Any] = {"configs": {}}
    for name, reps in runs.items():
        cells = {}
        for cell in reps[0]["cells"]:
            cells[cell] = {k: _median(r["cells"][cell][k] for r in reps)
                           for k in reps[0]["cells"][cell]}
            p50s = [r["cells"][cell]["ttft_p50_ms"] for r in reps]
            cells[cell]["ttft_p50_ms_spread"] = [min(p50s), max(p50s)]
        pss = statistics.median(r["pss_bytes"] for r in reps) / 2**20
        shm = statistics.median(r["shm_bytes"] for r in reps) / 2**20
        out["configs"][name] = {"cells": cells, "pss_mb": pss, "shm_mb": shm,
                                "memory_mb": pss + shm}
    return out


def report(result: dict[str, Any]) -> None:
    configs = result["configs"]
    photos = result.get("photo_mp") or 0
    print(f"model image {result.get('image_size', '?')} px; client images: "
          + (f"{photos} MP JPEG photos by {result.get('source')}" if photos else "64x64 PNG")
          + "; TTFT p50 [spread over repeats] / p99 ms, requests/s, CPU ms per request of "
          "the API servers / of the whole server")
    for name, data in configs.items():
        print(f"\n{name}: memory {data['memory_mb']:.0f} MB (processes {data['pss_mb']:.0f}, "
              f"/dev/shm {data['shm_mb']:.1f})")
        for cell, v in data["cells"].items():
            ipc = v.get("ipc_mb_per_request")  # absent from runs saved before it was counted
            spread = v.get("ttft_p50_ms_spread")
            cpu = v.get("api_cpu_ms_per_request")
            print(f"  {cell:10s} {v['ttft_p50_ms']:7.1f}"
                  + ("" if spread is None else f" [{spread[0]:.0f}-{spread[1]:.0f}]")
                  + f" {v['ttft_p99_ms']:7.1f} {v['requests_per_s']:6.2f}/s"
                  + ("" if cpu is None else
                     f" cpu {cpu:6.1f} / {v['server_cpu_ms_per_request']:6.1f} ms")
                  + ("" if not v.get("pool_cpu_ms_per_request") else
                     f" (pool {v['pool_cpu_ms_per_request']:5.1f} ms)")
                  + ("" if ipc is None else f" {ipc:7.3f} MB serialized"))
            by_process = v.get("cpu_ms_per_request_by_process")
            if by_process:  # the server's processes by name, CPU ms per request
                print("             " + ", ".join(f"{k} {ms:.0f}" for k, ms in
                                                 by_process.items() if ms >= 1))
            by_thread = v.get("api_cpu_ms_per_request_by_thread")
            if by_thread:  # --threads: the API server's threads, CPU ms per request
                print("             API server: " + ", ".join(
                    f"{k} {ms:.1f}" for k, ms in sorted(by_thread.items(), key=lambda kv: -kv[1])
                    if ms >= 0.5))
    print("\nratios (shmstore / vLLM, same run): TTFT p50, TTFT p99, requests/s, API-server "
          "CPU per request, server CPU per request, MB serialized between the server's "
          "processes per request; memory")
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
                  + ("" if "api_cpu_ms_per_request" not in x else
                     f" {x['api_cpu_ms_per_request'] / y['api_cpu_ms_per_request']:5.2f}"
                     f" {x['server_cpu_ms_per_request'] / y['server_cpu_ms_per_request']:5.2f}")
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
    rounds = result.get("repeats", 1)
    photos = result.get("photo_mp") or 0
    fig.suptitle(f"real vllm serve, {result.get('image_size', '?')} px images, "
                 + (f"{photos:g} MP JPEG clients, " if photos else "")
                 + (f"median of {rounds} rounds" if rounds > 1 else "one run")
                 + " (2-core machine: compare bars in one panel)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
