"""LoRA on one engine: the registry (names, tenants, weights on the CPU) and the slot table
(weights on the device), built from the config after the model's projections are fused."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvfence.config import ConfigError, EngineConfig
from kvfence.lora.apply import install
from kvfence.lora.checkpoint import LoraAdapter, LoraCheckpointError
from kvfence.lora.config import parse_lora_module
from kvfence.lora.registry import LoraRegistry
from kvfence.lora.sites import model_sites
from kvfence.lora.slots import LoraSlots
from kvfence.model.config import ModelConfig
from kvfence.model.llama import CausalLM


class LoraRuntime:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, model: CausalLM, model_name: str,
                 device: torch.device) -> None:
        dtype = next(model.parameters()).dtype
        sites = model_sites(mc)
        self.max_loras = cfg.max_loras
        self.registry = LoraRegistry(sites, cfg.max_lora_rank, dtype, frozenset({model_name}))
        self.slots = LoraSlots(sites, cfg.max_loras, cfg.max_lora_rank, dtype, device)
        install(model, self.slots)
        for text in cfg.lora_modules:
            try:
                self.registry.load(parse_lora_module(text))
            except (LoraCheckpointError, ValueError) as e:
                raise ConfigError(f"--lora-modules: {e}") from e

    def may_enter(self, adapter: LoraAdapter | None, live: Iterable[LoraAdapter | None]) -> bool:
        """Whether a sequence with `adapter` may join the live ones without needing more
        distinct adapters in a step than there are slots."""
        if adapter is None:
            return True
        held = {a.digest for a in live if a is not None}
        return adapter.digest in held or len(held) < self.max_loras
