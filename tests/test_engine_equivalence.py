"""kvfence's greedy output is token-exact with transformers under continuous batching and
chunked prefill, for every supported architecture."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, random_prompts

from kvfence.engine.engine import Engine
from kvfence.engine.llm import LLM, Completion
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams

PAGE = 16
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5, 70]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def run_staggered(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Submit half the prompts, step a few times, then the rest: requests join a running batch."""
    outs: dict[str, list[int]] = {}
    done: set[str] = set()

    def sink(o: RequestOutput) -> None:
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            done.add(o.request_id)

    ids = [f"r{i}" for i in range(len(prompts))]
    half = len(prompts) // 2
    for rid, p in zip(ids[:half], prompts[:half], strict=True):
        engine.submit(GenerateRequest(rid, "t", tuple(p), params), sink)
    for _ in range(3):
        engine.step()
    for rid, p in zip(ids[half:], prompts[half:], strict=True):
        engine.submit(GenerateRequest(rid, "t", tuple(p), params), sink)
    while len(done) < len(ids):
        engine.step()
    return [outs[r] for r in ids]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_token_exact_with_transformers(arch: str, checkpoint_dir) -> None:
    model_dir = checkpoint_dir(arch)
    prompts = random_prompts(LENGTHS, vocab=256)
    llm = LLM(str(model_dir), kv_pool_tokens=4096, page_size=PAGE, chunked_prefill_size=24)
    assert llm.engine.runner.attention.name == "cpu_native"  # chunks read pages in place
    got = run_staggered(llm.engine, prompts, GREEDY)
    want = hf_greedy(model_dir, prompts, 32)
    for n, g, w in zip(LENGTHS, got, want, strict=True):
        assert g == w, f"{arch}: prompt of {n} tokens diverged"
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize(
    "variant",
    [
        {"tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"num_key_value_heads": 1},
    ],
    ids=["tied", "llama3-rope", "mqa"],
)
def test_llama_variants_token_exact(variant: dict, checkpoint_dir) -> None:
    model_dir = checkpoint_dir("llama", **variant)
    prompts = random_prompts([5, 33, 100], vocab=256, seed=3)
    got = LLM(str(model_dir), kv_pool_tokens=2048, chunked_prefill_size=40).generate(
        prompts, GREEDY
    )
    assert [c.token_ids for c in got] == hf_greedy(model_dir, prompts, 32)


def test_text_prompt_roundtrip(checkpoint_dir) -> None:
    llm = LLM(str(checkpoint_dir("llama")), kv_pool_tokens=1024)
    [c] = llm.generate(
        ["hello world"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert isinstance(c, Completion) and len(c.token_ids) == 8
    assert c.text == llm.engine.tokenizer.decode(c.token_ids)
