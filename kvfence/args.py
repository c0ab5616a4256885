"""Every command-line option of a node, defined once. `kvfence serve`, `preflight`, `up` and the
router add these specs to their parsers; `node_argv` writes a NodeConfig back as a command line
(`up`'s workers). Each option's default is read from its field of EngineConfig, ServerConfig,
PdConfig or RoutingConfig, so a default lives only there: a new flag is an Option here and a
field there, nothing else."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvfence.config import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_MODES,
    DISAGGREGATION_MODES,
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    ROUTING_POLICIES,
    TRANSFER_BACKENDS,
    EngineConfig,
    NodeConfig,
    PdConfig,
    RoutingConfig,
    ServerConfig,
)


class Parser(Protocol):
    """An argparse parser or one of its groups."""

    def add_argument(self, *names: str, **kw: Any) -> Any: ...


@dataclass(frozen=True)
class Option:
    """One flag: its spellings (the first is canonical), where it lands, and how it parses."""

    names: tuple[str, ...]
    dest: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    help: str | None = None
    switch: bool = False  # a store_true flag: present or not, no value
    negations: tuple[str, ...] = ()  # a switch on by default: the spellings that turn it off
    required: bool = False
    metavar: str | None = None
    nargs: str | None = None  # "+": one or more values, parsed as a list

    @property
    def flag(self) -> str:
        return self.names[0]

    def add(self, parser: Parser, **changes: Any) -> None:
        """Add to `parser` (or a group of it); `changes` adapt one command's view of the flag
        (a help text, a default that command resolves differently), never its name."""
        if {"names", "dest"} & changes.keys():
            raise ValueError(f"{self.flag}: a command may not rename an option")
        o = dataclasses.replace(self, **changes) if changes else self
        kw: dict[str, Any] = {"dest": o.dest, "default": o.default, "help": o.help}
        if o.switch:
            kw["action"] = "store_true"
        else:
            kw.update(type=o.type, choices=o.choices, required=o.required, metavar=o.metavar)
            if o.nargs is not None:
                kw["nargs"] = o.nargs
        parser.add_argument(*o.names, **kw)
        if o.negations:
            off = f"turn {o.flag} off" if o.help != argparse.SUPPRESS else o.help
            parser.add_argument(
                *o.negations, dest=o.dest, default=o.default, action="store_false", help=off
            )

    def argv(self, value: Any) -> list[str]:
        """This option with `value` as a child process's command line spells it."""
        if self.switch:
            return [self.flag] if value else list(self.negations[:1])
        if self.nargs is not None:
            return [self.flag, *(str(v) for v in value)]
        return [self.flag, str(value)]


def add_options(
    parser: Parser,
    options: Iterable[Option],
    **changes: Mapping[str, Any],
) -> None:
    """Add each option; `changes[dest]` adapts that one (see `Option.add`)."""
    options = tuple(options)
    unknown = set(changes) - {o.dest for o in options}
    if unknown:
        raise ValueError(f"no such option to change: {', '.join(sorted(unknown))}")
    for o in options:
        o.add(parser, **changes.get(o.dest, {}))


def command_line(args: argparse.Namespace, options: Iterable[Option]) -> list[str]:
    """The flags of `options` whose parsed value differs from the default (required ones always):
    a child given these parses back the same values, and its own defaults are the same ones."""
    out: list[str] = []
    for o in options:
        value = getattr(args, o.dest, None)
        if value is None or (value == o.default and not o.required):
            continue
        out += o.argv(value)
    return out


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


_DEFAULTS = _defaults(EngineConfig)
_SERVER_DEFAULTS = _defaults(ServerConfig)
_PD_DEFAULTS = _defaults(PdConfig)


def _engine(names: str | tuple[str, ...], dest: str, **kw: Any) -> Option:
    spellings = (names,) if isinstance(names, str) else names
    return Option(spellings, dest, default=_DEFAULTS[dest], **kw)


