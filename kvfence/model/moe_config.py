"""MoeConfig: the mixture-of-experts facts of a config.json (Mixtral, Qwen3-MoE, GLM-4 MoE), each
family's fields read and validated as transformers reads them; variants we do not compute are
refused here, at start-up, never approximated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM")


class MoeConfigError(ValueError):
    """A mixture-of-experts field kvfence does not implement (subclassed as unsupported model)."""


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    scoring: str  # "softmax" (Mixtral, Qwen3-MoE) | "sigmoid" (GLM-4 MoE)
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int  # group-limited top-k: experts in n_group groups, top-k over the best topk_group
    topk_group: int
    correction_bias: bool  # sigmoid routing picks by score + e_score_correction_bias
    shared_intermediate_size: int  # 0: no shared experts
    sparse_layers: frozenset[int]  # the layers whose MLP is the expert block
    block_name: str  # HF module name of the block: "block_sparse_moe" | "mlp"
    expert_names: tuple[str, str, str]  # HF names of an expert's gate, up, down projections
    weights_in_input_dtype: bool  # Qwen3-MoE casts routing weights to the hidden dtype

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.expert_intermediate_size

    def block_params(self, hidden: int) -> tuple[int, int]:
        """(total, read per token) parameters of one expert block: router, experts, shared."""
        router = self.num_experts * hidden + (self.num_experts if self.correction_bias else 0)
        shared = 3 * hidden * self.shared_intermediate_size
        expert = self.expert_params(hidden)
        return (
            router + shared + self.num_experts * expert,
            router + shared + self.top_k * expert,
        )


def parse_moe(arch: str, cfg: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """The MoE block of `arch` as config.json describes it; None for a dense architecture."""
    if arch == "MixtralForCausalLM":
        return _mixtral(cfg, num_layers)
    if arch == "Qwen3MoeForCausalLM":
        return _qwen3_moe(cfg, num_layers)
    if arch == "Glm4MoeForCausalLM":
        return _glm4_moe(cfg, num_layers)
    return None


def _mixtral(cfg: dict[str, Any], num_layers: int) -> MoeConfig:
    experts = _positive(cfg, "num_local_experts", 8)
    return _checked(
        MoeConfig(
            num_experts=experts,
            top_k=_positive(cfg, "num_experts_per_tok", 2),
            expert_intermediate_size=_positive(cfg, "intermediate_size"),
            scoring="softmax",
            norm_topk_prob=True,  # MixtralTopKRouter always renormalises the top-k
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            correction_bias=False,
            shared_intermediate_size=0,
            sparse_layers=frozenset(range(num_layers)),
            block_name="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
            weights_in_input_dtype=False,
        )
    )


def _qwen3_moe(cfg: dict[str, Any], num_layers: int) -> MoeConfig:
    # Qwen2-MoE's shared expert does not exist in Qwen3-MoE (transformers ignores the field).
    experts = _positive(cfg, "num_experts", cfg.get("num_local_experts", 128))
    step = _positive(cfg, "decoder_sparse_step", 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    sparse = frozenset(
        i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
    )
    return _checked(
        MoeConfig(
            num_experts=experts,
            top_k=_positive(cfg, "num_experts_per_tok", 8),
            expert_intermediate_size=_positive(cfg, "moe_intermediate_size", 768),
            scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            correction_bias=False,
            shared_intermediate_size=0,
            sparse_layers=sparse,
            block_name="mlp",
            expert_names=("gate_proj", "up_proj", "down_proj"),
            weights_in_input_dtype=True,
        )
    )


def _glm4_moe(cfg: dict[str, Any], num_layers: int) -> MoeConfig:
    # DeepSeek-V3-style fields GLM-4 MoE checkpoints may carry: only the variant transformers'
    # Glm4MoeTopkRouter computes (sigmoid scores, bias-corrected group-limited top-k) is served.
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise MoeConfigError(f"topk_method {method!r} is not supported (noaux_tc only)")
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise MoeConfigError(f"scoring_func {scoring!r} is not supported (sigmoid only)")
    first_dense = int(cfg.get("first_k_dense_replace", 1))
    if first_dense < 0:
        raise MoeConfigError(f"first_k_dense_replace {first_dense}: must be >= 0")
    inter = _positive(cfg, "moe_intermediate_size", 1408)
    shared = int(cfg.get("n_shared_experts", 1))
    if shared < 0:
        raise MoeConfigError(f"n_shared_experts {shared}: must be >= 0")
    return _checked(
        MoeConfig(
            num_experts=_positive(cfg, "n_routed_experts", 128),
            top_k=_positive(cfg, "num_experts_per_tok", 8),
            expert_intermediate_size=inter,
            scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=_positive(cfg, "n_group", 1),
            topk_group=_positive(cfg, "topk_group", 1),
            correction_bias=True,
            shared_intermediate_size=inter * shared,
            sparse_layers=frozenset(range(first_dense, num_layers)),
            block_name="mlp",
            expert_names=("gate_proj", "up_proj", "down_proj"),
            weights_in_input_dtype=False,
        )
    )


def _checked(m: MoeConfig) -> MoeConfig:
    if m.top_k > m.num_experts:
        raise MoeConfigError(f"num_experts_per_tok {m.top_k} > number of experts {m.num_experts}")
    if m.num_experts % m.n_group:
        raise MoeConfigError(f"{m.num_experts} experts do not split into n_group {m.n_group}")
    per_group = m.num_experts // m.n_group
    if m.n_group > 1 and per_group < 2:
        # The group score is the sum of each group's best two experts.
        raise MoeConfigError(f"n_group {m.n_group}: each group needs at least 2 experts")
    if m.topk_group > m.n_group:
        raise MoeConfigError(f"topk_group {m.topk_group} > n_group {m.n_group}")
    if m.top_k > m.topk_group * per_group:
        raise MoeConfigError(
            f"num_experts_per_tok {m.top_k} > the {m.topk_group * per_group} experts "
            f"in topk_group {m.topk_group} groups"
        )
    return m


def _positive(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise MoeConfigError(f"config.json lacks {key!r}")
    if int(value) < 1:
        raise MoeConfigError(f"{key} {value}: must be >= 1")
    return int(value)
