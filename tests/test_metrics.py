"""Prometheus export of a store's statistics (shmstore.metrics)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from shmstore.metrics import register_store_metrics  # noqa: E402
from tests._names import ObjectStore  # noqa: E402


def sample(registry: object, name: str, **labels: str) -> float | None:
    return prometheus_client.CollectorRegistry.get_sample_value(registry, name, labels)  # type: ignore[arg-type]


def test_every_statistic_is_exported_and_follows_the_store(name: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    with ObjectStore.create(name, capacity_bytes=256 << 10, n_readers=2) as w, \
            ObjectStore.attach(name, 0) as r0, ObjectStore.attach(name, 1) as r1:
        unregister = register_store_metrics(w, registry, inline_fallbacks=lambda: 7)
        for i in range(12):  # 40 KB each through 256 KiB: evictions
            h = w.put(f"k{i}", np.full(40_000, i, np.uint8))
            r0.get(h)
            if i < 11:
                r1.get(h)
        w.get_cached("k11")
        assert sample(registry, "shmstore_puts_total", segment=name) == 12
        assert sample(registry, "shmstore_hits_total", segment=name) == 1
        assert sample(registry, "shmstore_evictions_total", segment=name) >= 6
        assert sample(registry, "shmstore_inline_fallbacks_total", segment=name) == 7
        assert sample(registry, "shmstore_capacity_bytes", segment=name) == w.capacity_bytes
        assert sample(registry, "shmstore_objects", segment=name) == len(w)
        assert sample(registry, "shmstore_bytes_in_use", segment=name) == w.stats().bytes_in_use
        assert sample(registry, "shmstore_reader_lag", segment=name, reader="0") == 1
        assert sample(registry, "shmstore_reader_lag", segment=name, reader="1") == 2
        assert sample(registry, "shmstore_corrupt_reads_total", segment=name, reader="1") == 0
        assert sample(registry, "shmstore_policy_rule", segment=name, rule="fifo") == 1
        unregister()
        assert sample(registry, "shmstore_puts_total", segment=name) is None
        unregister()  # twice is fine


def test_a_relay_publishers_statistics_are_exported_per_node(name: str) -> None:
    from shmstore import Channel
    from shmstore.relay import (
        NodeChannel,
        Publisher,
        PublisherSecurity,
        Relay,
        RelaySecurity,
        Timing,
    )

    registry = prometheus_client.CollectorRegistry()
    fast = Timing(peer_timeout_s=1.0, heartbeat_s=0.1)
    writer = Channel.create(name, n_readers=1, capacity_bytes=4 << 20)
    publisher = Publisher(name, 0, "tcp://127.0.0.1:*", security=PublisherSecurity(plaintext=True),
                          timing=fast)
    relay = Relay(publisher.endpoint, f"{name}-n", n_readers=1, node="node1", timing=fast,
                  security=RelaySecurity(plaintext=True),
                  channel=NodeChannel(capacity_bytes=4 << 20))
    reader = Channel.attach(f"{name}-n", 0)
    try:
        unregister = register_store_metrics(writer.store, registry, publisher=publisher)
        assert sample(registry, "shmstore_relay_nodes", segment=f"{name}.store") == 0
        publisher.start()
        relay.start()
        publisher.wait_for_nodes(1, 10)
        writer.wait_for_readers(10)
        for _ in range(2):  # a body, then a reference
            writer.send({"x": np.arange(100_000, dtype=np.uint8)}, key="k", timeout=10)
            reader.recv(timeout=10)
        node = {"segment": f"{name}.store", "node": "node1"}
        stats = publisher.stats()
        assert sample(registry, "shmstore_relay_nodes", segment=f"{name}.store") == 1
        assert sample(registry, "shmstore_relay_objects_sent_total", **node) == 1
        assert sample(registry, "shmstore_relay_refs_sent_total", **node) == 1
        sent = sample(registry, "shmstore_relay_bytes_sent_total", segment=f"{name}.store")
        assert stats.bytes_sent <= sent <= publisher.stats().bytes_sent  # PINGs go on meanwhile
        assert sent > 100_000
        # an ACK may arrive between two reads: the scrape lies between the snapshots around it
        unacked = sample(registry, "shmstore_relay_unacked", **node)
        assert stats.nodes[0].unacked >= unacked >= publisher.stats().nodes[0].unacked
        assert sample(registry, "shmstore_relay_lost_total", segment=f"{name}.store") == 0
        unregister()
    finally:
        reader.close()
        relay.close()
        publisher.close()
        writer.close()


def test_several_stores_share_one_registry_each_by_segment(name: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    with ObjectStore.create(name + "-a", capacity_bytes=1 << 20, n_readers=1) as a, \
            ObjectStore.create(name + "-b", capacity_bytes=1 << 20, n_readers=1) as b:
        off_a = register_store_metrics(a, registry)
        off_b = register_store_metrics(b, registry)  # no DuplicateTimeseries
        a.put("k", b"x")
        text = generate_latest(registry).decode()
        assert f'shmstore_puts_total{{segment="{name}-a"}} 1.0' in text
        assert f'shmstore_puts_total{{segment="{name}-b"}} 0.0' in text
        off_a()
        text = generate_latest(registry).decode()
        assert f'segment="{name}-a"' not in text and f'segment="{name}-b"' in text
        off_b()
        assert "shmstore_" not in generate_latest(registry).decode()
        off_b()  # twice is fine


@pytest.mark.slow
def test_a_scrape_thread_reads_stats_while_the_writer_puts(name: str) -> None:
    import threading

    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    errors: list[BaseException] = []
    stop = threading.Event()
    with ObjectStore.create(name, capacity_bytes=1 << 20, n_readers=1, max_object_bytes=64 << 10) as w:
        reader = ObjectStore.attach(name, 0)
        off = register_store_metrics(w, registry)

        def scrape() -> None:
            while not stop.is_set():
                try:
                    generate_latest(registry)
                    w.stats()
                except BaseException as exc:
                    errors.append(exc)

        thread = threading.Thread(target=scrape)
        thread.start()
        try:
            end = time.monotonic() + 2.0
            i = 0
            while time.monotonic() < end:  # puts that evict: the ring's deque changes
                reader.get(w.put(f"k{i}", b"x" * (i % 7 * 4096 + 100)))
                i += 1
        finally:
            stop.set()
            thread.join(10)
            off()
            reader.close()
    assert not errors, errors[:3]


@pytest.mark.slow
def test_the_rule_adaptive_follows_is_in_stats_and_metrics_as_it_changes(name: str) -> None:
    """A store whose objects are used a few times and then never again (recency's case), then
    a few hot objects among one-time ones (freq's): the rule shown follows, scrape by scrape."""
    registry = prometheus_client.CollectorRegistry()
    value = np.zeros(1000, np.uint8)
    with ObjectStore.create(name, capacity_bytes=11 * 1300, n_readers=0, policy="adaptive") as w:
        unregister = register_store_metrics(w, registry)
        assert w.stats().policy_rule == "freq"  # before any evidence: freq
        keys = [f"s{j}" for j in range(10)]
        for turn in range(1200):
            for j in range(10):
                if w.is_cached(keys[j]):
                    w.get_cached(keys[j])
                else:
                    w.put(keys[j], value)
                if turn % 3 == 2:
                    keys[j] = f"s{turn}-{j}"
        assert w.stats().policy_rule == "recency"
        assert sample(registry, "shmstore_policy_rule", segment=name, rule="recency") == 1
        assert sample(registry, "shmstore_policy_rule", segment=name, rule="freq") is None
        for i in range(3600):  # 18,000 requests: the decayed scores forget recency's lead
            for key in [f"hot{i % 3}"] + [f"once{i}-{j}" for j in range(4)]:
                if w.is_cached(key):
                    w.get_cached(key)
                else:
                    w.put(key, value)
        assert w.stats().policy_rule == "freq" and w.stats().policy == "adaptive"
        assert sample(registry, "shmstore_policy_rule", segment=name, rule="freq") == 1
        unregister()


MIRROR_CODE = """
import os, time
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.core import GaugeMetricFamily
from shmstore.metrics import MIRRORED, mirror_to_multiprocess

value = [1.0]

class Source:
    def collect(self):
        family = GaugeMetricFamily("t_value", "t", labels=["segment"])
        family.add_metric(["s"], value[0])
        yield family

def read():
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}

def copies(source):
    key = (MIRRORED, (("process", str(os.getpid())), ("source", source)))
    return read().get(key, 0)

stops = [mirror_to_multiprocess(Source(), every_s=0.05) for _ in range(2)]
sources = sorted(dict(labels)["source"] for name, labels in read() if name == MIRRORED)
assert len(sources) == 2 and all(s.startswith("Source-") for s in sources), sources
assert all(copies(s) >= 1 for s in sources)
for new in (2.0, 3.0, 4.0):  # each: the reader waits for two more copies, then sees it
    value[0] = new
    looked = {s: copies(s) for s in sources}
    deadline = time.monotonic() + 60
    while any(copies(s) < looked[s] + 2 for s in sources):
        assert time.monotonic() < deadline, "the mirror stopped copying"
        time.sleep(0.01)
    assert read()[("t_value", (("segment", "s"),))] == new
for stop in stops:
    stop()
print("ok")
"""


def test_a_mirror_counts_its_copies_so_a_reader_can_wait_for_values_as_of_now(
        tmp_path: Path) -> None:
    """Several API servers' /metrics reads prometheus_client's multiprocess files, copied
    twice a second: the count of copies lets a reader wait for what it checks, not a time."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", MIRROR_CODE], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
