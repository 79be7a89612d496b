"""Prometheus metrics for a store, read from `StoreWriter.stats()` at each scrape.

    from shmstore.metrics import register_store_metrics
    unregister = register_store_metrics(writer)        # prometheus_client's default registry
    ...
    unregister()                                       # before writer.close()

Every metric carries a `segment` label (the store's name); per-reader ones also `reader`.

    shmstore_puts_total                 objects stored
    shmstore_hits_total                 hand-outs of cached objects (get_cached)
    shmstore_evictions_total            objects dropped to make room or by clear()
    shmstore_give_backs_total           hand-outs taken back unread
    shmstore_full_events_total          puts that found the oldest object still owed
    shmstore_reinsertions_total         objects copied forward by the policy (all but fifo)
    shmstore_reinserted_bytes_total     ring bytes those copies wrote
    shmstore_damaged_objects_total      objects dropped because shared memory was damaged
    shmstore_withdrawn_total            objects withdrawn while readers still owed reads
    shmstore_dead_readers_total         readers found dead and no longer waited for
    shmstore_inline_fallbacks_total     values sent inline because too large or store full
                                        (only where the caller counts them: the vLLM cache)
    shmstore_vllm_settled_total         hand-outs settled without being read, by reason
                                        (refused, aborted, finished_unread, lease; the vLLM
                                        cache)
    shmstore_bytes_in_use               ring bytes held by live objects
    shmstore_capacity_bytes             ring capacity
    shmstore_objects                    live objects
    shmstore_policy_rule                1 for the eviction rule applied now (label rule: the
                                        policy's name, or the rival `adaptive` follows)
    shmstore_reader_lag                 hand-outs each reader still owes (per reader)
    shmstore_corrupt_reads_total        objects each reader gave up on as damaged (per reader)

With a relay Publisher (`publisher=`; the vLLM cache of a TP group across nodes):

    shmstore_relay_nodes                relays connected now
    shmstore_relay_nodes_dropped_total  relays dropped (silent, too slow, or gone)
    shmstore_relay_lost_total           messages the nodes got as LOST (cleared or damaged)
    shmstore_relay_bytes_sent_total     every frame to every node
    shmstore_relay_unacked              messages a node has not acknowledged (per node)
    shmstore_relay_objects_sent_total   bodies sent to a node (per node)
    shmstore_relay_refs_sent_total      references sent instead of a body (per node)

Needs `prometheus_client` (installed with the `vllm` extra).

May import: errors, handle, _proc, store (a relay Publisher's stats are read by their fields).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .store._object_store import StoreWriter

__all__ = ["register_store_metrics", "register_collector", "mirror_to_multiprocess",
           "StoreCollector"]

_COUNTERS = (
    ("puts", "puts", "Objects stored"),
    ("hits", "hits", "Hand-outs of cached objects"),
    ("evictions", "evictions", "Objects dropped to make room or by clear()"),
    ("give_backs", "give_backs", "Hand-outs taken back unread"),
    ("full_events", "full_events", "Puts that found the oldest object still owed to a reader"),
    ("reinsertions", "reinsertions", "Objects copied forward by the policy (all but fifo)"),
    ("reinserted_bytes", "bytes_reinserted", "Ring bytes written by reinsertions"),
    ("damaged_objects", "damaged_objects", "Objects dropped because shared memory was damaged"),
    ("withdrawn", "withdrawn", "Objects withdrawn while readers still owed reads"),
    ("dead_readers", "dead_readers", "Readers found dead and no longer waited for"),
)
_GAUGES = (
    ("bytes_in_use", "bytes_in_use", "Ring bytes held by live objects"),
    ("capacity_bytes", "capacity_bytes", "Ring capacity in bytes"),
    ("objects", "objects", "Live objects"),
)


class StoreCollector:
    """A prometheus_client collector: one stats() snapshot per scrape."""

    def __init__(self, writer: StoreWriter,
                 inline_fallbacks: Callable[[], int] | None = None,
                 publisher: Any = None,
                 settled: Callable[[], Mapping[str, int]] | None = None,
                 lock: AbstractContextManager[Any] | None = None) -> None:
        self._writer = writer
        self._inline_fallbacks = inline_fallbacks
        self._publisher = publisher
        self._settled = settled
        self._lock = nullcontext() if lock is None else lock

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:  # the writer's own thread may be inside a call
            if self._writer.closed:
                return
            stats = self._writer.stats()
            settled = {} if self._settled is None else self._settled()
        segment = [stats.name]
        for name, field, doc in _COUNTERS:
            family = CounterMetricFamily(f"shmstore_{name}", doc, labels=["segment"])
            family.add_metric(segment, getattr(stats, field))
            yield family
        if self._inline_fallbacks is not None:
            family = CounterMetricFamily("shmstore_inline_fallbacks",
                                         "Values sent inline because too large or store full",
                                         labels=["segment"])
            family.add_metric(segment, self._inline_fallbacks())
            yield family
        if self._settled is not None:
            family = CounterMetricFamily("shmstore_vllm_settled",
                                         "Hand-outs settled without being read, by reason",
                                         labels=["segment", "reason"])
            for reason, count in settled.items():
                family.add_metric([*segment, reason], count)
            yield family
        for name, field, doc in _GAUGES:
            gauge = GaugeMetricFamily(f"shmstore_{name}", doc, labels=["segment"])
            gauge.add_metric(segment, getattr(stats, field))
            yield gauge
        gauge = GaugeMetricFamily("shmstore_policy_rule", "1 for the eviction rule applied now",
                                  labels=["segment", "rule"])
        gauge.add_metric([*segment, stats.policy_rule], 1)
        yield gauge
        lag = GaugeMetricFamily("shmstore_reader_lag", "Hand-outs each reader still owes",
                                labels=["segment", "reader"])
        corrupt = CounterMetricFamily("shmstore_corrupt_reads",
                                      "Objects each reader gave up on as damaged",
                                      labels=["segment", "reader"])
        for r in range(stats.n_readers):
            lag.add_metric([stats.name, str(r)], stats.reader_lag[r])
            corrupt.add_metric([stats.name, str(r)], stats.corrupt_reads[r])
        yield lag
        yield corrupt
        if self._publisher is not None:
            yield from _relay_families(self._publisher.stats(), segment)


def _relay_families(stats: Any, segment: list[str]) -> Iterator[Any]:
    """The metrics of a relay Publisher's PublisherStats."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    nodes = GaugeMetricFamily("shmstore_relay_nodes", "Relays connected now", labels=["segment"])
    nodes.add_metric(segment, len(stats.nodes))
    yield nodes
    for name, value, doc in (
            ("nodes_dropped", stats.nodes_dropped, "Relays dropped: silent, too slow, or gone"),
            ("lost", stats.lost, "Messages the nodes got as LOST: cleared or damaged"),
            ("bytes_sent", stats.bytes_sent, "Bytes of every frame to every node")):
        family = CounterMetricFamily(f"shmstore_relay_{name}", doc, labels=["segment"])
        family.add_metric(segment, value)
        yield family
    unacked = GaugeMetricFamily("shmstore_relay_unacked", "Messages a node has not acknowledged",
                                labels=["segment", "node"])
    objects = CounterMetricFamily("shmstore_relay_objects_sent", "Bodies sent to a node",
                                  labels=["segment", "node"])
    refs = CounterMetricFamily("shmstore_relay_refs_sent",
                               "References sent to a node instead of a body",
                               labels=["segment", "node"])
    for node in stats.nodes:
        labels = [*segment, node.name]
        unacked.add_metric(labels, node.unacked)
        objects.add_metric(labels, node.objects_sent)
        refs.add_metric(labels, node.refs_sent)
    yield unacked
    yield objects
    yield refs


