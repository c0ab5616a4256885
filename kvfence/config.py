"""The frozen, validated configurations a node is built from (flags named like SGLang's):
EngineConfig, and NodeConfig (engine + HTTP server + PD settings), built once from the flags
(kvfence/args/) and all that crosses to the engine process; RoutingConfig for the router."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from kvfence import env
from kvfence.lora.config import LoraSpecError, parse_lora_module
from kvfence.tp_layout import pd_tp_problem

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# --attention-backend / --linear-backend. auto: the native CPU kernel (paged decode; packed
# float32 matmuls) when it builds here and fits the model, else torch; native: require it.
KERNEL_BACKENDS = ("auto", "native", "torch")
# --attention-backend also takes flex: torch's flex_attention reading the pool's pages in place
# (kvfence/model/attn/flex.py), auto's choice on CUDA, and forced on CPU by its tests.
ATTENTION_BACKENDS = ("auto", "native", "flex", "torch")
CUDA_GRAPH_MODES = ("auto", "on", "off")


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    context_length: int | None = None  # None: the model's max_position_embeddings
    # Operator override: serve a context_length beyond the positions the checkpoint supports
    # (refused at start otherwise; rope past them gives answers the model was never trained on).
    allow_context_beyond_positions: bool = False
    page_size: int = 16
    kv_pool_tokens: int | None = None  # wins over mem_fraction_static when set
    mem_fraction_static: float = 0.5
    chunked_prefill_size: int = 512
    # A hard cap on the prefill tokens a step may add while sequences are decoding (None: no cap
    # beyond the step-time budget below and chunked_prefill_size).
    decode_step_prefill_budget: int | None = None
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # Decode steps per batch-size bucket from static buffers, captured as CUDA graphs (auto: on
    # CUDA only; on: also on CPU, uncaptured, the path the CPU tests check), up to this many rows.
    cuda_graph: str = "auto"
    cuda_graph_max_bs: int = 128
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
    # Before a server reports ready, a few steps through the runner fit the step-time budget's
    # cost model and pay the process's one-time costs (kvfence/engine/warmup.py).
    boot_warmup: bool = True
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
    # in benchmarks/RESULTS.md "HTTP: TTFT and ITL" (C=32 TTFT p50 0.31-0.44x vLLM's, ITL p99
    # 0.25x).
    wide_step_factor: float = 6.0
    # Latency targets the steps are sized to hold together (kvfence/engine/deadlines.py): a
    # decoding stream's mean time per output token, a prompt's time to its first token (None:
    # not held; the step-time budget above decides alone).
    target_tpot_ms: float | None = None
    target_ttft_ms: float | None = None
    # With both targets: a wave too big for the TTFT target is cut to the prompts that can be
    # on time (kvfence/engine/waves.py CUT) instead of the step budget alone.
    ttft_cuts: bool = True
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
    # Multi-LoRA (kvfence/lora/): adapters from --lora-modules (name=path or JSON with an optional
    # "tenants" list), at most max_loras resident in device slots, each of rank <= max_lora_rank.
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16

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
        for flag, value, allowed in (
            ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS),
            ("--linear-backend", self.linear_backend, KERNEL_BACKENDS),
        ):
            if value not in allowed:
                raise ConfigError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
            if value == "native" and self.device != "cpu":
                raise ConfigError(f"{flag} native: the native kernel is CPU-only")
        if self.cuda_graph not in CUDA_GRAPH_MODES:
            raise ConfigError(
                f"--cuda-graph {self.cuda_graph!r}: expected one of {', '.join(CUDA_GRAPH_MODES)}"
            )
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs {self.cuda_graph_max_bs}: must be >= 1")
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
        if self.prefill_backlog_steps < 0:
            raise ConfigError(f"--prefill-backlog-steps {self.prefill_backlog_steps}: must be >= 0")
        if not self.prefill_pace >= 0:
            raise ConfigError(f"--prefill-pace {self.prefill_pace}: must be >= 0")
        if not self.wide_step_factor >= 1:
            raise ConfigError(f"--wide-step-factor {self.wide_step_factor}: must be >= 1")
        for flag, target in (
            ("--target-tpot-ms", self.target_tpot_ms),
            ("--target-ttft-ms", self.target_ttft_ms),
        ):
            if target is not None and not target > 0:
                raise ConfigError(f"{flag} {target}: must be > 0")
        if self.min_prefill_chunk < 1:
            raise ConfigError(f"--min-prefill-chunk {self.min_prefill_chunk}: must be >= 1")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests {self.max_running_requests}: must be >= 1")
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size {self.tp_size}: must be >= 1")
        if not self.tp_timeout > 0:
            raise ConfigError(f"--tp-timeout {self.tp_timeout}: must be > 0")
        self._check_lora()
        per_tenant = self.max_running_requests_per_tenant
        if per_tenant is not None and per_tenant < 1:
            raise ConfigError(f"--max-running-requests-per-tenant {per_tenant}: must be >= 1")

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras {self.max_loras}: must be >= 1")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank}: must be >= 1")
        if self.enable_lora and self.tp_size > 1:
            raise ConfigError("--enable-lora with --tp-size above 1 is not supported")
        try:
            names = [parse_lora_module(m).name for m in self.lora_modules]
        except LoraSpecError as e:
            raise ConfigError(str(e)) from e
        if len(set(names)) != len(names):
            raise ConfigError("--lora-modules: two adapters share a name")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From flags parsed with kvfence.args.engine.ENGINE_OPTIONS (one option per field)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _fields_of(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values args has for cls's fields: a command that does not take a flag leaves its
    field at the default (`kvfence up` takes no --tls-cert: it makes each worker's own)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


TRANSFER_BACKENDS = ("tcp", "mooncake")
# The most tool calls one answer may make when parallel calls are allowed (server/tools.py).
DEFAULT_MAX_TOOL_CALLS = 8
DISAGGREGATION_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True)
class ServerConfig:
    """A node's HTTP listener and what its HTTP layer needs."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: str | None = None  # lines of `key tenant`; enables auth
    log_level: str = "info"
    drain_timeout: float = 30.0  # seconds in flight requests get on SIGTERM (server/drain.py)
    admin_api_key_file: str | None = None
    tool_call_parser: str | None = None
    # A model that never stops adding calls would otherwise write them until max_tokens.
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
    # The engine's step loop in a process of its own (kvfence/role_process.py) or in the HTTP
    # server's (the default: on 2 quiet shared cores the split measured ~10% slower; its case is
    # hosts with cores to spare for the HTTP process, and isolation).
    engine_process: bool = False

    def __post_init__(self) -> None:
        if not self.drain_timeout >= 0:
            raise ConfigError(f"--drain-timeout {self.drain_timeout}: must be >= 0")
        if self.max_tool_calls < 1:
            raise ConfigError(f"--max-tool-calls {self.max_tool_calls}: must be >= 1")


