"""The router's Prometheus metrics: request and upstream-error counters, and worker gauges read
from the pools at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.server.router.workers import WorkerPool


class RouterMetrics:
    def __init__(self, pools: Callable[[], Iterable[WorkerPool]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvfence_router_requests",
            "Client requests by route and HTTP status sent.",
            ["path", "status"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvfence_router_upstream_errors",
            "Failures talking to a worker, by kind.",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvfence_router_retries",
            "Requests re-sent to another decode after a connect error.",
            registry=r,
        )
        r.register(_WorkerCollector(pools))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _WorkerCollector(Collector):
    """Reads the pools at scrape time, so the gauges are never stale."""

    def __init__(self, pools: Callable[[], Iterable[WorkerPool]]) -> None:
        self._pools = pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "kvfence_router_workers_healthy", "Workers in rotation, by role.", labels=["role"]
        )
        in_flight = GaugeMetricFamily(
            "kvfence_router_worker_in_flight",
            "Requests the router has open on a worker.",
            labels=["worker", "role"],
        )
        for pool in self._pools():
            healthy.add_metric([pool.role.value], float(pool.healthy_count()))
            for w in pool.workers:
                in_flight.add_metric([w.url, pool.role.value], float(w.in_flight))
        yield healthy
        yield in_flight
