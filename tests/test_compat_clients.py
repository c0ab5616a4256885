"""The clients users already run, at the versions pinned in pyproject's `test` extra, against
kvfence with the bundled model: the official `openai` client (completions, chat, streams with
usage, `n`, logprobs, `chat.completions.parse`, tools with streamed tool-call deltas, the
Responses API), `litellm` and `langchain-openai` (`with_structured_output`, `bind_tools`, the
Responses API). Each runs against the unified server (in-process, on a real socket) and through
`kvfence up` (router + 1 prefill + 1 decode processes). The load clients (vLLM's bench, guidellm,
aiperf) are too heavy for CI: scripts/compat_heavy.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from api_client import LiveServer
from conftest import TINY_MODEL
from pydantic import BaseModel

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.tools.cluster import LocalCluster

# litellm fetches its model price list from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

KEY = "sk-compat-alpha"
RECALL = "name: Ada\ncode: X7qPz91\ncity: Paris\ncode:"
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
CHAT_ADD = {"type": "function", "function": {"name": "add", "parameters": ADD}}
NAMED = {"type": "function", "function": {"name": "add"}}


class Pick(BaseModel):
    city: Literal["paris", "rome"]


@dataclass(frozen=True)
class Target:
    name: str  # unified | pd
    url: str  # the OpenAI base URL (…/v1)
    model: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["unified", "pd"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    Target
]:
    if request.param == "unified":
        cfg = EngineConfig(
            model=str(TINY_MODEL), kv_pool_tokens=4096, context_length=512, served_model_name="tiny"
        )
        engine = Engine(cfg)
        engine.start()
        app = build_app(UnifiedService(engine), api_keys={KEY: "alpha"}, tool_call_parser="hermes")
        try:
            with LiveServer(app) as live:
                yield Target("unified", f"{live.url}/v1", "tiny")
        finally:
            engine.shutdown()
        return
    tmp = tmp_path_factory.mktemp("compat-pd")
    cluster = LocalCluster(
        tmp,
        TINY_MODEL,
        "--context-length", "512", "--kv-pool-tokens", "4096", "--tool-call-parser", "hermes",
        keys={KEY: "alpha"},
    )  # fmt: skip
    try:
        yield Target("pd", f"{cluster.url}/v1", "kvfence-tiny")
    finally:
        cluster.stop()


def _chat(content: str = RECALL) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


# ---- the official openai client ------------------------------------------------------------------


def test_openai_completions_n_logprobs_and_stream_usage(target: Target) -> None:
    oa = target.openai()
    r = oa.completions.create(
        model=target.model, prompt=RECALL, max_tokens=6, temperature=0, n=2, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == r.usage.completion_tokens // 2
    chunks = list(
        oa.completions.create(
            model=target.model, prompt=RECALL, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_openai_chat_n_logprobs_and_stream_usage(target: Target) -> None:
    oa = target.openai()
    r = oa.chat.completions.create(
        model=target.model, messages=_chat(), max_tokens=6, temperature=0, n=2,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert len(r.choices) == 2
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    stream = oa.chat.completions.create(
        model=target.model, messages=_chat(), max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_openai_chat_completions_parse_with_a_pydantic_model(target: Target) -> None:
    r = target.openai().chat.completions.parse(
        model=target.model, messages=_chat("city?"), response_format=Pick, max_tokens=40,
        temperature=0,
    )  # fmt: skip
    assert isinstance(r.choices[0].message.parsed, Pick)


def test_openai_tools_and_streamed_tool_call_deltas(target: Target) -> None:
    oa = target.openai()
    kw: dict[str, Any] = dict(
        model=target.model, messages=_chat("add"), tools=[CHAT_ADD], tool_choice=NAMED,
        max_tokens=40, temperature=0,
    )  # fmt: skip
    r = oa.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a"}
    assert r.choices[0].finish_reason == "tool_calls"
    parts, names = [], []
    for chunk in oa.chat.completions.create(**kw, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [tc.function.name] if tc.function and tc.function.name else []
            parts.append(tc.function.arguments or "" if tc.function else "")
    assert names == ["add"] and json.loads("".join(parts)) == json.loads(call.function.arguments)


def test_openai_responses_create_and_stream(target: Target) -> None:
    oa = target.openai()
    r = oa.responses.create(
        model=target.model, input=RECALL, instructions="Recall.", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert r.output_text and r.usage is not None and r.usage.output_tokens >= 1
    kinds: list[str] = []
    with oa.responses.stream(
        model=target.model, input=RECALL, instructions="Recall.", max_output_tokens=6,
        temperature=0,
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    call = oa.responses.create(
        model=target.model, input="add", max_output_tokens=40, temperature=0,
        tools=[{"type": "function", "name": "add", "parameters": ADD, "strict": True}],
        tool_choice={"type": "function", "name": "add"},
    )  # fmt: skip
    (item,) = [o for o in call.output if o.type == "function_call"]
    assert item.name == "add" and set(json.loads(item.arguments)) == {"a"}


# ---- litellm -------------------------------------------------------------------------------------


def test_litellm_completion_stream_and_tools(target: Target) -> None:
    import litellm

    kw: dict[str, Any] = dict(
        model=f"openai/{target.model}", api_base=target.url, api_key=KEY, max_tokens=6,
        temperature=0,
    )  # fmt: skip
    r = litellm.completion(messages=_chat(), **kw)
    text = r.choices[0].message.content
    assert text and r.usage.prompt_tokens > 0
    chunks = litellm.completion(messages=_chat(), stream=True, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == text
    tool = litellm.completion(
        messages=_chat("add"), tools=[CHAT_ADD], tool_choice=NAMED,
        **{**kw, "max_tokens": 40},
    )  # fmt: skip
    (call,) = tool.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a"}


# ---- langchain-openai ----------------------------------------------------------------------------


def _langchain(target: Target, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=target.model, base_url=target.url, api_key=KEY, temperature=0, max_retries=0, **kw
    )


def test_langchain_structured_output_and_bind_tools(target: Target) -> None:
    picked = _langchain(target, max_tokens=40).with_structured_output(Pick).invoke("city?")
    assert isinstance(picked, Pick)
    # An OpenAI tool dict: its bounded argument keeps the tiny model's call short.
    msg = _langchain(target, max_tokens=40).bind_tools([CHAT_ADD], tool_choice="add").invoke("add")
    (call,) = msg.tool_calls
    assert call["name"] == "add" and isinstance(call["args"]["a"], int)
    answer = _langchain(target, max_tokens=6, use_responses_api=True).invoke(RECALL)
    assert answer.text and answer.usage_metadata["output_tokens"] >= 1


def test_the_pinned_versions_are_the_ones_installed() -> None:
    """The report of this suite names these versions; a drifted environment says so here."""
    from importlib.metadata import version

    pins = _test_extra_pins()
    for name in ("openai", "litellm", "langchain-openai", "langchain-core"):
        assert version(name) == pins[name], name


def _test_extra_pins() -> dict[str, str]:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = {}
    for spec in pyproject["project"]["optional-dependencies"]["test"]:
        if "==" in spec:
            name, _, ver = spec.partition("==")
            pins[name.strip()] = ver.strip()
    return pins
