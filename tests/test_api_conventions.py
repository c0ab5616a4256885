"""The small vLLM conventions clients rely on: a stream chunk per generated token even while its
text is held back (U+FFFD, partial UTF-8), /tokenize and /detokenize, the client's X-Request-Id
echoed (never a room id), and --skip-tokenizer-init for token-id-only serving."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_client import MODEL, client_for, fake_app_fixtures, sse_json
from conftest import TINY_MODEL
from fake_engine import BOS, FakeEngine
from fake_workers import FakeState, ServerThread, free_port, make_app, stop_all
from fastapi.testclient import TestClient

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.faults import Faults
from kvfence.model.config import UnsupportedModelError
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.server.router import build_router_app

KEYS = {"sk-acme-123": "acme"}
AUTH = {"Authorization": "Bearer sk-acme-123"}
# The bundled model copies a `code:` value; three U+FFFD are nine byte tokens whose text the
# incremental detokenizer holds until each character is whole.
FFFD_PROMPT = "name: Ada\ncode: \ufffd\ufffd\ufffd\ncity: Paris\ncode:"
TINY_ENGINE = dict(
    kv_pool_tokens=2048,
    context_length=512,
    attention_backend="torch",
    linear_backend="torch",
    enable_prefix_caching=False,
)


engine, client = fake_app_fixtures(KEYS)


def _tiny_client(model_dir: Path, **changes: object) -> TestClient:
    cfg = EngineConfig(model=str(model_dir), **{**TINY_ENGINE, **changes})  # type: ignore[arg-type]
    service = UnifiedService(Engine(cfg, Faults()))
    service.start()
    client = TestClient(build_app(service, api_keys=KEYS), raise_server_exceptions=False)
    client.__dict__["_service"] = service
    return client


@pytest.fixture(scope="module")
def tiny() -> Iterator[TestClient]:
    client = _tiny_client(TINY_MODEL)
    with client:
        yield client
    client.__dict__["_service"].shutdown()


# ---- a chunk per token -------------------------------------------------------------------------


def test_stream_sends_a_chunk_per_token_while_text_is_held_back(tiny: TestClient) -> None:
    body = {"model": "kvfence-tiny", "prompt": FFFD_PROMPT, "max_tokens": 10, "temperature": 0}
    whole = tiny.post("/v1/completions", json=body, headers=AUTH)
    assert whole.status_code == 200, whole.text
    r = tiny.post(
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    events = sse_json(r.text)
    chunks = [e for e in events if e["choices"]]
    tokens = events[-1]["usage"]["completion_tokens"]
    assert tokens == 10
    # vLLM's shape: one chunk per token, `text: ""` where the detokenizer holds the bytes back.
    assert len(chunks) == tokens, [c["choices"][0]["text"] for c in chunks]
    assert sum(1 for c in chunks if c["choices"][0]["text"] == "") >= 6
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]
    assert "\ufffd" in whole.json()["choices"][0]["text"]


def test_chat_stream_sends_empty_content_chunks_for_held_back_tokens(tiny: TestClient) -> None:
    r = tiny.post(
        "/v1/chat/completions",
        json={
            "model": "kvfence-tiny",
            "messages": [{"role": "user", "content": FFFD_PROMPT}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    events = sse_json(r.text)
    content = [
        e for e in events if e["choices"] and "content" in e["choices"][0]["delta"]
    ]
    # The first is the role chunk every chat stream opens with; then one per token.
    assert len(content) - 1 == events[-1]["usage"]["completion_tokens"] == 8


# ---- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_prompt_and_messages_in_vllms_shapes(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": 512, "tokens": [BOS, ord("h"), ord("i")]}
    r = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}, headers=AUTH)
    assert r.json()["tokens"] == [ord("h"), ord("i")]
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/tokenize", json={"messages": msgs}, headers=AUTH)
    assert r.status_code == 200, r.text
    # The same ids the chat route would feed the engine.
    assert bytes(t for t in r.json()["tokens"]).decode() == "<s><user>hi\n<assistant>"
    r = client.post("/detokenize", json={"model": MODEL, "tokens": [104, 105]}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "hi"}


def test_tokenize_answers_the_same_for_every_tenant(engine: FakeEngine) -> None:
    keys = {**KEYS, "sk-globex-456": "globex"}
    with client_for(engine, keys) as c:
        a = c.post("/tokenize", json={"prompt": "same"}, headers=AUTH)
        b = c.post(
            "/tokenize", json={"prompt": "same"}, headers={"Authorization": "Bearer sk-globex-456"}
        )
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json()
    assert engine.submitted == []  # the engine never saw a request


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
         "invalid_value"),
        ("/tokenize", {}, 400, "invalid_value"),
        ("/tokenize", {"prompt": 5}, 400, "invalid_type"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model_not_found"),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "unsupported_parameter"),
        ("/tokenize", {"messages": [{"role": "assistant", "content": "x"}]}, 400,
         "invalid_messages"),
        ("/detokenize", {"tokens": [1, 999]}, 400, "invalid_value"),
        ("/detokenize", {"tokens": [-1]}, 400, "invalid_value"),
        ("/detokenize", {"tokens": [True]}, 400, "invalid_value"),
        ("/detokenize", {"tokens": "abc"}, 400, "invalid_type"),
    ],
)
def test_tokenize_bad_input_is_an_openai_error(
    client: TestClient, path: str, body: dict[str, object], status: int, code: str
) -> None:
    r = client.post(path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_tokenize_needs_a_tenant_key(client: TestClient) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert client.post(path, json=body).status_code == 401
        bad = {"Authorization": "Bearer sk-nope"}
        assert client.post(path, json=body, headers=bad).status_code == 401


# ---- X-Request-Id ------------------------------------------------------------------------------


def test_client_request_id_is_echoed_and_logged_never_the_room_id(
    client: TestClient, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    rid = "client-7f3a.9:abc"
    body = {"model": MODEL, "prompt": "hey", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="kvfence.server"):
        r = client.post("/v1/completions", json=body, headers={**AUTH, "X-Request-Id": rid})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    # The engine's ids (PD room ids) stay server-minted 128-bit values.
    assert [q.request_id for q in engine.submitted] != [rid]
    assert rid not in engine.submitted[0].request_id and rid not in r.json()["id"]
    assert any(f"client_request_id={rid}" in m for m in caplog.messages), caplog.messages
    streamed = client.post(
        "/v1/completions", json={**body, "stream": True}, headers={**AUTH, "X-Request-Id": rid}
    )
    assert streamed.headers["x-request-id"] == rid
    refused = client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == rid
    assert "x-request-id" not in client.post("/v1/completions", json=body, headers=AUTH).headers


@pytest.mark.parametrize(
    "bad",
    ["", "a" * 129, "two words", 'quote"d', "tab\tid", "new%0aline", "ünï"],
)
def test_bad_client_request_id_is_a_400(client: TestClient, engine: FakeEngine, bad: str) -> None:
    body = {"model": MODEL, "prompt": "hey", "max_tokens": 2}
    r = client.post(
        "/v1/completions",
        content=json.dumps(body),
        headers={**AUTH, "Content-Type": "application/json", "X-Request-Id": bad.encode("utf-8")},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request_id"
    assert "x-request-id" not in r.headers
    assert engine.submitted == []


def test_repeated_client_request_id_is_a_400(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hey"},
        headers=[("Authorization", AUTH["Authorization"]), ("X-Request-Id", "a"),
                 ("X-Request-Id", "b")],
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id"


# ---- --skip-tokenizer-init ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model's weights and config without any tokenizer file."""
    out = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(TINY_MODEL / name, out / name)
    return out


