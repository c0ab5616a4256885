"""Chat tool calling on the real engine (bundled tiny model): tool_choice required / named are
enforced by a grammar, auto is read by --tool-call-parser, calls stream as OpenAI deltas, the
template sees `tools`, and malformed tool requests get a 400."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from api_client import sse_json, typed_events
from fastapi.testclient import TestClient
from tiny_app import MODEL, tiny_app_fixtures

from kvfence.cli import build_parser
from kvfence.config import DEFAULT_MAX_TOOL_CALLS, ConfigError, NodeConfig
from kvfence.engine.engine import Engine
from kvfence.model.tokenizer import ChatTemplateError, Tokenizer
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    parse_call_list,
    partial_call,
)

TINY = Path(__file__).resolve().parents[1] / "models" / "kvfence-tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two small numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


engine, client = tiny_app_fixtures(tool_call_parser="hermes")


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], **kw}


def _check_call(call: dict[str, Any]) -> str:
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])
    return name


def test_required_always_yields_well_formed_calls_to_declared_functions(
    client: TestClient,
) -> None:
    body = _chat(
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=80,
    )
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert _check_call(call) in PARAMS
    # Parallel calls: a model that never stops adding calls runs into max_tokens (or, given
    # room, into --max-tool-calls). A cut list says "length" and holds the calls as far as they
    # were written; its text is never the content.
    body = _chat(tools=TOOLS, tool_choice="required", n=4, temperature=1.0, seed=5, max_tokens=80)
    finishes = set()
    for choice in client.post("/v1/chat/completions", json=body).json()["choices"]:
        finishes.add(choice["finish_reason"])
        assert choice["message"]["content"] is None, choice
        calls = choice["message"].get("tool_calls") or []
        assert all(c["function"]["name"] in PARAMS for c in calls)
        if choice["finish_reason"] == "tool_calls":
            assert all(_check_call(c) in PARAMS for c in calls)
    assert finishes <= {"tool_calls", "length"}, finishes


def test_named_function_is_called_with_valid_arguments(client: TestClient) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = _chat(tools=TOOLS, tool_choice=choice, n=2, temperature=1.0, seed=1, max_tokens=60)
    for c in client.post("/v1/chat/completions", json=body).json()["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert _check_call(call) == "get_weather"


def test_auto_reads_hermes_calls_and_leaves_plain_answers_alone(client: TestClient) -> None:
    # The tiny model cannot write a call by itself; a regex makes it write one in hermes form.
    call = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9]\}\}</tool_call>'
    body = _chat(tools=TOOLS, max_tokens=60, temperature=0, structured_outputs={"regex": call})
    (c,) = client.post("/v1/chat/completions", json=body).json()["choices"]
    assert c["finish_reason"] == "tool_calls", c
    (tc,) = c["message"]["tool_calls"]
    assert _check_call(tc) == "add"
    # Streamed: the call's text is held back and arrives as tool-call deltas, never as content.
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [ch["choices"][0] for ch in sse_json(r.text) if ch["choices"]]
    assert not "".join(ch["delta"].get("content") or "" for ch in chunks)
    deltas = [d for ch in chunks for d in ch["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "add"
    assert (
        "".join(d["function"].get("arguments", "") for d in deltas) == tc["function"]["arguments"]
    )
    assert chunks[-1]["finish_reason"] == "tool_calls"
    body = _chat(tools=TOOLS, max_tokens=8, temperature=0, structured_outputs={"regex": "hi|yo"})
    (c,) = client.post("/v1/chat/completions", json=body).json()["choices"]
    assert c["finish_reason"] == "stop" and c["message"]["content"] in ("hi", "yo")
    assert "tool_calls" not in c["message"]


def test_openai_client_parses_calls_and_streamed_deltas(client: TestClient) -> None:
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    out = oa.chat.completions.create(**kw)
    calls = out.choices[0].message.tool_calls or []
    assert out.choices[0].finish_reason == "tool_calls" and calls
    acc: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in oa.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            slot = acc.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function and d.function.name:
                slot["name"] += d.function.name
            if d.function and d.function.arguments:
                slot["arguments"] += d.function.arguments
        assert not ch.delta.content, "a required call is never streamed as content"
    assert finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (v["name"], v["arguments"]) for _, v in sorted(acc.items())
    ]
    # A named call streams its arguments as they are written: pieces that add up to them.
    kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    body = oa.chat.completions.create(**kw).choices[0].message.tool_calls or []
    pieces = [
        d.function.arguments
        for chunk in oa.chat.completions.create(stream=True, **kw)
        if chunk.choices
        for d in chunk.choices[0].delta.tool_calls or []
        if d.function and d.function.arguments
    ]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == json.loads(body[0].function.arguments)


@pytest.mark.parametrize(
    "kw, code, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "unknown_function",
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_value", "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "invalid_value",
            "tools",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "invalid_value", "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "invalid_value",
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "if": {}}},
                    }
                ],
                "tool_choice": "required",
            },
            "unsupported_schema_keyword",
            None,
        ),
    ],
)
def test_bad_tool_requests_get_a_400(
    client: TestClient, kw: dict[str, Any], code: str, param: str | None
) -> None:
    r = client.post("/v1/chat/completions", json=_chat(max_tokens=4, **kw))
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), r.text


def test_auto_without_a_parser_is_refused(engine: Engine) -> None:
    with TestClient(build_app(UnifiedService(engine), api_keys=None)) as c:
        r = c.post("/v1/chat/completions", json=_chat(tools=TOOLS, max_tokens=4))
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]


def test_template_gets_tools_and_tool_turns(tmp_path: Path) -> None:
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.a }}{% endfor %}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    messages = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 4}}}
            ],
        },
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS)
    assert text == "TOOLS:get_weather;add;[user]add[assistant]CALL add 4[tool]4"
    with pytest.raises(ChatTemplateError):  # control-token text cannot ride in a tool schema
        bad = [{"type": "function", "function": {"name": "f", "description": "<|eos|>"}}]
        tok.encode_chat(messages, tools=bad)


def test_parsers_split_calls_from_text() -> None:
    declared = frozenset({"add", "get_weather"})
    text = (
        'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    assert HermesParser().parse(text, declared) == (
        "Sure.",
        [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", '{"city": "Rome"}')],
    )
    assert (
        HermesParser().parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', declared)[1]
        == []
    )
    assert HermesParser().may_start_call("abc <tool_") == 4
    text = '{"name": "add", "parameters": {"a": 2}}; {"name": "add", "parameters": {"a": 3}}'
    assert Llama3JsonParser().parse(text, declared) == (
        "",
        [ToolCall("add", '{"a": 2}'), ToolCall("add", '{"a": 3}')],
    )
    assert Llama3JsonParser().parse("plain {not json}", declared) == ("plain {not json}", [])


def test_cut_calls_are_parsed_as_far_as_written() -> None:
    declared = frozenset({"add", "get_weather"})
    assert partial_call('{"name": "add", "parameters": {"a": 1', declared) == ToolCall(
        "add", '{"a": 1'
    )
    assert partial_call('{"name": "ad', declared) is None  # the name itself was cut
    assert partial_call('{"name": "rm", "parameters": {', declared) is None  # not declared
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {"ci'
    assert parse_call_list(text, declared, cut=True) == [
        ToolCall("add", '{"a": 1}'),
        ToolCall("get_weather", '{"ci'),
    ]
    assert parse_call_list(text, declared, cut=False) == [ToolCall("add", '{"a": 1}')]
    cut = 'Hi <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call><tool_call>{"name": "a'
    assert HermesParser().parse(cut, declared, cut=True) == ("Hi", [ToolCall("add", '{"a": 2}')])
    cut = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_'
    assert HermesParser().parse(cut, declared, cut=True) == ("", [ToolCall("add", '{"a": 2}')])
    # A malformed call is not content either.
    assert HermesParser().parse("ok <tool_call>{nope}</tool_call>", declared) == ("ok", [])
    assert Llama3JsonParser().parse('{"name": "add", "parameters": {"a"', declared, cut=True) == (
        "",
        [ToolCall("add", '{"a"')],
    )


# ---- every tool_choice x parallel_tool_calls, sampled, cut or not ----------------------------

# auto: the tiny model cannot write calls by itself; a regex makes it write one or two in
# hermes form after an optional word, so the parser has calls to find (and max_tokens to cut).
AUTO_CALLS = r'(ok )?(<tool_call>\{"name": "add", "arguments": \{"a": [1-9]\}\}</tool_call>){1,2}'
CHOICES = {
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "auto": {"structured_outputs": {"regex": AUTO_CALLS}},
}
# 10 samples each: 50 per combination. One call is 20-45 tokens of this tokenizer, a hermes
# call ~40: the small budgets cut every answer, the large ones leave room for whole ones.
MAX_TOKENS = (4, 12, 28, 56, 96)
# The same requests streamed: all 50 with RUN_SLOW=1, 30 in CI (a loaded 2-core box runs each
# combination's 50 + 50 in one to three minutes).
STREAMED = MAX_TOKENS if os.environ.get("RUN_SLOW") == "1" else MAX_TOKENS[::2]


def _holds_call_text(content: Any) -> bool:
    """Whether content carries a call's text: a marker, a name key, or JSON of a call list."""
    if not content:
        return False
    if "<tool_call>" in content or '"name"' in content or '"parameters"' in content:
        return True
    try:
        return isinstance(json.loads(content), (list, dict))
    except ValueError:
        return False


