"""Random LoRA adapters built with PEFT on the tiny checkpoints, and PEFT's greedy answers: the
reference the LoRA tests compare kvfence with."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# MoE families: PEFT 0.21 on transformers 5 maps every gate/up/down target (by leaf name, so the
# dense layers' MLP and GLM's shared experts too) to the routed experts' fused parameters
# (`target_parameters`), which kvfence refuses; so their adapters target attention only.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "glm4_moe")


def build_adapter(
    model_dir: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | str | None = None,
    rslora: bool = False,
    std: float = 0.2,
) -> Path:
    """A PEFT checkpoint whose A and B are random (PEFT initialises B to zero, a no-op), large
    enough that its answers differ from the base model's."""
    import peft
    import transformers as tf

    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets or ALL, use_rslora=rslora,
        lora_dropout=0.0, bias="none",
    )
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out


def peft_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    import peft
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
        out.append(ids[0, len(p):].tolist())
    return out
