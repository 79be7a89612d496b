"""Prometheus export of a store's statistics (shmstore.metrics)."""

from __future__ import annotations

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
        unregister()
        assert sample(registry, "shmstore_puts_total", segment=name) is None
        unregister()  # twice is fine
