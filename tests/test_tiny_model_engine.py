"""The bundled model in kvfence's own engine: token-exact with transformers, and it recalls."""

from __future__ import annotations

import random
import sys

from conftest import REPO, TINY_MODEL, hf_greedy

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams

sys.path.insert(0, str(REPO / "scripts"))
import recall_data  # noqa: E402


def prompts(llm: LLM, n: int, lo: int, hi: int, seed: int) -> list[recall_data.RecallPrompt]:
    tok = llm.engine.tokenizer
    maker = recall_data.PromptMaker("heldout", lambda s: len(tok.encode(s, False)))
    rng = random.Random(seed)
    return [maker.make(rng, lo, hi) for _ in range(n)]


def test_tiny_model_greedy_token_exact_with_transformers() -> None:
    llm = LLM(str(TINY_MODEL), kv_pool_tokens=16384, chunked_prefill_size=256)
    cases = prompts(llm, 4, 200, 1500, seed=5) + prompts(llm, 1, 1500, 3000, seed=6)
    ids = [llm.engine.tokenizer.encode(c.text) for c in cases]
    got = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in got] == hf_greedy(TINY_MODEL, ids, 24)


def test_tiny_model_recalls_through_kvfence() -> None:
    llm = LLM(str(TINY_MODEL), kv_pool_tokens=32768)
    cases = prompts(llm, 30, 200, 800, seed=2026)
    outs = llm.generate([c.text for c in cases], SamplingParams(max_tokens=16, temperature=0))
    hits = sum(recall_data.recalled(o.text, c.value) for o, c in zip(outs, cases, strict=True))
    assert hits >= 27, f"recall {hits}/30"