def _server(names: tuple[str, ...], dest: str, **kw: Any) -> Option:
    return Option(names, dest, default=_SERVER_DEFAULTS[dest], **kw)


def _pd(names: tuple[str, ...], dest: str, **kw: Any) -> Option:
    return Option(names, dest, default=_PD_DEFAULTS[dest], **kw)


# ---- the engine: one field of EngineConfig each (tests check the two stay in step) -----------

MODEL = Option(
    ("--model", "--model-path"),
    "model",
    required=True,
    metavar="DIR",
    help="local Hugging Face model directory",
)
SERVED_MODEL_NAME = _engine("--served-model-name", "served_model_name")
DEVICE = _engine("--device", "device", help="cpu | cuda[:N]")
DTYPE = _engine("--dtype", "dtype", choices=DTYPES)
KV_CACHE_DTYPE = _engine("--kv-cache-dtype", "kv_cache_dtype", choices=KV_CACHE_DTYPES)
CONTEXT_LENGTH = _engine(
    "--context-length", "context_length", type=int, help="default: max_position_embeddings"
)
ALLOW_CONTEXT_BEYOND_POSITIONS = _engine(
    "--allow-context-beyond-positions",
    "allow_context_beyond_positions",
    switch=True,
    help="serve a --context-length beyond the checkpoint's positions (max_position_embeddings, "
    "or what its rope scaling extends it to); answers past them are untrained",
)
PAGE_SIZE = _engine("--page-size", "page_size", type=int)
KV_POOL_TOKENS = _engine(
    "--kv-pool-tokens",
    "kv_pool_tokens",
    type=int,
    help="explicit pool size in tokens; wins over --mem-fraction-static",
)
MEM_FRACTION_STATIC = _engine("--mem-fraction-static", "mem_fraction_static", type=float)
CHUNKED_PREFILL_SIZE = _engine("--chunked-prefill-size", "chunked_prefill_size", type=int)
DECODE_STEP_PREFILL_BUDGET = _engine(
    "--decode-step-prefill-budget",
    "decode_step_prefill_budget",
    type=int,
    help="hard cap on the prefill tokens of a step that also decodes (default: none beyond "
    "--max-decode-step-ms)",
)
ATTENTION_BACKEND = _engine(
    "--attention-backend",
    "attention_backend",
    choices=ATTENTION_BACKENDS,
    help="attention over the KV pages: auto (native on CPU, flex on CUDA), native CPU kernels, "
    "flex (torch flex_attention reading pages in place), or torch gather+SDPA (the reference)",
)
LINEAR_BACKEND = _engine(
    "--linear-backend",
    "linear_backend",
    choices=KERNEL_BACKENDS,
    help="projection matmuls: native packed float32 CPU kernel, or torch (MKL / cuBLAS)",
)
CUDA_GRAPH = _engine(
    "--cuda-graph",
    "cuda_graph",
    choices=CUDA_GRAPH_MODES,
    help="decode steps per batch-size bucket, captured as CUDA graphs: auto (on CUDA), on "
    "(also on CPU, uncaptured), off",
)
CUDA_GRAPH_MAX_BS = _engine(
    "--cuda-graph-max-bs",
    "cuda_graph_max_bs",
    type=int,
    help="the largest decode batch run from a captured graph (larger ones run eagerly)",
)
MAX_RUNNING_REQUESTS = _engine("--max-running-requests", "max_running_requests", type=int)
THREADS = _engine(
    "--threads",
    "threads",
    type=int,
    help="CPU threads for the kernels (default: every core; `kvfence up` gives each worker "
    "its share of the cores)",
)
SEED = _engine("--seed", "seed", type=int)
UNSAFE_SKIP_PREFLIGHT = _engine(
    "--unsafe-skip-preflight", "unsafe_skip_preflight", switch=True, help=argparse.SUPPRESS
)
KV_POISON_ON_FREE = _engine(
    "--kv-poison-on-free",
    "kv_poison_on_free",
    switch=True,
    help="debug: fill freed KV pages with NaN so any stale read shows up",
)
ENABLE_PREFIX_CACHING = _engine(
    "--enable-prefix-caching",
    "enable_prefix_caching",
    switch=True,
    negations=("--no-enable-prefix-caching", "--disable-radix-cache"),  # the last is SGLang's
    help="reuse the KV of cached prompt prefixes, within a tenant only (on by default)",
)
BOOT_WARMUP = _engine(
    "--boot-warmup", "boot_warmup", switch=True, negations=("--no-boot-warmup",),
    help="before reporting ready, run a few steps that fit the step-time budget's cost model "
    "and pay one-time kernel costs (on by default)",
)
SHARED_PREFIX_FILE = _engine(
    "--shared-prefix-file",
    "shared_prefix_file",
    metavar="FILE",
    help="JSON list of public prefixes (texts or token-id lists) every tenant may reuse; what "
    "it declares is public by definition",
)
PREFIX_CACHE_TTL = _engine(
    "--prefix-cache-ttl",
    "prefix_cache_ttl",
    type=float,
    metavar="SECONDS",
    help="an unused cached page leaves the cache after this long (default: only for space)",
)
MAX_DECODE_STEP_MS = _engine(
    "--max-decode-step-ms",
    "max_decode_step_ms",
    type=float,
    metavar="MS",
    help="time target of a step that also decodes (the ITL side): prefill beside decodes is "
    "sized from the measured step cost to fit it (default: auto, 2x the decode-only step; "
    "0: no time bound)",
)
MIN_PREFILL_CHUNK = _engine(
    "--min-prefill-chunk", "min_prefill_chunk", type=int, metavar="TOKENS",
    help="prefill tokens a step that also decodes always takes, whatever the time target "
    "(the TTFT side)",
)
PREFILL_BACKLOG_STEPS = _engine(
    "--prefill-backlog-steps", "prefill_backlog_steps", type=int, metavar="STEPS",
    help="a step that also decodes takes at least 1/STEPS of the prompt tokens waiting, so a "
    "burst of prompts drains in about STEPS steps (the TTFT side; lower: earlier first tokens; "
    "0: no such floor)",
)
PREFILL_PACE = _engine(
    "--prefill-pace",
    "prefill_pace",
    type=float,
    metavar="FACTOR",
    help="a step that also decodes takes at least FACTOR x the prompt tokens arriving per step "
    "(a moving average), so prefill keeps pace with arrivals in even chunks (smooth ITL); "
    "0: off",
)
WIDE_STEP_FACTOR = _engine(
    "--wide-step-factor",
    "wide_step_factor",
    type=float,
    metavar="FACTOR",
    help="the auto time target (no --max-decode-step-ms) at 32 or more decode rows, as a "
    "multiple of the decode-only step: 2x up to 8 rows, rising linearly to FACTOR at 32 "
    "(default 6; higher: prompts behind a wide batch wait less, its streams' steps are longer; "
    "2: the same 2x at every width)",
)
TARGET_TPOT_MS = _engine(
    "--target-tpot-ms",
    "target_tpot_ms",
    type=float,
    metavar="MS",
    help="hold each stream's mean time per output token within MS: a step that decodes takes "
    "prefill tokens only up to the slack of its tightest stream, never beyond MS (default: "
    "the step-time budget alone)",
)
TARGET_TTFT_MS = _engine(
    "--target-ttft-ms",
    "target_ttft_ms",
    type=float,
    metavar="MS",
    help="hold each prompt's time to first token within MS: steps take at least the prompt "
    "tokens that keep every waiting prompt on time (wins over --target-tpot-ms); with both "
    "targets, prompts are computed in waves while no stream decodes (kvfence/engine/waves.py)",
)
TTFT_CUTS = _engine(
    "--ttft-cuts",
    "ttft_cuts",
    switch=True,
    help="with both targets, a wave too big for the TTFT target is cut to the prompts that can "
    "be on time, the rest computed beside them (kvfence/engine/waves.py CUT; default: off)",
)
SKIP_TOKENIZER_INIT = _engine(
    "--skip-tokenizer-init",
    "skip_tokenizer_init",
    switch=True,
    help="load no tokenizer (the model dir may have none): serve token-id prompts only; outputs "
    "are token ids (logprobs with return_tokens_as_token_ids) and empty text",
)
MAX_RUNNING_REQUESTS_PER_TENANT = _engine(
    "--max-running-requests-per-tenant",
    "max_running_requests_per_tenant",
    type=int,
    help="running slots one tenant may hold (default: no cap; a free slot always goes to the "
    "waiting tenant holding the fewest)",
)
SPECIAL_TOKENS_IN_CHAT = _engine(
    "--special-tokens-in-chat",
    "special_tokens_in_chat",
    switch=True,
    help="let control-token text typed in chat messages (<|eos|>, <|system|>) act as control "
    "tokens; off by default, so a user cannot forge a turn or an end of text",
)
TP_SIZE = _engine(
    "--tp-size",
    "tp_size",
    type=int,
    help="tensor parallelism: this many processes per engine (gloo on cpu, NCCL on cuda), each "
    "holding a slice of every layer and of the KV pool and its share of --threads",
)
TP_TIMEOUT = _engine(
    "--tp-timeout",
    "tp_timeout",
    type=float,
    metavar="SECONDS",
    help="a collective that waits longer (a stalled rank) fails the engine closed",
)
ENABLE_LORA = _engine(
    "--enable-lora", "enable_lora", switch=True, help="serve LoRA adapters on the base model"
)
LORA_MODULES = _engine(
    "--lora-modules",
    "lora_modules",
    nargs="+",
    metavar="SPEC",
    help='adapters to load at start: name=path, or JSON {"name", "path", "tenants": [...]} '
    "(tenants absent: every tenant may use it); a request selects one by its model field",
)
MAX_LORAS = _engine(
    "--max-loras",
    "max_loras",
    type=int,
    help="adapters resident on the device at once (slots; swapped least recently used first); "
    "also the most distinct adapters one step runs",
)
MAX_LORA_RANK = _engine(
    "--max-lora-rank", "max_lora_rank", type=int, help="adapters of a higher rank are refused"
)

