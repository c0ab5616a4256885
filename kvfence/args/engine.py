"""The engine's options: one field of EngineConfig each (tests check the two stay in step), and
the sizing subset `kvfence preflight` takes."""

from __future__ import annotations

import argparse

from kvfence.args.option import Option, field_options
from kvfence.config import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_MODES,
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    EngineConfig,
)

_engine = field_options(EngineConfig)

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
    "--boot-warmup",
    "boot_warmup",
    switch=True,
    negations=("--no-boot-warmup",),
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
    "--min-prefill-chunk",
    "min_prefill_chunk",
    type=int,
    metavar="TOKENS",
    help="prefill tokens a step that also decodes always takes, whatever the time target "
    "(the TTFT side)",
)
PREFILL_BACKLOG_STEPS = _engine(
    "--prefill-backlog-steps",
    "prefill_backlog_steps",
    type=int,
    metavar="STEPS",
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
    negations=("--no-ttft-cuts",),
    help="with both targets, a wave too big for the TTFT target is cut to the prompts that can "
    "be on time, the rest computed beside them (kvfence/engine/waves.py CUT; on by default)",
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
    MODEL,
    SERVED_MODEL_NAME,
    DEVICE,
    DTYPE,
    KV_CACHE_DTYPE,
    CONTEXT_LENGTH,
    ALLOW_CONTEXT_BEYOND_POSITIONS,
    PAGE_SIZE,
    KV_POOL_TOKENS,
    MEM_FRACTION_STATIC,
    CHUNKED_PREFILL_SIZE,
    DECODE_STEP_PREFILL_BUDGET,
    BOOT_WARMUP,
    ATTENTION_BACKEND,
    LINEAR_BACKEND,
    CUDA_GRAPH,
    CUDA_GRAPH_MAX_BS,
    MAX_RUNNING_REQUESTS,
    THREADS,
    SEED,
    UNSAFE_SKIP_PREFLIGHT,
    KV_POISON_ON_FREE,
    ENABLE_PREFIX_CACHING,
    SHARED_PREFIX_FILE,
    PREFIX_CACHE_TTL,
    SKIP_TOKENIZER_INIT,
    MAX_DECODE_STEP_MS,
    MIN_PREFILL_CHUNK,
    PREFILL_BACKLOG_STEPS,
    PREFILL_PACE,
    WIDE_STEP_FACTOR,
    TARGET_TPOT_MS,
    TARGET_TTFT_MS,
    TTFT_CUTS,
    MAX_RUNNING_REQUESTS_PER_TENANT,
    SPECIAL_TOKENS_IN_CHAT,
    TP_SIZE,
    TP_TIMEOUT,
    ENABLE_LORA,
    LORA_MODULES,
    MAX_LORAS,
    MAX_LORA_RANK,
)
# What sizes a node's pool (kv/sizing.plan_for_engine reads these fields): `kvfence preflight`
# takes exactly these, so it plans what `serve` would build.
SIZING_OPTIONS: tuple[Option, ...] = (
    MODEL,
    CONTEXT_LENGTH,
    PAGE_SIZE,
    KV_POOL_TOKENS,
    MEM_FRACTION_STATIC,
    DTYPE,
    KV_CACHE_DTYPE,
    DEVICE,
    CHUNKED_PREFILL_SIZE,
    MAX_RUNNING_REQUESTS,
    TP_SIZE,
    ENABLE_LORA,
    MAX_LORAS,
    MAX_LORA_RANK,
)