@dataclass(frozen=True)
class PdConfig:
    """A node's part in PD disaggregation ("null": unified) and its transfer's settings."""

    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "tcp"
    # Seconds a transfer may take from RESERVE (a prompt queueing at a busy prefill counts).
    disaggregation_timeout: float = 300.0
    tls_handshake_timeout: float = 10.0  # an unauthenticated peer's time to finish TLS
    max_pending_handshakes: int = 64  # connections the bootstrap port lets handshake at once
    pd_idle_timeout: float = 300.0  # how long a decode keeps a prefill connection with no room
    # I8: this worker's certificate, key and the cluster CA (None: KVFENCE_TLS_DIR's).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # A decode computes a prompt itself when it would wait this many times longer at the prefill
    # worker (kvfence/pd/local_prefill.py). None: `kvfence up` on one host picks UP_FACTOR, a
    # worker started alone never does (0).
    decode_local_prefill: float | None = None
    # CPU threads a decode adds to its own (--threads) for the steps it runs while none of its
    # prompts is at the prefill worker (kvfence/pd/local_prefill.py). None: `kvfence up` lends
    # the prefill worker's share to the decode of a 1P1D pair on one host, a worker started
    # alone never borrows (0).
    decode_borrow_threads: int | None = None

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ConfigError(
                f"--disaggregation-mode {self.disaggregation_mode!r}: "
                f"expected one of {', '.join(DISAGGREGATION_MODES)}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ConfigError(
                f"--disaggregation-transfer-backend {self.disaggregation_transfer_backend!r}: "
                f"expected one of {', '.join(TRANSFER_BACKENDS)}"
            )
        for flag, value in (
            ("--disaggregation-timeout", self.disaggregation_timeout),
            ("--tls-handshake-timeout", self.tls_handshake_timeout),
            ("--pd-idle-timeout", self.pd_idle_timeout),
        ):
            if not value > 0:
                raise ConfigError(f"{flag} {value}: must be > 0")
        if self.max_pending_handshakes < 1:
            raise ConfigError(f"--max-pending-handshakes {self.max_pending_handshakes}: >= 1")
        local = self.decode_local_prefill
        if local is not None and not local >= 0:
            raise ConfigError(f"--decode-local-prefill {local}: must be >= 0")
        borrow = self.decode_borrow_threads
        if borrow is not None and borrow < 0:
            raise ConfigError(f"--decode-borrow-threads {borrow}: must be >= 0")


@dataclass(frozen=True)
class NodeConfig:
    """Everything one node (`kvfence serve`, or a worker `kvfence up` starts) is built from:
    made once from the flags, then handed whole to kvfence/node.py and, pickled, to the engine
    process. kvfence.args.node.node_argv writes it back as a command line."""

    engine: EngineConfig
    server: ServerConfig = ServerConfig()
    pd: PdConfig = PdConfig()

    def __post_init__(self) -> None:
        if self.pd.disaggregation_mode != "null":
            problem = pd_tp_problem(self.engine.tp_size, self.pd.disaggregation_transfer_backend)
            if problem is not None:  # refused before any certificate is read or rank started
                raise ConfigError(problem)
        if self.engine.enable_lora and self.server.engine_process:
            # The HTTP process resolves adapter names against the engine's registry in-process.
            raise ConfigError("--enable-lora with --engine-process is not supported")

    @property
    def role(self) -> str:
        """unified, prefill or decode."""
        mode = self.pd.disaggregation_mode
        return "unified" if mode == "null" else mode

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NodeConfig:
        """From flags parsed with kvfence/args/'s engine, server and PD options."""
        return cls(
            EngineConfig.from_args(args),
            ServerConfig(**_fields_of(ServerConfig, args)),
            PdConfig(**_fields_of(PdConfig, args)),
        )


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
        """From flags parsed with kvfence.args.routing.ROUTING_OPTIONS (one option per field)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