ENGINE_OPTIONS: tuple[Option, ...] = (
    MODEL, SERVED_MODEL_NAME, DEVICE, DTYPE, KV_CACHE_DTYPE, CONTEXT_LENGTH,
    ALLOW_CONTEXT_BEYOND_POSITIONS, PAGE_SIZE, KV_POOL_TOKENS, MEM_FRACTION_STATIC,
    CHUNKED_PREFILL_SIZE, DECODE_STEP_PREFILL_BUDGET, BOOT_WARMUP,
    ATTENTION_BACKEND, LINEAR_BACKEND, CUDA_GRAPH, CUDA_GRAPH_MAX_BS, MAX_RUNNING_REQUESTS,
    THREADS, SEED,
    UNSAFE_SKIP_PREFLIGHT, KV_POISON_ON_FREE, ENABLE_PREFIX_CACHING, SHARED_PREFIX_FILE,
    PREFIX_CACHE_TTL, SKIP_TOKENIZER_INIT, MAX_DECODE_STEP_MS, MIN_PREFILL_CHUNK,
    PREFILL_BACKLOG_STEPS, PREFILL_PACE, WIDE_STEP_FACTOR, TARGET_TPOT_MS, TARGET_TTFT_MS,
    TTFT_CUTS, MAX_RUNNING_REQUESTS_PER_TENANT,
    SPECIAL_TOKENS_IN_CHAT, TP_SIZE, TP_TIMEOUT, ENABLE_LORA, LORA_MODULES, MAX_LORAS,
    MAX_LORA_RANK,
)  # fmt: skip
# What sizes a node's pool (kv/sizing.plan_for_engine reads these fields): `kvfence preflight`
# takes exactly these, so it plans what `serve` would build.
SIZING_OPTIONS: tuple[Option, ...] = (
    MODEL, CONTEXT_LENGTH, PAGE_SIZE, KV_POOL_TOKENS, MEM_FRACTION_STATIC, DTYPE, KV_CACHE_DTYPE,
    DEVICE, CHUNKED_PREFILL_SIZE, MAX_RUNNING_REQUESTS, TP_SIZE, ENABLE_LORA, MAX_LORAS,
    MAX_LORA_RANK,
)  # fmt: skip

