"""Sampling and stopping: seeds, top-k/top-p, stop strings and ids, max_tokens, logprobs; the
params' wire form. Abort ending a request once (I5) is in test_i5_status.py."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.model.sampling import SamplingBatch, _filter_top_k_top_p, sample


@pytest.fixture(scope="module")
def llm(checkpoint_dir) -> LLM:
    return LLM(str(checkpoint_dir("llama")), kv_pool_tokens=2048, context_length=256)


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm: LLM) -> None:
    prompts = random_prompts([12, 12], vocab=256, seed=9)

    def run(seed: int) -> list[list[int]]:
        sp = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return [c.token_ids for c in llm.generate(prompts, sp)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    prompts = random_prompts([20], vocab=256, seed=5)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    topk = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True)
    )
    assert greedy[0].token_ids == topk[0].token_ids


def test_top_p_filter_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = _filter_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.7]))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()
    out = _filter_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert torch.isfinite(out[0, :3]).all() and torch.isinf(out[0, 3])


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    sb = SamplingBatch(
        temperature=torch.ones(4000),
        top_p=torch.ones(4000),
        top_k=torch.full((4000,), -1),
        generators=[None] * 4000,
        needs_filter=False,
        all_greedy=False,
        max_logprobs=None,
    )
    ids = sample(logits, sb, torch.Generator().manual_seed(0)).token_ids
    freq = torch.bincount(ids, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_max_tokens_and_stop_token_ids(llm: LLM) -> None:
    prompts = random_prompts([10], vocab=256, seed=11)
    [c] = llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(c.token_ids) == 7 and c.finish_reason is FinishReason.LENGTH
    stop_id = c.token_ids[3]
    [s] = llm.generate(
        prompts,
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)),
    )
    first = c.token_ids.index(stop_id)
    assert s.token_ids == c.token_ids[: first + 1] and s.finish_reason is FinishReason.STOP


def test_stop_string_truncates_text(llm: LLM) -> None:
    prompts = random_prompts([10], vocab=256, seed=12)
    [c] = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert len(c.text) > 6
    stop = c.text[3:6]
    [s] = llm.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=(stop,))
    )
    assert s.finish_reason is FinishReason.STOP
    assert s.text == c.text[: c.text.index(stop)]


def test_logprobs_are_reported(llm: LLM) -> None:
    engine = llm.engine
    outs: list[RequestOutput] = []
    sp = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    engine.submit(GenerateRequest("lp", "t", (3, 4, 5), sp), outs.append)
    while not outs or not outs[-1].finished:
        engine.step()
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 4
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the top one


def test_sampling_params_round_trip_through_their_dict() -> None:
    """What a RESERVE carries: every field, JSON-able, and back exactly; bad dicts refused."""
    import json

    sp = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=("\n", "end"),
        stop_token_ids=(2, 9), ignore_eos=True, logprobs=2,
    )
    assert SamplingParams.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(TypeError):
        SamplingParams.from_dict({"tenant": "b"})
    with pytest.raises(TypeError):
        SamplingParams.from_dict({"stop": "x"})
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"top_p": 2.0})
