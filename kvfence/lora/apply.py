"""Binds the slot table's sites to the model's fused projections (after fuse_projections), so each
one adds its LoRA update after the base matmul, on the torch and the packed native path alike;
and the routed experts' sites to their MoE block."""

from __future__ import annotations

from kvfence.lora.slots import ExpertDelta, LoraSlots
from kvfence.model.linear import Projection
from kvfence.model.llama import CausalLM
from kvfence.model.mlp import MLP
from kvfence.model.moe import SparseMoE


def site_projections(model: CausalLM) -> dict[str, Projection]:
    """Site key (kvfence/lora/sites.py) -> the fused projection computing it."""
    out: dict[str, Projection] = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert attn.qkv is not None and attn.o is not None, "fuse_projections() first"
        out[f"layers.{i}.qkv"], out[f"layers.{i}.o"] = attn.qkv, attn.o
        ffn = layer.ffn
        mlp, key = (ffn, f"layers.{i}") if isinstance(ffn, MLP) else (None, "")
        if isinstance(ffn, SparseMoE) and ffn.shared_experts is not None:
            mlp, key = ffn.shared_experts, f"layers.{i}.shared"
        if mlp is not None:
            assert mlp.gate_up is not None and mlp.down is not None
            out[f"{key}.gate_up"], out[f"{key}.down"] = mlp.gate_up, mlp.down
    return out


def install(model: CausalLM, slots: LoraSlots) -> None:
    projections = site_projections(model)
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.ffn, SparseMoE):
            d = slots.deltas
            layer.ffn.lora = ExpertDelta(d[f"layers.{i}.experts.gate_up"],
                                         d[f"layers.{i}.experts.down"])
    missing = {k for k, d in slots.deltas.items() if not d.site.experts} - projections.keys()
    assert not missing, f"LoRA sites with no projection: {sorted(missing)}"
    for key, delta in slots.deltas.items():
        if not delta.site.experts:
            projections[key].lora = delta
