"""ModelConfig: the architecture facts kvfence needs, parsed from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfence.model.moe_config import MOE_ARCHITECTURES, MoeConfig, MoeConfigError, parse_moe

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
# Sliding window fields these families ship but apply only when use_sliding_window is set.
_SLIDING_OPT_IN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one kvfence can serve; the message says why."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    partial_rotary_factor: float = 1.0  # GLM-4 MoE rotates only the first half of each head


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    moe: MoeConfig | None = None  # the expert block of the layers in moe.sparse_layers
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rope rotates (the rest pass through)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def max_supported_positions(self) -> int:
        """The positions the checkpoint's rope was trained or scaled for. llama3 scaling's
        max_position_embeddings is already the extended length; linear scaling stretches the
        trained one by its factor (vLLM derives its own limit the same way)."""
        if self.rope.kind == "linear":
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    def context_problem(self, context_length: int) -> str | None:
        """Why a context length is past what this checkpoint's positions support, or None."""
        limit = self.max_supported_positions
        if context_length <= limit:
            return None
        return (
            f"--context-length {context_length} exceeds the {limit} positions this checkpoint "
            f"supports (max_position_embeddings {self.max_position_embeddings}, rope "
            f"{self.rope.kind!r}): rope past them gives answers the model was never trained on. "
            "Lower --context-length, or pass --allow-context-beyond-positions to serve it anyway."
        )

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def num_params(self) -> int:
        """Parameter count implied by the shapes (what preflight needs without weights): every
        expert, since every expert stays resident."""
        return self._params()[0]

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward reads: num_params with only top_k routed experts per
        expert block (the embedding table counted whole, as Mixtral and Qwen publish it)."""
        return self._params()[1]

    @property
    def token_intermediate_size(self) -> int:
        """The widest MLP intermediate one token holds in any layer: a dense layer's, or an
        expert layer's top-k routed plus shared experts'."""
        widths = [self.intermediate_size] if self.moe is None or any(
            not self.is_sparse(i) for i in range(self.num_layers)
        ) else []
        if self.moe is not None:
            m = self.moe
            widths.append(m.top_k * m.expert_intermediate_size + m.shared_intermediate_size)
        return max(widths)

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def _params(self) -> tuple[int, int]:
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        total = active = self.num_embedding_params + h
        for layer in range(self.num_layers):
            if self.moe is not None and self.is_sparse(layer):
                block_total, block_active = self.moe.block_params(h)
            else:
                block_total = block_active = 3 * h * i
            total += attn + block_total + 2 * h
            active += attn + block_active + 2 * h
        return total, active

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(
                f"{model_dir}: no config.json (expected a Hugging Face model directory)"
            )
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; "
                f"kvfence serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window")
        if arch in _SLIDING_OPT_IN:
            sliding = sliding if cfg.get("use_sliding_window") else None
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)"
            )
        layers = int(cfg["num_hidden_layers"])
        try:
            moe = parse_moe(arch, cfg, layers)
        except MoeConfigError as e:
            raise UnsupportedModelError(f"{arch}: {e}") from e
        if arch == "Glm4MoeForCausalLM":
            qk_norm = bool(cfg.get("use_qk_norm", False))
        else:
            qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        rope = _parse_rope(cfg, arch)
        if int(head_dim * rope.partial_rotary_factor) % 2 or rope.partial_rotary_factor <= 0:
            raise UnsupportedModelError(
                f"partial_rotary_factor {rope.partial_rotary_factor} of head_dim {head_dim} "
                "is not an even number of rotated dims"
            )
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            moe=moe,
            raw=cfg,
        )


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
    }.get(model_type, model_type or "<missing>")


def _parse_rope(cfg: dict[str, Any], arch: str) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older checkpoints use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ("default", "llama3", "linear"):
        raise UnsupportedModelError(
            f"rope type {kind!r} is not supported (default, linear, llama3)"
        )
    # Glm4MoeConfig defaults partial_rotary_factor to 0.5 when config.json omits it.
    partial_default = 0.5 if arch == "Glm4MoeForCausalLM" else 1.0
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", partial_default))
    if partial != 1.0 and kind != "default":
        raise UnsupportedModelError(
            f"partial_rotary_factor {partial} with rope type {kind!r} is not supported"
        )
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(partial),
    )
