"""Prometheus metrics of one HTTP app (own registry: counters, latencies, pool gauges) and the
per-request record + middleware that feeds them and writes the one log line per request."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.server.request_id import client_request_id

if TYPE_CHECKING:
    from kvfence.faults import Faults
    from kvfence.role import RoleService

logger = logging.getLogger("kvfence.server")

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class _PoolCollector(Collector):
    """Reads the role's stats() and metrics() at scrape time, so the gauges are never stale."""

    def __init__(self, engine: RoleService) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        # Registration must not call into the engine (it may not be started yet).
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._engine.stats()
        except Exception:  # a dead engine must not break the scrape; /health reports it
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        for name, doc, value in (
            ("kvfence_pool_pages_total", "KV pool pages in total.", s.pages_total),
            ("kvfence_pool_pages_used", "KV pool pages a request holds.", s.pages_used),
            ("kvfence_pool_pages_free", "KV pool pages free or only cached.", s.pages_free),
            ("kvfence_pool_page_size_tokens", "Tokens per KV page.", s.page_size),
            ("kvfence_pool_tokens", "KV pool capacity in tokens.", s.pool_tokens),
            ("kvfence_requests_running", "Requests the scheduler is running.", s.running),
            ("kvfence_requests_waiting", "Requests admitted and waiting.", s.waiting),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))
        yield from self._engine.metrics()
        yield CounterMetricFamily(
            "kvfence_kv_integrity_errors",
            "Requests failed closed by the KV page ownership check (I2).",
            value=s.integrity_failures,
        )
        yield from _prefix_cache_metrics(s)
        yield CounterMetricFamily(
            "kvfence_preemptions", "Sequences preempted for pages.", value=float(s.preemptions)
        )


def _prefix_cache_metrics(s: Any) -> Iterator[Metric]:
    """Node-wide prefix cache figures. No tenant label, on purpose: a per-tenant hit count is
    another tenant's hit state for whoever reads it."""
    pc = getattr(s, "prefix_cache", None)
    if pc is None:
        return
    yield CounterMetricFamily(
        "kvfence_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        value=float(pc.queries),
    )
    yield CounterMetricFamily(
        "kvfence_prefix_cache_hits",
        "Prompt tokens whose KV came from the prefix cache.",
        value=float(pc.hits),
    )
    yield GaugeMetricFamily(
        "kvfence_prefix_cache_hit_rate",
        "Prefix cache hits / queries since start (tokens).",
        value=pc.hits / pc.queries if pc.queries else 0.0,
    )
    yield GaugeMetricFamily(
        "kvfence_prefix_cache_pages", "KV pages held by the prefix cache.", value=float(pc.pages)
    )
    yield GaugeMetricFamily(
        "kvfence_prefix_cache_evictable_pages",
        "Prefix cache pages no request references (evicted first when pages are needed).",
        value=float(pc.evictable),
    )
    yield CounterMetricFamily(
        "kvfence_prefix_cache_evictions",
        "Prefix cache pages evicted (for space or by the ttl).",
        value=float(pc.evictions),
    )
    yield GaugeMetricFamily(
        "kvfence_prefix_cache_holders",
        "Requests holding references to prefix cache pages (0 at rest).",
        value=float(pc.holders),
    )
    yield GaugeMetricFamily(
        "kvfence_prefix_cache_references",
        "References to prefix cache pages over all pages (0 at rest).",
        value=float(pc.references),
    )


class _FaultCollector(Collector):
    """How often each armed fault point fired in this process: nothing unless a test harness
    armed points (KVFENCE_FAULT_INJECTION=1), so a production scrape never shows the family."""

    def __init__(self, faults: Faults) -> None:
        self._faults = faults

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if not self._faults.armed:
            return
        fam = CounterMetricFamily(
            "kvfence_fault_fires", "Times an armed fault point fired.", labels=["point"]
        )
        for point in sorted(self._faults.armed):
            fam.add_metric([point], float(self._faults.fired[point]))
        yield fam


class ServerMetrics:
    def __init__(self, engine: RoleService, faults: Faults | None = None) -> None:
        # A registry per app: several apps in one process (tests, router + node) must not clash.
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvfence_requests",
            "API requests by tenant and HTTP status.",
            ["tenant", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvfence_prompt_tokens", "Prompt tokens admitted, by tenant.", ["tenant"], registry=r
        )
        self.completion_tokens = Counter(
            "kvfence_completion_tokens",
            "Completion tokens generated, by tenant.",
            ["tenant"],
            registry=r,
        )
        self.rejections = Counter(
            "kvfence_rejections", "Requests refused, by reason code.", ["reason"], registry=r
        )
        self.finishes = Counter(
            "kvfence_request_finish",
            "Generations ended, by finish reason.",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvfence_e2e_request_latency_seconds",
            "Arrival to last byte of a generation.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvfence_inter_token_latency_seconds",
            "Gap between successive output increments.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        r.register(_PoolCollector(engine))
        if faults is not None:
            r.register(_FaultCollector(faults))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass
class RequestRecord:
    """One API request's facts, filled in by the handler, counted and logged once at the end."""

    start: float = field(default_factory=time.monotonic)
    tenant: str = "-"  # "-": not authenticated (yet)
    request_id: str = "-"
    n_generations: int = 0
    status: int = 500
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str = "-"
    error_code: str | None = None


class RequestRecorder:
    """Pure ASGI middleware (streams stay streams): one counter update and one log line per API
    request, after its last byte, so streamed requests report their real outcome."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        rec = RequestRecord()
        scope["kvfence.record"] = rec

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self._finish(scope, rec)

    def _finish(self, scope: Scope, rec: RequestRecord) -> None:
        m = self.metrics
        m.requests.labels(tenant=rec.tenant, status=str(rec.status)).inc()
        if rec.prompt_tokens:
            m.prompt_tokens.labels(tenant=rec.tenant).inc(rec.prompt_tokens)
        if rec.completion_tokens:
            m.completion_tokens.labels(tenant=rec.tenant).inc(rec.completion_tokens)
        if rec.error_code is not None and 400 <= rec.status < 500:
            m.rejections.labels(reason=rec.error_code).inc()
        logger.info(
            "%s %s tenant=%s request_id=%s client_request_id=%s generations=%d status=%d "
            "prompt_tokens=%d completion_tokens=%d finish=%s error=%s duration_s=%.4f",
            scope.get("method", "-"),
            scope["path"],
            rec.tenant,
            rec.request_id,
            client_request_id(scope),
            rec.n_generations,
            rec.status,
            rec.prompt_tokens,
            rec.completion_tokens,
            rec.finish,
            rec.error_code or "-",
            time.monotonic() - rec.start,
        )


def _is_api_path(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
