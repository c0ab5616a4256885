"""LoRA over HTTP with two tenants, one private adapter each and one shared: each tenant lists and
uses only what it may, and a forbidden adapter answers exactly as a name that does not exist;
the operator alone loads and unloads adapters at run time."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from conftest import random_prompts
from fastapi.testclient import TestClient
from lora_adapters import build_adapter, peft_greedy

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.server.operator import operator_headers

OPERATOR_KEY = "op-lora-tests-0123456789abcdef"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
OP = operator_headers(OPERATOR_KEY)
NEW = 8


@pytest.fixture(scope="module")
def setup(checkpoint_dir, tmp_path_factory) -> Iterator[tuple[TestClient, dict]]:
    model = checkpoint_dir("llama")
    root = tmp_path_factory.mktemp("lora-api")
    paths = {n: build_adapter(model, root / n, seed=50 + i, rank=4)
             for i, n in enumerate(["alice-ft", "bob-ft", "shared", "late"])}
    mods = (
        json.dumps({"name": "alice-ft", "path": str(paths["alice-ft"]), "tenants": ["alice"]}),
        json.dumps({"name": "bob-ft", "path": str(paths["bob-ft"]), "tenants": ["bob"]}),
        f"shared={paths['shared']}",
    )
    cfg = EngineConfig(model=str(model), kv_pool_tokens=2048, served_model_name="base",
                       enable_lora=True, max_loras=2, max_lora_rank=4, lora_modules=mods)
    engine = Engine(cfg)
    engine.start()
    app = build_app(UnifiedService(engine), api_keys=KEYS, operator_key=OPERATOR_KEY)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, {"model": model, **paths}
    engine.shutdown()


def listed(c: TestClient, who: dict) -> list[str]:
    r = c.get("/v1/models", headers=who)
    assert r.status_code == 200
    return [m["id"] for m in r.json()["data"]]


def not_found_shape(r, name: str) -> tuple:
    err = r.json()["error"]
    return r.status_code, err["code"], err["type"], err["param"], err["message"].replace(name, "X")


def test_each_tenant_lists_only_its_own_and_the_shared_adapters(setup) -> None:
    c, _ = setup
    assert listed(c, ALICE) == ["base", "alice-ft", "shared"]
    assert listed(c, BOB) == ["base", "bob-ft", "shared"]
    card = c.get("/v1/models/alice-ft", headers=ALICE).json()
    assert card["id"] == "alice-ft" and card["parent"] == "base" and "path" not in json.dumps(card)


@pytest.mark.parametrize("route", ["models", "completions", "chat", "tokenize"])
def test_a_forbidden_adapter_is_exactly_a_missing_one(setup, route: str) -> None:
    c, _ = setup

    def ask(name: str):
        if route == "models":
            return c.get(f"/v1/models/{name}", headers=ALICE)
        if route == "completions":
            body = {"model": name, "prompt": [1, 2, 3], "max_tokens": 2}
            return c.post("/v1/completions", json=body, headers=ALICE)
        if route == "chat":
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            return c.post("/v1/chat/completions", json=body, headers=ALICE)
        return c.post("/tokenize", json={"model": name, "prompt": "hi"}, headers=ALICE)

    forbidden, missing = ask("bob-ft"), ask("no-such")
    assert forbidden.status_code == 404
    assert not_found_shape(forbidden, "bob-ft") == not_found_shape(missing, "no-such")


def test_each_tenant_gets_its_adapters_answers(setup) -> None:
    c, paths = setup
    prompt = random_prompts([19], vocab=256, seed=9)[0]
    want = {n: peft_greedy(paths["model"], paths[n] if n != "base" else None, [prompt], NEW)[0]
            for n in ("base", "alice-ft", "shared")}
    for name in ("base", "alice-ft", "shared"):
        body = {"model": name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0}
        r = c.post("/v1/completions", json=body, headers=ALICE)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        toks = r.json()["choices"][0]["logprobs"]["tokens"]
        assert [int(t.split(":")[1]) for t in toks] == want[name], name
    assert len({tuple(v) for v in want.values()}) == 3


def test_only_the_operator_loads_and_unloads_adapters(setup) -> None:
    c, paths = setup
    body = {"lora_name": "late", "lora_path": str(paths["late"]), "tenants": ["bob"]}
    for who in (ALICE, BOB, {}):
        assert c.post("/v1/load_lora_adapter", json=body, headers=who).status_code in (401, 403)
    r = c.post("/v1/load_lora_adapter", json=body, headers=OP)
    assert r.status_code == 200 and r.json()["digest"].startswith("sha256:")
    assert "late" in listed(c, BOB) and "late" not in listed(c, ALICE)
    assert c.post("/v1/load_lora_adapter", json=body, headers=OP).status_code == 400  # taken
    bad = {"lora_name": "x", "lora_path": str(paths["model"])}  # no adapter_config.json
    r = c.post("/v1/load_lora_adapter", json=bad, headers=OP)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora"
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "late"},
                  headers=BOB).status_code == 403
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=OP)
    assert r.status_code == 200
    assert "late" not in listed(c, BOB)
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=OP)
    assert r.status_code == 404
