"""`POST /v1/responses` (OpenAI's Responses API as vLLM serves it, stateless): text and message
inputs, instructions, max_output_tokens, function tools with tool_choice, the typed stream
events, usage; the tenant from the credential as on chat; malformed requests get a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from api_client import client_for, typed_events
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from openai.types.responses import Response as OpenAIResponse
from pydantic import BaseModel, ValidationError
from tiny_app import MODEL, tiny_app_fixtures

from kvfence.server.responses_schema import ResponsesRequest

engine, client = tiny_app_fixtures(tool_call_parser="hermes")

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "add", "description": "add", "parameters": ADD}]
OUT_YO = {"type": "output_text", "text": "yo"}
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}
RECALL = "name: Ada\ncode: X7qPz91\ncity: Paris\ncode:"


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": RECALL, "temperature": 0, "max_output_tokens": 8, **kw}


def client_shape(resp: dict[str, Any]) -> None:
    """resp parses as the official client's Response, but for the usage field newer than vLLM's
    shape (cache_write_tokens: OpenAI's prompt-cache billing, which a self-hosted server has
    no figure for); the client itself reads bodies without validating, so it does not mind."""
    try:
        OpenAIResponse.model_validate(resp)
    except ValidationError as e:
        missing = {err["loc"][-1] for err in e.errors() if err["type"] == "missing"}
        assert missing == {"cache_write_tokens"} and len(e.errors()) == 1, e


def _text(resp: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in resp["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


# ---- answers -----------------------------------------------------------------------------------


def test_text_input_answers_as_the_same_chat_would(client: TestClient) -> None:
    r = client.post("/v1/responses", json=_body())
    assert r.status_code == 200, r.text
    resp = r.json()
    client_shape(resp)
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    assert resp["store"] is False
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": RECALL}],
            "temperature": 0,
            "max_tokens": 8,
        },
    ).json()
    assert _text(resp) == chat["choices"][0]["message"]["content"]
    u = resp["usage"]
    assert u["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert u["output_tokens"] == chat["usage"]["completion_tokens"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens_details"] == {"reasoning_tokens": 0}


def test_instructions_and_message_items_become_the_chat_prompt(client: TestClient) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "content": [OUT_YO]},
        {"role": "user", "content": RECALL},
    ]
    resp = client.post("/v1/responses", json=_body(input=items, instructions="Be brief.")).json()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": RECALL},
    ]
    tok = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert resp["usage"]["input_tokens"] == tok["count"]
    assert resp["instructions"] == "Be brief."


def test_max_output_tokens_cut_is_incomplete_as_vllm_says(client: TestClient) -> None:
    resp = client.post("/v1/responses", json=_body(max_output_tokens=1)).json()
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["output_tokens"] == 1
    assert resp["output"][0]["status"] == "incomplete"


def test_stream_events_in_order_and_the_same_answer(client: TestClient) -> None:
    whole = client.post("/v1/responses", json=_body()).json()
    r = client.post("/v1/responses", json=_body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text  # a Responses stream ends with response.completed
    evs = typed_events(r.text)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    done = evs[-1]["response"]
    assert deltas == _text(done) == _text(whole)
    assert done["usage"] == whole["usage"]
    assert done["status"] == whole["status"]
    client_shape(done)


def test_official_client_create_and_stream(client: TestClient) -> None:
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    resp = oa.responses.create(model=MODEL, input=RECALL, temperature=0, max_output_tokens=8)
    assert resp.output_text and resp.usage is not None
    with oa.responses.stream(
        model=MODEL, input=RECALL, temperature=0, max_output_tokens=8
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == resp.output_text


class Pick(BaseModel):
    city: Literal["paris", "rome"]


def test_text_format_json_schema_through_the_official_parse(client: TestClient) -> None:
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    r = oa.responses.parse(
        model=MODEL, input="city?", text_format=Pick, max_output_tokens=40, temperature=0
    )
    assert isinstance(r.output_parsed, Pick)


# ---- tools -------------------------------------------------------------------------------------


def _calls(resp: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in resp["output"] if item["type"] == "function_call"]


def test_named_tool_choice_is_one_function_call_item(client: TestClient) -> None:
    body = _body(tools=TOOLS, tool_choice={"type": "function", "name": "add"}, max_output_tokens=40)
    resp = client.post("/v1/responses", json=body).json()
    (call,) = _calls(resp)
    assert call["name"] == "add" and call["call_id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"a"}
    assert resp["tool_choice"] == {"type": "function", "name": "add"}


def test_required_tool_choice_calls_a_declared_function(client: TestClient) -> None:
    body = _body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    resp = client.post("/v1/responses", json={**body, "max_output_tokens": 40}).json()
    for call in _calls(resp):
        assert call["name"] == "add"
        json.loads(call["arguments"])
    if resp["status"] == "completed":
        assert len(_calls(resp)) == 1


def test_streamed_call_arguments_add_up_to_the_done_event(client: TestClient) -> None:
    body = _body(tools=TOOLS, tool_choice={"type": "function", "name": "add"}, stream=True)
    evs = typed_events(client.post("/v1/responses", json={**body, "max_output_tokens": 40}).text)
    kinds = [e["type"] for e in evs]
    assert kinds[2] == "response.output_item.added" and evs[2]["item"]["type"] == "function_call"
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    (done,) = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == args and set(json.loads(args)) == {"a"}
    (call,) = _calls(evs[-1]["response"])
    assert call["arguments"] == args and call["call_id"] == evs[2]["item"]["call_id"]


def test_function_call_output_items_reach_the_template(client: TestClient) -> None:
    # kvfence-tiny's template knows no tool role: the template's refusal comes back as a 400,
    # which shows the function_call_output item reached it as a tool message.
    items = [
        {"role": "user", "content": "add 2"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
    ]
    r = client.post("/v1/responses", json=_body(input=items, tools=TOOLS, tool_choice="none"))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_messages"


def test_items_read_into_chat_messages() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "sys",
            "input": [
                {"role": "developer", "content": "dev"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
            ],
        }
    )
    chat = req.chat_request()
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "developer", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert chat.messages[3].tool_call_id == "c1"


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, "input[0].content[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, None),
    ],
)
def test_malformed_or_unservable_requests_get_a_400(client: TestClient, change, param) -> None:
    r = client.post("/v1/responses", json=_body(**change))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_store_true_is_served_stateless(client: TestClient) -> None:
    resp = client.post("/v1/responses", json=_body(store=True)).json()
    assert resp["output"] and resp["store"] is False


def test_bad_json_and_unknown_model(client: TestClient) -> None:
    r = client.post("/v1/responses", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/responses", json=_body(model="other"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---- tenancy and failures (fake engine) ----------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeEngine]:
    e = FakeEngine()
    e.start()
    yield e
    e.shutdown()


def test_i6_tenant_comes_from_the_key_on_responses(fake: FakeEngine) -> None:
    with client_for(fake, api_keys={"sk-a": "tenant-a"}) as c:
        body = {"model": fake.model_name, "input": "hi", "max_output_tokens": 2, "tenant": "b"}
        assert c.post("/v1/responses", json=body).status_code == 401
        r = c.post("/v1/responses", json=body, headers={"Authorization": "Bearer sk-a"})
        assert r.status_code == 200, r.text
    assert [req.tenant for req in fake.submitted] == ["tenant-a"]


def test_i5_failure_mid_stream_is_an_error_event_not_completed(fake: FakeEngine) -> None:
    fake.fail_after = 2
    with client_for(fake) as c:
        body = {"model": fake.model_name, "input": "hi", "max_output_tokens": 8, "stream": True}
        r = c.post("/v1/responses", json=body)
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert "response.completed" not in r.text
    assert json.loads(blocks[-1].removeprefix("data: "))["error"]["code"] == "kv_grant_mismatch"
