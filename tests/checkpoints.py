"""Tiny random Hugging Face checkpoints of every supported architecture, built with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# Tiny mixture-of-experts configs: each family's routing features switched on (GLM-4 MoE: a dense
# first layer, shared expert, grouped top-k with a correction bias, scaling, partial rotary, q/k
# norm, qkv bias; Qwen3-MoE: a dense layer by mlp_only_layers, renormalised top-k; Mixtral: top-2
# with a sliding window shorter than the longest test prompts).
MOE_DEFAULTS: dict[str, tuple[str, dict]] = {
    "mixtral": (
        "Mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=48),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
        ),
    ),
    "glm4_moe": (
        "Glm4Moe",
        dict(
            head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
            attention_bias=True, num_hidden_layers=3,
        ),
    ),
}


def build_checkpoint(arch: str, out: Path, *, vocab: int = 256, seed: int = 0, **overrides) -> Path:
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        bos_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=16, **common), tf.Qwen3ForCausalLM
    elif arch in MOE_DEFAULTS:
        name, defaults = MOE_DEFAULTS[arch]
        kwargs = {**common, **defaults, **overrides}  # the test's overrides win
        cfg = getattr(tf, name + "Config")(**kwargs)
        cls = getattr(tf, name + "ForCausalLM")
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Random init gives near-uniform logits; scale up so greedy ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0 if "embed" in name or "lm_head" in name else 2.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make it pick experts
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(out, safe_serialization=True)
    write_byte_tokenizer(out, vocab)
    return out


def write_byte_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE trained on a little text so encode/decode and chat templates work."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog. hello world, key: value"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def word_level_checkpoint(out: Path, tiny: Path) -> Path:
    """The bundled tiny model's weights under a word-level tokenizer (`w6` ... `w2047`, anything
    else the unknown token) and no chat template: the kind of checkpoint whose vocabulary makes
    random words all one token."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny / name, out / name)
    specials = ["<unk>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), 2048)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out
