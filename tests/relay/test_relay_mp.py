"""The relay across processes on localhost: a writer, a `shmstore relay serve` process, two
`shmstore relay connect` processes (simulated nodes, each with its own channel) behind TCP
forwarders that count the bytes and can cut the connection, and reader processes on every node.

Every reader checks every value (checksum and the bytes themselves) and the order against the
writer's plan; the forwarders prove that each object crosses to a node once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmstore import Channel, dumps
from tests._waiting import wait_for
from tests.conftest import new_name
from tests.relay._tcp_proxy import TcpProxy

from . import relay_workers

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.serving]
SPAWN = multiprocessing.get_context("spawn")
FAST = ["--peer-timeout", "1", "--heartbeat", "0.1", "--insecure"]


def make_plan(n: int, n_keys: int, seed: int) -> list[int | None]:
    """n messages: about 30% inline (None), the rest keys with a skewed reuse."""
    rng = random.Random(seed)
    return [None if rng.random() < 0.3 else int(rng.paretovariate(1.2)) % n_keys
            for _ in range(n)]


def expected(plan: list[int | None]) -> list[list[Any]]:
    return [["i", i] if key is None else ["k", key] for i, key in enumerate(plan)]


class Cluster:
    """Processes and forwarders of one test; close() stops whatever is left."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.spawned: list[Any] = []
        self.proxies: list[TcpProxy] = []
        self.logs: dict[str, Path] = {}
        self.names: list[str] = []

    def cli(self, tag: str, *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{tag}.log"
        self.logs[tag] = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "shmstore", "relay", *args],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def log(self, tag: str) -> str:
        return self.logs[tag].read_text(errors="replace")

    def publisher(self, channel: str, reader: int) -> int:
        """Start `relay serve`; return its port."""
        self.cli("publisher", "serve", channel, "--reader", str(reader), "--bind",
                 "tcp://127.0.0.1:*", *FAST)
        wait_for(lambda: "publishing channel" in self.log("publisher"), 60, "the publisher")
        line = next(x for x in self.log("publisher").splitlines() if "publishing" in x)
        return int(line.rsplit(":", 1)[1])

    def node(self, tag: str, port: int, n_readers: int, name: str | None = None
             ) -> tuple[subprocess.Popen[bytes], list[str]]:
        """A relay behind a forwarder to `port`, with reader processes; wait until it joined."""
        proxy = TcpProxy(port)
        self.proxies.append(proxy)
        name = name or new_name(tag)
        self.names.append(name)
        proc = self.cli(tag, "connect", f"tcp://127.0.0.1:{proxy.port}", "--name", name,
                        "--readers", str(n_readers), "--capacity", "64MiB", *FAST)
        wait_for(lambda: "waiting for" in self.log(tag), 60, f"relay {tag}")
        outs = [self.reader(name, i, f"{tag}-r{i}") for i in range(n_readers)]
        wait_for(lambda: "joined" in self.log(tag), 60, f"relay {tag} to join")
        return proc, outs

    def reader(self, channel: str, index: int, tag: str) -> str:
        out = str(self.tmp / f"{tag}.json")
        proc = SPAWN.Process(target=relay_workers.reader, args=(channel, index, out, 60.0))
        proc.start()
        self.spawned.append(proc)
        wait_for(lambda: os.path.exists(out + ".ready"), 60, f"reader {tag}")
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sp in self.spawned:
            sp.join(30)
            if sp.is_alive():
                sp.kill()
                sp.join()
        for proxy in self.proxies:
            proxy.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def result(path: str, timeout: float = 120) -> dict[str, Any]:
    wait_for(lambda: os.path.exists(path), timeout, f"{path}")  # renamed into place whole
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def send(writer: Any, plan: list[int | None], start: int = 0, stop: int | None = None) -> None:
    for i in range(start, len(plan) if stop is None else stop):
        key = plan[i]
        writer.send(relay_workers.value_for(i, key), key=None if key is None else f"img-{key}",
                    timeout=60)


def test_every_reader_on_every_node_gets_every_value_each_object_crossing_once(
        cluster: Cluster) -> None:
    plan = make_plan(2000, 80, seed=1)
    name = new_name("mp")
    with Channel.create(name, n_readers=2, capacity_bytes=64 << 20) as writer:
        local = cluster.reader(name, 0, "local")
        port = cluster.publisher(name, 1)
        writer.wait_for_readers(60)
        _, outs_b = cluster.node("nodeB", port, 2)
        _, outs_c = cluster.node("nodeC", port, 1)
        send(writer, plan)
        writer.end()
        want = expected(plan)
        for out in [local, *outs_b, *outs_c]:
            got = result(out)
            tag = Path(out).name.split("-r")[0]  # nodeB-r0.json: relay nodeB's log
            why = (out, len(got["received"]), len(want),
                   cluster.log(tag)[-3000:] if tag != "local.json" else "")
            assert got["bad"] == 0 and got["how"] == "closed", why
            assert got["received"] == want, why
    # on the wire to each node: each distinct object's body once, every inline value, and at
    # most 48 bytes of header per message (a REF is 33) plus handshake and PINGs; that slack
    # (116 kB here) is less than the smallest object (150 kB), so a second copy would not fit
    keys = {k for k in plan if k is not None}
    bodies = sum(len(dumps(relay_workers.value_for(0, k))) for k in keys)
    inline = sum(len(dumps(relay_workers.value_for(i, None))) for i, k in enumerate(plan)
                 if k is None)
    for proxy in cluster.proxies:
        assert bodies + inline <= proxy.down_bytes <= bodies + inline + 48 * len(plan) + 20_000
    for tag in ("nodeB", "nodeC"):
        wait_for(lambda t=tag: "relay stopped: end" in cluster.log(t), 30, f"{tag} to stop")
    wait_for(lambda: "publisher stopped: end" in cluster.log("publisher"), 30, "publisher")


