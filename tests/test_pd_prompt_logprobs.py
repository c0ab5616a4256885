"""Prompt logprobs in PD: prefill scores the prompt (RESERVE's sampling params carry the ask) and
DONE carries the scores to decode, which answers with them or fails the request closed (I5).
Through decode's HTTP API: lm-eval `local-completions` loglikelihoods equal transformers'
(float32, 1e-4) with and without a prefix-cache hit on both roles."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from lm_eval_style import encode_pairs, hf_loglikelihoods, loglikelihoods
from pd_harness import PDPair

from kvfence.server.api import build_app
from kvfence.server.hop import sign_prefill

MODEL = "tiny-llama"
OPERATOR = "operator-key-for-the-hop-signature"
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def pair(model_dir) -> Iterator[PDPair]:
    pd = PDPair(str(model_dir), kv_pool_tokens=4096, page_size=4, served_model_name=MODEL)
    yield pd
    pd.close()


@pytest.fixture(scope="module")
def client(pair: PDPair) -> Iterator[TestClient]:
    app = build_app(pair.decode, api_keys=None, operator_key=OPERATOR)
    with TestClient(app) as c:
        yield c


def send(client: TestClient, pair: PDPair, body: dict, status: int = 200) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **body},
                    headers=sign_prefill(OPERATOR, pair.peer))
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_pd_lm_eval_loglikelihoods_equal_transformers(client, pair, model_dir,
                                                      max_tokens: int) -> None:
    pairs = encode_pairs(model_dir)
    want = hf_loglikelihoods(model_dir, pairs)
    got = loglikelihoods(lambda b: send(client, pair, b), MODEL, pairs, max_tokens=max_tokens)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOL
    for ctx, cont in pairs:  # both roles' caches now hold every prompt
        send(client, pair, {"prompt": ctx + cont, "max_tokens": 1})
    hit = send(client, pair, {"prompt": pairs[0][0] + pairs[0][1], "max_tokens": 1})
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "decode holds the prompt"
    again = loglikelihoods(lambda b: send(client, pair, b), MODEL, pairs, max_tokens=max_tokens)
    assert max(abs(g - w) for g, w in zip(again, want, strict=True)) < TOL
    assert pair.wait_idle(), pair.pages_used()


def test_pd_prompt_logprobs_field_matches_transformers(client, pair, model_dir) -> None:
    import transformers as tf

    ids = pair.decode.engine.tokenizer.encode("hello world, key: value")
    body = send(client, pair, {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 2,
                               "temperature": 0})
    plp = body["choices"][0]["prompt_logprobs"]
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:]):
        assert entry[str(ids[i + 1])]["logprob"] == pytest.approx(float(ref[i, ids[i + 1]]),
                                                                  abs=TOL)
        top = ref[i].topk(3)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                       strict=True), start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=TOL)
            assert entry[str(t)]["rank"] == r or t == ids[i + 1]


def test_i5_decode_fails_closed_when_prefill_sends_no_prompt_logprobs(client, pair) -> None:
    """A prefill whose DONE lacks the prompt logprobs: decode's client gets a 500, never a 200
    without them. Twin: with decode's check off, the answer is a 200 whose prompt entries are
    missing, which is what the check prevents."""
    body = {"prompt": [5, 6, 7, 8, 9], "echo": True, "logprobs": 1, "max_tokens": 0}
    with pair.faults.injected("drop_prompt_logprobs"):
        err = send(client, pair, body, status=500)
    assert err["error"]["code"] == "prompt_logprobs_missing"
    with pair.faults.injected("drop_prompt_logprobs", "skip_prompt_logprobs_check"):
        partial = send(client, pair, body)
    assert partial["choices"][0]["logprobs"]["token_logprobs"] == [None], "the leak the check stops"
    whole = send(client, pair, body)
    assert len(whole["choices"][0]["logprobs"]["token_logprobs"]) == 5
    assert pair.wait_idle(), pair.pages_used()