# ---- an HTTP listener (serve, router, up) -------------------------------------------------------

HOST = _server(("--host",), "host")
PORT = _server(("--port",), "port", type=int)
API_KEY_FILE = _server(
    ("--api-key-file",), "api_key_file", help="lines of `key tenant`; enables auth"
)
LOG_LEVEL = _server(("--log-level",), "log_level")
DRAIN_TIMEOUT = _server(
    ("--drain-timeout",),
    "drain_timeout",
    type=float,
    metavar="SECONDS",
    help="on SIGTERM: admit nothing new and give what is in flight this long to finish; the "
    "rest gets a 503 (a second SIGTERM stops at once)",
)
ADMIN_API_KEY_FILE = _server(
    ("--admin-api-key-file",),
    "admin_api_key_file",
    metavar="FILE",
    help="the operator key (or KVFENCE_ADMIN_API_KEY), separate from tenant keys: it alone "
    "reads /metrics, /pd/info and /health's detail, and signs the router's word to a decode",
)
SERVER_OPTIONS: tuple[Option, ...] = (
    HOST, PORT, API_KEY_FILE, LOG_LEVEL, DRAIN_TIMEOUT, ADMIN_API_KEY_FILE,
)  # fmt: skip
# Why the engine process is not the default: ServerConfig.engine_process.
ENGINE_PROCESS = _server(
    ("--engine-process",),
    "engine_process",
    switch=True,
    help="run the engine in a process of its own, as vLLM's EngineCore and SGLang's scheduler "
    "run: the HTTP server never shares the engine's GIL nor maps its KV pool (costs one core's "
    "share of the HTTP work on small hosts)",
)
# Chat answers with tool_choice "auto" are read for calls in this model family's format.
TOOL_CALL_PARSER = _server(
    ("--tool-call-parser",),
    "tool_call_parser",
    choices=("hermes", "qwen", "llama3_json"),
    help="how the model writes tool calls (vLLM's names); needed for tool_choice auto",
)


