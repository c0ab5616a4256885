"""The routing policy: which decode and which prefill get a request (`--policy`).

cache_aware (default): the worker the router predicts holds the longest prefix of the prompt in
the requesting tenant's namespace (its PrefixIndex table only: which worker answers, and how
fast, is observable, so another tenant's prompts must never move a decision), unless that
worker is too busy (SGLang's two imbalance thresholds), else the least loaded.
least_loaded: the fewest requests open, ties in turn. round_robin: in turn, load ignored.
Also the decision metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.config import RoutingConfig
from kvfence.faults import Faults
from kvfence.kv.prefix import Namespace
from kvfence.server.router.prefix_index import CHUNK_TOKENS, PrefixIndex, PrefixKey, PublicPrefixes
from kvfence.server.router.prompt import read_prompt
from kvfence.server.router.workers import Role, Worker, WorkerPool

# The fault point's namespace: every tenant's prompts in one table (what "ignore tenant" means).
_EVERYONE = Namespace.of_tenant("")


class Reason(StrEnum):
    CACHE_HIT = "cache_hit"  # sent where the tenant's prefix is predicted
    LOAD = "load"  # a prefix is predicted, but on a worker too busy: the least loaded instead
    FALLBACK = "fallback"  # no prefix predicted (or a policy that predicts none)


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: Reason
    predicted_tokens: int  # of the prompt, predicted cached on `worker` for this tenant


@dataclass(frozen=True)
class Pair:
    decode: Decision
    prefill: Decision


def too_busy(load: int, least: int, config: RoutingConfig) -> bool:
    """SGLang's imbalance test, applied to the worker holding the prefix: both thresholds."""
    return (
        load - least > config.balance_abs_threshold and load > config.balance_rel_threshold * least
    )


def prefix_owner(
    candidates: Sequence[Worker],
    matched: Mapping[str, int],
    key: PrefixKey,
    config: RoutingConfig,
) -> tuple[Worker | None, Reason]:
    """Pure: of `candidates`, the one whose predicted prefix (`matched`: chunks per worker url,
    from the requesting tenant's entries only) is longest and covers at least the cache
    threshold, unless it is too busy (then the next such one); ties to the less loaded.
    None: no owner, or every owner too busy (the caller takes the least loaded)."""
    least = min(w.in_flight for w in candidates)
    owners = [
        w
        for w in candidates
        if matched.get(w.url, 0) > 0 and key.share(matched[w.url]) >= config.cache_threshold
    ]
    if not owners:
        return None, Reason.FALLBACK
    owners.sort(key=lambda w: (-matched[w.url], w.in_flight))  # stable: pool order breaks ties
    for w in owners:
        if not too_busy(w.in_flight, least, config):
            return w, Reason.CACHE_HIT
    return None, Reason.LOAD


class Routing:
    """Picks a (decode, prefill) pair per request and remembers, per tenant, what went where.
    Only the event loop calls it, so no locks."""

    def __init__(
        self,
        prefill: WorkerPool,
        decode: WorkerPool,
        config: RoutingConfig,
        faults: Faults,
        registry: CollectorRegistry,
        shared_prefixes: Iterable[str | Sequence[int]] = (),
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.config = config
        self._faults = faults
        self.index = PrefixIndex(
            config.prefix_index_max_entries,
            config.prefix_index_max_entries_per_tenant,
            config.prefix_index_ttl,
            public=PublicPrefixes(shared_prefixes),
        )
        self._turn = {Role.PREFILL: 0, Role.DECODE: 0}
        self.metrics = RoutingMetrics(registry, self)

    @property
    def cache_aware(self) -> bool:
        return self.config.policy == "cache_aware"

    def key(self, tenant: str, path: str, body: bytes) -> PrefixKey | None:
        """The request's prefix in its tenant's namespace (`tenant`: from the credential, I6;
        the body's cache_salt narrows it). None when the policy does not look at prompts or
        the body has none it can read."""
        if not self.cache_aware:
            return None
        prompt = read_prompt(path, body)
        if prompt is None:
            return None
        if self._faults.guards().on("router_tenant"):
            namespace = Namespace.of_tenant(tenant, prompt.cache_salt)
        else:
            namespace = _EVERYONE
        return self.index.key(namespace, prompt)

    def pick_pair(self, key: PrefixKey | None, exclude: Sequence[Worker] = ()) -> Pair | None:
        """A decode (not in `exclude`) and a prefill it can pair with, or None."""
        decode = self._pick(self.decode, key, exclude, None)
        if decode is None:
            return None
        prefill = self._pick(self.prefill, key, (), decode.worker)
        if prefill is None:
            return None
        for d in (decode, prefill):
            self.metrics.decided(d, key)
            if key is not None:
                self.index.insert(key, d.worker.url)
        return Pair(decode, prefill)

    def _pick(
        self,
        pool: WorkerPool,
        key: PrefixKey | None,
        exclude: Sequence[Worker],
        partner: Worker | None,
    ) -> Decision | None:
        candidates = pool.candidates(exclude, partner)
        if not candidates:
            return None
        if self.config.policy == "round_robin":
            worker = candidates[self._turn[pool.role] % len(candidates)]
            self._turn[pool.role] += 1
            return Decision(worker, Reason.FALLBACK, 0)
        if key is None:
            least = pool.least_loaded(candidates)
            assert least is not None
            return Decision(least, Reason.FALLBACK, 0)
        matched = self.index.match(key, (w.url for w in candidates))
        owner, reason = prefix_owner(candidates, matched, key, self.config)
        worker = owner or pool.least_loaded(candidates)
        assert worker is not None
        return Decision(worker, reason, matched[worker.url] * CHUNK_TOKENS)


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry, routing: Routing) -> None:
        self._policy = routing.config.policy
        self.decisions = Counter(
            "kvfence_router_decisions",
            "Worker picks by role and reason: cache_hit (sent where the tenant's prefix is "
            "predicted), load (that worker was too busy: the least loaded instead), fallback "
            "(no prefix predicted, or a policy that predicts none).",
            ["policy", "role", "reason"],
            registry=registry,
        )
        self.predicted_hit_tokens = Counter(
            "kvfence_router_predicted_hit_tokens",
            "Prompt tokens predicted cached on the worker picked (chunks of 16 tokens; text "
            "counted at 4 characters a token).",
            ["worker", "role"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvfence_router_routed_prompt_tokens",
            "Prompt tokens (estimated as above) of the requests a cache-aware pick placed; "
            "predicted_hit_tokens over this is the predicted hit rate.",
            ["worker", "role"],
            registry=registry,
        )
        registry.register(_IndexCollector(routing.index))

    def decided(self, d: Decision, key: PrefixKey | None) -> None:
        role = d.worker.role.value
        self.decisions.labels(policy=self._policy, role=role, reason=d.reason.value).inc()
        if key is not None:
            self.predicted_hit_tokens.labels(worker=d.worker.url, role=role).inc(d.predicted_tokens)
            self.prompt_tokens.labels(worker=d.worker.url, role=role).inc(key.tokens)


class _IndexCollector(Collector):
    """The index's size, read at scrape time. Never per tenant: /metrics is the operator's, but
    nothing about one tenant's prompts needs to be in it."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvfence_router_prefix_index_entries",
            "Prefix chunks the router remembers (all tenants).",
            value=float(len(self._index)),
        )
        yield CounterMetricFamily(
            "kvfence_router_prefix_index_evictions",
            "Prefix chunks dropped for space (the caps), not counting the ttl.",
            value=float(self._index.evictions),
        )