def test_model_without_tokenizer_needs_skip_tokenizer_init(bare_model: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="--skip-tokenizer-init"):
        Engine(EngineConfig(model=str(bare_model), **TINY_ENGINE), Faults())  # type: ignore[arg-type]


def test_skip_tokenizer_init_serves_token_ids_and_refuses_text(
    bare_model: Path, tiny: TestClient
) -> None:
    ids = tiny.post("/tokenize", json={"prompt": FFFD_PROMPT}, headers=AUTH).json()["tokens"]
    body = {
        "model": "kvfence-tiny",
        "prompt": ids,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    expected = tiny.post("/v1/completions", json=body, headers=AUTH).json()
    client = _tiny_client(bare_model, skip_tokenizer_init=True, served_model_name="kvfence-tiny")
    try:
        with client:
            r = client.post("/v1/completions", json=body, headers=AUTH)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]
            # Same tokens as with a tokenizer; ids only, no text.
            assert got["logprobs"]["tokens"] == expected["choices"][0]["logprobs"]["tokens"]
            assert got["text"] == ""
            plain = {k: body[k] for k in ("model", "prompt", "max_tokens")}
            got = client.post("/v1/completions", json=plain, headers=AUTH).json()["choices"][0]
            assert got["logprobs"] is None and got["finish_reason"] == "length"
            refusals = [
                ("/v1/completions", {**body, "prompt": "text"}, "prompt"),
                ("/v1/completions", {**body, "stop": "\n"}, "stop"),
                (
                    "/v1/chat/completions",
                    {"model": "kvfence-tiny", "messages": [{"role": "user", "content": "x"}]},
                    "messages",
                ),
                ("/tokenize", {"prompt": "x"}, "prompt"),
                ("/detokenize", {"tokens": [5]}, "tokens"),
            ]
            for path, req, param in refusals:
                r = client.post(path, json=req, headers=AUTH)
                assert r.status_code == 400, (path, r.text)
                err = r.json()["error"]
                assert (err["code"], err["param"]) == ("tokenizer_disabled", param)
                assert "--skip-tokenizer-init" in err["message"]
    finally:
        client.__dict__["_service"].shutdown()


# ---- through the router ------------------------------------------------------------------------


@pytest.fixture
def routed() -> Iterator[tuple[str, FakeState]]:
    prefill = make_app("prefill", "prefill-0", bootstrap_port=free_port())
    decode = make_app("decode", "decode-0")
    servers = [ServerThread(prefill).start(), ServerThread(decode).start()]
    router = ServerThread(
        build_router_app([servers[0].url], [servers[1].url], api_keys=None)
    ).start()
    servers.append(router)
    yield router.url, decode.state.fake
    stop_all(servers)


def test_router_relays_tokenize_unpaired_and_echoes_the_request_id_once(routed) -> None:
    url, decode = routed
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(url + path, json={"prompt": "hi"}, headers={"X-Request-Id": "abc-1"})
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-request-id") == ["abc-1"]
        seen = decode.requests[-1]
        assert seen["path"] == path
        assert "x-kvfence-prefill" not in seen["headers"]  # no prefill, no room
        assert seen["headers"]["x-request-id"] == "abc-1"
    r = httpx.post(url + "/tokenize", json={}, headers={"X-Request-Id": "bad id"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id"
    assert len(decode.requests) == 2  # refused at the router
