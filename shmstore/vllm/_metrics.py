"""The plugin's shmstore_* metrics for vLLM's /metrics: each API server's own counters (items by
outcome, work skipped, records refused, hand-outs settled, the miss pool's items and state),
and the store's, from the API server that writes it (metrics.py StoreCollector). With several
API servers vLLM serves /metrics from prometheus_client's multiprocess files: the values are
mirrored into them. prometheus_client is imported only when metrics are exported."""

from __future__ import annotations

import logging
from typing import Any

from ..serving._outcome import PoolStats
from ._env import LOG_NAME

__all__ = ["export_metrics"]

log = logging.getLogger(LOG_NAME)


class _SenderCollector:
    """One API server's own counters (prometheus_client collector), labelled by segment and
    api_server: items by outcome, inline fallbacks, hand-outs settled unread by reason."""

    def __init__(self, sender: Any) -> None:
        self._sender = sender

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        sender = self._sender
        labels = [sender.deployment.name, str(sender.deployment.api_rank)]
        with sender.ledger.lock:
            items, settled = dict(sender.items), dict(sender.ledger.settled)
            skipped, refused = dict(sender.accel.skipped), dict(sender.accel.refused)
        for name, doc, label, values in (
                ("shmstore_vllm_items", "Items by outcome: hit (stored, prompt updates here), "
                 "pooled (new, stored by the node's miss pool for this request), shared "
                 "(processed here, stored already: no second copy), stored, inline",
                 "outcome", items),
                ("shmstore_vllm_skipped", "Work this API server skipped: decode (an image "
                 "never decoded: a hit), processor (a hit on an item another API server "
                 "processed: its prompt-update record used, no HF processor run here)",
                 "what", skipped),
                ("shmstore_vllm_records_refused", "Prompt-update records not used (the "
                 "processor ran), by reason: missing, version, fingerprint, damaged",
                 "reason", refused),
                ("shmstore_vllm_settled", "Hand-outs settled without being read, by reason",
                 "reason", settled)):
            family = CounterMetricFamily(name, doc, labels=["segment", "api_server", label])
            for key, count in values.items():
                family.add_metric([*labels, key], count)
            yield family
        if sender.pool is not None:
            yield from _pool_families(sender.pool.snapshot(), sender.pool.node.stats(), labels)
        family = CounterMetricFamily("shmstore_inline_fallbacks",
                                     "Values sent inline because too large or store full",
                                     labels=["segment", "api_server"])
        family.add_metric(labels, items["inline"])
        yield family


def _pool_families(counts: dict[str, int], stats: PoolStats | None, labels: list[str]) -> Any:
    """One API server's items sent to the node's miss pool, by outcome; and, from the API
    server that runs the pool, the pool now (serving/_pool.py PoolStats)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    family = CounterMetricFamily(
        "shmstore_vllm_pool_items", "Items this API server sent to the node's miss pool: sent, "
        "stored (by a pool worker), waited (in flight on the node already: single flight), "
        "and each fallback reason (the item processed on the API server, as without the pool)",
        labels=["segment", "api_server", "outcome"])
    for outcome, count in counts.items():
        family.add_metric([*labels, outcome], count)
    yield family
    if stats is None:
        return
    family = CounterMetricFamily(
        "shmstore_vllm_pool_runs", "The node's miss pool: items its workers ran the processor "
        "for (processed) and workers started again after dying (restarts)",
        labels=["segment", "api_server", "what"])
    for what, count in (("processed", stats.processed), ("restarts", stats.restarts)):
        family.add_metric([*labels, what], count)
    yield family
    gauge = GaugeMetricFamily("shmstore_vllm_pool", "The node's miss pool now: workers ready, "
                              "busy, items queued", labels=["segment", "api_server", "what"])
    for what, value in (("ready", stats.ready), ("busy", stats.busy), ("queued", stats.queued)):
        gauge.add_metric([*labels, what], value)
    yield gauge


def export_metrics(sender: Any) -> Any:
    """shmstore_* metrics for vLLM's /metrics: the store's (from the API server that writes
    it) and each API server's own. With several API servers vLLM serves /metrics from
    prometheus_client's multiprocess files: the values are mirrored into them."""
    try:  # vLLM ships prometheus_client; another embedder may not: then no metrics, no error
        import prometheus_client  # noqa: F401  (metrics.py imports it only when it exports)
    except ImportError:
        log.info("shmstore: prometheus_client is not installed: no shmstore_* metrics")
        return lambda: None
    from ..metrics import StoreCollector, mirror_to_multiprocess, register_collector
    sources: list[Any] = [_SenderCollector(sender)]
    local = sender._writers.local
    if local is not None:  # the API server that writes the store reports it
        sources.append(StoreCollector(local, publisher=sender.publisher, lock=sender.ledger.lock))
    if sender.deployment.metrics_multiprocess:
        stops = [mirror_to_multiprocess(source) for source in sources]
    else:
        stops = [register_collector(source) for source in sources]

    def stop() -> None:
        for each in stops:
            each()
    return stop
