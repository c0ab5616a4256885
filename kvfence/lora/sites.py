"""Where a LoRA adapter can apply: each fused projection of the decoder (a *site*) and the Hugging
Face module names whose output columns it holds. Pure arithmetic over a ModelConfig, so the pool
sizing and preflight count the slot table's bytes without building the model."""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.model.config import ModelConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# The routed experts' stacked parameters as transformers 5 holds them and PEFT targets them
# (`target_parameters`; PEFT maps gate_proj/up_proj/down_proj targets of MoE families there).
EXPERT_TARGETS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Site:
    """One fused projection: its input width and its output slices (HF name, width), in the
    column order of the fused weight."""

    key: str  # "layers.{i}.qkv" | ".o" | ".gate_up" | ".down" (".shared" before the kind for
    #          GLM's shared experts, ".experts" for the routed experts)
    module: str  # the HF module path of the slices' parent, e.g. "model.layers.3.self_attn"
    in_dim: int
    slices: tuple[tuple[str, int], ...]
    # Routed experts: how many, each with its own A and B. PEFT fuses gate and up into one
    # parameter and doubles its rank, so the routed gate_up holds twice --max-lora-rank.
    experts: int = 0
    rank_scale: int = 1

    @property
    def out_dim(self) -> int:
        return sum(n for _, n in self.slices)

    def width(self, max_rank: int) -> int:
        """Columns of A_t (rows of B_t): each slice's rank block side by side."""
        return max_rank * self.rank_scale * len(self.slices)

    def slot_elements(self, rank: int) -> int:
        """A_t [in, width] and a block-diagonal B_t [width, out] per slot (and expert)."""
        r = self.width(rank)
        return max(self.experts, 1) * (self.in_dim * r + r * self.out_dim)


def model_sites(mc: ModelConfig) -> list[Site]:
    """Every site of the model: attention everywhere; the MLP of dense layers and GLM's shared
    experts; the routed experts' stacked gate_up and down."""
    h, nq, nkv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    out: list[Site] = []
    for i in range(mc.num_layers):
        attn = f"model.layers.{i}.self_attn"
        out.append(Site(f"layers.{i}.qkv", attn, h, (("q_proj", nq), ("k_proj", nkv),
                                                      ("v_proj", nkv))))
        out.append(Site(f"layers.{i}.o", attn, nq, (("o_proj", h),)))
        mlps: list[tuple[str, str, int]] = []
        if not mc.is_sparse(i):
            mlps.append((f"layers.{i}", f"model.layers.{i}.mlp", mc.intermediate_size))
        elif mc.moe is not None and mc.moe.shared_intermediate_size:
            block = f"model.layers.{i}.{mc.moe.block_name}.shared_experts"
            mlps.append((f"layers.{i}.shared", block, mc.moe.shared_intermediate_size))
        for key, module, inter in mlps:
            out.append(Site(f"{key}.gate_up", module, h, (("gate_proj", inter),
                                                          ("up_proj", inter))))
            out.append(Site(f"{key}.down", module, inter, (("down_proj", h),)))
        if mc.is_sparse(i) and mc.moe is not None:
            m, ei = mc.moe, mc.moe.expert_intermediate_size
            # transformers 5's module tree (PEFT's keys) names every family's block "mlp".
            module = f"model.layers.{i}.mlp.experts"
            out.append(Site(f"layers.{i}.experts.gate_up", module, h, (("gate_up_proj", 2 * ei),),
                            m.num_experts, 2))
            out.append(Site(f"layers.{i}.experts.down", module, ei, (("down_proj", h),),
                            m.num_experts))
    return out


def slot_table_bytes(mc: ModelConfig, max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """Device bytes of the slot table: every site, every slot, at the largest rank."""
    return max_loras * dtype_bytes * sum(s.slot_elements(max_rank) for s in model_sites(mc))
