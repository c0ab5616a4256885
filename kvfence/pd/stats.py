"""Transfer statistics of a PD worker, rendered into the worker's /metrics at scrape time."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class TransferStats:
    role: str
    counters: dict[str, int] = field(default_factory=dict)
    _bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    _sum: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def inc(self, name: str, by: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + by

    def get(self, name: str) -> int:
        return self.counters.get(name, 0)

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self._bucket_counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def metrics(self, held_pages: int) -> Iterator:
        with self._lock:
            counters = dict(self.counters)
            counts, total = list(self._bucket_counts), self._sum
        for name, value in sorted(counters.items()):
            yield CounterMetricFamily(
                f"kvfence_pd_{name}", f"PD {self.role}: {name.replace('_', ' ')}.", value=value
            )
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "kvfence_pd_transfer_seconds",
            f"PD {self.role}: RESERVE to DONE, per room.",
            buckets=buckets,
            sum_value=total,
        )
        yield GaugeMetricFamily(
            "kvfence_pd_pages_held",
            "Pages held for a transfer or its deferred release.",
            value=held_pages,
        )
