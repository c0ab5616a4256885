"""The router's routing policy (router; `up` hands them to its router): one field of
RoutingConfig each. Each has SGLang's router spelling first (what the router's command line gets)
and a --router-* one that reads clearly among `up`'s worker flags."""

from __future__ import annotations

from kvfence.args.option import Option, field_options
from kvfence.config import ROUTING_POLICIES, RoutingConfig

_routing = field_options(RoutingConfig)

ROUTER_POLICY = _routing(
    ("--policy", "--router-policy"),
    "policy",
    choices=ROUTING_POLICIES,
    help="cache_aware: the prefill and decode holding the longest prefix of the tenant's prompt "
    "(its own prefixes only), unless that worker is too busy; least_loaded; round_robin",
)
CACHE_THRESHOLD = _routing(
    ("--cache-threshold", "--router-cache-threshold"),
    "cache_threshold",
    type=float,
    help="cache_aware: share of the prompt a worker's predicted prefix must cover (0..1)",
)
BALANCE_ABS_THRESHOLD = _routing(
    ("--balance-abs-threshold", "--router-balance-abs-threshold"),
    "balance_abs_threshold",
    type=int,
    help="cache_aware: the prefix's worker is too busy with more than this many requests above "
    "the least-loaded one ...",
)
BALANCE_REL_THRESHOLD = _routing(
    ("--balance-rel-threshold", "--router-balance-rel-threshold"),
    "balance_rel_threshold",
    type=float,
    help="... and more than this many times its load",
)
PREFIX_INDEX_MAX_ENTRIES = _routing(
    ("--prefix-index-max-entries", "--router-prefix-index-max-entries"),
    "prefix_index_max_entries",
    type=int,
    help="cache_aware: prefix chunks (~16 tokens each) the router remembers, all tenants",
)
PREFIX_INDEX_MAX_ENTRIES_PER_TENANT = _routing(
    ("--prefix-index-max-entries-per-tenant", "--router-prefix-index-max-entries-per-tenant"),
    "prefix_index_max_entries_per_tenant",
    type=int,
    help="cache_aware: ... per tenant (one tenant's prompts never push out more than this)",
)
PREFIX_INDEX_TTL = _routing(
    ("--prefix-index-ttl", "--router-prefix-index-ttl"),
    "prefix_index_ttl",
    type=float,
    metavar="SECONDS",
    help="cache_aware: how long a prefix sent to a worker stays predicted there",
)
ROUTING_OPTIONS: tuple[Option, ...] = (
    ROUTER_POLICY,
    CACHE_THRESHOLD,
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    PREFIX_INDEX_MAX_ENTRIES,
    PREFIX_INDEX_MAX_ENTRIES_PER_TENANT,
    PREFIX_INDEX_TTL,
)