class _AllStores:
    """The one collector per registry: every registered store's metrics, one family per name
    with a sample per store (labelled by segment), so several stores never clash."""

    def __init__(self) -> None:
        self.sources: list[Any] = []  # StoreCollector, or any other collect()

    def collect(self) -> Iterator[Any]:
        merged: dict[str, Any] = {}
        for source in list(self.sources):
            for family in source.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


_SHARED: dict[int, tuple[Any, _AllStores]] = {}  # id(registry) -> (registry, its collector)
_SHARED_LOCK = threading.Lock()


def register_store_metrics(writer: StoreWriter, registry: Any = None,
                           inline_fallbacks: Callable[[], int] | None = None,
                           publisher: Any = None,
                           settled: Callable[[], Mapping[str, int]] | None = None,
                           lock: AbstractContextManager[Any] | None = None
                           ) -> Callable[[], None]:
    """Export `writer`'s statistics on `registry` (default: prometheus_client's), and those of
    the relay `publisher` of its channel if given; return a function that removes them again.
    Any number of stores may be registered on one registry (one collector serves them all,
    labelled by segment). `lock`, if given, is held around each scrape's reading of the
    writer (a writer used from another thread takes the same lock)."""
    return register_collector(StoreCollector(writer, inline_fallbacks, publisher, settled, lock),
                              registry)


