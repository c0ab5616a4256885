"""Prompt logprobs on the HTTP API (unified): `echo` with `logprobs` (and `max_tokens: 0`) on
completions in OpenAI's legacy / vLLM's shape, vLLM's `prompt_logprobs` on completions and chat,
the 400s of their bad combinations, and lm-eval `local-completions` loglikelihoods equal to
transformers' (float32, 1e-4) with and without a prefix-cache hit."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from lm_eval_style import encode_pairs, hf_loglikelihoods, loglikelihoods

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.role import UnifiedService
from kvfence.server.api import build_app

MODEL = "tiny-llama"
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def engine(model_dir) -> Iterator[Engine]:
    cfg = EngineConfig(
        model=str(model_dir), kv_pool_tokens=4096, page_size=4, served_model_name=MODEL
    )
    e = Engine(cfg)
    e.start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(build_app(UnifiedService(engine), api_keys=None)) as c:
        yield c


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logp


def post(client: TestClient, body: dict, path: str = "/v1/completions") -> dict:
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_max_tokens_0_is_the_prompt_alone_with_its_logprobs(client, engine, hf) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(text)
    body = post(client, {"prompt": text, "echo": True, "logprobs": 2, "max_tokens": 0})
    [choice] = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf(ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=TOL)
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    for i, top in enumerate(lp["top_logprobs"][1:]):
        # the top 2 and the prompt's own token: up to k + 1 entries, as OpenAI documents
        assert 2 <= len(top) <= 3 and lp["tokens"][i + 1] in top
        assert max(top.values()) == pytest.approx(float(ref[i].max()), abs=TOL)


def test_echo_with_generation_leads_with_the_prompt(client, engine) -> None:
    ids = engine.tokenizer.encode("hello world, key:")
    body = post(client, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3,
                         "temperature": 0, "ignore_eos": True})
    [choice] = body["choices"]
    plain = post(client, {"prompt": ids, "logprobs": 1, "max_tokens": 3, "temperature": 0,
                          "ignore_eos": True})["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(ids) + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    assert body["usage"]["completion_tokens"] == 3


def test_echo_without_logprobs_is_text_only(client, engine) -> None:
    body = post(client, {"prompt": "hello world", "echo": True, "max_tokens": 0})
    assert body["choices"][0]["text"] == "hello world"
    assert body["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_field_on_completions_and_chat(client, engine, hf) -> None:
    text = "key: value key: value"
    ids = engine.tokenizer.encode(text)
    body = post(client, {"prompt": text, "prompt_logprobs": 2, "max_tokens": 1})
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    ref = hf(ids)
    for i, entry in enumerate(plp[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(float(ref[i, ids[i + 1]]), abs=TOL)
        assert own["rank"] == int((ref[i] > ref[i, ids[i + 1]]).sum()) + 1
        assert own["decoded_token"] == engine.tokenizer.decode([ids[i + 1]])
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[i + 1]))
        assert ranks == [r for r in (1, 2) if str(int(ref[i].topk(2).indices[r - 1])) in entry
                         and int(ref[i].topk(2).indices[r - 1]) != ids[i + 1]]
    chat = post(client, {"messages": [{"role": "user", "content": text}], "prompt_logprobs": 0,
                         "max_tokens": 1}, "/v1/chat/completions")
    cplp = chat["prompt_logprobs"]
    assert cplp[0] is None and len(cplp) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in cplp[1:]), "k = 0: the prompt's own token only"


def test_echo_streams_the_prompt_first(client, engine) -> None:
    ids = engine.tokenizer.encode("the lazy dog")
    with client.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 2,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    first = choices[0]
    assert first["text"].startswith(engine.tokenizer.decode(ids))
    assert first["logprobs"]["token_logprobs"][0] is None
    tokens = sum((c["logprobs"]["tokens"] for c in choices), [])
    offsets = sum((c["logprobs"]["text_offset"] for c in choices), [])
    assert len(tokens) == len(ids) + 2
    assert offsets[0] == 0 and offsets == sorted(offsets)
    if len(choices) > 1 and choices[1]["logprobs"]["text_offset"]:
        # later chunks count from the start of the choice's text, the echoed prompt included
        assert choices[1]["logprobs"]["text_offset"][0] >= len(engine.tokenizer.decode(ids))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_bad_prompt_fields_are_400(client, body: dict, param: str) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_prompt_logprobs_in_a_stream_is_400(client) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
        "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_logprobs_over_the_cap_is_400(client, engine, monkeypatch) -> None:
    from kvfence.engine import admission

    monkeypatch.setattr(admission, "MAX_PROMPT_LOGPROB_ENTRIES", 10)
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": list(range(1, 12)), "echo": True, "logprobs": 0,
        "max_tokens": 0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "prompt_logprobs_too_large"


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihoods_equal_transformers(client, engine, model_dir,
                                                   max_tokens: int) -> None:
    """lm-eval's local-completions requests (max_tokens 1, its own; 0, the prompt alone) give
    each choice transformers' loglikelihood; the second pass finds every context cached (the
    plain requests prime it) and must give the same numbers."""
    pairs = encode_pairs(model_dir)
    want = hf_loglikelihoods(model_dir, pairs)

    def send(body: dict) -> dict:
        return post(client, body)

    got = loglikelihoods(send, MODEL, pairs, max_tokens=max_tokens)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOL
    for ctx, cont in pairs:  # prime the cache with every full prompt, then score again
        post(client, {"prompt": ctx + cont, "max_tokens": 1})
    hit = post(client, {"prompt": pairs[0][0] + pairs[0][1], "max_tokens": 1})
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the cache holds them"
    again = loglikelihoods(send, MODEL, pairs, max_tokens=max_tokens)
    assert max(abs(g - w) for g, w in zip(again, want, strict=True)) < TOL


def test_echo_max_tokens_0_streams_the_prompt_alone(client, engine) -> None:
    text = "hello world"
    with client.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": [text, text], "echo": True, "logprobs": 1, "max_tokens": 0,
        "n": 2, "stream": True, "stream_options": {"include_usage": True},
    }) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    choices = [c for e in events for c in e["choices"]]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3], "one chunk per choice"
    for c in choices:
        assert c["text"] == text and c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == len(engine.tokenizer.encode(text))
    assert events[-1]["usage"]["completion_tokens"] == 0
