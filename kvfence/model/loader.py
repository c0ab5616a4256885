"""Load a local Hugging Face checkpoint (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kvfence.model.config import ModelConfig, UnsupportedModelError
from kvfence.model.llama import CausalLM
from kvfence.model.moe import Router

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers some exporters write that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp_layer(name: str, mc: ModelConfig) -> bool:
    """GLM-4 MoE checkpoints carry num_nextn_predict_layers multi-token-prediction layers after
    the decoder's (model.layers.{num_layers}...); transformers does not run them, nor do we."""
    extra = int(mc.raw.get("num_nextn_predict_layers", 0) or 0)
    match = _LAYER.match(name) if extra > 0 else None
    return match is not None and mc.num_layers <= int(match.group(1)) < mc.num_layers + extra


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir}: no *.safetensors weights found")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UnsupportedModelError(
            f"{model_dir}: shard {missing[0].name} listed in the index is missing"
        )
    return files


def load_model(model_dir: str | Path, dtype: str, device: str | torch.device) -> CausalLM:
    model_dir = Path(model_dir)
    mc = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(mc)
    model = model.to_empty(device=device).to(TORCH_DTYPES[dtype])
    for m in model.modules():
        if isinstance(m, Router) and m.moe.scoring == "sigmoid":
            m.float()  # as transformers keeps GLM's router weight and bias in float32
    if mc.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or _is_mtp_layer(name, mc):
                    continue
                if name == "lm_head.weight" and mc.tie_word_embeddings:
                    continue
                if name not in params:
                    raise UnsupportedModelError(f"{path.name}: unexpected weight {name!r}")
                tensor = f.get_tensor(name)
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise UnsupportedModelError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} "
                        f"!= config shape {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
                loaded.add(name)
    expected = {n for n in params if not (n == "lm_head.weight" and mc.tie_word_embeddings)}
    missing = sorted(expected - loaded)
    if missing:
        raise UnsupportedModelError(
            f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {missing[0]!r}"
        )
    model.eval()
    return model
