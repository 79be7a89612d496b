"""End-to-end: one writer sends K float32 tensors to R reader processes; shmstore vs transports.

    OMP_NUM_THREADS=1 python bench/bench_pipeline.py [--quick] [--json PATH]

Each reader touches every tensor (reads one element) and keeps a running checksum that the
writer verifies at the end. Time per item is end to end: from the first send to the moment the
last reader is done, divided by K, after a warm-up pass. Every transport runs in the same
process tree and the same run:

  shmstore        Channel: the tensor is put into the shared ring once, a Handle is broadcast,
                  readers use recv_view (zero copy)
  shm reserve     the same Channel, but the producer writes its output straight into the ring
                  (ChannelWriter.reserve, here a fill of the tensor): no copy in either direction;
                  the time includes producing the bytes, which the other rows do beforehand
  pipe            pickle through one multiprocessing.Pipe per reader
  mp.Queue        one multiprocessing.Queue per reader
  torch.mp.Queue  torch.multiprocessing.Queue per reader; the tensor's storage moves to shared
                  memory once per item and the readers map it
  shm-per-item    a fresh POSIX shared-memory segment per item: create, write, send its name,
                  each reader attaches and copies, the writer unlinks when all are done
  vllm shm        vLLM's own: SingleWriterShmObjectStorage (its ring, msgpack serde) plus its
                  MessageQueue carrying the signed handle, as vLLM's shm cache uses them
                  (bench/vllm_baseline.py; skipped when vllm is not installed)
  memcpy          the floor: one plain copy of S bytes (np.copyto into warm memory)
  fill            printed at the end of each row: one fill of S bytes of that memory, the
                  producer's own write in `shm reserve` (its floor); below the row, the
                  writer's side of `shm reserve` split into entering, the fill and leaving

Queue alone: small-message latency (p50, p99) paced (one message per millisecond, and one per
20 ms so readers fall asleep) and messages/s flooded, with 1, 2 and 4 readers, for shmstore's
BroadcastQueue and vLLM's MessageQueue; and the CPU an idle shmstore reader burns.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import statistics
import time
from queue import Empty
from typing import Any

import numpy as np
import vllm_baseline

from shmstore import Blank, BroadcastQueue, Channel

KIB, MIB = 1 << 10, 1 << 20
SIZES = [256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB]
READERS = [1, 2, 4]
METHODS = ["shmstore", "shm reserve", "pipe", "mp.Queue", "torch.mp.Queue", "shm-per-item",
           "vllm shm"]
CTX = mp.get_context("spawn")
# The writer's side of each timed `shm reserve` item: (entering reserve, the fill, leaving it).
RESERVE_PHASES: list[tuple[float, float, float]] = []


def items_for(size: int, quick: bool) -> int:
    budget = (64 if quick else 256) * MIB
    return max(10, min(200, budget // size))


# -- readers (run in spawned processes) ---------------------------------------------------------

def reader_main(method: str, name: str, index: int, n_items: int, inbox: Any, report: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    checksum = 0.0
    if method in ("shmstore", "shm reserve"):
        ch = Channel.attach(name, reader=index)
        report.put(("ready", index))
        for _ in range(n_items):
            with ch.recv_view(timeout=120) as value:
                arr = value["x"] if method == "shm reserve" else value
                checksum += float(arr[len(arr) // 2])
        ch.close()
    elif method == "vllm shm":
        reader = vllm_baseline.Reader(inbox, index)
        report.put(("ready", index))
        reader.wait_until_ready()
        for _ in range(n_items):
            arr = reader.recv(timeout=120)
            checksum += float(arr[len(arr) // 2])
        reader.close()
    elif method == "shm-per-item":
        import mmap

        import posix_ipc
        report.put(("ready", index))
        for _ in range(n_items):
            seg_name, count = inbox.get(timeout=120)
            shm = posix_ipc.SharedMemory(seg_name)
            with mmap.mmap(shm.fd, count * 4) as mapping:
                shm.close_fd()
                arr = np.frombuffer(mapping, dtype=np.float32, count=count).copy()
            checksum += float(arr[len(arr) // 2])
            report.put(("ack", seg_name))
    else:
        if method == "torch.mp.Queue":
            import torch  # noqa: F401  (unpickling the tensors needs it)
        report.put(("ready", index))
        for _ in range(n_items):
            arr = inbox.recv() if method == "pipe" else inbox.get(timeout=120)
            checksum += float(arr[len(arr) // 2])
    report.put(("done", index, time.monotonic(), checksum))


# -- one run ------------------------------------------------------------------------------------

def run_transfer(method: str, size: int, n_readers: int, n_items: int) -> float:
    """Seconds per item, end to end, for one transport; warm-up included but not timed."""
    count = size // 4
    RESERVE_PHASES.clear()
    sources = [np.full(count, float(i), dtype=np.float32) for i in range(4)]
    name = f"shmstore-bench-pipe-{os.getpid()}"
    report = CTX.Queue()
    inboxes: list[Any] = []
    senders: list[Any] = []
    writer: Any = None
    if method in ("shmstore", "shm reserve"):
        writer = Channel.create(name, n_readers=n_readers, capacity_bytes=max(64 * MIB, 8 * size),
                                inline_threshold=4 * KIB, n_slots=64)
        inboxes = [None] * n_readers
    elif method == "vllm shm":
        writer = vllm_baseline.Writer(n_readers, max(64 * MIB, 8 * size), size + MIB, CTX.Lock())
        inboxes = [writer.handles()] * n_readers
    elif method == "pipe":
        for _ in range(n_readers):
            recv_end, send_end = CTX.Pipe(duplex=False)
            inboxes.append(recv_end)
            senders.append(send_end)
    elif method == "torch.mp.Queue":
        import torch.multiprocessing as tmp
        tctx = tmp.get_context("spawn")
        inboxes = [tctx.Queue() for _ in range(n_readers)]
    else:
        inboxes = [CTX.Queue() for _ in range(n_readers)]
    total = 2 * n_items  # a warm-up pass, then the timed pass
    procs = [CTX.Process(target=reader_main, args=(method, name, r, total, inboxes[r], report))
             for r in range(n_readers)]
    for p in procs:
        p.start()
    try:
        _await_ready(method, report, procs)
        if method == "vllm shm":
            writer.wait_until_ready()
        elif writer is not None:
            writer.wait_for_readers(timeout=60)
        expected = 0.0
        pending: dict[str, int] = {}
        start = 0.0
        done_times: list[float] = []
        checksums: list[float] = []
        for i in range(total):
            if i == n_items:  # warm-up over: wait until the readers are idle again
                start = time.monotonic()
            src = sources[i % len(sources)]
            expected += float(src[count // 2])
            if method in ("shmstore", "vllm shm"):
                writer.send(src, timeout=120)
            elif method == "shm reserve":  # the producer writes its output into the ring
                t0 = time.perf_counter()
                with writer.reserve({"x": Blank((count,), "float32")}, timeout=120) as res:
                    t1 = time.perf_counter()
                    res.arrays["x"].fill(float(i % len(sources)))
                    t2 = time.perf_counter()
                if i >= n_items:
                    RESERVE_PHASES.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            elif method == "pipe":
                for s in senders:
                    s.send(src)
            elif method == "torch.mp.Queue":
                import torch
                t = torch.from_numpy(src.copy())  # a fresh tensor per item, as a server makes
                for q in inboxes:
                    q.put(t)
            elif method == "mp.Queue":
                for q in inboxes:
                    q.put(src)
            else:  # shm-per-item
                import mmap

                import posix_ipc
                seg = f"/{name}-{i}"
                shm = posix_ipc.SharedMemory(seg, flags=posix_ipc.O_CREX, mode=0o600, size=size)
                with mmap.mmap(shm.fd, size) as mapping:
                    shm.close_fd()
                    np.frombuffer(mapping, dtype=np.float32)[:] = src
                pending[seg] = n_readers
                for q in inboxes:
                    q.put((seg, count))
                while not report.empty():
                    _collect(report, pending, done_times, checksums)
        while len(done_times) < n_readers:
            _collect(report, pending, done_times, checksums, block=True)
        elapsed = max(done_times) - start
        for c in checksums:
            if abs(c - expected) > 1e-3 * max(1.0, abs(expected)):
                raise RuntimeError(f"{method}: a reader's checksum {c} != {expected}")
        return elapsed / n_items
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if writer is not None:
            writer.close()
        for s in senders:
            s.close()


def _await_ready(method: str, report: Any, procs: list[Any], limit_s: float = 240.0) -> None:
    """Until every reader says ready; a reader that dies first is named, not waited for."""
    deadline = time.monotonic() + limit_s
    ready = 0
    while ready < len(procs):
        try:
            kind, _ = report.get(timeout=0.5)
        except Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"{method}: readers (index, exit code) {dead} died before "
                                   "they were ready; their tracebacks are above") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{method}: {len(procs) - ready} readers alive but not ready "
                                   f"after {limit_s:.0f} s") from None
            continue
        assert kind == "ready", kind
        ready += 1


def _collect(report: Any, pending: dict[str, int], done_times: list[float],
             checksums: list[float], block: bool = False) -> None:
    msg = report.get(timeout=120) if block else report.get_nowait()
    if msg[0] == "ack":
        pending[msg[1]] -= 1
        if pending[msg[1]] == 0:
            import posix_ipc
            posix_ipc.unlink_shared_memory(msg[1])
            del pending[msg[1]]
    elif msg[0] == "done":
        done_times.append(msg[2])
        checksums.append(msg[3])


def memcpy_floor(size: int, repeats: int, fill: bool = False) -> float:
    """One np.copyto of `size` bytes into warm memory of the ring's size, at rotating offsets;
    with `fill`, one fill of those bytes instead (what `shm reserve`'s producer writes)."""
    src = np.ones(size // 4, dtype=np.float32)
    footprint = np.empty(max(64 * MIB, 8 * size) // 4, dtype=np.float32)
    footprint.fill(0.0)
    slots = len(footprint) // len(src)
    times = []
    for i in range(repeats + 1):
        start = (i % slots) * len(src)
        t0 = time.perf_counter()
        if fill:
            footprint[start:start + len(src)].fill(float(i))
        else:
            np.copyto(footprint[start:start + len(src)], src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# -- queue alone --------------------------------------------------------------------------------

def latency_reader(name: Any, index: int, n: int, report: Any) -> None:
    """`name`: a shmstore queue's name, or the handles of a vllm_baseline.Writer."""
    q: Any = (BroadcastQueue.attach(name, reader=index) if isinstance(name, str)
              else vllm_baseline.Reader(name, index))
    report.put(("ready", index))
    if not isinstance(name, str):
        q.wait_until_ready()
    lat = []
    for _ in range(n):
        sent = q.get(timeout=120)
        lat.append(time.monotonic() - sent)
    report.put(("done", index, time.monotonic(), lat))
    q.close()


def idle_reader(name: Any, index: int, seconds: float, report: Any) -> None:
    q: Any = (BroadcastQueue.attach(name, reader=index) if isinstance(name, str)
              else vllm_baseline.Reader(name, index))
    report.put(("ready", index))
    if not isinstance(name, str):
        q.wait_until_ready()
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        q.get(timeout=seconds)
    except Exception:
        pass
    report.put(("idle", (time.process_time() - cpu0) / (time.monotonic() - wall0)))
    q.close()


def run_queue(n_readers: int, n: int, interval_s: float | None, vllm: bool = False
              ) -> dict[str, float]:
    """Small-message latency and rate through shmstore's BroadcastQueue, or vLLM's
    MessageQueue (`vllm`), in the same way."""
    name = f"shmstore-bench-q-{os.getpid()}"
    report = CTX.Queue()
    q: Any
    if vllm:
        q = vllm_baseline.Writer(n_readers)
        where: Any = q.handles()
    else:
        q = BroadcastQueue.create(name, n_readers=n_readers, slot_bytes=256, n_slots=256)
        where = name
    try:
        procs = [CTX.Process(target=latency_reader, args=(where, r, n, report))
                 for r in range(n_readers)]
        for p in procs:
            p.start()
        for _ in range(n_readers):
            report.get(timeout=120)
        if vllm:
            q.wait_until_ready()
        else:
            q.wait_for_readers(timeout=60)
        start = time.monotonic()
        for _ in range(n):
            q.put(time.monotonic())
            if interval_s:
                target = time.monotonic() + interval_s
                while time.monotonic() < target:
                    time.sleep(interval_s / 4 if interval_s > 0.005 else 0)
        results = [report.get(timeout=120) for _ in range(n_readers)]
        for p in procs:
            p.join(timeout=60)
    finally:
        q.close()
    lat = sorted(x for r in results for x in r[3])
    elapsed = max(r[2] for r in results) - start
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
            "msgs_per_s": n / elapsed}


def run_idle(seconds: float, vllm: bool = False) -> float:
    """The share of a core one reader uses while it waits `seconds` for a message."""
    name = f"shmstore-bench-idle-{os.getpid()}"
    report = CTX.Queue()
    q: Any = (vllm_baseline.Writer(1) if vllm
              else BroadcastQueue.create(name, n_readers=1, slot_bytes=256, n_slots=8))
    try:
        p = CTX.Process(target=idle_reader, args=(q.handles() if vllm else name, 0, seconds,
                                                  report))
        p.start()
        report.get(timeout=120)
        if vllm:
            q.wait_until_ready()
        _, share = report.get(timeout=seconds + 60)
        p.join(timeout=60)
    finally:
        q.close()
    return float(share)


# -- main ---------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and messages")
    parser.add_argument("--json", default="bench/results/bench_pipeline.json")
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="bytes per tensor")
    parser.add_argument("--readers", type=int, nargs="*", default=READERS)
    parser.add_argument("--no-queue", action="store_true", help="skip the queue-alone part")
    parser.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS,
                        help="transports to run (shmstore always runs: the ratios need it)")
    args = parser.parse_args()
    methods = ["shmstore"] + [m for m in METHODS if m in args.methods and m != "shmstore"
                              and (m != "vllm shm" or vllm_baseline.available())]
    out: dict[str, Any] = {"omp_num_threads": os.environ["OMP_NUM_THREADS"], "transfer": [],
                           "queue": [], "idle_reader_cpu_share": None}
    print("seconds per item, end to end (ratio: baseline / shmstore)")
    print(f"{'size':>8} {'R':>2} {'memcpy':>9} " + " ".join(f"{m:>16}" for m in methods))
    for size in args.sizes:
        floor = memcpy_floor(size, 20)
        fill_floor = memcpy_floor(size, 20, fill=True)
        for n_readers in args.readers:
            n_items = items_for(size, args.quick)
            row: dict[str, Any] = {"size_bytes": size, "n_readers": n_readers, "items": n_items,
                                   "memcpy_s": floor, "fill_s": fill_floor}
            for method in methods:
                row[f"{method}_s"] = run_transfer(method, size, n_readers, n_items)
                if method == "shm reserve":
                    row["reserve_phases_s"] = [statistics.median(p) for p in zip(*RESERVE_PHASES)]
            out["transfer"].append(row)
            ours = row["shmstore_s"]
            label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
            cells = [f"{ours * 1e3:9.3f} ms" + " " * 4]
            cells += [f"{row[f'{m}_s'] * 1e3:8.3f} ({row[f'{m}_s'] / ours:5.1f}x)" for m in methods[1:]]
            print(f"{label:>8} {n_readers:>2} {floor * 1e3:6.3f} ms " + " ".join(f"{c:>16}" for c in cells)
                  + f"   shmstore/memcpy {ours / floor:.2f}   fill {fill_floor * 1e3:.3f} ms")
            if "reserve_phases_s" in row:
                enter, fill, leave = (t * 1e3 for t in row["reserve_phases_s"])
                print(f"{'':>13} shm reserve, the writer's side (medians): entering {enter:.3f} ms,"
                      f" the fill {fill:.3f} ms, leaving (commit, send) {leave:.3f} ms")
    if args.no_queue:
        _write(out, args.json)
        return
    n_flood = 20_000 if args.quick else 100_000
    n_paced = 500 if args.quick else 2000
    print("\nqueue alone: small messages (a float timestamp)")
    print(f"{'queue':>13} {'R':>2} {'paced 1 ms p50/p99 us':>22} {'paced 20 ms p50/p99 us':>23} "
          f"{'flood msgs/s':>13}")
    queues = ["shmstore"] + (["vllm"] if "vllm shm" in methods else [])
    for n_readers in args.readers:
        for queue in queues:
            vllm = queue == "vllm"
            paced = run_queue(n_readers, n_paced, 0.001, vllm)
            asleep = run_queue(n_readers, max(50, n_paced // 20), 0.02, vllm)
            flood = run_queue(n_readers, n_flood, None, vllm)
            out["queue"].append({"queue": queue, "n_readers": n_readers, "paced_1ms": paced,
                                 "paced_20ms": asleep, "flood": flood})
            label = "MessageQueue" if vllm else "BroadcastQueue"
            print(f"{label:>13} {n_readers:>2} {paced['p50_us']:10.1f} / {paced['p99_us']:8.1f} "
                  f"{asleep['p50_us']:11.1f} / {asleep['p99_us']:8.1f} "
                  f"{flood['msgs_per_s']:13,.0f}", flush=True)
    idle_s = 1.0 if args.quick else 3.0
    share = run_idle(idle_s)
    out["idle_reader_cpu_share"] = share
    print(f"\nidle reader (blocked in get for {idle_s:g} s): {share * 100:.2f}% of a core")
    if "vllm" in queues:
        out["vllm_idle_reader_cpu_share"] = vllm_share = run_idle(idle_s, vllm=True)
        print(f"idle MessageQueue reader (blocked in dequeue for {idle_s:g} s): "
              f"{vllm_share * 100:.2f}% of a core")
    _write(out, args.json)


def _write(out: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
