"""What an Engine is built from, each part made from its EngineConfig: the start-up refusals and
the pool plan, the tensor-parallel leader, the model, the KV pool with its prefix cache, and the
runner (this process's, or rank 0's of a TP group)."""

from __future__ import annotations

import logging

import torch

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.runner import ModelRunner
from kvfence.engine.tp_group import TpLeader
from kvfence.engine.tp_runner import LeaderRunner
from kvfence.faults import Faults
from kvfence.kv.pool import KVPool
from kvfence.kv.prefix import PrefixCache, SharedPrefixes, load_shared_prefixes
from kvfence.kv.sizing import PoolPlan, plan_for_engine, require_fits
from kvfence.model.config import ModelConfig
from kvfence.model.llama import CausalLM
from kvfence.model.loader import TORCH_DTYPES, load_model
from kvfence.model.tokenizer import NoTokenizer, Tokenizer
from kvfence.model.tp import install_collectives, shard_model
from kvfence.structured.grammar import Grammars
from kvfence.tp_layout import TpLayout, tp_problem

log = logging.getLogger("kvfence.engine")


def plan_or_refuse(cfg: EngineConfig, mc: ModelConfig) -> PoolPlan:
    """The pool plan, or a refusal to start: a TP size the model cannot be split by, a context
    beyond the checkpoint's positions (unless allowed), a pool that cannot hold one context."""
    problem = tp_problem(mc, cfg.tp_size, mc.intermediate_size, mc.moe is not None)
    if problem is not None:
        raise ConfigError(problem)
    plan = plan_for_engine(cfg, mc)
    beyond = mc.context_problem(plan.context_length)
    if beyond is not None and not cfg.allow_context_beyond_positions:
        raise ConfigError(beyond)
    if beyond is not None:
        log.warning("--allow-context-beyond-positions: %s", beyond)
    if cfg.unsafe_skip_preflight:
        log.warning("UNSAFE: preflight skipped: %s", plan.problem())
    else:
        require_fits(plan)  # I7: refuse to start rather than silently lower the limit
    return plan


def tp_leader(cfg: EngineConfig, mc: ModelConfig, plan: PoolPlan) -> TpLeader | None:
    """Rank 0 of a TP group, whose ranks 1..N-1 start now, so they load their slices while this
    process loads its own (None without tensor parallelism)."""
    if cfg.tp_size == 1:
        return None
    return TpLeader(
        cfg,
        lambda rank: TpLayout.of(mc, rank, cfg.tp_size),
        plan.pool_pages,
        plan.context_length,
        plan.kv_cache_dtype,
    )


def model(
    cfg: EngineConfig, device: torch.device, context_length: int, tp: TpLeader | None
) -> CausalLM:
    """The model on its device, rope sized for the context, and this rank's slice under TP."""
    m = load_model(cfg.model, cfg.dtype, device)
    m.init_rope(context_length, device)
    if tp is not None:
        shard_model(m, tp.layout)
    return m


def prefix_cache(
    cfg: EngineConfig, tokenizer: Tokenizer | NoTokenizer, vocab_size: int, faults: Faults
) -> PrefixCache:
    """The tenant-scoped prefix cache, with the public prefixes of --shared-prefix-file."""
    shared: list[list[int]] = []
    if cfg.shared_prefix_file is not None:
        shared = load_shared_prefixes(
            cfg.shared_prefix_file,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            vocab_size,
        )
    return PrefixCache(
        cfg.page_size,
        shared=SharedPrefixes(shared, cfg.page_size),
        ttl=cfg.prefix_cache_ttl,
        faults=faults,
    )


def kv_pool(
    cfg: EngineConfig,
    mc: ModelConfig,
    plan: PoolPlan,
    device: torch.device,
    tp: TpLeader | None,
    prefix: PrefixCache | None,
) -> KVPool:
    """The plan's pages (under TP, this rank's KV heads of each)."""
    return KVPool(
        num_layers=mc.num_layers,
        num_pages=plan.pool_pages,
        page_size=cfg.page_size,
        num_kv_heads=mc.num_kv_heads if tp is None else tp.layout.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=TORCH_DTYPES[plan.kv_cache_dtype],
        device=device,
        poison_on_free=cfg.kv_poison_on_free,
        prefix=prefix,
    )


def runner(
    cfg: EngineConfig,
    m: CausalLM,
    pool: KVPool,
    device: torch.device,
    faults: Faults,
    grammars: Grammars,
    tp: TpLeader | None,
    context_length: int,
) -> ModelRunner:
    """This process's runner with its decode graphs; under TP, rank 0's, which sends every step
    to the other ranks, the model's collectives installed and the group told it is ready."""
    args = (m, pool, device, cfg.seed, cfg.attention_backend, cfg.linear_backend, faults, grammars)
    if tp is None:
        r = ModelRunner(*args)
        r.use_decode_graphs(cfg, pool.pages_for(context_length))
        return r
    r = LeaderRunner(*args, group=tp.group, send=tp.send, lock=tp.lock)
    install_collectives(m, tp.group, tp.layout)
    tp.ready()
    return r
