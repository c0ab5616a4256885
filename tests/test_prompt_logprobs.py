"""Prompt logprobs computed in prefill equal transformers' log_softmax at every prompt position
(float32, 1e-4), under chunked prefill, continuous batching, preemption and a prefix cache whose
hit a prompt-logprob request must not take (it recomputes its whole prompt)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from kvfence.engine import admission
from kvfence.engine.admission import Rejected
from kvfence.engine.llm import LLM
from kvfence.engine.prompt_logprobs import MAX_PROMPT_LOGPROB_ENTRIES
from kvfence.engine.request import (
    GenerateRequest,
    PromptLogprobs,
    RequestOutput,
    SamplingParams,
)

PAGE = 16
TOL = 1e-4


def hf_prompt_logprobs(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """[len - 1, V] log_softmax of transformers' logits at every prompt position but the last."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p])).logits[0].float()
            out.append(logits[:-1].log_softmax(-1))
    return out


def run(engine, prompts, params) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for i, p in enumerate(prompts):
        engine.submit(
            GenerateRequest(f"r{i}", "t", tuple(p), params),
            lambda o: outs.setdefault(o.request_id, []).append(o),
        )
    while not all(outs.get(f"r{i}") and outs[f"r{i}"][-1].finished for i in range(len(prompts))):
        engine.step()
    return outs


def check(plp: PromptLogprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert list(plp.token_ids) == prompt[1:]
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(plp.logprobs), want, atol=TOL), "chosen logprobs differ"
    want_rank = (ref > want[:, None]).sum(-1) + 1
    assert list(plp.ranks) == want_rank.tolist()
    if k and len(prompt) > 1:
        top = ref.topk(k, dim=-1)
        assert torch.allclose(torch.tensor(plp.top_logprobs), top.values, atol=TOL)
        assert [len(r) for r in plp.top_ids] == [k] * (len(prompt) - 1)


def only_first(outs: list[RequestOutput]) -> PromptLogprobs:
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and outs[0].prompt_logprobs is not None, "first output only"
    return carried[0]


@pytest.mark.parametrize("chunk", [24, 512])
def test_prompt_logprobs_match_transformers(checkpoint_dir, chunk: int) -> None:
    model_dir = checkpoint_dir("llama")
    lengths = [1, 2, PAGE - 1, PAGE + 1, 3 * PAGE + 5, 70]
    prompts = random_prompts(lengths, vocab=256, seed=5)
    llm = LLM(str(model_dir), kv_pool_tokens=4096, page_size=PAGE, chunked_prefill_size=chunk)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    outs = run(llm.engine, prompts, params)
    refs = hf_prompt_logprobs(model_dir, prompts)
    for i, p in enumerate(prompts):
        check(only_first(outs[f"r{i}"]), p, refs[i], 3)
    assert llm.engine.pool.num_used == 0


def test_prefix_cache_hit_does_not_lose_prompt_logprobs(checkpoint_dir) -> None:
    """The second request's prompt is cached by the first; asking for prompt logprobs it skips
    the hit and recomputes, so its logprobs are whole and right; one that does not ask still
    hits."""
    model_dir = checkpoint_dir("llama")
    [p] = random_prompts([4 * PAGE + 3], vocab=256, seed=8)
    llm = LLM(str(model_dir), kv_pool_tokens=4096, page_size=PAGE, enable_prefix_caching=True)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    first = run(llm.engine, [p], plain)["r0"]
    assert first[-1].cached_tokens == 0
    again = run(llm.engine, [p], plain)["r0"]
    assert again[-1].cached_tokens == 4 * PAGE, "the prompt is cached"
    asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    outs = run(llm.engine, [p], asked)["r0"]
    assert outs[-1].cached_tokens == 0, "a prompt-logprob request recomputes its prompt"
    check(only_first(outs), p, hf_prompt_logprobs(model_dir, [p])[0], 1)


def test_preempted_request_scores_each_prompt_token_once(checkpoint_dir) -> None:
    model_dir = checkpoint_dir("llama")
    prompts = random_prompts([40, 40, 40], vocab=256, seed=9)
    # 8 pages of 16: three 40-token prompts growing to 90 tokens cannot all stay.
    llm = LLM(str(model_dir), kv_pool_tokens=128, page_size=PAGE, context_length=128,
              chunked_prefill_size=32, unsafe_skip_preflight=True)
    params = SamplingParams(max_tokens=50, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    outs = run(llm.engine, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the test needs a preemption"
    refs = hf_prompt_logprobs(model_dir, prompts)
    for i, p in enumerate(prompts):
        check(only_first(outs[f"r{i}"]), p, refs[i], 0)


def test_prompt_logprobs_bounded_at_admission(checkpoint_dir, monkeypatch) -> None:
    """prompt tokens x (k + 1) above the cap is a 400 at the engine's door (a small cap here:
    the tiny model's context is shorter than the real cap allows)."""
    assert MAX_PROMPT_LOGPROB_ENTRIES >= 2048 * 2, "lm-eval's 2,048-token windows at k = 1 fit"
    monkeypatch.setattr(admission, "MAX_PROMPT_LOGPROB_ENTRIES", 100)
    llm = LLM(str(checkpoint_dir("llama")), kv_pool_tokens=4096)

    def verdict(n: int, k: int):
        sp = SamplingParams(max_tokens=1, prompt_logprobs=k)
        return llm.engine.admit(GenerateRequest("r", "t", (1,) * n, sp))

    assert not isinstance(verdict(50, 1), Rejected), "50 x 2 entries fit"
    big = verdict(51, 1)
    assert isinstance(big, Rejected) and big.code == "prompt_logprobs_too_large"
    assert big.status == 400 and big.param == "prompt_logprobs"
    assert isinstance(verdict(20, 5), Rejected) and not isinstance(verdict(20, 4), Rejected)


def test_prompt_logprobs_round_trip_and_reject_malformed() -> None:
    plp = PromptLogprobs((5, 6), (-1.0, -2.0), (1, 3), ((5, 1), (2, 6)), ((-1.0, -2.0),) * 2)
    assert PromptLogprobs.from_dict(plp.to_dict()) == plp
    bad = plp.to_dict() | {"ranks": [1]}
    with pytest.raises(ValueError):
        PromptLogprobs.from_dict(bad)
    with pytest.raises(ValueError):
        SamplingParams(prompt_logprobs=21)
