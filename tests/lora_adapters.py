"""Random LoRA adapters built with PEFT on the tiny checkpoints, and PEFT's greedy answers: the
reference the LoRA tests compare kvfence with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# MoE families: PEFT 0.21 on transformers 5 maps every gate/up/down target by leaf name to the
# routed experts' stacked parameters (`target_parameters`: one rank-r pair per expert, gate and
# up fused at rank 2r), so the dense layers' MLP and GLM's shared experts, plain nn.Linear
# modules, are never adapted that way. With that mapping off (`dense_mlp=True`) the same targets
# reach exactly those modules: both kinds of adapter are PEFT's own computation.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "glm4_moe")

# On an MoE family: attention + routed experts (PEFT's own mapping; gate_up at rank 2r), attention
# + dense MLP + shared experts, routed experts alone, and the second kind again. PEFT refuses
# rsLoRA beside the rank pattern its expert mapping writes.
MOE_ADAPTERS = [
    dict(rank=8), dict(rank=4, alpha=8.0, dense_mlp=True),
    dict(rank=2, targets=["gate_proj", "up_proj", "down_proj"]),
    dict(rank=8, alpha=4.0, dense_mlp=True),
]
SLOW = pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="another family: RUN_SLOW=1")




@contextmanager
def peft_v4_targets() -> Iterator[None]:
    """PEFT's transformers-5 remapping of MoE targets turned off while building or loading."""
    from peft.utils import transformers_weight_conversion as conv

    saved = conv.convert_peft_config_for_transformers
    conv.convert_peft_config_for_transformers = lambda *a, **k: None
    try:
        yield
    finally:
        conv.convert_peft_config_for_transformers = saved


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
    dense_mlp: bool = False,
) -> Path:
    """A PEFT checkpoint whose A and B are random (PEFT initialises B to zero, a no-op), large
    enough that its answers differ from the base model's. `dense_mlp`: on an MoE family, MLP
    targets mean the dense MLPs and shared experts, not the routed experts."""
    import peft
    import transformers as tf

    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets or ALL, use_rslora=rslora,
        lora_dropout=0.0, bias="none",
    )
    with peft_v4_targets() if dense_mlp else nullcontext():
        model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out


def peft_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int,
    dense_mlp: bool = False,
) -> list[list[int]]:
    import peft
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        with peft_v4_targets() if dense_mlp else nullcontext():
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
