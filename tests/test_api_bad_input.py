"""Bad input at the HTTP door: every case gets the right status and an OpenAI error body, nothing
reaches the engine (I1), and the server stays healthy afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fake_engine import EOS, FakeEngine
from fastapi.testclient import TestClient

from kvfence.server.api import build_app

MODEL = "fake-model"
LIMIT = 64 * 1024


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def resp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", **kw}


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    code: str
    param: str | None = None
    path: str = "/v1/completions"
    method: str = "POST"
    body: Any = None  # JSON-encoded unless raw is set
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
NESTED = b'{"model": "fake-model", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"

CASES = [
    # body is not JSON / not an object
    Case("malformed_json", 400, "invalid_json", raw=b'{"model": "fake-model", "prompt": '),
    Case("empty_body", 400, "invalid_json", raw=b""),
    Case("json_array_body", 400, "invalid_json", raw=b"[1, 2]"),
    Case("json_string_body", 400, "invalid_json", raw=b'"hello"'),
    Case("invalid_utf8", 400, "invalid_json", raw=b'{"model": "\xff\xfe", "prompt": "x"}'),
    Case("nan_temperature", 400, "invalid_value", "temperature",
         raw=b'{"model": "fake-model", "prompt": "x", "temperature": NaN}'),
    Case("deeply_nested", 400, "invalid_json", raw=NESTED),
    # missing fields
    Case("missing_model", 400, "missing_required_parameter", "model", body={"prompt": "hi"}),
    Case("missing_prompt", 400, "missing_required_parameter", "prompt", body={"model": MODEL}),
    Case("missing_messages", 400, "missing_required_parameter", "messages", CH,
         body={"model": MODEL}),
    # wrong types
    Case("model_not_string", 400, "invalid_type", "model", body=comp(model=7)),
    Case("max_tokens_string", 400, "invalid_type", "max_tokens", body=comp(max_tokens="5")),
    Case("max_tokens_float", 400, "invalid_type", "max_tokens", body=comp(max_tokens=5.5)),
    Case("temperature_string", 400, "invalid_type", "temperature", body=comp(temperature="hot")),
    Case("stream_string", 400, "invalid_type", "stream", body=comp(stream="yes")),
    Case("stream_options_type", 400, "invalid_type", "stream_options",
         body=comp(stream=True, stream_options="usage")),
    Case("prompt_number", 400, "invalid_value", "prompt", body=comp(prompt=5)),
    Case("prompt_float_ids", 400, "invalid_value", "prompt", body=comp(prompt=[1.5, 2.0])),
    Case("prompt_bool_ids", 400, "invalid_value", "prompt", body=comp(prompt=[True, False])),
    Case("prompt_mixed_ids", 400, "invalid_value", "prompt", body=comp(prompt=[65, "a"])),
    Case("prompt_nested_non_int", 400, "invalid_value", "prompt", body=comp(prompt=[[65, "a"]])),
    Case("prompt_object", 400, "invalid_value", "prompt", body=comp(prompt={"text": "hi"})),
    Case("stop_number", 400, "invalid_type", "stop", body=comp(stop=123)),
    Case("stop_too_many", 400, "invalid_value", "stop", body=comp(stop=["a", "b", "c", "d", "e"])),
    Case("stop_empty_string", 400, "invalid_value", "stop", body=comp(stop=[""])),
    Case("stop_token_ids_negative", 400, "invalid_value", "stop_token_ids[0]",
         body=comp(stop_token_ids=[-1])),
    Case("messages_string", 400, "invalid_type", "messages", CH, body=chat(messages="hi")),
    Case("messages_empty", 400, "invalid_value", "messages", CH, body=chat(messages=[])),
    Case("message_bad_role", 400, "invalid_value", "messages[0].role", CH,
         body=chat(messages=[{"role": "wizard", "content": "hi"}])),
    Case("message_unknown_role", 400, "invalid_value", "messages[0].role", CH,
         body=chat(messages=[{"role": "function", "content": "hi"}])),
    Case("message_image_part", 400, "invalid_value", "messages[0].content", CH,
         body=chat(messages=[{"role": "user",
                              "content": [{"type": "image_url", "image_url": {}}]}])),
    Case("message_content_number", 400, "invalid_value", "messages[0].content", CH,
         body=chat(messages=[{"role": "user", "content": 5}])),
    Case("chat_template_refuses", 400, "invalid_messages", "messages", CH,
         body=chat(messages=[{"role": "assistant", "content": "first"}])),
    # values out of range
    Case("max_tokens_zero", 400, "invalid_value", "max_tokens", body=comp(max_tokens=0)),
    Case("max_tokens_negative", 400, "invalid_value", "max_tokens", body=comp(max_tokens=-3)),
    Case("max_completion_tokens_zero", 400, "invalid_value", "max_completion_tokens", CH,
         body=chat(max_completion_tokens=0)),
    Case("temperature_negative", 400, "invalid_value", "temperature", body=comp(temperature=-0.1)),
    Case("temperature_above_2", 400, "invalid_value", "temperature", body=comp(temperature=2.5)),
    Case("top_p_zero", 400, "invalid_value", "top_p", body=comp(top_p=0)),
    Case("top_p_above_1", 400, "invalid_value", "top_p", body=comp(top_p=1.5)),
    Case("top_k_below_minus_1", 400, "invalid_value", "top_k", body=comp(top_k=-2)),
    Case("seed_too_big", 400, "invalid_value", "seed", body=comp(seed=2**64)),
    Case("n_zero", 400, "invalid_value", "n", body=comp(n=0)),
    Case("n_too_big", 400, "invalid_value", "n", body=comp(n=1000)),
    Case("too_many_generations", 400, "invalid_value", "n", body=comp(prompt=["a"] * 5, n=16)),
    Case("logprobs_6", 400, "invalid_value", "logprobs", body=comp(logprobs=6)),
    Case("logprobs_negative", 400, "invalid_value", "logprobs", body=comp(logprobs=-1)),
    Case("chat_logprobs_int", 400, "invalid_type", "logprobs", CH, body=chat(logprobs=3)),
    Case("chat_top_logprobs_21", 400, "invalid_value", "top_logprobs", CH,
         body=chat(logprobs=True, top_logprobs=21)),
    Case("chat_top_logprobs_without_logprobs", 400, "invalid_value", "top_logprobs", CH,
         body=chat(top_logprobs=2)),
    Case("max_tokens_0_without_echo", 400, "invalid_value", "max_tokens",
         body=comp(max_tokens=0)),
    Case("prompt_logprobs_21", 400, "invalid_value", "prompt_logprobs",
         body=comp(prompt_logprobs=21)),
    Case("prompt_logprobs_in_stream", 400, "invalid_value", "prompt_logprobs",
         body=comp(prompt_logprobs=1, stream=True)),
    # parsed but unsupported: refused, not silently ignored
    Case("suffix", 400, "unsupported_parameter", "suffix", body=comp(suffix="end")),
    Case("presence_penalty", 400, "unsupported_parameter", "presence_penalty",
         body=comp(presence_penalty=0.5)),
    Case("logit_bias", 400, "unsupported_parameter", "logit_bias", body=comp(logit_bias={"1": 5})),
    Case("best_of", 400, "unsupported_parameter", "best_of", body=comp(best_of=3)),
    # tools are served now (tests/test_tool_calls.py); a tool_choice naming no tool is not.
    Case("tool_choice_unknown_function", 400, "unknown_function", "tool_choice", CH,
         body=chat(tools=[{"type": "function", "function": {"name": "f"}}],
                   tool_choice={"type": "function", "function": {"name": "g"}})),
    # response_format json_object/json_schema are served now (tests/test_structured.py).
    Case("response_format_unknown_type", 400, "invalid_value", "response_format.type", CH,
         body=chat(response_format={"type": "xml"})),
    # token ids: admission (I1) refuses ids outside the vocabulary, and empty prompts
    Case("token_id_out_of_vocab", 400, "invalid_token_id", "prompt",
         body=comp(prompt=[65, 999999])),
    Case("token_id_negative", 400, "invalid_token_id", "prompt", body=comp(prompt=[-1])),
    Case("token_id_huge", 400, "invalid_token_id", "prompt", body=comp(prompt=[10**30])),
    Case("token_id_out_of_vocab_nested", 400, "invalid_token_id", "prompt",
         body=comp(prompt=[[65, 258]])),
    Case("empty_token_prompt", 400, "empty_prompt", "prompt", body=comp(prompt=[])),
    # an empty string is an empty prompt too, not a lone BOS to continue from (was a 200)
    Case("empty_string_prompt", 400, "empty_prompt", "prompt", body=comp(prompt="")),
    Case("prompt_too_long", 400, "context_length_exceeded", "prompt", body=comp(prompt="x" * 600)),
    Case("max_tokens_past_context", 400, "context_length_exceeded", "max_tokens",
         body=comp(max_tokens=10_000)),
    # model, routes, methods
    Case("unknown_model", 404, "model_not_found", "model", body=comp(model="gpt-4")),
    Case("unknown_model_chat", 404, "model_not_found", "model", CH, body=chat(model="gpt-4")),
    Case("unknown_route", 404, "not_found", None, "/v1/engines", "GET"),
    Case("unknown_route_post", 404, "not_found", None, "/nope", body={}),
    Case("get_on_completions", 405, "method_not_allowed", None, C, "GET"),
    Case("delete_on_chat", 405, "method_not_allowed", None, CH, "DELETE"),
    Case("post_on_models", 405, "method_not_allowed", None, "/v1/models", body={}),
    # the Responses API: the same door, and what a stateless server cannot honour
    Case("responses_malformed_json", 400, "invalid_json", None, R, raw=b'{"model": "fake-m'),
    Case("responses_missing_input", 400, "missing_required_parameter", "input", R,
         body={"model": MODEL}),
    Case("responses_input_wrong_type", 400, "invalid_type", "input", R, body=resp(input=5)),
    Case("responses_unknown_item", 400, "unsupported_parameter", "input[0].type", R,
         body=resp(input=[{"type": "item_reference", "id": "msg_1"}])),
    Case("responses_previous_response_id", 400, "unsupported_parameter", "previous_response_id",
         R, body=resp(previous_response_id="resp_1")),
    Case("responses_hosted_tool", 400, "unsupported_parameter", "tools[0].type", R,
         body=resp(tools=[{"type": "web_search"}])),
    Case("responses_unknown_model", 404, "model_not_found", "model", R, body=resp(model="gpt-4")),
    Case("get_on_responses", 405, "method_not_allowed", None, R, "GET"),
    # size
    Case("body_over_limit_declared", 413, "request_too_large",
         body=comp(prompt="x" * (LIMIT + 10))),
    Case("bad_content_length", 400, "invalid_header", raw=b"{}",
         headers={"content-length": "lots"}),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine()
    e.start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(engine: FakeEngine) -> Iterator[TestClient]:
    app = build_app(engine, api_keys=None, max_body_bytes=LIMIT)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def send(client: TestClient, case: Case) -> Any:
    raw = case.raw if case.raw is not None else (
        json.dumps(case.body).encode() if case.body is not None else None
    )
    headers = {"content-type": "application/json", **case.headers}
    return client.request(case.method, case.path, content=raw, headers=headers)


def assert_error_body(resp: Any, status: int, code: str, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "authentication_error", "server_error")
    assert err["code"] == code, err
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_with_openai_error(client: TestClient, case: Case) -> None:
    assert_error_body(send(client, case), case.status, case.code, case.param)


def test_413_when_streamed_body_exceeds_limit_without_content_length(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    # A generator body goes out chunked: no Content-Length, so only counting can catch it.
    resp = client.post("/v1/completions", content=chunks())
    assert_error_body(resp, 413, "request_too_large", None)


def test_413_when_body_is_larger_than_its_content_length_says(engine: FakeEngine) -> None:
    app = build_app(engine, api_keys=None, max_body_bytes=LIMIT)
    body = json.dumps(comp(prompt="x" * (LIMIT + 10))).encode()
    sent: list[dict[str, Any]] = []
    messages = [
        {"type": "http.request", "body": body[: len(body) // 2], "more_body": True},
        {"type": "http.request", "body": body[len(body) // 2 :], "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def asgi_send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
        "headers": [(b"content-length", b"10"), (b"content-type", b"application/json")],
    }
    import asyncio

    asyncio.run(app(scope, receive, asgi_send))
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


def test_bad_input_matrix_leaves_server_healthy_and_admits_nothing(engine: FakeEngine) -> None:
    # A fresh app + engine so "nothing admitted" is about this matrix alone.
    fresh = FakeEngine()
    fresh.start()
    try:
        app = build_app(fresh, api_keys=None, max_body_bytes=LIMIT)
        with TestClient(app, raise_server_exceptions=False) as client:
            for case in CASES:
                resp = send(client, case)
                assert resp.status_code == case.status, (case.name, resp.text)
            # I1: nothing that failed validation or admission was ever queued.
            assert fresh.submitted == []
            assert {r.code for r in fresh.rejected} >= {"invalid_token_id", "empty_prompt"}
            assert client.get("/health").json() == {"status": "ok"}
            good = client.post("/v1/completions", json=comp(prompt=[65, 66, EOS], max_tokens=8))
            assert good.status_code == 200, good.text
            assert good.json()["choices"][0]["text"] == "AB"
            metrics = client.get("/metrics").text
            assert 'kvfence_rejections_total{reason="invalid_json"}' in metrics
            assert 'kvfence_rejections_total{reason="invalid_token_id"}' in metrics
            assert 'kvfence_requests_total{status="400",tenant="default"}' in metrics
            assert 'kvfence_requests_total{status="200",tenant="default"}' in metrics
    finally:
        fresh.shutdown()