MAX_TOOL_CALLS = _server(
    ("--max-tool-calls",),
    "max_tool_calls",
    type=int,
    help="the most tool calls one answer may make when parallel_tool_calls is not false "
    "(false: exactly one)",
)

# ---- a PD worker (serve; up forwards TRANSFER_OPTIONS to every worker) --------------------------

DISAGGREGATION_MODE = _pd(
    ("--disaggregation-mode",), "disaggregation_mode", choices=DISAGGREGATION_MODES
)
BOOTSTRAP_PORT = _pd(
    ("--disaggregation-bootstrap-port",), "disaggregation_bootstrap_port", type=int
)
TRANSFER_BACKEND = _pd(
    ("--disaggregation-transfer-backend",),
    "disaggregation_transfer_backend",
    choices=TRANSFER_BACKENDS,
)
# I8: every PD connection is mutual TLS 1.3 with certificates of the cluster CA (pd/tls.py).
# Per worker, so `up` makes its own for each and does not forward these.
TLS_CERT = _pd(
    ("--tls-cert",),
    "tls_cert",
    metavar="PEM",
    help="this worker's certificate (its role: prefill or decode) from the cluster CA",
)
TLS_KEY = _pd(("--tls-key",), "tls_key", metavar="PEM", help="its private key (mode 0600)")
TLS_CA = _pd(
    ("--tls-ca",),
    "tls_ca",
    metavar="PEM",
    help="the cluster CA: peers must hold a certificate it issued (or KVFENCE_TLS_DIR)",
)
TLS_FILE_OPTIONS: tuple[Option, ...] = (TLS_CERT, TLS_KEY, TLS_CA)
TLS_HANDSHAKE_TIMEOUT = _pd(
    ("--tls-handshake-timeout",),
    "tls_handshake_timeout",
    type=float,
    help="seconds an unauthenticated peer has to complete its TLS handshake",
)
MAX_PENDING_HANDSHAKES = _pd(
    ("--max-pending-handshakes",),
    "max_pending_handshakes",
    type=int,
    help="connections the bootstrap port lets handshake at once; more are closed on accept",
)
PD_IDLE_TIMEOUT = _pd(
    ("--pd-idle-timeout",),
    "pd_idle_timeout",
    type=float,
    help="seconds a decode keeps a prefill connection that carries no transfer",
)
DISAGGREGATION_TIMEOUT = _pd(
    ("--disaggregation-timeout",),
    "disaggregation_timeout",
    type=float,
    help="seconds a KV transfer may take before it is aborted, from RESERVE (so a prompt's "
    "queueing at a busy prefill counts); SGLang's waiting timeout is also 300 s",
)
DECODE_LOCAL_PREFILL = _pd(
    ("--decode-local-prefill",),
    "decode_local_prefill",
    type=float,
    metavar="FACTOR",
    help="a decode worker computes a prompt itself, beside its decodes, when the prefill "
    "worker's queue of its prompts is FACTOR times its own (0: never; `kvfence up`: 1)",
)
TRANSFER_OPTIONS: tuple[Option, ...] = (
    TRANSFER_BACKEND,
    DECODE_LOCAL_PREFILL,
    DISAGGREGATION_TIMEOUT,
    TLS_HANDSHAKE_TIMEOUT,
    MAX_PENDING_HANDSHAKES,
    PD_IDLE_TIMEOUT,
)
PD_OPTIONS: tuple[Option, ...] = (
    DISAGGREGATION_MODE,
    BOOTSTRAP_PORT,
    *TRANSFER_OPTIONS,
    *TLS_FILE_OPTIONS,
)
# ---- a whole node: one option per NodeConfig field --------------------------------------------

