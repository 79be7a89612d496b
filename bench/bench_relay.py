"""Readers on other nodes: shmstore's relay against sending the value over ZeroMQ per message.

    OMP_NUM_THREADS=1 python bench/bench_relay.py [--items N] [--sizes 4,16] [--json OUT]

Two simulated nodes on localhost, two readers each (4 remote readers), items of 4 and 16 MiB,
every key sent twice (50% cache hits). Per item: wall time from the first send until every
remote reader has every item, and bytes the writer's side put on the wire.

  shmstore relay   Publisher (a thread of the writer process) -> one Relay process per node,
                   which stores each object once in the node's shared memory; readers read in
                   place. A hit crosses as a REF of a few dozen bytes.
  pub/sub pickled  the approach of vLLM's MessageQueue for remote readers: every message
                   pickled and published on one PUB socket to every remote reader.
  per reader       the value pickled and pushed to each remote reader separately.

Ratios are against the relay, measured in the same run (a shared 2-core machine is noisy).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import pickle
import secrets
import time
from typing import Any

import numpy as np
import zmq

from shmstore import Channel
from shmstore.relay import (
    NodeChannel,
    Publisher,
    PublisherSecurity,
    Relay,
    RelaySecurity,
    Timing,
)

N_NODES = 2
READERS_PER_NODE = 2
CTX = mp.get_context("spawn")


def items(n: int, nbytes: int) -> list[tuple[str, np.ndarray]]:
    """n items, each key twice in a row: 50% hits."""
    arrays = {k: np.full(nbytes // 4, k, dtype=np.float32) for k in range(n // 2 + 1)}
    return [(f"img-{i // 2}", arrays[i // 2]) for i in range(n)]


def relay_node(endpoint: str, name: str, ready: Any) -> None:
    with Relay(endpoint, name, n_readers=READERS_PER_NODE,
               security=RelaySecurity(plaintext=True), timing=Timing(peer_timeout_s=30),
               channel=NodeChannel(capacity_bytes=256 << 20)) as relay:
        ready.put("up")
        relay.wait_for_readers(60)
        relay.serve()


def shm_reader(name: str, index: int, n: int, done: Any) -> None:
    with Channel.attach(name, index) as reader:
        done.put(("ready", name))
        for _ in range(n):
            with reader.recv_view(timeout=120) as value:
                float(value["pv"][0])
        done.put(("done", time.monotonic()))


def zmq_reader(endpoint: str, kind: int, n: int, done: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
    else:
        sock.bind(endpoint)
    done.put(("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    for _ in range(n):
        value = pickle.loads(sock.recv())
        float(value["pv"][0])
    done.put(("done", time.monotonic()))
    sock.close(0)
    ctx.term()


def wait_all(done: Any, what: str, count: int) -> list[Any]:
    """The values of `count` (what, value) reports."""
    reports = [done.get(timeout=120) for _ in range(count)]
    assert all(w == what for w, _ in reports), reports
    return [v for _, v in reports]


def bench_relay(n: int, nbytes: int) -> tuple[float, int]:
    name = f"bench-relay-{secrets.token_hex(4)}"
    done = CTX.Queue()
    ready = CTX.Queue()
    procs = []
    with Channel.create(name, n_readers=1, capacity_bytes=256 << 20) as writer:
        with Publisher(name, 0, "tcp://127.0.0.1:*", security=PublisherSecurity(plaintext=True),
                       timing=Timing(peer_timeout_s=30)) as pub:
            pub.start()
            for node in range(N_NODES):
                p = CTX.Process(target=relay_node, args=(pub.endpoint, f"{name}-n{node}", ready))
                p.start()
                procs.append(p)
                ready.get(timeout=60)
                for r in range(READERS_PER_NODE):
                    p = CTX.Process(target=shm_reader, args=(f"{name}-n{node}", r, n, done))
                    p.start()
                    procs.append(p)
            wait_all(done, "ready", N_NODES * READERS_PER_NODE)
            pub.wait_for_nodes(N_NODES, 60)
            work = items(n, nbytes)
            start = time.monotonic()
            for key, arr in work:
                writer.send({"pv": arr}, key=key, timeout=120)
            end = max(wait_all(done, "done", N_NODES * READERS_PER_NODE))
            wire = pub.stats().bytes_sent
            writer.end()
            for p in procs:
                p.join(60)
    return (end - start) / n, wire


def bench_zmq(n: int, nbytes: int, per_reader: bool) -> tuple[float, int]:
    done = CTX.Queue()
    ctx = zmq.Context()
    readers = N_NODES * READERS_PER_NODE
    procs = []
    socks = []
    if per_reader:
        for _ in range(readers):
            p = CTX.Process(target=zmq_reader, args=("tcp://127.0.0.1:*", zmq.PULL, n, done))
            p.start()
            procs.append(p)
    else:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        for _ in range(readers):
            p = CTX.Process(target=zmq_reader, args=(f"tcp://127.0.0.1:{port}", zmq.SUB, n, done))
            p.start()
            procs.append(p)
    endpoints = wait_all(done, "ready", readers)
    if per_reader:
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(endpoint)
            socks.append((sock, endpoint))
    else:
        time.sleep(1.0)  # SUB sockets join late (the slow-joiner rule): let them connect
    work = items(n, nbytes)
    wire = 0
    start = time.monotonic()
    for _, arr in work:
        data = pickle.dumps({"pv": arr}, protocol=5)
        if per_reader:
            for sock, _ in socks:
                sock.send(data)
                wire += len(data)
        else:
            pub.send(data)
            wire += len(data) * readers  # PUB sends one copy per subscriber connection
    end = max(wait_all(done, "done", readers))
    for p in procs:
        p.join(60)
    for sock, _ in socks:
        sock.close(0)
    if not per_reader:
        pub.close(0)
    ctx.term()
    return (end - start) / n, wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=16, help="items per size (even)")
    parser.add_argument("--sizes", default="4,16", help="item sizes in MiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{N_NODES} nodes x {READERS_PER_NODE} readers on localhost, {args.items} items per "
          "size, each key twice (50% hits); per item")
    print(f"{'size':>6} {'method':<16} {'ms/item':>9} {'x relay':>8} {'MB on wire':>11} "
          f"{'x relay':>8}")
    for mib in (int(s) for s in args.sizes.split(",")):
        nbytes = mib << 20
        relay = bench_relay(args.items, nbytes)
        results = {"shmstore relay": relay,
                   "pub/sub pickled": bench_zmq(args.items, nbytes, per_reader=False),
                   "per reader": bench_zmq(args.items, nbytes, per_reader=True)}
        for method, (seconds, wire) in results.items():
            mb = wire / args.items / 1e6
            print(f"{mib:>4}Mi {method:<16} {seconds * 1e3:9.1f} {seconds / relay[0]:8.2f} "
                  f"{mb:11.1f} {wire / relay[1]:8.2f}")
            rows.append({"mib": mib, "method": method, "ms_per_item": seconds * 1e3,
                         "mb_per_item": mb})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
