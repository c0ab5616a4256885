"""EngineConfig: one frozen, validated configuration per engine node (flags named like SGLang's)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from kvfence import env

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# --attention-backend / --linear-backend. auto: the native CPU kernel (paged decode; packed
# float32 matmuls) when it builds here and fits the model, else torch; native: require it.
KERNEL_BACKENDS = ("auto", "native", "torch")


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    context_length: int | None = None  # None: the model's max_position_embeddings
    page_size: int = 16
    kv_pool_tokens: int | None = None  # wins over mem_fraction_static when set
    mem_fraction_static: float = 0.5
    chunked_prefill_size: int = 512
    # A hard cap on the prefill tokens a step may add while sequences are decoding (None: no cap
    # beyond the step-time budget below and chunked_prefill_size).
    decode_step_prefill_budget: int | None = None
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    max_running_requests: int = 64
    # CPU threads for this engine's kernels (None: torch's default, every core). Workers that
    # share a host's cores each want their own share: `kvfence up` splits them.
    threads: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    # Tests only (needs KVFENCE_FAULT_INJECTION=1): run with a pool smaller than one context,
    # the incident's fault 1, so the other guards can be shown to hold without I7.
    unsafe_skip_preflight: bool = False
    kv_poison_on_free: bool = False  # debug: NaN-fill freed pages so any stale read shows
    # The tenant-scoped prefix cache (kvfence/kv/prefix.py): on unless asked off. Its namespace
    # is the tenant's; the shared-prefix file declares public prefixes every tenant may reuse.
    enable_prefix_caching: bool = True
    shared_prefix_file: str | None = None
    prefix_cache_ttl: float | None = None  # seconds an unused cached page may stay
    # The step-time budget (kvfence/engine/step_budget.py) of a step that also decodes: its
    # target in ms (None: auto, a multiple of the measured decode-only step; 0: no time bound),
    # and the prefill tokens such a step always takes, so prompts progress (TTFT) however
    # tight the target (ITL).
    max_decode_step_ms: float | None = None
    min_prefill_chunk: int = 32
    # ... and at least 1/N of the prompt tokens waiting, so a burst drains in about N steps.
    prefill_backlog_steps: int = 16
    # ... and at least this times the prompt tokens arriving per step (0: no such floor).
    prefill_pace: float = 0.0
    # The auto target's multiple of the decode-only step at WIDE_ROWS decode rows or more (2x at
    # NARROW_ROWS or fewer, linear between): kvfence/engine/step_budget.py says why; 6 measured
    # in benchmarks/RESULTS.md "Session 14" (C=32 TTFT p50 0.33-0.51x vLLM's, ITL p99 0.22-0.29x).
    wide_step_factor: float = 6.0
    # vLLM's --skip-tokenizer-init: no tokenizer is loaded (the model dir may have none); only
    # token-id prompts are served and outputs carry token ids with empty text.
    skip_tokenizer_init: bool = False
    # Running slots one tenant may hold (None: no cap). Admission is fair either way: a free
    # slot goes to the waiting tenant that holds the fewest (kvfence/engine/fairness.py).
    max_running_requests_per_tenant: int | None = None
    # Operator opt-in: control-token text typed in chat content becomes control tokens.
    special_tokens_in_chat: bool = False
    # Tensor parallelism: this many processes per engine (kvfence/engine/tp_group.py), each
    # holding a slice of every layer and of the KV pool; a collective that waits longer than
    # tp_timeout seconds (a stalled rank) fails the engine closed.
    tp_size: int = 1
    tp_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"--device {self.device!r}: expected cpu or cuda[:N]")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r}: "
                f"expected one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.page_size < 1:
            raise ConfigError(f"--page-size {self.page_size}: must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"--context-length {self.context_length}: must be >= 2")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < 1:
            raise ConfigError(f"--kv-pool-tokens {self.kv_pool_tokens}: must be >= 1")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError(
                f"--mem-fraction-static {self.mem_fraction_static}: must be in (0, 1]"
            )
        if self.decode_step_prefill_budget is not None and self.decode_step_prefill_budget < 1:
            raise ConfigError(
                f"--decode-step-prefill-budget {self.decode_step_prefill_budget}: must be >= 1"
            )
        for flag, value in (
            ("--attention-backend", self.attention_backend),
            ("--linear-backend", self.linear_backend),
        ):
            if value not in KERNEL_BACKENDS:
                raise ConfigError(f"{flag} {value!r}: expected one of {', '.join(KERNEL_BACKENDS)}")
            if value == "native" and self.device != "cpu":
                raise ConfigError(f"{flag} native: the native kernel is CPU-only")
        if self.chunked_prefill_size < 1:
            raise ConfigError(f"--chunked-prefill-size {self.chunked_prefill_size}: must be >= 1")
        if self.unsafe_skip_preflight and not env.fault_injection():
            raise ConfigError(f"--unsafe-skip-preflight is for tests: set {env.FAULT_INJECTION}=1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads {self.threads}: must be >= 1")
        if self.prefix_cache_ttl is not None and not self.prefix_cache_ttl > 0:
            raise ConfigError(f"--prefix-cache-ttl {self.prefix_cache_ttl}: must be > 0")
        if self.shared_prefix_file is not None and not self.enable_prefix_caching:
            raise ConfigError("--shared-prefix-file needs --enable-prefix-caching")
        if self.max_decode_step_ms is not None and not self.max_decode_step_ms >= 0:
            raise ConfigError(f"--max-decode-step-ms {self.max_decode_step_ms}: must be >= 0")
        if self.prefill_backlog_steps < 1:
            raise ConfigError(f"--prefill-backlog-steps {self.prefill_backlog_steps}: must be >= 1")
        if not self.prefill_pace >= 0:
            raise ConfigError(f"--prefill-pace {self.prefill_pace}: must be >= 0")
        if not self.wide_step_factor >= 1:
            raise ConfigError(f"--wide-step-factor {self.wide_step_factor}: must be >= 1")
        if self.min_prefill_chunk < 1:
            raise ConfigError(f"--min-prefill-chunk {self.min_prefill_chunk}: must be >= 1")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests {self.max_running_requests}: must be >= 1")
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size {self.tp_size}: must be >= 1")
        if not self.tp_timeout > 0:
            raise ConfigError(f"--tp-timeout {self.tp_timeout}: must be > 0")
        per_tenant = self.max_running_requests_per_tenant
        if per_tenant is not None and per_tenant < 1:
            raise ConfigError(f"--max-running-requests-per-tenant {per_tenant}: must be >= 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From flags parsed with kvfence.args.ENGINE_OPTIONS (one option per field)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


# ---- the router -------------------------------------------------------------------------------

ROUTING_POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    """How the router picks a prefill and a decode (kvfence/server/router/policy.py); flags named
    like SGLang's router's. The thresholds are in requests the router has open on a worker."""

    policy: str = "cache_aware"
    # A worker's predicted prefix must cover at least this share of the prompt to attract it.
    cache_threshold: float = 0.3
    # The worker holding the prefix is too busy when it has more than `abs` requests above the
    # least-loaded candidate AND more than `rel` times its load. SGLang's defaults (64, 1.5) are
    # sized for GPU batches of hundreds; a CPU worker runs tens.
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    # The prefix index (chunks of ~16 tokens), bounded in entries overall and per tenant.
    prefix_index_max_entries: int = 200_000
    prefix_index_max_entries_per_tenant: int = 50_000
    prefix_index_ttl: float = 300.0  # seconds a prefix sent to a worker stays predicted there

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ConfigError(
                f"--policy {self.policy!r}: expected one of {', '.join(ROUTING_POLICIES)}"
            )
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"--cache-threshold {self.cache_threshold}: must be in [0, 1]")
        if self.balance_abs_threshold < 0:
            raise ConfigError(f"--balance-abs-threshold {self.balance_abs_threshold}: must be >= 0")
        if not self.balance_rel_threshold >= 1.0:
            raise ConfigError(f"--balance-rel-threshold {self.balance_rel_threshold}: must be >= 1")
        if self.prefix_index_max_entries < 1 or self.prefix_index_max_entries_per_tenant < 1:
            raise ConfigError("--prefix-index-max-entries[-per-tenant]: must be >= 1")
        if self.prefix_index_max_entries_per_tenant > self.prefix_index_max_entries:
            raise ConfigError(
                "--prefix-index-max-entries-per-tenant must not exceed --prefix-index-max-entries"
            )
        if not self.prefix_index_ttl > 0:
            raise ConfigError(f"--prefix-index-ttl {self.prefix_index_ttl}: must be > 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RoutingConfig:
        """From flags parsed with kvfence.args.ROUTING_OPTIONS (one option per field)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
