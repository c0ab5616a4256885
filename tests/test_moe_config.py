"""MoE config.json parsing: each family's published configs give the published parameter counts
and the right KV size in `kvfence preflight`; variants kvfence does not compute are refused at
start-up; GLM's multi-token-prediction layers are skipped at load, anything else unknown is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfence.engine.llm import LLM
from kvfence.model.config import ModelConfig, UnsupportedModelError
from kvfence.model.loader import load_model
from kvfence.tools.preflight import main

# The fields of the published config.json files (zai-org/GLM-4.5, zai-org/GLM-4.5-Air,
# Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1), written out so no test downloads anything.
GLM45_COMMON = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "n_group": 1,
    "topk_group": 1, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
    "num_key_value_heads": 8, "num_experts_per_tok": 8, "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151552,
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
}  # fmt: skip
GLM45 = {
    **GLM45_COMMON, "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 92, "first_k_dense_replace": 3,
    "n_routed_experts": 160, "routed_scaling_factor": 2.5, "use_qk_norm": True,
}  # fmt: skip
GLM45_AIR = {
    **GLM45_COMMON, "hidden_size": 4096, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 46, "first_k_dense_replace": 1,
    "n_routed_experts": 128, "routed_scaling_factor": 1.0, "use_qk_norm": False,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}  # fmt: skip


@pytest.mark.parametrize(
    "cfg, total, active, active_counts_embeddings",
    [
        # GLM publishes active parameters without the embedding and LM head; Qwen and Mistral
        # with them. The GLM-4.5 total leaves out the MTP layer, which is not served (1% of 355B).
        (GLM45, 355e9, 32e9, False),
        (GLM45_AIR, 106e9, 12e9, False),
        (QWEN3_30B_A3B, 30.5e9, 3.3e9, True),
        (MIXTRAL_8X7B, 46.7e9, 12.9e9, True),
    ],
    ids=["glm-4.5", "glm-4.5-air", "qwen3-30b-a3b", "mixtral-8x7b"],
)
def test_published_parameter_counts(cfg, total, active, active_counts_embeddings) -> None:
    mc = ModelConfig.from_dict(cfg)
    got_active = mc.num_active_params - (0 if active_counts_embeddings else mc.num_embedding_params)
    # The published figures are rounded to 2-3 significant digits (12B is 12.18B here).
    assert mc.num_params == pytest.approx(total, rel=0.02)
    assert got_active == pytest.approx(active, rel=0.02)


def test_preflight_plans_glm45_with_all_experts_resident_and_its_kv(tmp_path: Path, capsys) -> None:
    d = tmp_path / "glm-4.5"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GLM45))
    argv = ["--model", str(d), "--device-memory-gib", "141", "--tp-size", "8", "--json"]
    main(argv)
    plan = json.loads(capsys.readouterr().out)
    mc = ModelConfig.from_dict(GLM45)
    assert plan["num_params"] == mc.num_params and plan["num_active_params"] < mc.num_params / 10
    assert plan["model_bytes"] == -(-mc.num_params * 2 // 8)  # bf16, all experts, split by 8
    # 92 layers (the MTP layer keeps no KV here), one of 8 KV heads of 128 per rank, bf16.
    assert plan["kv_bytes_per_token"] == 2 * 92 * 1 * 128 * 2
    main(argv[:-1])
    assert "33.63B active" in capsys.readouterr().out  # printed with the embeddings


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({**GLM45_AIR, "topk_method": "greedy"}, "topk_method"),
        ({**GLM45_AIR, "scoring_func": "softmax"}, "scoring_func"),
        ({**GLM45_AIR, "n_group": 3}, "n_group"),
        ({**GLM45_AIR, "n_group": 8, "topk_group": 9}, "topk_group"),
        ({**GLM45_AIR, "n_group": 8, "topk_group": 1, "num_experts_per_tok": 20},
         "num_experts_per_tok"),
        ({**QWEN3_30B_A3B, "num_experts_per_tok": 129}, "num_experts_per_tok"),
        ({**MIXTRAL_8X7B, "hidden_act": "gelu"}, "hidden_act"),
        ({**GLM45_AIR, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         "partial_rotary_factor"),
    ],
    ids=["topk-method", "scoring", "groups-split", "topk-group", "topk-over-groups",
         "topk-over-experts", "act", "partial-rope-scaled"],
)  # fmt: skip
def test_unsupported_moe_variants_refused_with_the_field_named(cfg, field) -> None:
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(cfg)


def test_engine_refuses_an_unsupported_variant_at_start_up(checkpoint_dir, tmp_path) -> None:
    src = checkpoint_dir("glm4_moe")
    d = tmp_path / "glm-variant"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**cfg, "scoring_func": "softmax"}))
    with pytest.raises(UnsupportedModelError, match="scoring_func 'softmax'"):
        LLM(str(d), kv_pool_tokens=256)


def test_glm_mtp_layer_weights_skipped_other_unknown_weights_refused(
    checkpoint_dir, tmp_path
) -> None:
    src = checkpoint_dir("glm4_moe")
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(src / "model.safetensors")
    d = tmp_path / "glm-mtp"
    d.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).symlink_to(f)
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128)}
    save_file({**weights, **mtp}, d / "model.safetensors")
    model = load_model(d, "float32", "cpu")
    assert len(model.model.layers) == n
    beyond = {f"model.layers.{n + 1}.eh_proj.weight": torch.zeros(64, 128)}
    save_file({**weights, **beyond}, d / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="unexpected weight"):
        load_model(d, "float32", "cpu")
