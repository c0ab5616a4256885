"""Checks that models/kvfence-tiny loads in transformers, fits its budget and really does recall.

Owns the model-artifact contract (size, context, chat template, recall); not engine behaviour.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import jinja2
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "kvfence-tiny"
sys.path.insert(0, str(REPO / "scripts"))

import eval_recall  # noqa: E402
import recall_data  # noqa: E402

pytest.importorskip("transformers")

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the amber heron?"},
]
EXPECTED_CHAT = (
    "<|bos|><|system|>\nBe brief.<|eos|>\n"
    "<|user|>\nWhat is the amber heron?<|eos|>\n"
    "<|assistant|>\n"
)


@pytest.fixture(scope="module")
def loaded() -> tuple[torch.nn.Module, object]:
    torch.set_num_threads(1)
    return eval_recall.load(MODEL_DIR, "float32")


def test_size_and_shape() -> None:
    total = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert total <= 20 * 1024 * 1024, total
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["max_position_embeddings"] >= 4096
    assert cfg["rope_parameters"]["rope_type"] == "default"
    assert cfg["rope_scaling"] is None
    assert cfg["attention_bias"] is False
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name


def test_chat_template_renders(loaded: tuple[torch.nn.Module, object]) -> None:
    _, tok = loaded
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == (
        EXPECTED_CHAT
    )
    # The same string from the raw template with plain jinja2, the way a serving engine renders it.
    tc = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(tc["chat_template"])
    assert (
        template.render(messages=MESSAGES, bos_token=tc["bos_token"])
        == EXPECTED_CHAT[: -len("<|assistant|>\n")]
    )
    ids = tok(EXPECTED_CHAT, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2 and ids.count(2) == 2


def test_recall(loaded: tuple[torch.nn.Module, object]) -> None:
    model, tok = loaded
    maker = recall_data.PromptMaker("heldout", eval_recall.token_counter(tok))
    res = eval_recall.evaluate(model, tok, maker, n=30, lo=200, hi=600, seed=1234)
    assert res.rate >= 0.9, res.summary() + "\n" + "\n".join(res.failures)


def test_recalled_metric() -> None:
    assert recall_data.recalled(" aB3xYz90QwEr\nfoo", "aB3xYz90QwEr")
    assert not recall_data.recalled("  aB3xYz90QwEr", "aB3xYz90QwEr")
    assert not recall_data.recalled(" aB3xYz90Qw", "aB3xYz90QwEr")
    rng = random.Random(0)
    assert all(12 <= len(recall_data.random_value(rng)) <= 16 for _ in range(50))