def _streamed(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice of a streamed answer put back together: content, calls, finish reason."""
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    out: dict[int, dict[str, Any]] = {}
    for chunk in sse_json(r.text):
        for ch in chunk["choices"]:
            got = out.setdefault(ch["index"], {"content": "", "calls": {}, "finish": None})
            got["content"] += ch["delta"].get("content") or ""
            for d in ch["delta"].get("tool_calls") or []:
                slot = got["calls"].setdefault(d["index"], {"name": "", "arguments": ""})
                slot["name"] += (d.get("function") or {}).get("name") or ""
                slot["arguments"] += (d.get("function") or {}).get("arguments") or ""
            got["finish"] = ch["finish_reason"] or got["finish"]
    return [out[i] for i in sorted(out)]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("mode", list(CHOICES))
def test_no_answer_carries_call_text_as_content(
    client: TestClient, mode: str, parallel: bool
) -> None:
    counts = {"samples": 0, "cut": 0, "call_text_in_content": 0, "calls": 0}
    for k, max_tokens in enumerate(MAX_TOKENS):
        body = _chat(
            tools=TOOLS,
            parallel_tool_calls=parallel,
            n=10,
            temperature=0.9,
            seed=100 + k,
            max_tokens=max_tokens,
            **CHOICES[mode],
        )
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        plain = [
            {
                "content": c["message"]["content"],
                "calls": [tc["function"] for tc in c["message"].get("tool_calls") or []],
                "finish": c["finish_reason"],
            }
            for c in r.json()["choices"]
        ]
        streamed = []
        if max_tokens in STREAMED:
            streamed = [{**c, "calls": list(c["calls"].values())} for c in _streamed(client, body)]
        for got in plain + streamed:
            counts["samples"] += 1
            counts["cut"] += got["finish"] == "length"
            counts["calls"] += len(got["calls"])
            counts["call_text_in_content"] += _holds_call_text(got["content"])
            assert got["finish"] in ("tool_calls", "length", "stop"), got
            assert all(c["name"] in PARAMS for c in got["calls"]), got
            assert len(got["calls"]) <= (DEFAULT_MAX_TOOL_CALLS if parallel else 1), got
            if mode != "auto":
                assert not got["content"], got  # a forced answer is its call(s), never text
            if got["finish"] == "tool_calls":
                for c in got["calls"]:
                    jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
                if not parallel or mode == "named":
                    assert len(got["calls"]) == 1, got
    assert counts["samples"] == 10 * (len(MAX_TOKENS) + len(STREAMED))
    print(f"{mode} parallel={parallel}: {counts}")  # the figures, with -s
    assert counts["call_text_in_content"] == 0, counts
    assert counts["cut"] > 0, counts
    if not (mode == "required" and parallel):  # that one writes calls up to its bound
        assert counts["cut"] < counts["samples"], counts  # whole answers too
    assert counts["calls"] > 0, counts


def test_max_tool_calls_bounds_a_required_list(engine: Engine) -> None:
    app = build_app(UnifiedService(engine), api_keys=None, max_tool_calls=2)
    with TestClient(app) as c:
        body = _chat(tools=TOOLS, tool_choice="required", n=6, temperature=1.0, seed=3)
        body["max_tokens"] = 300
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        calls = choice["message"].get("tool_calls") or []
        assert 1 <= len(calls) <= 2 and choice["finish_reason"] == "tool_calls", choice
    assert any(len(ch["message"]["tool_calls"]) == 2 for ch in r.json()["choices"])


def test_max_tool_calls_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m"])
    assert args.max_tool_calls == DEFAULT_MAX_TOOL_CALLS
    assert parser.parse_args(["serve", "--model", "m", "--max-tool-calls", "3"]).max_tool_calls == 3
    with pytest.raises(ConfigError, match="--max-tool-calls"):
        NodeConfig.from_args(parser.parse_args(["serve", "--model", "m", "--max-tool-calls", "0"]))


# ---- the same rule through the Responses API -----------------------------------------------------

R_TOOLS = [{"type": "function", "name": t["function"]["name"], **t["function"]} for t in TOOLS]
R_CHOICES = {
    "required": "required",
    "named": {"type": "function", "name": "get_weather"},
    "auto": "auto",
}


# 50 seeded samples per case with RUN_SLOW=1 (the count), each also streamed; CI runs 4.
R_SAMPLES = 50 if os.environ.get("RUN_SLOW") == "1" else 4


def _responses_answer(client: TestClient, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The response object, and every output_text a client was shown (streamed: the deltas)."""
    r = client.post("/v1/responses", json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        resp = r.json()
        shown = [
            p["text"] for it in resp["output"] if it["type"] == "message" for p in it["content"]
        ]
        return {"response": resp, "texts": shown}
    events = typed_events(r.text)
    done = [e for e in events if e["type"] == "response.completed"]
    assert len(done) == 1, events[-3:]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return {"response": done[0]["response"], "texts": [deltas] if deltas else []}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("mode", list(R_CHOICES))
def test_responses_never_carry_call_text_as_output_text(
    client: TestClient, mode: str, parallel: bool
) -> None:
    """/v1/responses turns the chat answer into items: a call is a function_call item, cut or
    not, and no output_text (whole, or streamed as deltas) holds a call's text."""
    seen = {"samples": 0, "cut": 0, "calls": 0, "call_text_in_output_text": 0}
    for seed in range(R_SAMPLES):
        body = {
            "model": MODEL,
            "input": "weather?",
            "tools": R_TOOLS,
            "tool_choice": R_CHOICES[mode],
            "parallel_tool_calls": parallel,
            "temperature": 0.9,
            "seed": seed,
            "max_output_tokens": (6, 56)[seed % 2],
        }
        for stream in (False, True) if R_SAMPLES > 4 else (False,):
            got = _responses_answer(client, body, stream)
            resp, texts = got["response"], got["texts"]
            calls = [item for item in resp["output"] if item["type"] == "function_call"]
            seen["samples"] += 1
            seen["cut"] += resp["status"] == "incomplete"
            seen["calls"] += len(calls)
            seen["call_text_in_output_text"] += any(_holds_call_text(t) for t in texts)
            assert all(c["name"] in PARAMS for c in calls), resp
            if mode != "auto":
                assert not texts, resp
            if not parallel:
                assert len(calls) <= 1, resp
    print(f"responses {mode} parallel={parallel}: {seen}")  # the figures, with -s
    assert seen["call_text_in_output_text"] == 0, seen
    if mode != "auto":  # the tiny model, unforced, ends its answers by itself
        assert seen["cut"] > 0 and seen["calls"] > 0, seen