def register_collector(source: Any, registry: Any = None) -> Callable[[], None]:
    """Serve `source` (anything with collect()) on `registry` (default: prometheus_client's)
    through the one shared collector per registry, so that families of the same name from
    several sources merge instead of clashing; return a function that removes it again."""
    from prometheus_client import REGISTRY

    target = REGISTRY if registry is None else registry
    with _SHARED_LOCK:
        entry = _SHARED.get(id(target))
        if entry is None:
            entry = _SHARED[id(target)] = (target, _AllStores())
            target.register(entry[1])
        entry[1].sources.append(source)

    def unregister() -> None:
        with _SHARED_LOCK:
            found = _SHARED.get(id(target))
            if found is None or source not in found[1].sources:
                return
            found[1].sources.remove(source)
            if not found[1].sources:
                del _SHARED[id(target)]
                try:
                    target.unregister(found[1])
                except KeyError:
                    pass

    return unregister


MIRROR_EVERY_S = 0.5  # how stale a mirrored value may be
MIRRORED = "shmstore_metrics_mirrored"  # copies a mirror has made, labelled by process (pid) and source
_MIRRORS = itertools.count(1)  # each mirror of a process: a source label of its own


def mirror_to_multiprocess(collector: Any, every_s: float = MIRROR_EVERY_S) -> Callable[[], None]:
    """Copy `collector`'s samples into prometheus_client's multiprocess files every `every_s`
    seconds (a daemon thread), for a server whose /metrics reads those files
    (PROMETHEUS_MULTIPROC_DIR: vLLM with several API servers), where a collector registered in
    one process is never asked. Each sample becomes a gauge of the same name and labels (mode
    "mostrecent"). After each copy, `shmstore_metrics_mirrored{process, source}` (process:
    the pid) says how many copies this mirror has made: a reader that wants the values as of
    now waits until it has grown by two (a copy begun after it looked). Return a function
    that stops the thread."""
    from prometheus_client import Gauge

    gauges: dict[tuple[str, tuple[str, ...]], Any] = {}
    stop = threading.Event()
    made = [0]
    copies = Gauge(MIRRORED, "copies of these values a mirror made (one each MIRROR_EVERY_S)",
                   ["process", "source"], registry=None, multiprocess_mode="mostrecent")
    copies = copies.labels(process=str(os.getpid()),
                           source=f"{type(collector).__name__}-{next(_MIRRORS)}")

    def copy() -> None:
        for family in collector.collect():
            for sample in family.samples:
                labels = tuple(sorted(sample.labels))
                gauge = gauges.get((sample.name, labels))
                if gauge is None:
                    gauge = gauges[(sample.name, labels)] = Gauge(
                        sample.name, family.documentation, labels, registry=None,
                        multiprocess_mode="mostrecent")
                (gauge.labels(**sample.labels) if labels else gauge).set(sample.value)
        made[0] += 1
        copies.set(made[0])  # mostrecent has no inc

    def run() -> None:
        while not stop.wait(every_s):
            try:
                copy()
            except Exception as exc:  # a scrape must never kill the server; say why, go on
                import logging

                logging.getLogger("shmstore").warning("shmstore: metrics mirror: %s", exc)

    copy()
    threading.Thread(target=run, name="shmstore-metrics-mirror", daemon=True).start()
    return stop.set