def test_relay_killed_and_restarted_and_a_connection_cut_mid_stream(cluster: Cluster) -> None:
    plan = make_plan(1500, 60, seed=2)
    want = expected(plan)
    name = new_name("chaos")
    with Channel.create(name, n_readers=2, capacity_bytes=64 << 20) as writer:
        local = cluster.reader(name, 0, "local")
        port = cluster.publisher(name, 1)
        writer.wait_for_readers(60)
        proc_b, outs_b = cluster.node("nodeB", port, 2)
        _, outs_c = cluster.node("nodeC", port, 1)
        proxy_c = cluster.proxies[1]
        send(writer, plan, 0, 400)
        proc_b.kill()  # SIGKILL: its readers see their writer (the relay) die
        proc_b.wait()  # reaped: a zombie would still look alive
        for out in outs_b:
            got = result(out)
            assert got["how"] == "gone" and got["bad"] == 0
            assert got["received"] == want[:len(got["received"])]  # a prefix, in order
        send(writer, plan, 400, 600)  # node B is gone: the writer is not held up by it
        # a new relay (and readers) for node B, on the same channel name: it takes the dead
        # relay's segments over, and unlinks them at the end
        _, outs_b2 = cluster.node("nodeB2", port, 2, name=cluster.names[0])
        send(writer, plan, 600, 900)
        proxy_c.cut()
        cut_at = time.monotonic()
        send(writer, plan, 900, 1000)
        time.sleep(max(0.0, 2.5 - (time.monotonic() - cut_at)))  # past the 1 s peer timeout
        proxy_c.restore()
        wait_for(lambda: cluster.log("nodeC").count("joined") >= 2, 60, "node C to rejoin")
        send(writer, plan, 1000)
        writer.end()
        assert result(local)["received"] == want
        for out in outs_b2:  # joined at message 600 or so: every message from then on
            got = result(out)
            assert got["how"] == "closed" and got["bad"] == 0
            assert got["received"] == want[len(want) - len(got["received"]):]
            assert len(got["received"]) >= 900
        got = result(outs_c[0])
        assert got["how"] == "closed" and got["bad"] == 0
        received = got["received"]
        head = next((i for i, (a, b) in enumerate(zip(received, want)) if a != b), len(received))
        tail = received[head:]
        # everything before the cut but what was on the wire (at most the 64-message window),
        # then everything from some point after the reconnect, in order
        assert head >= 900 - 64 and tail == want[len(want) - len(tail):]
        assert len(tail) >= 500
    assert "reconnecting" in cluster.log("nodeC")


def test_writer_killed_is_writer_gone_on_remote_readers(cluster: Cluster) -> None:
    plan = make_plan(100, 10, seed=3)
    name = new_name("dead")
    tmp = cluster.tmp
    ready, start, done = (str(tmp / f) for f in ("w.ready", "w.start", "w.done"))
    writer = SPAWN.Process(target=relay_workers.writer, args=(name, 1, plan, ready, start, done))
    writer.start()
    try:
        wait_for(lambda: os.path.exists(f"/dev/shm/{name}.queue"), 60, "the writer")
        port = cluster.publisher(name, 0)
        wait_for(lambda: os.path.exists(ready), 60, "the publisher to attach")
        _, outs = cluster.node("nodeB", port, 1)
        Path(start).touch()
        wait_for(lambda: os.path.exists(done), 60, "the writer to send")
        os.kill(writer.pid or 0, signal.SIGKILL)
        writer.join(10)  # reaped: a zombie would still look alive
        got = result(outs[0])
        assert got["how"] == "gone" and got["bad"] == 0
        assert got["received"] == expected(plan)
        wait_for(lambda: "publisher stopped: gone" in cluster.log("publisher"), 30, "publisher")
        wait_for(lambda: "relay stopped: gone" in cluster.log("nodeB"), 30, "relay")
    finally:
        writer.kill()
        writer.join()
        # take over the dead writer's names, unlink
        Channel.create(name, n_readers=1, capacity_bytes=1 << 20).close()