NODE_OPTIONS: tuple[Option, ...] = (
    *ENGINE_OPTIONS,
    *SERVER_OPTIONS,
    TOOL_CALL_PARSER,
    MAX_TOOL_CALLS,
    ENGINE_PROCESS,
    *PD_OPTIONS,
)


def node_values(config: NodeConfig) -> argparse.Namespace:
    """config's fields flat, by option dest (what parsing its command line gives)."""
    parts = (config.engine, config.server, config.pd)
    return argparse.Namespace(
        **{f.name: getattr(p, f.name) for p in parts for f in dataclasses.fields(p)}
    )


def node_argv(config: NodeConfig, options: Iterable[Option] = NODE_OPTIONS) -> list[str]:
    """The `kvfence serve` command line that parses back into config (a value at its default
    is left out, so the child resolves it as the parent would)."""
    return command_line(node_values(config), options)


# ---- the router's routing policy (router; `up` hands them to its router) ------------------------
# Each has SGLang's router spelling first (what the router's command line gets) and a --router-*
# one that reads clearly among `up`'s worker flags. Defaults live on RoutingConfig's fields.

_ROUTING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RoutingConfig)}


def _routing(names: tuple[str, ...], dest: str, **kw: Any) -> Option:
    return Option(names, dest, default=_ROUTING_DEFAULTS[dest], **kw)


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
    ROUTER_POLICY, CACHE_THRESHOLD, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD,
    PREFIX_INDEX_MAX_ENTRIES, PREFIX_INDEX_MAX_ENTRIES_PER_TENANT, PREFIX_INDEX_TTL,
)  # fmt: skip
