"""Publisher memory under a flood from hostile nodes: the bound the relay promises, measured.

    OMP_NUM_THREADS=1 python bench/bench_relay_flood.py [--nodes 4] [--window 16] [--mib 1]
                                                        [--seconds 10] [--json OUT]

A writer channel and its Publisher run in this process (plain TCP on 127.0.0.1). Another
process opens --nodes rogue connections. Each says HELLO listing 65,536 held ids (the most a
HELLO may carry), never acknowledges, never reads, floods NEEDs for every message number and
PINGs to stay alive (it reads only its WELCOME, to learn which message numbers to ask
for); every second each one connects again with a fresh HELLO. The writer sends
--mib MiB objects, each under a new key, as fast as the Publisher lets it. Reported: the
peak growth of this process's anonymous memory (RssAnon in /proc/self/status: what the
Publisher and ZeroMQ allocate; the store is shared memory and is counted apart), beside the
window's worth of body copies the Publisher keeps (one per unacknowledged message, shared by
every node's queue) and what the queues could hold if no copy were shared.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from shmstore import Channel
from shmstore.errors import StoreFull, Timeout
from shmstore.relay import Publisher, PublisherSecurity, Timing
from shmstore.relay._wire import HELLO, NEED, PING, PROTOCOL_VERSION, WELCOME, pack, parse

MIB = 1 << 20
HELD_IDS = 1 << 16  # the most one HELLO may list


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def rogues(endpoint: str, nodes: int, window: int, seconds: float,
            ready: mp.synchronize.Event) -> None:
    """Hostile nodes: huge HELLOs, no ACK, no reads, NEED floods, reconnects every second."""
    ctx = zmq.Context()
    held = [secrets.token_bytes(24) for _ in range(HELD_IDS)]

    def connect(i: int) -> tuple[zmq.Socket, int]:
        """A new connection: HELLO, read the WELCOME (its first message number), then never
        read again."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(endpoint)
        sock.send(pack(HELLO, PROTOCOL_VERSION, f"rogue-{i}", 0, held, time.time_ns()))
        first = 1
        if sock.poll(2000):
            kind, fields, _ = parse(sock.recv_multipart())
            if kind == WELCOME:
                first = fields[4]
        return sock, first

    socks = [connect(i) for i in range(nodes)]
    ready.set()
    end = time.monotonic() + seconds
    reconnect = time.monotonic() + 1.0
    while time.monotonic() < end:
        for sock, first in socks:
            try:  # a NEED for each message it may wait for, again and again
                for number in range(first, first + window):
                    sock.send(pack(NEED, number), zmq.NOBLOCK)
                sock.send(pack(PING), zmq.NOBLOCK)
            except zmq.Again:
                pass
        if time.monotonic() > reconnect:
            for i, (sock, _) in enumerate(socks):
                sock.close()
                socks[i] = connect(i)
            reconnect = time.monotonic() + 1.0
        time.sleep(0.001)
    for sock, _ in socks:
        sock.close()
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--mib", type=float, default=1.0, help="object size")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    nbytes = int(args.mib * MIB)
    name = f"flood-{os.getpid()}"
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.02)

    with Channel.create(name, n_readers=1, capacity_bytes=256 * MIB,
                        max_object_bytes=2 * nbytes + MIB, inline_threshold=1024) as writer:
        publisher = Publisher(name, 0, "tcp://127.0.0.1:*",
                              security=PublisherSecurity(plaintext=True), window=args.window,
                              timing=Timing(ack_timeout_s=3600, peer_timeout_s=3600),
                              max_nodes=max(args.nodes, 1))
        publisher.start()
        value = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        writer.send(value, key="warm", timeout=10)  # buffers and sockets made once
        time.sleep(0.5)
        base = peak[0] = rss_anon()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ready = mp.get_context("spawn").Event()
        flood = mp.get_context("spawn").Process(
            target=rogues, args=(publisher.endpoint, args.nodes, args.window, args.seconds, ready))
        flood.start()
        ready.wait(60)
        sent, end = 0, time.monotonic() + args.seconds
        while time.monotonic() < end:
            try:
                writer.send(value, key=f"k{sent}", timeout=0.1)
                sent += 1
            except (Timeout, StoreFull):
                pass
        flood.join(60)
        stop.set()
        sampler.join()
        stats = publisher.stats()
        publisher.close()
        writer.end()
    copies = args.window * nbytes  # the body copies the Publisher keeps, shared by every queue
    queues = args.nodes * (2 * args.window + 64) * nbytes  # every node's queue full of distinct copies
    result = {"nodes": args.nodes, "window": args.window, "object_bytes": nbytes,
              "messages_sent": sent, "publisher_messages": stats.messages,
              "nodes_dropped": stats.nodes_dropped, "needs_served": stats.needs_served,
              "bad_messages": stats.bad_messages, "growth_bytes": peak[0] - base,
              "window_copies_bytes": copies, "unshared_queues_bytes": queues}
    print(f"{args.nodes} rogue nodes, window {args.window}, {nbytes / MIB:.1f} MiB objects, "
          f"{args.seconds:.0f} s: {sent} objects sent, {stats.messages} read by the Publisher, "
          f"{stats.needs_served} NEEDs answered, {stats.bad_messages} messages not answered, "
          f"{stats.nodes_dropped} nodes dropped")
    print(f"anonymous memory: peak growth {(peak[0] - base) / MIB:.1f} MiB; window x object "
          f"{copies / MIB:.0f} MiB; if no copy were shared, nodes x (2 x window + 64) x object "
          f"{queues / MIB:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
